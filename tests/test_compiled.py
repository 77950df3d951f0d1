"""``[encoder] compile`` (pipeline.compiled): the same vectors, one graph for every batch shape,
never part of a set's key, refused with int8."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.assembly import build_job
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.errors import ConfigError
from pipeline.run import job_keys

TEXTS = [f"text number {i} " + "word " * (i % 40) for i in range(120)]


@pytest.mark.slow
def test_compiled_vectors_match_eager_with_one_graph_for_all_shapes(
        tiny_model_dir: Path) -> None:
    import torch
    from torch._dynamo.utils import counters

    def embedder(compiled: bool) -> Embedder:
        cfg = EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu",
                            compile=compiled, max_batch_rows=32)
        return Embedder(cfg, [PoolerSpec(name="mean")])

    eager, compiled = embedder(False), embedder(True)
    assert isinstance(compiled.encoder.model, torch._dynamo.eval_frame.OptimizedModule)
    torch._dynamo.reset()
    counters.clear()
    pieces = [TEXTS[:1], TEXTS, TEXTS[5:8], TEXTS[-1:]]  # one row, many batches, a few rows
    for texts in pieces:
        np.testing.assert_allclose(compiled.encode(texts), eager.encode(texts), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # no recompile per batch shape


def test_compile_is_refused_with_int8_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="compile runs the torch model; dtype int8 runs its own"):
        build_job(str(tmp_path / "c.parquet"), str(tmp_path / "out"), dtype="int8", compile=True)


def test_compile_is_a_job_option_that_leaves_the_sets_keys_alone(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    def job(**options):
        return build_job(str(tmp_path / "c.parquet"), str(tmp_path / "out"),
                         model=str(tiny_model_dir), **options)

    assert job(compile=True).encoder.compile and not job().encoder.compile
    assert job_keys(job(compile=True)) == job_keys(job())  # the same vectors either way
