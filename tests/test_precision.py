"""``dtype auto`` measured on the model itself, cached; half-dtype weights cast once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pipeline.config import EncoderConfig
from pipeline.encoder import TIMING_MAX_ROUNDS, TIMING_ROUNDS, TIMING_SECONDS, Encoder
from pipeline.fused_bert import FusedBert
from pipeline.hardware import (
    ISA_CAPS,
    ONEDNN_CACHES,
    cpu_bf16_is_faster,
    cpu_key,
    cpu_profile,
    prepare_cpu_kernels,
)
from pipeline.models import loader
from pipeline.onednn import PackedLinear
from pipeline.precision import (
    CHECK_VERSION,
    MIN_COSINE,
    DtypeCheck,
    cached_check,
    choose_dtype,
)

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path))
    return tmp_path


def test_a_half_dtype_wins_only_when_close_and_faster() -> None:
    assert DtypeCheck(cosine=0.99995, speedup=3.0).wins()
    assert not DtypeCheck(cosine=0.99995, speedup=0.86).wins()  # slower on this model
    assert not DtypeCheck(cosine=MIN_COSINE - 1e-5, speedup=3.0).wins()  # too far from fp32


def test_auto_takes_bf16_only_where_the_hardware_and_the_model_say_so(cache: Path) -> None:
    asked: list[str] = []

    def check(speedup: float):
        def measure(candidate: str) -> DtypeCheck:
            asked.append(candidate)
            return DtypeCheck(cosine=0.99999, speedup=speedup)
        return measure

    fast = choose_dtype("auto", CPU, check(3.0), "model-a")
    slow = choose_dtype("auto", CPU, check(0.8), "model-b")
    if cpu_bf16_is_faster():
        assert (fast, slow, asked) == ("bf16", "fp32", ["bf16", "bf16"])
    else:  # no fast bf16 path: the model is never timed in an emulated dtype
        assert (fast, slow, asked) == ("fp32", "fp32", [])
    assert choose_dtype("fp32", CPU, check(3.0), "model-a") == "fp32"


def test_the_measurement_is_cached_per_key_and_remeasured_when_unreadable(cache: Path) -> None:
    calls: list[int] = []

    def measure() -> DtypeCheck:
        calls.append(1)
        return DtypeCheck(cosine=0.99991, speedup=2.5)

    first = cached_check("k1", measure)
    again = cached_check("k1", measure)
    assert first == again == DtypeCheck(cosine=0.99991, speedup=2.5)
    assert len(calls) == 1
    for damaged in ("{not json", '{"cosine": "1.0", "speedup": 2.5}', '{"cosine": 0.9999}',
                    '[0.9999, 2.5]'):
        (cache / f"dtype-v{CHECK_VERSION}-k1.json").write_text(damaged)
        assert cached_check("k1", measure) == first
    assert len(calls) == 5
    cached_check("k2", measure)  # another model or machine: its own measurement
    assert len(calls) == 6


def test_the_tiny_encoder_is_timed_and_its_choice_recorded(cache: Path,
                                                           tiny_model_dir: Path) -> None:
    encoder = Encoder(EncoderConfig(model=str(tiny_model_dir), device="cpu"))
    assert encoder.dtype in {"fp32", "bf16"}
    saved = list(cache.glob("dtype-*.json"))
    if cpu_bf16_is_faster():  # measured once, and the choice follows the measurement
        assert len(saved) == 1
        check = DtypeCheck(**json.loads(saved[0].read_text()))
        assert check.speedup > 0 and 0.99 < check.cosine <= 1.0 + 1e-6
        assert encoder.dtype == ("bf16" if check.wins() else "fp32")
    else:
        assert (encoder.dtype, saved) == ("fp32", [])


@pytest.mark.skipif(not cpu_profile()["bf16_ok"], reason="this CPU cannot run bf16")
def test_the_check_measures_bf16_on_the_model_and_leaves_it_in_fp32(tiny_model_dir: Path) -> None:
    """Run directly, so CPUs whose bf16 is emulated (where ``auto`` never asks) cover it too."""
    encoder = Encoder(EncoderConfig(model=str(tiny_model_dir), device="cpu", dtype="fp32"))
    ids, mask = encoder.pad(encoder.tokenize(["measured, then back to fp32"]))
    before = encoder.forward(ids, mask, {encoder.num_layers}, False).layer(-1)
    check = encoder._check_dtype("bf16")
    assert 0.99 < check.cosine <= 1.0 + 1e-6
    assert check.speedup > 0
    assert encoder.dtype == "fp32"
    after = encoder.forward(ids, mask, {encoder.num_layers}, False).layer(-1)
    assert torch.equal(before, after)


def test_a_checkpoint_saved_in_fp16_runs_fp32_where_the_run_says_fp32(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """transformers 5 loads a checkpoint in its stored dtype; the encoder's weights are float32
    whatever the files hold, so ``dtype fp32`` means fp32 products (the same vectors as the
    fp16-rounded weights upcast by hand)."""
    import shutil

    from transformers import AutoModel

    half = tmp_path / "fp16-saved"
    shutil.copytree(tiny_model_dir, half)
    AutoModel.from_pretrained(str(tiny_model_dir)).half().save_pretrained(half)
    encoder = Encoder(EncoderConfig(model=str(half), device="cpu", dtype="fp32"))
    assert {p.dtype for p in encoder.model.parameters()} == {torch.float32}
    ids, mask = encoder.pad(encoder.tokenize(["stored in fp16", "run in fp32 " * 5]))
    got = encoder.forward(ids, mask, {encoder.num_layers}, False).layer(-1)
    by_hand = AutoModel.from_pretrained(str(half), attn_implementation="sdpa").float().eval()
    assert next(AutoModel.from_pretrained(str(half)).parameters()).dtype == torch.float16
    with torch.inference_mode():
        want = by_hand(input_ids=ids, attention_mask=mask.long(),
                       token_type_ids=torch.zeros_like(ids)).last_hidden_state
    real = mask.bool()  # the states of padding are the forward's own (the fused one: zeros)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_profile()["bf16_ok"], reason="this CPU cannot run bf16")
def test_bf16_weights_cast_once_give_autocasts_vectors(tiny_model_dir: Path) -> None:
    """Linear weights stored in bf16 (packed for oneDNN in the fused CPU forward, where the
    encoder runs it) round exactly as autocast rounds them every forward."""
    encoder = Encoder(EncoderConfig(model=str(tiny_model_dir), device="cpu", dtype="bf16"))
    linears = [m for m in encoder.model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [m for m in encoder.model.modules() if isinstance(m, PackedLinear)]  # fused
    norms = [m for m in encoder.model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert linears or packed
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert all(m.dtype == m.bias.dtype == torch.bfloat16 for m in packed)
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)
    ids, mask = encoder.pad(encoder.tokenize(["weights cast once", "a second, longer text " * 4]))
    got = encoder.forward(ids, mask, {encoder.num_layers}, False).layer(-1)
    files = loader.read_model_files(str(tiny_model_dir))
    plain = loader.load_transformer(files, False, False, loader.load_config(files, False))
    if encoder.fused:
        plain = FusedBert.from_model(plain, onednn_fp32=encoder.fp32_kernel == "onednn")
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = plain(input_ids=ids, attention_mask=mask.long(),
                    token_type_ids=torch.zeros_like(ids))
    assert torch.equal(got, out.last_hidden_state.float())


def test_onednn_kernel_caches_are_bounded_unless_the_user_set_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ONEDNN_CACHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    prepare_cpu_kernels()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == ONEDNN_CACHES[
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


def test_kernels_capped_to_another_instruction_set_are_measured_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe and every dtype check are cached by ``cpu_key``: the same CPU with its kernels
    capped to AVX2 (bf16 emulated) must not reuse what its uncapped kernels measured."""
    for name in ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    keys = {cpu_key()}
    for name, value in zip(ISA_CAPS, ("AVX2", "AVX2", "avx2", "AVX2"), strict=True):
        monkeypatch.setenv(name, value)
        keys.add(cpu_key())
        assert cpu_key() in keys  # stable
    assert len(keys) == 1 + len(ISA_CAPS)


def test_a_cached_probe_that_cannot_serve_is_measured_again(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An older probe's file (without the figure a later probe added), damaged JSON or a wrong
    type: the probe runs again and its file is replaced; a whole one is read as it is."""
    from pipeline import hardware

    fresh = {"fp32_gflops": 200.0, "bf16_gflops": 2.5, "fp32_onednn_gflops": 196.0,
             "fp32_gelu_gflops": 126.0, "fp32_onednn_gelu_gflops": 153.0,
             "fp32_onednn_gelu_apart_gflops": 171.0, "bf16_ok": True, "amx_traps": False}
    measured = []
    monkeypatch.setattr(hardware, "_measure", lambda: measured.append(1) or dict(fresh))
    older = {k: v for k, v in fresh.items() if k != "fp32_onednn_gelu_apart_gflops"}
    file = hardware._cache_file()
    try:
        for stale in (json.dumps(older), "{not json", json.dumps([1]),
                      json.dumps({**fresh, "amx_traps": "no"}),
                      json.dumps({**fresh, "fp32_gflops": "fast"})):
            file.write_text(stale)
            hardware.cpu_profile.cache_clear()
            assert hardware.cpu_profile() == fresh
            assert json.loads(file.read_text()) == fresh
        assert len(measured) == 5
        whole = {**fresh, "fp32_onednn_gelu_apart_gflops": None}  # not measured: a whole file
        file.write_text(json.dumps(whole))
        hardware.cpu_profile.cache_clear()
        assert hardware.cpu_profile() == whole and len(measured) == 5
        assert not list(cache.glob("*.partial"))
    finally:
        hardware.cpu_profile.cache_clear()  # the session's own profile again


def test_a_cache_that_cannot_be_written_only_measures_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``EMBEDPIPE_CACHE`` a file, not a folder: each check is measured and used, nothing is
    written, no error (``settings.write_cache``); a writable cache holds whole files only."""
    from pipeline.settings import write_cache

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(blocked))
    calls: list[int] = []

    def measure() -> DtypeCheck:
        calls.append(1)
        return DtypeCheck(cosine=0.99991, speedup=2.5)

    assert cached_check("k", measure) == cached_check("k", measure) == measure()
    assert len(calls) == 3 and blocked.read_text() == ""
    write_cache(tmp_path / "cache" / "x.json", {"a": [1, 2]})
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["x.json"]
    assert json.loads((tmp_path / "cache" / "x.json").read_text()) == {"a": [1, 2]}


@pytest.mark.parametrize(("forward_s", "rounds"), [(0.0, TIMING_MAX_ROUNDS), (0.06, TIMING_ROUNDS)])
def test_the_check_times_the_dtypes_in_turns_until_each_ran_long_enough(
        forward_s: float, rounds: int) -> None:
    """Three forwards of each, one dtype after the other, measured a 32-wide BERT's bf16 at
    0.87x and at 1.25x of fp32 on one machine: ``auto`` picked it by chance (0.63-0.69x end
    to end). The dtypes now take turns until each ran ``TIMING_ROUNDS`` times and
    ``TIMING_SECONDS`` in all; a forward too quick for that stops at ``TIMING_MAX_ROUNDS``."""
    import time
    from types import SimpleNamespace

    ran: list[str] = []

    def forward(*_args) -> None:
        ran.append(fake.dtype)
        time.sleep(forward_s)

    fake = SimpleNamespace(dtype="fp32", device=CPU, num_layers=2, forward=forward)
    fp32_s, bf16_s = Encoder._time_forwards(fake, ("fp32", "bf16"), None, None)
    assert ran == ["fp32", "bf16"] * (rounds + 1)  # in turns, the first round a warm-up
    assert fp32_s >= forward_s and bf16_s >= forward_s
    if forward_s:
        assert rounds * forward_s >= TIMING_SECONDS


def test_a_set_continued_in_another_float_dtype_records_both(tmp_path, tiny_model_dir) -> None:
    """bf16 and fp32 vectors share a fingerprint (a set takes both); ``_SET.json`` said bf16
    for a set whose later rows were fp32's."""
    from _flowkit import job, run_library, text_for, write_corpus

    from pipeline.sets import SetFolder

    write_corpus(tmp_path / "c" / "a.parquet", list(range(10)), [text_for(i) for i in range(10)])
    bf16 = job(tmp_path / "c", tmp_path / "out", tiny_model_dir)
    bf16["encoder"] = bf16["encoder"] | {"dtype": "bf16"}
    run_library(bf16)
    assert SetFolder(str(tmp_path / "out"), "mean").meta().dtype == "bf16"
    write_corpus(tmp_path / "c" / "b.parquet", [10, 11], [text_for(10), text_for(11)])
    summary = run_library(job(tmp_path / "c", tmp_path / "out", tiny_model_dir))  # fp32
    assert summary.embedded == 2
    assert SetFolder(str(tmp_path / "out"), "mean").meta().dtype == "bf16+fp32"
    run_library(bf16)
    assert SetFolder(str(tmp_path / "out"), "mean").meta().dtype == "bf16+fp32"
