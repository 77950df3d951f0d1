"""A real corpus that needs no download: docstrings of the Python standard library.

Sources are parsed with ``ast`` (nothing is imported, so no module runs), and every module,
class and function docstring of a useful length becomes one row: id, name, text.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.errors import ConfigError

SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__"}


def _sources(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        if not SKIP_PARTS.intersection(path.relative_to(root).parts):
            yield path


def _docstrings(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    doc = ast.get_docstring(tree)
    if doc:
        yield module, doc
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and not node.name.startswith("_"):
                yield f"{module}.{node.name}", doc


def stdlib_docstrings(limit: int | None = None, min_chars: int = 40) -> pa.Table:
    """Rows (id: int64, name: string, text: string) in a stable order.

    With ``limit``, that many rows spread evenly over the whole library, so a small demo
    still spans many modules.
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"the demo corpus needs at least 1 row, got {limit}")
    root = Path(sysconfig.get_paths()["stdlib"])
    ids, names, texts = [], [], []
    seen: set[str] = set()
    for path in _sources(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for name, doc in _docstrings(tree, module):
            if len(doc) < min_chars or name in seen:
                continue
            seen.add(name)
            ids.append(len(ids))
            names.append(name)
            texts.append(doc)
    table = _table(ids, names, texts)
    if limit is not None and limit < table.num_rows:
        picks = np.linspace(0, table.num_rows - 1, num=limit).round().astype(np.int64)
        table = table.take(np.unique(picks))
    return table


def _table(ids: list[int], names: list[str], texts: list[str]) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "name": names, "text": texts})
