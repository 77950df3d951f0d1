"""Reading a corpus: file names, row groups, streaming, row validation, hashes, duplicates."""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import text_for, write_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.corpus import describe, find_duplicates, read_shard, text_hash, validate
from pipeline.errors import CorpusError, StorageError
from pipeline.shards import plan_shards
from pipeline.snippets import SnippetStore


def test_describe_names_files_relative_to_the_corpus_root(tmp_path):
    texts = [text_for(i) for i in range(25)]
    write_corpus(tmp_path / "c" / "x" / "a.parquet", list(range(25)), texts)
    write_corpus(tmp_path / "c" / "b.parquet", list(range(25, 30)), [text_for(i) for i in range(5)])
    info = describe(str(tmp_path / "c"), "id", "text")
    assert [f.name for f in info.files] == ["b.parquet", "x/a.parquet"]
    assert [f.group_rows for f in info.files] == [(5,), (10, 10, 5)]
    assert info.rows == 30 and info.id_type == "int64"
    glob = describe(str(tmp_path / "c" / "*" / "*.parquet"), "id", "text")
    assert [f.name for f in glob.files] == ["x/a.parquet"]
    single = describe(str(tmp_path / "c" / "x" / "a.parquet"), "id", "text")
    assert [f.name for f in single.files] == ["a.parquet"]


def test_shard_is_streamed_one_row_group_at_a_time(tmp_path):
    n = 45
    write_corpus(tmp_path / "a.parquet", list(range(n)), [text_for(i) for i in range(n)])
    info = describe(str(tmp_path / "a.parquet"), "id", "text")
    shards = plan_shards(info.files, 20)
    assert [(s.first_group, s.end_group) for s in shards] == [(0, 2), (2, 4), (4, 5)]
    chunks = list(read_shard(shards[1], "id", "text", info.id_type))
    assert [len(c.texts) for c in chunks] == [10, 10]  # one chunk per row group
    assert [i for c in chunks for i in c.ids.to_pylist()] == list(range(20, 40))
    assert chunks[0].texts[0] == text_for(20)
    assert chunks[0].hashes[0] == text_hash(text_for(20))


def test_validate_gives_every_skipped_row_a_reason():
    ids = pa.array([1, None, 3, 4, 5, 6, 7, 8], pa.int64())
    texts = pa.array(["ok", "x", None, "", " \t\n", "\x00ctrl\x1f", "\u200b\U0001f600", "fine"])
    chunk = validate(ids, texts, start=100, drop_rows=frozenset({107}))
    assert chunk.ids.to_pylist() == [1, 6, 7]
    assert chunk.texts == ["ok", "\x00ctrl\x1f", "\u200b\U0001f600"]
    assert chunk.skipped_rows == [101, 102, 103, 104, 107]
    assert chunk.skipped_reasons == [
        "null_id", "null_text", "empty_text", "empty_text", "duplicate_id"
    ]
    assert chunk.skipped == {"null_id": 1, "null_text": 1, "empty_text": 2, "duplicate_id": 1}


def test_a_text_of_marks_private_use_or_replacement_characters_is_empty(tiny_model_dir):
    """Each was embedded: its tokens vanished, and it got the empty text's vector."""
    from transformers import AutoTokenizer

    vanish = ["\ufffd\ufffd", "\u0301\u0302", "\ue000 \U000f0000", " \u0301\ufffd\u200b"]
    unseen = [" \u20dd\u0903"]  # enclosing and spacing marks, no base: [UNK] to this BERT
    kept = ["e\u0301", "\u0301e", "\ue000x", "\u2603"]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert [tokenizer.tokenize(t) for t in vanish] == [[]] * len(vanish)
    assert all(tokenizer.tokenize(t) for t in kept)
    texts = vanish + unseen + kept
    chunk = validate(pa.array(range(len(texts))), pa.array(texts), 0, frozenset())
    assert chunk.texts == kept and chunk.skipped == {"empty_text": len(vanish + unseen)}


def test_text_that_is_not_a_string_is_skipped():
    binary = validate(pa.array([1, 2, 3]), pa.array([b"hello", b"\xff\xfe", None]), 0, frozenset())
    assert binary.texts == ["hello"]
    assert binary.skipped_reasons == ["not_string", "null_text"]
    numbers = validate(pa.array([1, 2]), pa.array([5, 6]), 0, frozenset())
    assert numbers.skipped_reasons == ["not_string", "not_string"] and not numbers.texts


@pytest.mark.parametrize("column", [pa.array([5, 6]), pa.array([["a"], ["b"]]),
                                    pa.array([None, None], pa.null())])
def test_a_text_column_that_cannot_hold_text_is_refused_up_front(tmp_path, column):
    # every row would be skipped and the run leave an empty set, reported as a success
    path = str(tmp_path / "c" / "a.parquet")
    (tmp_path / "c").mkdir()
    pq.write_table(pa.table({"id": [1, 2], "body": column}), path)
    with pytest.raises(CorpusError, match=r"text column 'body' is .*, not text") as err:
        describe(path, "id", "body")
    assert "\n" not in str(err.value) and "a.parquet" in str(err.value)
    # beside a file that holds text, its rows are bad rows: skipped and quarantined
    pq.write_table(pa.table({"id": [3], "body": ["words"]}), tmp_path / "c" / "b.parquet")
    assert describe(str(tmp_path / "c"), "id", "body").rows == 3
    pq.write_table(pa.table({"id": [1, 2], "body": [b"hello", b"world"]}), path)
    assert describe(path, "id", "body").rows == 2  # binary is read as UTF-8, row by row


TEXT_ENCODINGS = {
    "dictionary": lambda p, t: pq.write_table(
        pa.table({"id": [1, 2, 3, 4], "text": pa.array(t).dictionary_encode()}), p),
    "polars categorical": lambda p, t: pl.DataFrame(
        {"id": [1, 2, 3, 4], "text": pl.Series(t, dtype=pl.Categorical)}).write_parquet(p),
    "string view": lambda p, t: pq.write_table(
        pa.table({"id": [1, 2, 3, 4], "text": pa.array(t, pa.string_view())}), p),
}


@pytest.mark.parametrize("encoding", TEXT_ENCODINGS)
def test_text_stored_dictionary_encoded_or_as_views_is_read_as_text(tmp_path, encoding):
    texts = ["red apples", "green pears", None, "red apples"]
    path = str(tmp_path / "c.parquet")
    TEXT_ENCODINGS[encoding](path, texts)
    info = describe(path, "id", "text")
    [chunk] = read_shard(plan_shards(info.files, 100)[0], "id", "text", info.id_type)
    assert chunk.texts == ["red apples", "green pears", "red apples"]
    assert chunk.ids.to_pylist() == [1, 2, 4] and chunk.skipped == {"null_text": 1}
    assert list(chunk.hashes) == [text_hash(t) for t in chunk.texts]
    snippets = SnippetStore(path)  # search shows their texts too
    assert snippets.check(pa.array([1, 2, 4])) is None
    assert snippets.texts([2, 4]) == {2: "green pears", 4: "red apples"}


def test_snippets_follow_a_corpus_rewritten_under_them_or_are_left_out(tmp_path):
    """A server's snippet store read the corpus's ids once; a nightly rewrite (rows reordered,
    some gone) before the next run made it show another row's text, or fail the search."""
    path = tmp_path / "c.parquet"
    ids = list(range(40))
    pq.write_table(pa.table({"id": ids, "text": [f"text {i}" for i in ids]}), path,
                   row_group_size=4)
    snippets = SnippetStore(str(path), cache_groups=2)
    assert snippets.check(pa.array(ids)) is None
    assert snippets.texts([1, 38]) == {1: "text 1", 38: "text 38"}
    kept = ids[:9:-1]  # reordered, rows 0-9 gone
    pq.write_table(pa.table({"id": kept, "text": [f"new {i}" for i in kept]}), path,
                   row_group_size=3)
    assert snippets.texts([1, 38, 12]) == {38: "new 38", 12: "new 12"}
    assert snippets.problem is None
    path.rename(tmp_path / "moved.parquet")
    assert snippets.texts([12, 20]) == {}  # the hits are served all the same, without texts
    assert snippets.problem.startswith(f"no snippets from {path}: ")
    (tmp_path / "moved.parquet").rename(path)
    assert snippets.texts([20]) == {20: "new 20"} and snippets.problem is None


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200), st.text(max_size=200))
def test_text_hash_is_stable_and_separates_texts(a, b):
    assert text_hash(a) == text_hash(a)
    if a != b:
        assert text_hash(a) != text_hash(b)


def test_duplicates_are_found_across_files_first_copy_kept(tmp_path):
    write_corpus(tmp_path / "c" / "a.parquet", ["a", "b", "c", "d"], ["t"] * 4, row_group_size=2)
    write_corpus(tmp_path / "c" / "b.parquet", ["e", "b", "f", "a", "b"], ["t"] * 5)
    info = describe(str(tmp_path / "c"), "id", "text")
    dupes = find_duplicates(info, "id", "text")
    assert dupes.rows == 3
    assert dupes.examples == ["'b'", "'a'"]
    assert dupes.drop == {"b.parquet": [1, 3, 4]}
    assert "first duplicates: 'b', 'a'" in dupes.describe()


def test_an_ids_first_valid_row_is_the_one_kept(tmp_path):
    # ids 1 and 2 first come with a text that is skipped anyway (blank, null): their later,
    # valid rows are kept, not dropped as duplicates; id 5 has no valid row at all
    ids = [1, 2, 3, 1, 2, 4, 1, 5, 5]
    texts = ["   ", None, "c", "a1", "b", "d", "a2", "", None]
    write_corpus(tmp_path / "a.parquet", ids, texts, row_group_size=4)
    info = describe(str(tmp_path / "a.parquet"), "id", "text")
    dupes = find_duplicates(info, "id", "text")
    assert dupes.drop == {"a.parquet": [6]} and dupes.examples == ["1"]
    [shard] = plan_shards(info.files, 100)
    chunks = list(read_shard(shard, "id", "text", info.id_type, frozenset(dupes.drop["a.parquet"])))
    kept = {i: t for c in chunks for i, t in zip(c.ids.to_pylist(), c.texts, strict=True)}
    assert kept == {1: "a1", 2: "b", 3: "c", 4: "d"}


def test_an_ids_snippet_is_the_text_of_the_row_kept(tmp_path):
    """With --dedupe, search showed the text of an id's first row though that row was skipped
    (blank, null) and a later one embedded: in the same row group, or in a later one."""
    ids = [1, 2, 3, 1, 2, 4, 1, 5, 5]
    texts = ["   ", None, "c", "a1", "b", "d", "a2", "", None]
    write_corpus(tmp_path / "a.parquet", ids, texts, row_group_size=4)
    snippets = SnippetStore(str(tmp_path / "a.parquet"))
    assert snippets.texts([1, 2, 3, 4, 5]) == {1: "a1", 2: "b", 3: "c", 4: "d"}
    write_corpus(tmp_path / "a.parquet", ids, texts, row_group_size=2)
    assert SnippetStore(str(tmp_path / "a.parquet")).texts([1, 2]) == {1: "a1", 2: "b"}


def test_texts_are_read_only_where_an_id_repeats(tmp_path, monkeypatch):
    ids = [1, 2, 3, 4, 5, 6, 1, 8]  # row groups of 2: id 1 in groups 0 and 3 only
    write_corpus(tmp_path / "a.parquet", ids, ["t"] * 8, row_group_size=2)
    info = describe(str(tmp_path / "a.parquet"), "id", "text")
    read, real = [], pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kwargs):
        read.append((i, tuple(columns or ())))
        return real(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    assert find_duplicates(info, "id", "text").drop == {"a.parquet": [6]}
    assert sorted(i for i, columns in read if "text" in columns) == [0, 3]


def test_integer_ids_without_duplicates(tmp_path):
    write_corpus(tmp_path / "a.parquet", list(range(1000)), ["t"] * 1000, row_group_size=100)
    info = describe(str(tmp_path / "a.parquet"), "id", "text")
    assert find_duplicates(info, "id", "text").rows == 0


def test_unusable_corpora_fail_with_one_line(tmp_path):
    write_corpus(tmp_path / "a.parquet", [1], ["x"], body=["y"])
    with pytest.raises(CorpusError, match=r"no column 'content' \(its columns: id, text, body\)"):
        describe(str(tmp_path / "a.parquet"), "id", "content")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(CorpusError, match=r"corrupt or unreadable Parquet file .*broken\.parquet"):
        describe(str(tmp_path / "bad"), "id", "text")
    pq.write_table(pa.table({"id": pa.array([], pa.int64()), "text": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    with pytest.raises(CorpusError, match=r"empty\.parquet is empty: 1 Parquet file\(s\), 0 rows"):
        describe(str(tmp_path / "empty.parquet"), "id", "text")
    with pytest.raises(StorageError, match=r"nowhere.*not found"):
        describe(str(tmp_path / "nowhere"), "id", "text")
    write_corpus(tmp_path / "f" / "a.parquet", [1.5], ["x"])
    with pytest.raises(CorpusError, match="ids must be integers or strings"):
        describe(str(tmp_path / "f"), "id", "text")
    view = pa.table({"id": pa.array(["a"], pa.string_view()), "text": ["x"]})
    pq.write_table(view, tmp_path / "v.parquet")
    with pytest.raises(CorpusError, match="is string_view; ids must be integers or strings "
                       "stored as string or large_string: cast the column"):
        describe(str(tmp_path / "v.parquet"), "id", "text")
    write_corpus(tmp_path / "m" / "a.parquet", [1], ["x"])
    write_corpus(tmp_path / "m" / "b.parquet", ["1"], ["x"])
    with pytest.raises(CorpusError, match="different types across files"):
        describe(str(tmp_path / "m"), "id", "text")


@pytest.mark.parametrize("encoding", ["dictionary", "polars categorical"])
def test_duplicates_are_found_in_a_dictionary_encoded_text_column(tmp_path, encoding):
    """The texts of a group where an id repeats came as a ChunkedArray, which has no
    ``dictionary_decode``: a traceback instead of the duplicate-id line or ``--dedupe``."""
    path = str(tmp_path / "a.parquet")
    TEXT_ENCODINGS[encoding](path, ["red", "green", "blue", "red"])
    rewritten = pq.read_table(path).set_column(0, "id", pa.array([1, 2, 1, 3]))
    pq.write_table(rewritten, path)
    dupes = find_duplicates(describe(path, "id", "text"), "id", "text")
    assert (dupes.drop, dupes.examples) == ({"a.parquet": [2]}, ["1"])


def test_uint64_ids_beyond_int64_beside_signed_ids_are_refused_up_front(tmp_path):
    write_corpus(tmp_path / "a.parquet", pa.array([1, 2**63 + 5], pa.uint64()), ["x", "y"])
    write_corpus(tmp_path / "b.parquet", [3], ["z"])
    with pytest.raises(CorpusError, match=r"a\.parquet are uint64 beyond int64 .* other "
                                          r"files' ids are signed"):
        describe(str(tmp_path), "id", "text")
    write_corpus(tmp_path / "a.parquet", pa.array([1, 2**62], pa.uint64()), ["x", "y"])
    assert describe(str(tmp_path), "id", "text").id_type == "int64"  # they fit: widened


@pytest.mark.parametrize("corpus, out", [
    ("{}/c", "{}/c/out"),  # a folder corpus holding OUT: refused on the first run
    ("{}/c/**/*.parquet", "{}/c/out"),  # a glob reaching into OUT: once OUT holds parts
    ("{}/c/out/../", "{}/c/./out"),  # however either is spelled,
    ("file://{}/c", "file:{}/c/out"),  # with any scheme fsspec reads as a local path
    ("{}/c", "local://{}/c/out"),
])
def test_an_out_inside_the_corpus_is_refused(tmp_path, corpus, out):
    write_corpus(tmp_path / "c" / "a.parquet", [1], ["x"])
    write_corpus(tmp_path / "c" / "out" / "sets" / "mean" / "part-0.parquet", [2], ["y"])
    with pytest.raises(CorpusError, match=r"lies inside the corpus .*: its own parts would be "
                                          r"read as corpus"):
        describe(corpus.format(tmp_path), "id", "text", out=out.format(tmp_path))
    (tmp_path / "c" / "out" / "sets" / "mean" / "part-0.parquet").unlink()
    assert describe(str(tmp_path / "c" / "a.parquet"), "id", "text",
                    out=str(tmp_path / "c" / "out")).rows == 1  # one file: nothing else read


def test_a_corpus_file_inside_out_is_refused_saying_so(tmp_path):
    """It said "OUT … lies inside the corpus …/a.parquet": the other way round."""
    path = write_corpus(tmp_path / "o" / "a.parquet", [1], ["x"])
    with pytest.raises(CorpusError) as refused:
        describe(str(path), "id", "text", out=str(tmp_path / "o"))
    assert str(refused.value) == (f"the corpus file {path} lies inside OUT {tmp_path / 'o'}: "
                                  "keep the corpus outside OUT")


@pytest.mark.parametrize(("corpus", "rows"), [("{}/c/**/*.parquet", 2),
                                             ("{}/c/*/*/*/part-*.parquet", 1)])
def test_a_glob_that_will_reach_outs_parts_is_refused_on_the_first_run(tmp_path, corpus, rows):
    """OUT holds no parts yet: the first run passed and every later one failed."""
    write_corpus(tmp_path / "c" / "a" / "x.parquet", [1], ["x"])
    write_corpus(tmp_path / "c" / "a" / "b" / "d" / "part-0.parquet", [2], ["y"])
    with pytest.raises(CorpusError, match=r"OUT .* lies inside the corpus .*: its own parts "
                                          r"would be read as corpus"):
        describe(corpus.format(tmp_path), "id", "text", out=str(tmp_path / "c" / "out"))
    elsewhere = str(tmp_path / "elsewhere" / "out")  # the same glob, OUT out of its reach
    assert describe(corpus.format(tmp_path), "id", "text", out=elsewhere).rows == rows


@pytest.mark.parametrize("kind", ["folder", "glob"])
def test_a_corpus_inside_out_is_refused_saying_so(tmp_path, kind):
    """A corpus folder inside OUT was refused as "OUT … lies inside the corpus …"."""
    write_corpus(tmp_path / "o" / "corpus" / "a.parquet", [1], ["x"])
    corpus = tmp_path / "o" / "corpus" / ("" if kind == "folder" else "*.parquet")
    with pytest.raises(CorpusError) as refused:
        describe(str(corpus), "id", "text", out=str(tmp_path / "o"))
    assert str(refused.value) == (f"the corpus {kind} {corpus} lies inside OUT "
                                  f"{tmp_path / 'o'}: keep the corpus outside OUT")


def test_truncated_file_is_named(tmp_path):
    path = write_corpus(tmp_path / "a.parquet", list(range(50)), [text_for(i) for i in range(50)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusError, match=r"a\.parquet"):
        describe(str(path), "id", "text")


def test_id_type_is_kept_when_files_agree_and_widened_when_not(tmp_path):
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.uint32()), "text": ["a", "b"]}),
                   tmp_path / "a.parquet")
    assert describe(str(tmp_path / "a.parquet"), "id", "text").id_type == "uint32"
    pq.write_table(pa.table({"id": pa.array([3], pa.int16()), "text": ["c"]}),
                   tmp_path / "b.parquet")
    info = describe(str(tmp_path), "id", "text")
    assert info.id_type == "int64"
    shard = plan_shards(info.files, 10)[0]
    assert next(read_shard(shard, "id", "text", info.id_type)).ids.type == pa.int64()


def test_duplicates_among_large_unsigned_ids(tmp_path):
    ids = pa.array([2**64 - 1, 5, 2**64 - 1, 2**63], pa.uint64())
    pq.write_table(pa.table({"id": ids, "text": ["a"] * 4}), tmp_path / "a.parquet")
    dupes = find_duplicates(describe(str(tmp_path / "a.parquet"), "id", "text"), "id", "text")
    assert dupes.rows == 1 and dupes.drop == {"a.parquet": [2]}


def test_describe_asks_once_whether_the_corpus_url_is_a_glob(tmp_path, monkeypatch):
    """On S3 the question is a request: describe asks it once and hands the answer on."""
    from pipeline import corpus, storage

    asked = []
    real = storage.is_pattern
    monkeypatch.setattr(storage, "is_pattern", lambda url: asked.append(url) or real(url))
    folder = tmp_path / "run [1]"
    folder.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), folder / "a.parquet")
    info = corpus.describe(str(folder), "id", "text", str(tmp_path / "out"))
    assert [f.name for f in info.files] == ["a.parquet"] and asked == [str(folder)]
