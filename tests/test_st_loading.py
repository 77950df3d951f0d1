"""Reading sentence-transformers folders: what is refused, old formats, the model hash and its
cache, the default set, prompts inside windows."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from _st_models import PROMPTS, Variant, real_texts, save_variant
from conftest import build_tiny_bert

from pipeline.config import EmbedJob, EncoderConfig, PoolerSpec, WindowConfig
from pipeline.data import TextBatch
from pipeline.embedder import Embedder
from pipeline.errors import ConfigError, ModelError
from pipeline.models.loader import read_model_files

HEADED = Variant("headed", "cls", dense=(16, "Tanh"), normalize=True, prompts=PROMPTS,
                 default_prompt="document", max_seq_length=64)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("base") / "bert")


@pytest.fixture(scope="module")
def headed(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_variant(base, tmp_path_factory.mktemp("st") / "headed", HEADED)


@pytest.fixture
def copy(headed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(headed, tmp_path / "copy"))


def embedder(folder: Path, *specs: PoolerSpec, **encoder) -> Embedder:
    cfg = EncoderConfig(model=str(folder), dtype="fp32", device="cpu", **encoder)
    return Embedder(cfg, list(specs) or [PoolerSpec(name="model")])


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("kind", ["sentence_transformers.models.LayerNorm", "my_code.Pooler"])
def test_an_unsupported_module_fails_in_one_line_before_loading_weights(
    copy: Path, kind: str
) -> None:
    edit_json(copy / "modules.json", lambda m: m.insert(2, {"idx": 9, "name": "9", "path": "x",
                                                            "type": kind}))
    (copy / "model.safetensors").unlink()  # nothing may be loaded before the check
    with pytest.raises(ModelError) as err:
        embedder(copy)
    message = str(err.value)
    assert "\n" not in message
    assert f"module type {kind!r} is not supported" in message
    assert "supported: Transformer, Pooling, Dense, Normalize" in message


def test_an_activation_from_elsewhere_than_torch_is_refused(copy: Path) -> None:
    edit_json(copy / "2_Dense" / "config.json",
              lambda c: c.update(activation_function="evil.module.Act"))
    with pytest.raises(ModelError, match=r"activation 'evil.module.Act' is not supported"):
        embedder(copy)


def test_a_module_path_outside_the_folder_is_refused(copy: Path) -> None:
    edit_json(copy / "modules.json", lambda m: m[2].update(path="../../etc"))
    with pytest.raises(ModelError, match=r"module path '../../etc' is not a folder inside"):
        embedder(copy)


DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError
HUGE = '{"max_seq_length": 1' + "0" * 5_000 + "}"  # json.loads: ValueError (digit limit)


@pytest.mark.parametrize(("name", "text"), [
    ("modules.json", DEEP),
    ("config_sentence_transformers.json", DEEP),
    ("sentence_bert_config.json", HUGE),
    ("1_Pooling/config.json", HUGE),
], ids=["modules deep", "prompts deep", "sbert huge", "pooling huge"])
def test_json_nested_too_deep_or_with_a_huge_number_is_one_line(copy: Path, name: str,
                                                                 text: str) -> None:
    (copy / name).write_text(text)
    with pytest.raises(ModelError, match="is not valid JSON") as err:
        embedder(copy)
    assert name in str(err.value) and "\n" not in str(err.value)
    assert len(str(err.value)) < 600  # the reason is cut, not the file repeated


def test_normalize_without_its_folder_still_normalises(copy: Path) -> None:
    shutil.rmtree(copy / "3_Normalize")  # as the packaged MiniLM ships it
    vectors = embedder(copy).encode(["no folder for Normalize", "x"])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-6)


def test_an_old_format_folder_matches_sentence_transformers(base: Path, tmp_path: Path) -> None:
    """Old saves: ``sentence_transformers.models.*`` types, max_seq_length and do_lower_case in
    sentence_bert_config.json, ``pooling_mode_*`` flags (two modes: concatenated in
    sentence-transformers' order), a Normalize without folder; a cased tokenizer."""
    from sentence_transformers import SentenceTransformer

    folder = Path(shutil.copytree(base, tmp_path / "old"))
    edit_json(folder / "tokenizer.json", lambda t: t["normalizer"].update(lowercase=False))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 40, "do_lower_case": True}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": False,
        "pooling_mode_mean_sqrt_len_tokens": True, "pooling_mode_max_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]))
    texts = real_texts(100)
    ours = embedder(folder)
    assert ours.encoder.max_length == 40 and ours.dims() == {"model": 64}
    got = ours.encode(texts)
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts)
    assert got.shape == expected.shape
    cosine = (got * expected).sum(1)
    assert cosine.min() >= 0.9999
    print(f"\nold format (max + mean_sqrt_len, lower-cased, length 40): min cosine "
          f"{cosine.min():.7f}")
    upper = ours.encode(["Hello World", "HELLO WORLD"])
    np.testing.assert_allclose(upper[0], upper[1], atol=1e-6)  # do_lower_case honoured


def test_the_model_hash_covers_what_changes_vectors(
    copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    first = read_model_files(str(copy)).model_hash()
    seen = {first}
    changes = [
        lambda: edit_json(copy / "config_sentence_transformers.json",
                          lambda c: c["prompts"].update(document="doc: ")),
        lambda: edit_json(copy / "1_Pooling" / "config.json",
                          lambda c: c.update(pooling_mode="mean")),
        lambda: edit_json(copy / "tokenizer_config.json", lambda c: c.update(model_max_length=32)),
        lambda: (copy / "2_Dense" / "model.safetensors").write_bytes(
            (copy / "2_Dense" / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\1"),
    ]
    for change in changes:
        change()
        seen.add(read_model_files(str(copy)).model_hash())
    assert len(seen) == len(changes) + 1
    (copy / "README.md").write_text("a model card edit changes no vector")
    assert read_model_files(str(copy)).model_hash() in seen


def test_the_model_hash_is_cached_by_size_and_mtime(
    copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    weights = copy / "model.safetensors"
    first = read_model_files(str(copy)).model_hash()
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same size; the mtime is put back: the cached hash is what comes back
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert read_model_files(str(copy)).model_hash() == first
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert read_model_files(str(copy)).model_hash() != first
    assert len(list((tmp_path / "cache" / "model-hash").glob("*.json"))) == 2


MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    {"idx": 3, "name": "3", "path": "3_Normalize",
     "type": "sentence_transformers.models.Normalize"},
]
PLAIN_FILES = {
    "config.json": '{"model_type": "bert"}', "model.safetensors": "transformer weights",
    "tokenizer.json": '{"tokenizer": 1}', "tokenizer_config.json": '{"a": 1}',
    "special_tokens_map.json": '{"b": 2}', "vocab.txt": "[PAD]\nhello\nworld\n",
    "README.md": "a model card changes no vector", "notes.txt": "nor do notes",
}
ST_FILES = PLAIN_FILES | {
    "modules.json": json.dumps(MODULES), "config_sentence_transformers.json": '{"prompts": {}}',
    "sentence_bert_config.json": '{"max_seq_length": 64}',
    "1_Pooling/config.json": '{"pooling_mode": "mean"}',
    "1_Pooling/vocab.txt": "a stray file in a module folder",
    "2_Dense/config.json": '{"in_features": 32}', "2_Dense/model.safetensors": "dense weights",
    "2_Dense/notes.txt": "nor do notes",
}
# model_hash of these folders before the Transformer's module folder was hashed too: every
# set made from a folder with its transformer at its root keeps its fingerprint
OLD_HASHES = {"plain": "4e73d6400c0744d1", "st": "fb4bb78ab6b0d15e"}


@pytest.mark.parametrize("kind", ["plain", "st"])
def test_the_hash_of_a_folder_with_its_transformer_at_its_root_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    from pipeline.models.hashing import folder_hash

    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))  # computed, not cached
    root = tmp_path / kind
    for name, text in (PLAIN_FILES if kind == "plain" else ST_FILES).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert folder_hash(str(root)) == OLD_HASHES[kind]


def transformer_in_a_module_folder(base: Path, root: Path, minilm_dir: Path) -> Path:
    """A sentence-transformers folder whose Transformer sits in ``0_Transformer/`` (no
    config.json at its root), its tokenizer an old save: vocab.txt, no tokenizer.json."""
    shutil.copytree(base, root / "0_Transformer")
    (root / "0_Transformer" / "tokenizer.json").unlink()
    shutil.copy(minilm_dir / "vocab.txt", root / "0_Transformer" / "vocab.txt")
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer",
         "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    return root


def test_a_transformer_in_a_module_folder_loads_and_its_vocabulary_is_hashed(
    base: Path, tmp_path: Path, minilm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such a folder loads as sentence-transformers loads it, and a changed 0_Transformer/
    vocab.txt (other vectors) changes the model hash, so a set's fingerprint."""
    from sentence_transformers import SentenceTransformer

    monkeypatch.setenv("EMBEDPIPE_CACHE", str(tmp_path / "cache"))
    root = transformer_in_a_module_folder(base, tmp_path / "sub", minilm_dir)
    assert not (root / "config.json").exists()
    texts = real_texts(60)
    before = embedder(root)
    expected = SentenceTransformer(str(root), device="cpu").encode(texts)
    got = before.encode(texts)
    assert got.shape == expected.shape == (len(texts), 32)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    vocab = (root / "0_Transformer" / "vocab.txt").read_text().split("\n")
    i, j = vocab.index("hello"), vocab.index("world")
    vocab[i], vocab[j] = vocab[j], vocab[i]
    (root / "0_Transformer" / "vocab.txt").write_text("\n".join(vocab))
    after = embedder(root)
    assert np.abs(after.encode(["hello world"]) - before.encode(["hello world"])).max() > 1e-3
    assert after.info.model_hash != before.info.model_hash
    assert after.fingerprint("model") != before.fingerprint("model")


def test_a_module_folder_linked_out_of_the_model_is_refused(
    base: Path, tmp_path: Path, minilm_dir: Path
) -> None:
    root = transformer_in_a_module_folder(base, tmp_path / "sub", minilm_dir)
    shutil.move(root / "1_Pooling", tmp_path / "elsewhere")
    (root / "1_Pooling").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ModelError, match=r"module path '1_Pooling' leads out of the model"):
        embedder(root)


def test_the_fingerprint_follows_prompts_and_max_length(headed: Path) -> None:
    default = embedder(headed)
    assert default.fingerprint("model") != embedder(headed, prompt_name="query").fingerprint(
        "model")
    assert default.fingerprint("model") != embedder(headed, max_length=32).fingerprint("model")
    assert default.fingerprint("model") == embedder(headed).fingerprint("model")


def test_the_default_set_is_the_models_own(headed: Path, tiny_model_dir: Path) -> None:
    from pipeline.assembly import build_job

    assert [p.name for p in EmbedJob(corpus="c", out="o").poolers] == ["model"]  # MiniLM
    plain = EmbedJob(corpus="c", out="o", encoder={"model": str(tiny_model_dir)})
    assert [p.name for p in plain.poolers] == ["mean"]
    elsewhere = EmbedJob(corpus="c", out="o", encoder={"model": "/models/on-the-workers"})
    assert [p.name for p in elsewhere.poolers] == ["model"]  # defined for any folder
    assert [p.name for p in build_job("c", "o", model=str(headed)).poolers] == ["model"]
    job = build_job("c", "o", poolers=["mean"], model=str(headed))
    assert [p.name for p in job.poolers] == ["mean"]


def test_prompt_names_are_checked(headed: Path) -> None:
    with pytest.raises(ConfigError, match=r"prompt_name 'passage' is not a prompt of this model "
                                          r"\(prompts: document, query, search\)"):
        embedder(headed, prompt_name="passage")


def test_a_query_prompt_with_no_room_refuses_queries_not_documents(
        base: Path, tmp_path: Path) -> None:
    """A query prompt longer than max_seq_length: sentence-transformers embeds the model's
    documents, and so does embedpipe (it refused the model); queries fail in one line naming
    the option that picks another, at load where a set is searched."""
    from _search_sets import embedded_set
    from _st_models import assert_same
    from sentence_transformers import SentenceTransformer

    from pipeline.search import QueryEncoder
    from pipeline.sets import SetFolder

    long_query = "Given a web search query, retrieve relevant passages that answer the query: "
    folder = save_variant(base, tmp_path / "st", Variant(
        "long_query", "mean", max_seq_length=16, prompts={"query": long_query,
                                                          "document": "passage: "},
        default_prompt="document"))
    texts = real_texts(20)
    st = SentenceTransformer(str(folder), device="cpu")
    ours = embedder(folder)
    assert_same(ours.encode(texts), st.encode(texts), "documents")
    refused = (r"query prompt 'Given a web .* takes \d+ tokens: no room for text within "
               r"max_length 16 \(`query_prompt_name = \"\"` for none\)")
    with pytest.raises(ConfigError, match=refused):
        ours.encode_queries(["lemon cake"])
    out = embedded_set(tmp_path / "out", folder, name="model", strategy="model")
    with pytest.raises(ConfigError, match=refused):
        QueryEncoder(SetFolder(str(out), "model").meta())
    plain = embedder(folder, query_prompt_name="")
    assert plain.fingerprint("model") != ours.fingerprint("model")
    assert_same(plain.encode_queries(texts), st.encode(texts, prompt=""), "no query prompt")


def test_model_head_needs_a_model_with_modules(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"model_head = true, but .* has no Dense or Normalize"):
        embedder(tiny_model_dir, PoolerSpec(name="c", strategy="cls", model_head=True))


def test_windows_repeat_the_prompt_inside_their_token_budget(
    headed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = WindowConfig(size=24, stride=10)
    ours = embedder(headed, window=window)
    enc = ours.encoder
    prompt = list(enc.document_prompt.ids)
    rows: list[list[int]] = []  # what the model sees, less the special tokens around it
    pad_rows = enc.pad_rows

    def seen(*args):
        ids, mask = pad_rows(*args)
        wrapped = [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]
        rows.extend(r[len(enc.prefix) : len(r) - len(enc.suffix)] for r in wrapped)
        return ids, mask

    monkeypatch.setattr(enc, "pad_rows", seen)
    long_text = " ".join(f"token{i}" for i in range(60))
    ours.embed(TextBatch([0], [long_text]))
    body = enc.tokenize([long_text])[0]
    assert len(rows) > 2
    covered = set()
    for row in rows:
        assert row[: len(prompt)] == prompt
        assert len(row) + len(enc.prefix) + len(enc.suffix) <= window.size
        text = row[len(prompt):]
        start = next(i for i in range(len(body)) if body[i : i + len(text)] == text)
        covered |= set(range(start, start + len(text)))
    assert covered == set(range(len(body)))
    short = ["a short text fits in one window", "x"]
    np.testing.assert_allclose(ours.encode(short), embedder(headed).encode(short), atol=1e-6)


def test_training_encodes_queries_and_texts_with_their_prompts(headed: Path) -> None:
    enc = embedder(headed).encoder
    texts = ["same words", "same words"]
    ids = enc.tokenize_for(texts, np.array([True, False]))
    assert ids[0] == enc.tokenize(["same words"], enc.query_prompt)[0]
    assert ids[1] == enc.tokenize(["same words"], enc.document_prompt)[0]
    assert ids[0][:2] != ids[1][:2]


def test_the_default_set_follows_the_model_installation_settings_choose(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI leaves the set to the job: once EMBEDPIPE_MODEL fills in a plain folder, the
    default set is ``mean``, not the packaged MiniLM's ``model``."""
    from pipeline.assembly import build_job
    from pipeline.config import parse
    from pipeline.settings import load_settings

    job = build_job("c", "o")
    dumped = job.model_dump(mode="json", exclude_unset=True)
    assert "poolers" not in dumped and [p.name for p in job.poolers] == ["model"]
    monkeypatch.setenv("EMBEDPIPE_MODEL", str(tiny_model_dir))
    final = parse(EmbedJob, load_settings().apply_to_job(dumped), "job")
    assert [p.name for p in final.poolers] == ["mean"]


def test_search_encodes_queries_with_the_query_prompt(headed: Path, tmp_path: Path) -> None:
    from _search_sets import embedded_set
    from sentence_transformers import SentenceTransformer

    from pipeline.index import IndexRequest, index_set
    from pipeline.search import Searcher

    out = embedded_set(tmp_path, headed, name="model", strategy="model")
    index_set(IndexRequest(out=str(out), set_name="model"), say=lambda _: None)
    searcher = Searcher(str(out), "model")
    queries = ["how to train a neural network", "lemon cake"]
    st = SentenceTransformer(str(headed), device="cpu")
    got = searcher.encode(queries)
    np.testing.assert_allclose(got, st.encode_query(queries), atol=1e-5)
    assert np.abs(got - st.encode(queries)).max() > 1e-4  # not the document prompt


@pytest.mark.parametrize(("args", "key"), [
    ("model_args", "subfolder"), ("tokenizer_args", "tokenizer_file"),
    ("config_args", "local_files_only"), ("model_args", "cache_dir")])
def test_the_folders_files_cannot_say_where_its_files_are_read_from(
        copy: Path, args: str, key: str) -> None:
    """Weights or a tokenizer read from outside the folder escaped its hash: two sets of
    vectors under one fingerprint (found by a review of what files in a model folder choose)."""
    edit_json(copy / "sentence_bert_config.json", lambda c: c.update({args: {key: "../x"}}))
    with pytest.raises(ModelError, match=rf"{args} may not set {key!r}"):
        embedder(copy)


def test_a_dense_activation_that_is_no_name_is_one_line(copy: Path) -> None:
    edit_json(copy / "2_Dense" / "config.json", lambda c: c.update(activation_function=5))
    with pytest.raises(ModelError, match="activation_function must be a class name, got 5"):
        embedder(copy)


def test_dense_weights_that_are_no_safetensors_are_one_line(copy: Path) -> None:
    (copy / "2_Dense" / "model.safetensors").write_text("garbage")
    with pytest.raises(ModelError, match="2_Dense/model.safetensors is not a safetensors file"):
        embedder(copy)


class _Calls:
    """Pickles as a call of ``print``: what a weights file must never make happen."""

    def __reduce__(self):
        return print, ("a pickled call ran",)


def test_dense_weights_of_another_shape_or_with_more_than_tensors_are_one_line_naming_it(
        copy: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import torch
    from safetensors.torch import save_file

    dense = copy / "2_Dense"
    save_file({"linear.weight": torch.zeros(16, 20), "linear.bias": torch.zeros(16)},
              str(dense / "model.safetensors"))
    with pytest.raises(ModelError) as err:
        embedder(copy)
    assert str(err.value).endswith("2_Dense: Dense weights do not match its config.json: weight "
                                   "linear.weight is (16, 20), its config.json makes (16, 32)")
    (dense / "model.safetensors").unlink()
    torch.save({"linear.weight": _Calls()}, dense / "pytorch_model.bin")
    capfd.readouterr()
    with pytest.raises(ModelError) as err:
        embedder(copy)
    message = str(err.value)
    assert "\n" not in message and "weights_only" not in message
    assert "pytorch_model.bin is not a plain tensor file (UnpicklingError" in message
    assert capfd.readouterr().err == ""  # torch's warning, and nothing ran
    assert "a pickled call ran" not in capfd.readouterr().out


def test_transformer_weights_damaged_or_of_another_shape_are_one_line_and_nothing_else(
        copy: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """transformers' load report (a table on stderr) said before embedpipe's line what that
    line says; a damaged checkpoint raised safetensors' own error with a traceback."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = copy / "model.safetensors"
    state = load_file(str(weights))
    state["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(60, 32)
    save_file(state, str(weights))
    capfd.readouterr()
    with pytest.raises(ModelError, match=r"weight encoder.layer.0.intermediate.dense.weight has "
                                         r"shape \(60, 32\) in the checkpoint but \(64, 32\)"):
        embedder(copy)
    assert "LOAD REPORT" not in capfd.readouterr().err
    weights.write_bytes(bytes(100))
    with pytest.raises(ModelError, match=r"model.safetensors is not a safetensors file: "):
        embedder(copy)
