"""Files in OUT written by someone else: nothing in them chooses a path, code or data.

Every attack here is the real thing on real files: a tampered ``_INDEX.json`` (traversal
names, a changed index file) on a local OUT and on a moto S3 OUT with its local cache, a
``_SET.json`` that asks for remote code or points its snippets at another Parquet file, and
malformed learned heads. Each fails with one line (or, for snippets, serves none) and leaves a
sentinel folder outside OUT and outside the cache untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _index_sets import clustered, write_set
from _s3 import upload_dir
from _search_sets import TEXTS, embedded_set
from safetensors.torch import save as save_safetensors

from flows.cli import main
from pipeline import storage
from pipeline.errors import ConfigError, EmbedpipeError, ModelError, StorageError
from pipeline.head_files import HeadConfig, expected_shapes
from pipeline.index import IndexRequest, index_set, open_index, read_meta
from pipeline.poolers.heads import PoolingHead, load_head, save_head
from pipeline.search import Searcher
from pipeline.server import ServerConfig, create_app

ROOT = Path(__file__).resolve().parents[1]


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert text and len(text.splitlines()) == 1, text
    return text


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder outside OUT and outside the cache that no attack may change."""
    folder = tmp_path / "victim"
    (folder / "sub").mkdir(parents=True)
    (folder / "keep.txt").write_text("precious")
    (folder / "sub" / "more.txt").write_text("also precious")
    return folder


def untouched(victim: Path) -> bool:
    found = sorted(p.relative_to(victim).as_posix() for p in victim.rglob("*"))
    return (found == ["keep.txt", "sub", "sub/more.txt"]
            and (victim / "keep.txt").read_text() == "precious")


# --- _INDEX.json: traversal names and checksums ----------------------------------------------

X = clustered(400, 8, seed=3)


def build(out: str, **kw):
    return index_set(IndexRequest(out=out, set_name="s", **kw), say=lambda _: None).meta


def local_out(tmp_path: Path) -> str:
    write_set(tmp_path / "out", "s", [f"d{i}" for i in range(len(X))], X, parts=2)
    out = str(tmp_path / "out")
    build(out)
    return out


def s3_out(tmp_path: Path, bucket: str) -> str:
    write_set(tmp_path / "staging", "s", [f"d{i}" for i in range(len(X))], X, parts=2)
    out = f"s3://{bucket}/run"
    upload_dir(tmp_path / "staging" / "sets", f"{out}/sets")
    build(out)
    return out


def tamper_index(out: str, **changes) -> None:
    url = storage.join(out, "index", "s", "_INDEX.json")
    storage.write_bytes(url, json.dumps(storage.read_json(url) | changes).encode())


def traversals(victim: Path) -> dict[str, dict]:
    up = "../" * 6  # from the cache's folder of the index (or from OUT/index/s) to tmp_path
    return {
        "name": {"name": f"{up}{victim.name}"},
        "token": {"token": f"{up}{victim.name}"},
        "absolute token": {"token": str(victim)},
        "index file": {"index_file": f"../../../{victim.name}/keep.txt"},
        "idmap file": {"idmap_file": str(victim / "keep.txt")},
        "previous token": {"previous_token": f"../../{victim.name}"},
    }


ATTACKS = ["name", "token", "absolute token", "index file", "idmap file", "previous token"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_traversal_names_in_a_local_index_are_refused(tmp_path, victim, attack):
    out = local_out(tmp_path)
    tamper_index(out, **traversals(victim)[attack])
    with pytest.raises(StorageError) as exc:
        read_meta(out, "s")
    assert "_INDEX.json" in one_line(exc)
    with pytest.raises(StorageError):  # the index command (catch-up) stops before writing
        build(out)
    assert untouched(victim)
    rebuilt = build(out, rebuild=True)  # --rebuild replaces the damaged description
    assert read_meta(out, "s") == rebuilt and untouched(victim)
    assert sorted(os.listdir(tmp_path)) == ["out", "victim"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_traversal_names_in_a_remote_index_never_reach_outside_the_cache(
        tmp_path, s3_bucket, monkeypatch, victim, attack):
    cache = tmp_path / "cache"
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(cache))
    out = s3_out(tmp_path, s3_bucket)
    good = read_meta(out, "s")
    open_index(out, good)  # a cached copy exists: the old code pruned its siblings by token
    tamper_index(out, **traversals(victim)[attack])
    with pytest.raises(StorageError) as exc:
        read_meta(out, "s")
    assert "_INDEX.json" in one_line(exc)
    bad = good.model_copy(update=traversals(victim)[attack])  # a caller passing it on anyway
    with pytest.raises(StorageError) as exc:
        open_index(out, bad)
    one_line(exc)
    assert untouched(victim)
    assert sorted(os.listdir(tmp_path)) == ["cache", "staging", "victim"]
    cached = cache / "index" / s3_bucket / "run" / "index" / "s"
    assert [p.name for p in cached.iterdir()] == [good.token]


def test_a_changed_index_file_is_refused_before_faiss_reads_it(tmp_path):
    out = local_out(tmp_path)
    meta = read_meta(out, "s")
    folder = Path(out) / "index" / "s"
    other = faiss.IndexIDMap(faiss.IndexFlatIP(8))
    other.add_with_ids(clustered(5, 8, seed=9), np.arange(5, dtype=np.int64))
    faiss.write_index(other, str(folder / meta.index_file))  # a valid index, not the one made
    with pytest.raises(StorageError) as exc:
        open_index(out, meta)
    assert meta.index_file in one_line(exc) and "SHA-256" in str(exc.value)
    build(out, rebuild=True)
    assert open_index(out, read_meta(out, "s")).search(X[:1], 1)[0][0][0] == "d0"


def test_a_changed_id_map_is_refused(tmp_path):
    out = local_out(tmp_path)
    meta = read_meta(out, "s")
    path = Path(out) / "index" / "s" / meta.idmap_file
    table = pq.read_table(path)
    ids = pa.array([f"x{i}" for i in range(table.num_rows)])
    pq.write_table(table.set_column(table.schema.get_field_index("id"), "id", ids), path)
    with pytest.raises(StorageError) as exc:
        open_index(out, meta)
    assert meta.idmap_file in one_line(exc) and "SHA-256" in str(exc.value)


def test_an_index_description_without_checksums_asks_for_a_rebuild(tmp_path):
    out = local_out(tmp_path)
    url = storage.join(out, "index", "s", "_INDEX.json")
    payload = storage.read_json(url)
    del payload["index_sha256"], payload["idmap_sha256"]
    storage.write_bytes(url, json.dumps(payload).encode())
    with pytest.raises(StorageError, match="no SHA-256 .* --rebuild") as exc:
        read_meta(out, "s")
    one_line(exc)
    build(out, rebuild=True)
    assert read_meta(out, "s").index_sha256


def test_a_changed_remote_index_is_not_cached_and_a_damaged_cache_is_refused(
        tmp_path, s3_bucket, monkeypatch, victim):
    cache = tmp_path / "cache"
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(cache))
    out = s3_out(tmp_path, s3_bucket)
    meta = read_meta(out, "s")
    remote = storage.join(out, "index", "s", meta.index_file)
    genuine = storage.read_bytes(remote)
    storage.write_bytes(remote, genuine[:-16] + b"\0" * 16)
    with pytest.raises(StorageError) as exc:
        open_index(out, meta)
    assert remote in one_line(exc) and "SHA-256" in str(exc.value)
    cached = cache / "index" / s3_bucket / "run" / "index" / "s"
    assert not [p for p in cached.iterdir() if not p.name.startswith(".")]  # nothing kept
    assert not any(cached.iterdir())  # and no partial download left behind
    storage.write_bytes(remote, genuine)
    assert open_index(out, meta).search(X[:1], 1)[0][0][0] == "d0"
    (cached / meta.token / meta.index_file).write_bytes(genuine[:-1])  # the cache itself
    with pytest.raises(StorageError) as exc:
        open_index(out, meta)
    assert "SHA-256" in one_line(exc)
    assert untouched(victim)


# --- _SET.json: remote code ------------------------------------------------------------------


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, tiny_model_dir) -> Path:
    out = embedded_set(tmp_path_factory.mktemp("trust"), tiny_model_dir)
    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    return out


def copy_out(indexed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(indexed, out)
    return out


def edit_set(out: Path, **changes) -> None:
    path = out / "sets" / "mean" / "_SET.json"
    payload = json.loads(path.read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            payload[key] = payload[key] | value
        else:
            payload[key] = value
    path.write_text(json.dumps(payload))


def evil_model(tmp_path: Path, tiny_model_dir: Path, sentinel: Path, where: str) -> Path:
    """The tiny BERT, plus an ``auto_map`` in ``where`` to evil.py, which leaves ``sentinel``."""
    folder = tmp_path / "evil-model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('remote code ran')\n"
        "from transformers import BertConfig, BertModel, BertTokenizerFast\n"
        "class EvilConfig(BertConfig):\n    model_type = 'bert'\n"
        "class EvilModel(BertModel):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(BertTokenizerFast):\n    pass\n"
    )
    path = folder / where
    config = json.loads(path.read_text())
    config["auto_map"] = ({"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
                          if where == "config.json"
                          else {"AutoTokenizer": [None, "evil.EvilTokenizer"]})
    path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_remote_code_named_by_a_set_never_runs(indexed, tmp_path, tiny_model_dir, capsys,
                                               where):
    sentinel = tmp_path / "sentinel"
    out = copy_out(indexed, tmp_path)
    evil = evil_model(tmp_path, tiny_model_dir, sentinel, where)
    edit_set(out, encoder={"model": str(evil), "trust_remote_code": True})
    with pytest.raises(ModelError) as exc:
        Searcher(str(out))
    assert "--trust-remote-code" in one_line(exc) and "auto_map" in str(exc.value)
    with pytest.raises(ModelError):
        create_app(ServerConfig(out=str(out)))
    queries = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query": [TEXTS[0]], "doc_id": [100]}), queries)
    for argv in (["query", str(out), "hello"], ["eval", str(out), str(queries)]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--trust-remote-code" in err, err
    assert not sentinel.exists()


def test_the_operator_flag_is_the_only_switch_for_remote_code(indexed, tmp_path,
                                                              tiny_model_dir):
    sentinel = tmp_path / "sentinel"
    out = copy_out(indexed, tmp_path)
    evil = evil_model(tmp_path, tiny_model_dir, sentinel, "config.json")
    edit_set(out, encoder={"model": str(evil)})  # _SET.json says nothing about remote code
    code = "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_MODULES_CACHE": str(tmp_path / "hfm"),
           "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code, "query", str(out), "hello",
                    "--trust-remote-code"], env=env, cwd=ROOT, capture_output=True,
                   timeout=300)
    assert sentinel.read_text() == "remote code ran"  # the operator asked for it


def test_a_backfill_does_not_inherit_remote_code_from_the_set(indexed, tmp_path):
    from pipeline.assembly import inherit_encoder
    from pipeline.config import EmbedJob

    out = copy_out(indexed, tmp_path)
    edit_set(out, encoder={"trust_remote_code": True})
    job = EmbedJob.model_validate(
        inherit_encoder({"corpus": str(tmp_path / "c.parquet"), "out": str(out)}))
    stored = json.loads((out / "sets" / "mean" / "_SET.json").read_text())["encoder"]
    assert job.encoder.model == stored["model"]  # the rest of the encoder is inherited
    assert job.encoder.trust_remote_code is False


# --- _SET.json: snippets only from the set's own corpus -------------------------------------


SECRET = "SECRET-"


def secret_file(tmp_path: Path, ids: list, **extra) -> Path:
    path = tmp_path / "secret.parquet"
    pq.write_table(pa.table({"id": ids, "text": [f"{SECRET}{i}" for i in ids], **extra}), path)
    return path


def snippet_attacks(tmp_path: Path) -> dict[str, dict]:
    other_ids = list(range(5000, 5020))
    return {
        "another file": {"corpus": str(secret_file(tmp_path, other_ids))},
        "string ids": {"corpus": str(secret_file(tmp_path, [str(i) for i in range(100, 120)]))},
        "another column": {"text_column": "secret",
                           "corpus": str(secret_file(tmp_path, list(range(100, 120)),
                                                     secret=[SECRET] * 20))},
        "missing file": {"corpus": str(tmp_path / "nothing.parquet")},
        "a few ids": {"corpus": str(secret_file(tmp_path, list(range(100, 104))
                                                + list(range(9000, 9016))))},
    }


SNIPPET_ATTACKS = ["another file", "string ids", "another column", "missing file", "a few ids"]


@pytest.mark.parametrize("attack", SNIPPET_ATTACKS)
def test_snippets_never_come_from_a_file_without_the_sets_ids(indexed, tmp_path, capsys,
                                                              attack):
    out = copy_out(indexed, tmp_path)
    changes = snippet_attacks(tmp_path)[attack]
    edit_set(out, **changes)
    searcher = Searcher(str(out))
    assert searcher.snippets is None
    note = searcher.snippet_note
    assert note and len(note.splitlines()) == 1 and "no snippets for set 'mean'" in note
    hits = searcher.search(TEXTS[:3], k=20)
    assert [h[0].id for h in hits] == [100, 101, 102]
    assert all(h.snippet is None for row in hits for h in row)
    assert main(["query", str(out), TEXTS[2], "-k", "20", "--json"]) == 0
    printed = capsys.readouterr()
    assert SECRET not in printed.out and "\"snippet\": null" in printed.out
    assert printed.err.strip() == f"note: {note}"


def test_the_operator_named_corpus_wins_and_is_checked_too(indexed, tmp_path, capsys):
    out = copy_out(indexed, tmp_path)
    real = json.loads((out / "sets" / "mean" / "_SET.json").read_text())["corpus"]
    secret = str(secret_file(tmp_path, list(range(5000, 5020))))
    edit_set(out, corpus=secret)
    searcher = Searcher(str(out), corpus=real)
    assert searcher.snippet_note is None
    assert searcher.search([TEXTS[4]], k=1)[0][0].snippet == TEXTS[4]
    edit_set(out, corpus=real)
    assert main(["query", str(out), TEXTS[4], "-k", "1", "--corpus", secret]) == 0
    printed = capsys.readouterr()
    assert SECRET not in printed.out and "is not the set's corpus" in printed.err


@pytest.mark.slow
def test_the_server_hands_out_no_snippets_from_another_file(indexed, tmp_path):
    import httpx
    from _serve import free_port

    out = copy_out(indexed, tmp_path)
    edit_set(out, **snippet_attacks(tmp_path)["another file"])
    port = free_port()
    code = ("import sys; from flows.cli import main; "
            f"sys.exit(main(['serve', {str(out)!r}, '--port', '{port}']))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        body = _search_when_up(proc, f"http://127.0.0.1:{port}", httpx)
    finally:
        proc.terminate()
        err = proc.communicate(timeout=60)[1]
    assert [r["id"] for r in body["results"][0][:1]] == [100]
    assert SECRET not in json.dumps(body)
    assert all(r["snippet"] is None for r in body["results"][0])
    assert "no snippets for set 'mean'" in err and "is not the set's corpus" in err


def _search_when_up(proc: subprocess.Popen, base: str, httpx) -> dict:
    import time

    deadline = time.monotonic() + 180  # a hang guard, not a timing
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            reply = httpx.post(f"{base}/search", json={"query": TEXTS[0], "k": 20}, timeout=5)
            return reply.json()
        except httpx.TransportError:
            time.sleep(0.5)
    raise RuntimeError("server did not start")


# --- learned heads --------------------------------------------------------------------------


def head_config(**kw) -> HeadConfig:
    base = {"kind": "adapter", "hidden_size": 32, "num_layers": 2, "model_hash": "m",
            "out_dim": 8}
    return HeadConfig(**(base | kw))


@pytest.mark.parametrize("cfg", [
    head_config(), head_config(kind="attention", adapter=True, out_dim=None),
    head_config(kind="positional", max_positions=64, out_dim=None),
    head_config(kind="layer_weights", layers=(-1, -2), out_dim=None),
])
def test_expected_shapes_are_those_of_the_head(cfg):
    made = {k: tuple(v.shape) for k, v in PoolingHead(cfg).state_dict().items()}
    assert expected_shapes(cfg) == made


@pytest.fixture
def head_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "head"
    save_head(PoolingHead(head_config()), str(folder))
    assert load_head(str(folder)).cfg == head_config()  # the genuine head loads
    return folder


def _json(folder: Path, **changes) -> None:
    path = folder / "head.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _truncate(folder: Path, keep: float) -> None:
    path = folder / "head.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _half_precision(folder: Path) -> None:
    tensors = {k: v.half() for k, v in PoolingHead(head_config()).state_dict().items()}
    (folder / "head.safetensors").write_bytes(save_safetensors(tensors))


def _extra_tensor(folder: Path) -> None:
    tensors = PoolingHead(head_config()).state_dict() | {"extra": torch.zeros(3)}
    (folder / "head.safetensors").write_bytes(save_safetensors(dict(tensors)))


HEAD_ATTACKS = {
    "bad json": (lambda f: (f / "head.json").write_text("{not json"), "not valid JSON"),
    "json list": (lambda f: (f / "head.json").write_text("[1, 2]"), "not a JSON object"),
    "unknown kind": (lambda f: _json(f, kind="pickle"), "kind"),
    "truncated weights": (lambda f: _truncate(f, 0.6), "truncated or damaged"),
    "truncated header": (lambda f: _truncate(f, 0.02), "bad header"),
    "huge adapter": (lambda f: _json(f, out_dim=10**12), "[1000000000000, 32]"),
    "huge positions": (lambda f: _json(f, kind="positional", max_positions=10**13,
                                       adapter=True), "[10000000000000]"),
    "shape disagrees": (lambda f: _json(f, out_dim=16), "does not match its head.json"),
    "fp16 weights": (_half_precision, "F16"),
    "extra tensor": (_extra_tensor, "extra F32 [3]"),
    "weights missing": (lambda f: (f / "head.safetensors").unlink(), "head.safetensors"),
}


@pytest.mark.parametrize("attack", sorted(HEAD_ATTACKS))
def test_malformed_heads_fail_in_one_line_before_allocating(head_dir, attack):
    damage, says = HEAD_ATTACKS[attack]
    damage(head_dir)
    with pytest.raises(EmbedpipeError) as exc:
        load_head(str(head_dir))
    assert says in one_line(exc)


def test_a_head_for_another_encoder_is_refused_before_its_weights_are_read(head_dir):
    _truncate(head_dir, 0.5)

    def expect(cfg: HeadConfig) -> None:
        raise ConfigError(f"head for hidden size {cfg.hidden_size}, encoder has 64")

    with pytest.raises(ConfigError, match="head for hidden size 32, encoder has 64"):
        load_head(str(head_dir), expect=expect)
