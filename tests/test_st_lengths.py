"""How long a row is and which tokens of a long text it keeps, as sentence-transformers decides:
a plain folder's length capped at the model's positions, and a tokenizer that truncates on the
left (``truncation_side``) keeping a long text's last tokens, its prompt cut with the text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _st_models import PROMPTS, Variant, assert_same, ours_for, real_texts, save_variant
from conftest import TINY_MAX_POSITIONS, build_tiny_bert

from pipeline.config import PoolerSpec, WindowConfig
from pipeline.data import TextBatch
from pipeline.windows import truncate

LONG = ["start words " + "filler " * 300 + " end of the long text",
        " ".join(f"token{i}" for i in range(400))]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return real_texts(120) + LONG




def edit_tokenizer_config(folder: Path, **changes) -> None:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_a_plain_folder_is_capped_at_its_positions(tmp_path: Path, texts: list[str]) -> None:
    """A tokenizer that allows 512 tokens on a model of 128 positions: sentence-transformers
    caps the length at 128, and so does embedpipe (it refused the folder)."""
    from sentence_transformers import SentenceTransformer

    folder = build_tiny_bert(tmp_path / "plain")
    edit_tokenizer_config(folder, model_max_length=512)
    st = SentenceTransformer(str(folder), device="cpu")
    ours = ours_for(folder)
    assert ours.encoder.max_length == st.max_seq_length == TINY_MAX_POSITIONS
    assert_same(ours.encode(texts), st.encode(texts, batch_size=32), "plain folder")


def test_a_plain_folder_numbering_positions_after_padding_leaves_room_for_them(
        tmp_path: Path, texts: list[str]) -> None:
    """MPNet (as RoBERTa) numbers a row's tokens from padding_idx + 1: of its 130 positions a
    row reads at most 128, so embedpipe truncates at 128 (sentence-transformers' own cap, 130,
    fails in the model on a long text; at 128 it gives the same vectors)."""
    from sentence_transformers import SentenceTransformer

    folder = build_tiny_bert(tmp_path / "mpnet", kind="mpnet")
    edit_tokenizer_config(folder, model_max_length=512)
    ours = ours_for(folder)
    assert ours.encoder.model.config.max_position_embeddings == TINY_MAX_POSITIONS + 2
    assert ours.encoder.max_length == TINY_MAX_POSITIONS
    st = SentenceTransformer(str(folder), device="cpu")
    st.max_seq_length = TINY_MAX_POSITIONS
    assert_same(ours.encode(texts), st.encode(texts, batch_size=32), "plain MPNet folder")


@pytest.mark.parametrize("pinned", [False, True])
def test_a_sentence_transformers_mpnet_reads_no_position_past_its_last(
        tmp_path: Path, texts: list[str], pinned: bool) -> None:
    """An MPNet saved by sentence-transformers with no length in its tokenizer (or a
    max_seq_length of all 130 positions): sentence-transformers truncates at 130 and fails in
    the model on a long text. embedpipe reads 128 (it failed the shard, IndexError, after its
    retries) and gives sentence-transformers' vectors wherever it gives any; a job asking for
    more is refused in one line."""
    from sentence_transformers import SentenceTransformer

    from pipeline.errors import ConfigError

    base = build_tiny_bert(tmp_path / "mpnet", kind="mpnet")
    positions = TINY_MAX_POSITIONS + 2
    folder = save_variant(base, tmp_path / "st", Variant(
        "mean", "mean", max_seq_length=positions if pinned else None))
    if not pinned:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("model_max_length", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    st = SentenceTransformer(str(folder), device="cpu")
    assert st.max_seq_length == positions
    with pytest.raises(IndexError):
        st.encode(LONG)
    ours = ours_for(folder)
    assert ours.encoder.max_length == TINY_MAX_POSITIONS
    fits = [t for t in texts if len(st.tokenize([t])["input_ids"][0]) <= TINY_MAX_POSITIONS]
    assert len(fits) > 100 and ours.encode(LONG).shape == (2, 32)
    assert_same(ours.encode(fits), st.encode(fits, batch_size=32), "sentence-transformers MPNet")
    with pytest.raises(ConfigError, match=r"max_length 130 exceeds the 128 tokens model .* "
                                          r"reads in a row \(its 130 positions less the 2 its "
                                          r"embeddings skip\)"):
        ours_for(folder, max_length=positions)


def test_truncate_keeps_the_side_the_tokenizer_keeps() -> None:
    right = truncate(np.array([3, 10, 5]), 5)
    left = truncate(np.array([3, 10, 5]), 5, "left")
    assert (right.start.tolist(), right.end.tolist()) == ([0, 0, 0], [3, 5, 5])
    assert (left.start.tolist(), left.end.tolist()) == ([0, 5, 0], [3, 10, 5])


@pytest.fixture(scope="module")
def left_minilm(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(shutil.copytree(minilm_dir, tmp_path_factory.mktemp("left") / "minilm"))
    edit_tokenizer_config(folder, truncation_side="left")
    return folder


def test_a_left_truncating_tokenizer_keeps_the_end_of_long_texts(
        left_minilm: Path, texts: list[str]) -> None:
    """all-MiniLM-L6-v2 with ``truncation_side: left``: a long text keeps its last 254
    tokens between [CLS] and [SEP], as sentence-transformers keeps them."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(left_minilm), device="cpu")
    assert st.tokenizer.truncation_side == "left"
    ours = ours_for(left_minilm)
    got = ours.embed(TextBatch(list(range(len(texts))), texts))
    assert got.stats.truncated >= len(LONG)
    worst = assert_same(got.vectors["model"], st.encode(texts, batch_size=32), "left MiniLM")
    print(f"\ntruncation_side left (all-MiniLM-L6-v2): min cosine {worst:.7f}")


@pytest.mark.parametrize("include_prompt", [True, False], ids=["prompt_pooled", "prompt_left_out"])
def test_a_left_truncating_tokenizer_cuts_the_prompt_as_sentence_transformers_does(
        tmp_path: Path, texts: list[str], include_prompt: bool) -> None:
    """sentence-transformers tokenizes prompt and text as one string and truncates that: on
    the left a long text loses its prompt first (and a Pooling that leaves the prompt out still
    masks the first prompt-length tokens); documents and queries come out the same here."""
    from sentence_transformers import SentenceTransformer

    base = build_tiny_bert(tmp_path / "base")
    variant = Variant("left", "mean", include_prompt=include_prompt, normalize=True,
                      max_seq_length=32, prompts=PROMPTS, default_prompt="search")
    folder = save_variant(base, tmp_path / "st", variant)
    edit_tokenizer_config(folder, truncation_side="left")
    st = SentenceTransformer(str(folder), device="cpu")
    ours = ours_for(folder)
    assert_same(ours.encode(texts), st.encode(texts, batch_size=32), "documents")
    assert_same(ours.encode_queries(texts), st.encode_query(texts, batch_size=32), "queries")


def test_windows_truncate_nothing_whatever_side_the_tokenizer_cuts(
        left_minilm: Path, minilm_dir: Path) -> None:
    """Windows cover every token of a text: the truncation side changes none of them."""
    window = WindowConfig(size=64, stride=40)
    spec = PoolerSpec(name="mean")
    left, right = ours_for(left_minilm, spec, window=window), ours_for(minilm_dir, spec,
                                                                       window=window)
    batch = TextBatch([0, 1, 2], [*LONG, "a short text"])
    got = left.embed(batch)
    assert got.stats.truncated == 0 and got.stats.windows > 3
    np.testing.assert_allclose(got.vectors["mean"], right.embed(batch).vectors["mean"],
                               atol=1e-6)


def test_a_pooler_trained_over_a_left_truncating_tokenizer_sees_the_rows_it_embeds(
        left_minilm: Path, texts: list[str]) -> None:
    """The training cache keeps the tokens the embedder keeps: a long text's last ones."""
    import torch

    from pipeline.training.cache import build_cache

    ours = ours_for(left_minilm, PoolerSpec(name="mean", strategy="mean", normalize=False))
    encoder = ours.encoder
    last = ours.info.num_layers
    cache = build_cache(encoder, encoder.tokenize(texts), (last,), False, torch.float32)
    means = cache.flat[cache.offsets[:-1], 0].numpy()
    embedded = ours.embed(TextBatch(list(range(len(texts))), texts)).vectors["mean"]
    assert_same(means, embedded, "the training cache's means")


@pytest.mark.parametrize("which", ["minilm", "tiny"])
def test_the_row_limit_read_before_a_load_is_the_loaded_encoders(minilm_dir, tiny_model_dir,
                                                                  which):
    """A job's checks read it without loading the model: they took the positions (512 for
    MiniLM) where a run reads max_seq_length (256), and let a window of 300 through to fail
    at every run's load."""
    from pipeline.assembly import check_model_choices
    from pipeline.config import EmbedJob, EncoderConfig
    from pipeline.embedder import Embedder
    from pipeline.errors import ConfigError
    from pipeline.models import loader, recorded

    model = minilm_dir if which == "minilm" else tiny_model_dir
    files = loader.read_model_files(str(model))
    config, _ = recorded.load(files, files.model_hash(), False)
    loaded = Embedder(EncoderConfig(model=str(model), dtype="fp32", device="cpu"),
                      [PoolerSpec(name="mean")]).encoder.max_length
    assert loader.max_length(files, config) == loaded
    wider = EmbedJob(corpus="c", out="o", poolers=(PoolerSpec(name="mean"),),
                     encoder=EncoderConfig(model=str(model), device="cpu", dtype="fp32",
                                           window=WindowConfig(size=loaded + 1, stride=8)))
    with pytest.raises(ConfigError, match=f"window size {loaded + 1} is above the tokens "
                                          f"model .* reads \\({loaded}\\)"):
        check_model_choices(wider)
