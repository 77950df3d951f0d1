"""What the model-hash cache saves at every start: hashing the packaged MiniLM's files
(weights included) against reading the cached hash, measured in one run.

    PYTHONPATH=$PWD python bench/model_hash.py
"""

from __future__ import annotations

import os
import tempfile
import time

from pipeline.models.loader import read_model_files


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["EMBEDPIPE_CACHE"] = cache
        files = read_model_files(None)
        started = time.perf_counter()
        first = files.model_hash()
        cold = time.perf_counter() - started
        runs = 20
        started = time.perf_counter()
        for _ in range(runs):
            assert files.model_hash() == first
        warm = (time.perf_counter() - started) / runs
    print(f"model hash of {files.folder.name}: cold {cold * 1e3:.1f} ms, cached {warm * 1e3:.2f} ms"
          f" ({cold / warm:.0f}x)")


if __name__ == "__main__":
    main()
