"""A learned head's files are trusted only as far as they are checked: head.json's ``layers``
are validated and bound to the weights saved with them, the safetensors header's entries are typed,
and neither file is read past its bound, from a device, a FIFO or through a link out of its
folder."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import head_files
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.data import TextBatch
from pipeline.embedder import Embedder
from pipeline.errors import ConfigError
from pipeline.head_files import HeadConfig
from pipeline.models.loader import read_model_files
from pipeline.poolers import heads
from pipeline.poolers.heads import PoolingHead, load_head, save_head

TEXTS = ["pepper walnut in the garden", "a stone river", "short", "the copper lantern " * 3]


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An attention head for the tiny BERT, with a random (not uniform) token scorer."""
    cfg = HeadConfig(kind="attention", hidden_size=32, num_layers=2, layers=(-1,),
                     model_hash=read_model_files(str(tiny_model_dir)).model_hash())
    torch.manual_seed(0)
    head = PoolingHead(cfg)
    with torch.no_grad():
        head.scorer.weight.normal_()
    folder = tmp_path_factory.mktemp("head")
    save_head(head, str(folder))
    return folder


def copy_head(head_dir: Path, target: Path, **changes: object) -> Path:
    """A copy of the head whose head.json has ``changes``."""
    shutil.copytree(head_dir, target)
    return edit_head(target, **changes)


def edit_head(folder: Path, **changes: object) -> Path:
    """``folder`` with ``changes`` made to its head.json in place."""
    cfg = json.loads((folder / "head.json").read_text()) | changes
    (folder / "head.json").write_text(json.dumps(cfg))
    return folder


def served(folder: Path, model: Path) -> tuple[str, np.ndarray]:
    emb = Embedder(EncoderConfig(model=str(model), dtype="fp32"),
                   [PoolerSpec(name="learned", strategy="learned", head=str(folder))])
    vectors = emb.embed(TextBatch(list(range(len(TEXTS))), TEXTS)).vectors["learned"]
    return emb.fingerprint("learned"), vectors


def test_a_head_trained_again_in_place_is_loaded_again_by_a_long_lived_process(
        head_dir: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A process that used a head (the Python API across runs, a Dask worker, ``serve``) kept
    it by its path after the head was trained again in place: it wrote the old head's vectors
    into new sets, and served them for queries of sets made with the new one."""
    import pipeline.embedder
    from pipeline.embedder import get_embedder

    monkeypatch.setattr(pipeline.embedder, "_CACHE", {})
    folder = shutil.copytree(head_dir, tmp_path / "head")
    encoder = EncoderConfig(model=str(tiny_model_dir), dtype="fp32", device="cpu")
    specs = [PoolerSpec(name="learned", strategy="learned", head=str(folder))]
    batch = TextBatch(list(range(len(TEXTS))), TEXTS)
    before = get_embedder(encoder, specs).embed(batch).vectors["learned"]
    assert get_embedder(encoder, specs) is get_embedder(encoder, specs)  # loaded once
    retrained = load_head(str(folder))
    with torch.no_grad():
        retrained.scorer.weight.normal_()
    save_head(retrained, str(folder))
    after = get_embedder(encoder, specs).embed(batch).vectors["learned"]
    assert not np.allclose(after, before, atol=1e-3)
    _, fresh = served(folder, tiny_model_dir)
    np.testing.assert_allclose(after, fresh, rtol=0, atol=1e-6)


def test_a_set_continued_with_a_head_trained_again_in_place_names_its_files(
        head_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The refusal said two fingerprints differ and nothing of what differs: the head's path,
    the model and the lengths are the same, only the weights in the folder changed."""
    from _flowkit import job, run_library, text_for, tree_digest, write_corpus

    from pipeline.errors import FingerprintError

    folder = shutil.copytree(head_dir, tmp_path / "head")
    write_corpus(tmp_path / "a.parquet", list(range(12)), [text_for(i) for i in range(12)])
    learned = job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir, poolers=[
        {"name": "learned", "strategy": "learned", "head": str(folder)}])
    run_library(learned)
    before = tree_digest(tmp_path / "out")
    retrained = load_head(str(folder))
    with torch.no_grad():
        retrained.scorer.weight.normal_()
    save_head(retrained, str(folder))
    with pytest.raises(FingerprintError, match=r"; differs in: pooler files \{'head_sha256': "
                                               r"'[0-9a-f]{16}'\} -> \{'head_sha256': "):
        run_library(learned)
    assert tree_digest(tmp_path / "out") == before


def test_a_head_json_edited_since_its_weights_were_saved_is_refused(
        head_dir: Path, tmp_path: Path) -> None:
    """Same folder and weights, head.json edited to read another layer (other vectors, the
    same weights hash): the weights carry the digest of the head.json saved with them."""
    folder = copy_head(head_dir, tmp_path / "h")
    load_head(str(folder))
    for change in ({"layers": [-2]}, {"layers": [-1], "model_hash": "0123456789abcdef"}):
        edited = copy_head(head_dir, tmp_path / f"h{len(change)}", **change)
        with pytest.raises(ConfigError, match=r"head.json is not the one its weights were "
                                              r"saved with") as err:
            load_head(str(edited))
        assert "\n" not in str(err.value)


def test_what_does_not_change_vectors_may_change_and_old_heads_still_load(
        head_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The recorded metrics, or the last layer named from the bottom (2) or the top (-1);
    and a head saved before its weights carried the digest still loads, its head.json (not
    bound to its weights) in its fingerprint beside them."""
    folder = copy_head(head_dir, tmp_path / "h")
    base, vectors = served(folder, tiny_model_dir)
    assert served(edit_head(folder, metrics={"val_mrr@10": 0.9}), tiny_model_dir)[0] == base
    assert served(edit_head(folder, layers=[2]), tiny_model_dir)[0] == base
    older = copy_head(head_dir, tmp_path / "older")  # its weights saved without metadata
    tensors = heads.load_safetensors((older / "head.safetensors").read_bytes())
    (older / "head.safetensors").write_bytes(heads.save_safetensors(tensors))
    fingerprint, again = served(older, tiny_model_dir)
    assert np.allclose(again, vectors, atol=1e-6)
    emb = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32"),
                   [PoolerSpec(name="learned", strategy="learned", head=str(older))])
    assert emb.poolers["learned"].identity() == {
        "head_sha256": load_head(str(older)).weights_sha256,
        "head_config": head_files.config_digest(load_head(str(older)).cfg)}
    # its layers edited (same shapes: nothing else refuses it): other vectors, another set.
    # The fingerprint stayed, and a set took the new layer's vectors beside the old ones.
    edited, moved = served(edit_head(older, layers=[1]), tiny_model_dir)
    assert edited != fingerprint and not np.allclose(moved, vectors, atol=1e-3)


@pytest.mark.parametrize(("layers", "problem"), [
    ([], "non-empty list of layers -3..2"),
    ([-1] * 20000, "layers must be distinct"),
    ([-1, 2], "layers must be distinct"),  # the same layer twice
    ([3], "layers -3..2 of a 2-layer encoder, got \\[3\\]"),
    ([-4], "got \\[-4\\]"),
])
def test_bad_layers_are_refused_in_one_line(head_dir: Path, tmp_path: Path, layers: list[int],
                                            problem: str) -> None:
    folder = copy_head(head_dir, tmp_path / "h", layers=layers)
    with pytest.raises(ConfigError, match=problem) as err:
        load_head(str(folder))
    assert "head.json" in str(err.value) and "\n" not in str(err.value)


def test_an_encoder_deeper_than_any_is_refused() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        HeadConfig(kind="attention", hidden_size=32, num_layers=10**6, model_hash="x")


def rewrite_header(folder: Path, tensor: str, field: str, value: object) -> None:
    file = folder / "head.safetensors"
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    header[tensor][field] = value
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


@pytest.mark.parametrize(("field", "value"), [
    ("shape", 5), ("shape", [None]), ("shape", [True]), ("shape", [-1]),
    ("data_offsets", 7), ("data_offsets", ["a", 4]), ("data_offsets", [0]),
    ("data_offsets", [4, 0]), ("dtype", None),
])
def test_a_malformed_safetensors_header_fails_in_one_line(head_dir: Path, tmp_path: Path,
                                                          field: str, value: object) -> None:
    folder = copy_head(head_dir, tmp_path / "h")
    rewrite_header(folder, "scorer.bias", field, value)
    with pytest.raises(ConfigError, match="head.safetensors is not a safetensors file: header "
                                          "entry 'scorer.bias'"):
        load_head(str(folder))


@pytest.mark.parametrize("name", ["head.json", "head.safetensors"])
def test_a_link_to_a_device_is_refused_unread(head_dir: Path, tmp_path: Path, name: str) -> None:
    """/dev/zero's size reads 0: it was read until memory ran out."""
    folder = copy_head(head_dir, tmp_path / "h")
    (folder / name).unlink()
    (folder / name).symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match=f"{name} is not a regular file"):
        load_head(str(folder))


def test_a_fifo_is_refused_not_waited_on(head_dir: Path, tmp_path: Path) -> None:
    folder = copy_head(head_dir, tmp_path / "h")
    fifo = folder / "head.json"
    fifo.unlink()
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            load_head(str(folder))
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # waiting for a writer: be one, so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=20)
        pytest.fail("loading a head whose head.json is a FIFO waited for a writer")
    assert isinstance(outcome[0], ConfigError)
    assert "head.json is not a regular file" in str(outcome[0])


def _job_keys(folder: Path, model: Path) -> dict[str, str]:
    from pipeline.config import EmbedJob
    from pipeline.run import job_keys

    spec = PoolerSpec(name="l", strategy="learned", head=str(folder))
    return job_keys(EmbedJob(corpus="c.parquet", out="out",
                             encoder=EncoderConfig(model=str(model)), poolers=[spec]))


def test_a_learned_sets_keys_are_computed_without_torch(head_dir: Path,
                                                        tiny_model_dir: Path) -> None:
    """A rerun with nothing to do plans from the sets' keys alone: for a learned set those
    read the head's files, which imported torch (a second or more) before any shard was
    looked at. The keys come out the same in a process that never imports it."""
    import subprocess
    import sys

    script = (
        "import json, sys\n"
        "from pipeline.config import EmbedJob, EncoderConfig, PoolerSpec\n"
        "from pipeline.run import job_keys\n"
        f"spec = PoolerSpec(name='l', strategy='learned', head={str(head_dir)!r})\n"
        "keys = job_keys(EmbedJob(corpus='c.parquet', out='out', poolers=[spec],\n"
        f"    encoder=EncoderConfig(model={str(tiny_model_dir)!r})))\n"
        "print(json.dumps([keys, 'torch' in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    keys, torch_imported = json.loads(done.stdout)
    assert keys == _job_keys(head_dir, tiny_model_dir) and not torch_imported


@pytest.mark.parametrize("make", ["device", "fifo"])
def test_a_jobs_keys_read_the_head_files_as_loading_does(head_dir: Path, tmp_path: Path,
                                                         tiny_model_dir: Path, make: str) -> None:
    """Planning hashed the head's files before ``load_head`` checked them: a head.json linked
    to /dev/zero, or a FIFO, hung `embed` for good."""
    folder = copy_head(head_dir, tmp_path / "h")
    (folder / "head.json").unlink()
    if make == "device":
        (folder / "head.json").symlink_to("/dev/zero")
    else:
        os.mkfifo(folder / "head.json")
    outcome: list[BaseException] = []

    def plan() -> None:
        try:
            _job_keys(folder, tiny_model_dir)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    planner = threading.Thread(target=plan, daemon=True)
    planner.start()
    planner.join(timeout=60)  # a hang guard
    if planner.is_alive() and make == "fifo":
        os.close(os.open(folder / "head.json", os.O_WRONLY | os.O_NONBLOCK))
    assert not planner.is_alive(), "planning read the head's file without bound"
    assert isinstance(outcome[0], ConfigError)
    assert "head.json is not a regular file" in str(outcome[0])
    # a sound head: its files' whole digests, as the keys of sets made before took them
    from pipeline import storage

    assert head_files.head_file_digests(str(head_dir)) == [
        storage.sha256(str(head_dir / name)) for name in ("head.json", "head.safetensors")]
    assert _job_keys(head_dir, tiny_model_dir)["l"]


def test_a_head_with_weights_that_are_not_finite_is_refused(head_dir: Path,
                                                            tmp_path: Path) -> None:
    """One flipped float (bit rot) made every vector of the set NaN, and every command
    after it (index, eval, search) ran on as if nothing were wrong."""
    folder = copy_head(head_dir, tmp_path / "h")
    raw = bytearray((folder / "head.safetensors").read_bytes())
    raw[-4:] = struct.pack("<f", float("nan"))
    (folder / "head.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"holds weights that are not finite \(NaN or "):
        load_head(str(folder))


def test_a_link_out_of_the_head_folder_is_refused(head_dir: Path, tmp_path: Path) -> None:
    elsewhere = copy_head(head_dir, tmp_path / "elsewhere")
    folder = copy_head(head_dir, tmp_path / "h")
    (folder / "head.safetensors").unlink()
    (folder / "head.safetensors").symlink_to(elsewhere / "head.safetensors")
    with pytest.raises(ConfigError, match="head.safetensors links to .*elsewhere.*outside"):
        load_head(str(folder))


def test_a_link_inside_the_head_folder_loads(head_dir: Path, tmp_path: Path) -> None:
    folder = copy_head(head_dir, tmp_path / "h")
    (folder / "v1").mkdir()
    for name in ("head.json", "head.safetensors"):
        (folder / name).rename(folder / "v1" / name)
        (folder / name).symlink_to(Path("v1") / name)
    reloaded = load_head(str(folder))
    assert torch.equal(reloaded.scorer.weight, load_head(str(head_dir)).scorer.weight)


def test_a_file_is_read_no_further_than_its_checked_size(tmp_path: Path) -> None:
    """The size read before may be stale (a file that grew or shrank): the read itself is
    bounded, and a file of another size refused."""
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 101)
    for stale in (100, 102):
        with pytest.raises(ConfigError, match=f"big.json changed while it was read \\({stale}"):
            head_files._read_at_most(str(big), stale)
    assert head_files._read_at_most(str(big), 101) == b" " * 101


def test_a_huge_head_json_shape_reads_no_more_than_the_file(head_dir: Path,
                                                           tmp_path: Path) -> None:
    """A head.json implying 40 TB of weights bounds nothing: the read is the file's size."""
    folder = copy_head(head_dir, tmp_path / "h", kind="positional", max_positions=10**13)
    with pytest.raises(ConfigError, match=r"does not match its head.json.*\[10000000000000\]"):
        load_head(str(folder))


@pytest.mark.parametrize(("change", "problem"), [
    ({"adapter": "no"}, "adapter: Input should be a valid boolean"),
    ({"hidden_size": 32.0}, "hidden_size: Input should be a valid integer"),
    ({"layers": [True]}, "layers.0: Input should be a valid integer"),
])
def test_a_head_json_value_of_another_type_is_refused(head_dir: Path, tmp_path: Path,
                                                      change: dict, problem: str) -> None:
    """head.json is read at its types: ``"no"`` is not false, ``32.0`` no width."""
    folder = copy_head(head_dir, tmp_path / "h", **change)
    with pytest.raises(ConfigError, match=problem) as err:
        load_head(str(folder))
    assert "head.json" in str(err.value) and "\n" not in str(err.value)


def _header(folder: Path, text: str) -> None:
    """``head.safetensors`` with ``text`` as its JSON header (and room for a tensor)."""
    body = text.encode()
    (folder / "head.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + bytes(132))


@pytest.mark.parametrize(("case", "problem"), [
    ("json deep", "head.json is not valid JSON"),
    ("json huge", "head.json is not valid JSON"),
    ("header deep", "is not a safetensors file"),
    ("header huge", "is not a safetensors file"),
])
def test_json_nested_too_deep_or_with_a_huge_number_is_one_line(
        head_dir: Path, tmp_path: Path, case: str, problem: str) -> None:
    """json.loads raises RecursionError and ValueError (Python's digit limit) beside
    JSONDecodeError: each is the file's one line, never a traceback."""
    folder = Path(shutil.copytree(head_dir, tmp_path / "h"))
    text = "[" * 100_000 + "]" * 100_000 if case.endswith("deep") else (
        '{"hidden_size": 1' + "0" * 5_000 + "}")
    if case.startswith("json"):
        (folder / "head.json").write_text(text)
    else:
        _header(folder, text)
    with pytest.raises(ConfigError, match=problem) as err:
        load_head(str(folder))
    assert "\n" not in str(err.value) and len(str(err.value)) < 600


def test_a_head_trained_through_the_other_int8_kernel_is_refused_naming_it() -> None:
    """A head trained under ``--dtype int8`` learned the states of one int8 kernel; a set run
    through the other refused it by hashes alone (train-pooler had no --int8-kernel)."""
    from pipeline.models.hashing import INT8_SUFFIXES

    base = "ab" * 32
    cfg = HeadConfig(kind="attention", hidden_size=32, num_layers=2,
                     model_hash=base + INT8_SUFFIXES["onednn"])
    with pytest.raises(ConfigError, match=r"was trained for encoder .*-onednn-int8-ffn, not for "
                                          r"m .*--int8-kernel onednn"):
        head_files.check_trained_for("h", cfg, {base + INT8_SUFFIXES["onnxruntime"]}, "m")
    args = ["train-pooler", "p.parquet", "h", "--kind", "attention", "--dtype", "int8",
            "--int8-kernel", "onnxruntime"]
    from flows.cli import build_parser
    from flows.cli.train import to_config

    assert to_config(build_parser().parse_args(args)).encoder.int8_kernel == "onnxruntime"
