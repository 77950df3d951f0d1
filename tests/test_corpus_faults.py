"""Bad rows and bad corpora (issue 7): counted, quarantined, refused before any work.

These run the library path the flows run (prepare, every shard, finalize) with the tiny
model, without Prefect; test_flows.py covers the same path through Prefect.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import job, read_set, run_library, text_for, tree_digest, write_corpus

from pipeline.errors import CorpusError, FingerprintError
from pipeline.sets import SetFolder, scan_set


def test_texts_without_a_visible_character_are_empty(tmp_path, tiny_model_dir):
    """A zero-width space, a byte-order mark with a soft hyphen, NUL: the tokenizer drops them
    all, so each row got the one vector of an empty text. They are skipped as empty_text; a
    visible character beside them is embedded."""
    blank = ["\u200b", "\ufeff\u00ad", "\x00 \t", "\u2060\u200e"]
    kept = ["a\u200b", "\u200bword", "\u00e9t\u00e9"]
    write_corpus(tmp_path / "a.parquet", list(range(7)), blank + kept)
    summary = run_library(job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir))
    assert summary.skipped == {"empty_text": 4}
    assert sorted(read_set(tmp_path / "out", "mean")) == [4, 5, 6]


def test_bad_rows_are_skipped_counted_and_quarantined(tmp_path, tiny_model_dir):
    ids = list(range(12)) + [None]
    texts = [text_for(i) for i in range(13)]
    texts[2], texts[4], texts[5] = None, "", "  \n\t "
    write_corpus(tmp_path / "c" / "a.parquet", ids, texts, row_group_size=5)
    # a second file whose text column is not text at all: every row is "not_string"
    pq.write_table(pa.table({"id": [100, 101], "text": [1, 2]}), tmp_path / "c" / "b.parquet")
    summary = run_library(
        job(tmp_path / "c", tmp_path / "out", tiny_model_dir, quarantine=True)
    )
    expected = {"null_id": 1, "null_text": 1, "empty_text": 2, "not_string": 2}
    assert summary.skipped == expected
    assert "skipped 6 rows (empty_text 2, not_string 2, null_id 1, null_text 1)" in summary.line()
    meta = SetFolder(str(tmp_path / "out"), "mean").read_meta()
    assert meta.rows_skipped == expected and meta.rows_written == 9
    assert sorted(read_set(tmp_path / "out", "mean")) == [0, 1, 3, 6, 7, 8, 9, 10, 11]
    quarantine = pa.concat_tables(
        pq.read_table(p) for p in sorted((tmp_path / "out" / "_quarantine").glob("*.parquet"))
    ).sort_by([("file", "ascending"), ("row", "ascending")])
    assert quarantine.column("id").to_pylist() == [2, 4, 5, None, 100, 101]
    assert quarantine.column("row").to_pylist() == [2, 4, 5, 12, 0, 1]
    assert quarantine.column("reason").to_pylist() == [
        "null_text", "empty_text", "empty_text", "null_id", "not_string", "not_string"
    ]


def _quarantined(out: Path) -> dict[int, str]:
    files = sorted((out / "_quarantine").glob("*.parquet"))
    rows = [row for f in files for row in pq.read_table(f).to_pylist()]
    return {row["id"]: row["reason"] for row in rows}


def test_quarantine_files_follow_the_shards_they_describe(tmp_path, tiny_model_dir):
    corpus, out = tmp_path / "c" / "a.parquet", tmp_path / "out"
    texts = [text_for(i) for i in range(20)]
    texts[2] = "   "
    write_corpus(corpus, list(range(20)), texts)
    run_library(job(corpus, out, tiny_model_dir))  # without --quarantine: no file
    assert _quarantined(out) == {}
    # asked for later: the shard that skipped a row is written again (vectors reused)
    summary = run_library(job(corpus, out, tiny_model_dir, quarantine=True))
    assert (summary.shards_run, summary.embedded) == (1, 0)
    assert _quarantined(out) == {2: "empty_text"}
    assert run_library(job(corpus, out, tiny_model_dir, quarantine=True)).shards_run == 0
    # the row fixed: the shard is redone and its file goes, the set holds the row
    texts[2] = text_for(2)
    write_corpus(corpus, list(range(20)), texts)
    run_library(job(corpus, out, tiny_model_dir, quarantine=True))
    assert _quarantined(out) == {} and 2 in read_set(out, "mean")
    # a shard retired (the file rewritten with other row groups) takes its file with it
    texts[2] = ""
    write_corpus(corpus, list(range(20)), texts)
    run_library(job(corpus, out, tiny_model_dir, quarantine=True))
    assert _quarantined(out) == {2: "empty_text"}
    write_corpus(corpus, list(range(20)), texts, row_group_size=20)
    run_library(job(corpus, out, tiny_model_dir, quarantine=True))
    assert len(list((out / "_quarantine").glob("*.parquet"))) == 1  # the new shard's only
    assert _quarantined(out) == {2: "empty_text"}


def test_runs_without_quarantine_keep_the_record_of_rows_still_skipped(tmp_path,
                                                                      tiny_model_dir):
    """A backfill or a nightly run without --quarantine deleted ``_quarantine``'s file of a
    shard whose rows the sets still skipped (their ``_SET.json`` still counted them)."""
    from pipeline.assembly import inherit_encoder

    corpus, out = tmp_path / "c" / "a.parquet", tmp_path / "out"
    texts = [text_for(i) for i in range(20)]
    texts[2], texts[4] = "   ", None
    write_corpus(corpus, list(range(20)), texts)
    run_library(job(corpus, out, tiny_model_dir, quarantine=True))
    assert _quarantined(out) == {2: "empty_text", 4: "null_text"}
    backfill = job(corpus, out, tiny_model_dir, poolers=[{"name": "cls"}])
    run_library(inherit_encoder(backfill))
    assert _quarantined(out) == {2: "empty_text", 4: "null_text"}
    texts[3] = ""  # a nightly run: another row skipped, the file keeps up with it
    write_corpus(corpus, list(range(20)), texts)
    run_library(job(corpus, out, tiny_model_dir), verify=True)
    assert _quarantined(out) == {2: "empty_text", 3: "empty_text", 4: "null_text"}
    texts[2] = texts[3] = texts[4] = text_for(9)  # none skipped: nothing left to record
    write_corpus(corpus, list(range(20)), texts)
    run_library(job(corpus, out, tiny_model_dir), verify=True)
    assert _quarantined(out) == {}


def test_long_control_and_unusual_unicode_texts_embed(tmp_path, tiny_model_dir):
    texts = [
        "word " * 200_000 + "end",  # 1 MB
        "tab\there\x00nul\x07bell\x1bescape\r\nnewline",
        "\u200b\u200d\ufeff zero widths",
        "emoji \U0001f600\U0001f9ec and rtl \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d",
        "combining e\u0301\u0301 and \ud7a3 and \U00010348 and \ufffd",
        "\x00\x01\x02",  # only control characters: no visible one, so an empty text
    ]
    assert len(texts[0]) > 1_000_000
    write_corpus(tmp_path / "a.parquet", list(range(len(texts))), texts)
    summary = run_library(job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir))
    vectors = read_set(tmp_path / "out", "mean")
    assert summary.skipped == {"empty_text": 1} and sorted(vectors) == list(range(5))
    matrix = np.stack([vectors[i] for i in range(5)])
    assert np.isfinite(matrix).all()
    assert np.allclose(np.linalg.norm(matrix, axis=1), 1.0, atol=1e-5)


def test_duplicate_ids_fail_naming_them_before_any_work(tmp_path, tiny_model_dir):
    write_corpus(tmp_path / "c" / "a.parquet", ["a", "b", "c"], ["x", "y", "z"])
    write_corpus(tmp_path / "c" / "b.parquet", ["d", "b", "a"], ["u", "v", "w"])
    expected = r"2 row\(s\) repeat .* first duplicates: 'b', 'a'.*--dedupe"
    with pytest.raises(CorpusError, match=expected):
        run_library(job(tmp_path / "c", tmp_path / "out", tiny_model_dir))
    assert not (tmp_path / "out").exists()


def test_dedupe_keeps_the_first_row_of_each_id(tmp_path, tiny_model_dir):
    write_corpus(tmp_path / "c" / "a.parquet", ["a", "b", "c"], ["x", "y", "z"])
    write_corpus(tmp_path / "c" / "b.parquet", ["d", "b", "a"], ["u", "v", "w"])
    summary = run_library(job(tmp_path / "c", tmp_path / "out", tiny_model_dir, dedupe=True))
    assert summary.skipped == {"duplicate_id": 2} and summary.rows == 4
    kept = read_set(tmp_path / "out", "mean")
    assert sorted(kept) == ["a", "b", "c", "d"]
    first = run_library(job(tmp_path / "c" / "a.parquet", tmp_path / "ref", tiny_model_dir))
    assert first.rows == 3
    ref = read_set(tmp_path / "ref", "mean")
    assert all(np.array_equal(kept[k], ref[k]) for k in "abc")  # the first copies were kept


@pytest.mark.parametrize(
    "make, message",
    [
        ("missing_column", r"a\.parquet has no column 'text' \(its columns: id, body\)"),
        ("corrupt", r"corrupt or unreadable Parquet file .*b\.parquet"),
        ("empty", r"is empty: 1 Parquet file\(s\), 0 rows"),
    ],
)
def test_bad_corpora_fail_before_any_work(tmp_path, tiny_model_dir, make, message):
    corpus = tmp_path / "c"
    corpus.mkdir()
    if make == "missing_column":
        pq.write_table(pa.table({"id": [1], "body": ["x"]}), corpus / "a.parquet")
    elif make == "corrupt":
        write_corpus(corpus / "a.parquet", [1, 2], ["x", "y"])
        good = (corpus / "a.parquet").read_bytes()
        (corpus / "b.parquet").write_bytes(good[:20] + b"\0" * 40 + good[60:-12])
    else:
        pq.write_table(
            pa.table({"id": pa.array([], pa.int64()), "text": pa.array([], pa.string())}),
            corpus / "a.parquet",
        )
    with pytest.raises(CorpusError, match=message) as info:
        run_library(job(corpus, tmp_path / "out", tiny_model_dir))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_damaged_page_behind_an_intact_footer_is_one_line(tmp_path, tiny_model_dir):
    """The footer reads, a row group's id page does not: the duplicate-id scan raised
    Arrow's OSError (a 64-line traceback from the CLI)."""
    corpus = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": list(range(60)), "text": [text_for(i) for i in range(60)]}),
                   corpus, row_group_size=20, compression="snappy")
    column = pq.ParquetFile(corpus).metadata.row_group(1).column(0)
    raw = bytearray(corpus.read_bytes())
    raw[column.data_page_offset : column.data_page_offset + 40] = b"\xab" * 40
    corpus.write_bytes(bytes(raw))
    with pytest.raises(CorpusError, match=r"corrupt Parquet file .*c\.parquet: row group 1 "
                                          r"unreadable: ") as info:
        run_library(job(corpus, tmp_path / "out", tiny_model_dir))
    assert "\n" not in str(info.value)


def test_out_with_a_set_of_another_fingerprint_is_refused(tmp_path, tiny_model_dir):
    write_corpus(tmp_path / "a.parquet", list(range(30)), [text_for(i) for i in range(30)])
    run_library(job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir,
                    poolers=[{"name": "main", "strategy": "mean"}]))
    before = tree_digest(tmp_path / "out")
    changed = job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir,
                  poolers=[{"name": "main", "strategy": "cls"}])
    with pytest.raises(FingerprintError, match=r"set 'main' in .* was made with fingerprint"
                                               r".*; differs in: pooler .*'strategy': 'mean'"
                                               r".* -> .*'strategy': 'cls'"):
        run_library(changed)
    other_model = job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir,
                      poolers=[{"name": "main", "strategy": "mean"}])
    other_model["encoder"] = other_model["encoder"] | {"max_length": 16}
    # the line named two fingerprints and one model: not what differs
    with pytest.raises(FingerprintError, match=r"; differs in: max length 128 -> 16; use "
                                               r"another set name or another OUT"):
        run_library(other_model)
    assert tree_digest(tmp_path / "out") == before


def test_an_int8_set_continued_in_a_float_dtype_says_how_to_continue_it(tmp_path,
                                                                        tiny_model_dir):
    """Refused, as it must be (int8 vectors are other vectors), naming nothing of int8."""
    write_corpus(tmp_path / "a.parquet", list(range(30)), [text_for(i) for i in range(30)])
    made = job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir)
    run_library(made | {"encoder": made["encoder"] | {"dtype": "int8"}})
    with pytest.raises(FingerprintError, match=r"its vectors were made in dtype int8 "
                                               r"\((onednn|onnxruntime)\), this job's in a float "
                                               r"dtype: --dtype int8 --int8-kernel \1 continues"):
        run_library(made)


def test_failure_while_writing_then_rerun_gives_every_row_once(tmp_path, tiny_model_dir,
                                                                 monkeypatch):
    """A fault injected before the 3rd part write; the rerun completes the set exactly."""
    n = 95
    write_corpus(tmp_path / "a.parquet", list(range(n)), [text_for(i) for i in range(n)])
    spec = job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir)
    run_library(job(tmp_path / "a.parquet", tmp_path / "ref", tiny_model_dir))
    monkeypatch.setenv("EMBEDPIPE_FAILPOINT", f"write_part:2:1:{tmp_path / 'fp'}")
    with pytest.raises(OSError, match="injected fault at write_part"):
        run_library(spec)
    monkeypatch.delenv("EMBEDPIPE_FAILPOINT")
    assert len(os.listdir(tmp_path / "out" / "sets" / "mean" / "_done")) == 2
    summary = run_library(spec)
    assert summary.shards_run == 3 and summary.embedded == n - 40
    ref, got = read_set(tmp_path / "ref", "mean"), read_set(tmp_path / "out", "mean")
    assert sorted(got) == list(range(n))
    assert all(np.array_equal(got[i], ref[i]) for i in range(n))
    meta = SetFolder(str(tmp_path / "out"), "mean").read_meta()
    assert meta.rows_written == n and meta.shards_done == 5 and meta.generation == 1


def test_process_killed_mid_shard_then_rerun_gives_every_row_once(tmp_path, tiny_model_dir):
    """kill -9 after a part is written but before its marker; the rerun redoes that shard."""
    n = 95
    write_corpus(tmp_path / "a.parquet", list(range(n)), [text_for(i) for i in range(n)])
    spec = job(tmp_path / "a.parquet", tmp_path / "out", tiny_model_dir)
    run_library(job(tmp_path / "a.parquet", tmp_path / "ref", tiny_model_dir))
    env = os.environ | {
        "EMBEDPIPE_FAILPOINT": f"write_marker:2:1:{tmp_path / 'fp'}:kill",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path]),
    }
    code = f"import json, _flowkit; _flowkit.run_library(json.loads({json.dumps(spec)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    set_dir = tmp_path / "out" / "sets" / "mean"
    assert len(list(set_dir.glob("part-*.parquet"))) == 3  # the 3rd part made it, not its marker
    assert len(list((set_dir / "_done").glob("*.json"))) == 2
    summary = run_library(spec)
    assert summary.shards_run == 3
    ref, got = read_set(tmp_path / "ref", "mean"), read_set(tmp_path / "out", "mean")
    assert sorted(got) == list(range(n))
    assert all(np.array_equal(got[i], ref[i]) for i in range(n))
    changes = json.loads((set_dir / "_changes" / "000001.json").read_text())
    assert len(changes["parts"]) == 5 and changes["deleted_ids"] == []


@pytest.mark.parametrize("then", ["grows", "goes"])
def test_a_part_left_without_its_marker_goes_once_its_shard_leaves_the_plan(
        tmp_path, tiny_model_dir, monkeypatch, then):
    """A run dies between a shard's part and its marker, then that shard leaves the plan: rows
    are appended to its file (its last shard gets another id) or the file is deleted. The
    part is never the set's (readers take marked parts only) and the next run removes it;
    before, its rows stayed in the set for good (ids twice, or a deleted file's rows)."""
    corpus, out = tmp_path / "c", tmp_path / "out"
    write_corpus(corpus / "a.parquet", list(range(25)), [text_for(i) for i in range(25)])
    write_corpus(corpus / "b.parquet", list(range(100, 110)), [text_for(i) for i in range(10)])
    spec = job(corpus, out, tiny_model_dir)
    monkeypatch.setenv("EMBEDPIPE_FAILPOINT", f"write_marker:1:1:{tmp_path / 'fp'}")
    with pytest.raises(OSError, match="injected fault at write_marker"):
        run_library(spec)  # a's 2nd shard (rows 20-24): part and hashes, no marker
    monkeypatch.delenv("EMBEDPIPE_FAILPOINT")
    folder = SetFolder(str(out), "mean")
    [orphan] = folder.unmarked_shards()
    assert len(folder.part_urls()) == 1 and folder.has_part(orphan)  # unseen by readers
    if then == "grows":
        write_corpus(corpus / "a.parquet", list(range(35)), [text_for(i) for i in range(35)])
    else:
        (corpus / "a.parquet").unlink()
    summary = run_library(spec)
    ids = sorted(read_set(out, "mean"))  # every part file: an id twice fails
    assert ids == [*range(35), *range(100, 110)] if then == "grows" else list(range(100, 110))
    assert not folder.has_part(orphan) and not folder.unmarked_shards()
    assert summary.rows == folder.meta().rows_written == len(ids)
    assert scan_set(str(out), "mean").collect().height == len(ids)


def test_a_part_whose_marker_is_damaged_goes_once_its_shard_leaves_the_plan(
        tmp_path, tiny_model_dir):
    """A done marker that is not one (damaged JSON) does not make its part the set's for good:
    the shard is redone while planned, and retired with its part once it leaves the plan."""
    corpus, out = tmp_path / "c", tmp_path / "out"
    write_corpus(corpus / "a.parquet", list(range(25)), [text_for(i) for i in range(25)])
    spec = job(corpus, out, tiny_model_dir)
    run_library(spec)
    folder = SetFolder(str(out), "mean")
    last = max(folder.read_markers().values(), key=lambda m: m.shard)
    damaged = out / "sets" / "mean" / "_done" / f"{last.shard}.json"
    damaged.write_text("{not json")
    write_corpus(corpus / "a.parquet", list(range(35)), [text_for(i) for i in range(35)])
    summary = run_library(spec)
    ids = sorted(read_set(out, "mean"))  # an id twice fails
    assert ids == list(range(35)) and not damaged.exists() and not folder.has_part(last.shard)
    assert summary.rows == folder.meta().rows_written == 35


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "incremental"])
def test_a_run_that_dies_rewriting_a_shard_leaves_no_marker_on_its_new_rows(
        tmp_path, tiny_model_dir, monkeypatch, verify):
    """A text is edited, the run dies after the shard's new part and hashes, before its new
    marker; the edit is rolled back. The old marker matched the restored file, so a rerun
    took the shard as done and kept the dead run's vector of the edited text for good."""
    corpus, texts = tmp_path / "a.parquet", [text_for(i) for i in range(40)]
    write_corpus(corpus, list(range(40)), texts)
    spec = job(corpus, tmp_path / "out", tiny_model_dir)
    run_library(spec)
    write_corpus(corpus, list(range(40)), [*texts[:3], "an edited text", *texts[4:]])
    monkeypatch.setenv("EMBEDPIPE_FAILPOINT", f"write_marker:0:1:{tmp_path / 'fp'}")
    with pytest.raises(OSError, match="injected fault at write_marker"):
        run_library(spec)
    monkeypatch.delenv("EMBEDPIPE_FAILPOINT")
    write_corpus(corpus, list(range(40)), texts)  # the edit rolled back
    summary = run_library(spec, verify=verify)
    assert summary.rows == 40 and summary.embedded == 20  # the shard again, none reused
    run_library(job(corpus, tmp_path / "ref", tiny_model_dir))
    ref, got = read_set(tmp_path / "ref", "mean"), read_set(tmp_path / "out", "mean")
    assert sorted(got) == list(range(40))
    assert all(np.array_equal(got[i], ref[i]) for i in range(40))


def test_a_run_that_dies_retiring_a_shard_leaves_no_marker_on_its_removed_rows(
        tmp_path, tiny_model_dir, monkeypatch):
    """A file is deleted, the run dies retiring its shard (part gone, marker not); the file
    comes back. The marker matched it, so a rerun took the shard as done: its rows were
    missing from the set for good while _SET.json counted them."""
    corpus = tmp_path / "c"
    write_corpus(corpus / "a.parquet", list(range(20)), [text_for(i) for i in range(20)])
    b = write_corpus(corpus / "b.parquet", list(range(100, 120)),
                     [text_for(i) for i in range(20)])
    saved = b.read_bytes()
    spec = job(corpus, tmp_path / "out", tiny_model_dir)
    run_library(spec)
    b.unlink()
    monkeypatch.setenv("EMBEDPIPE_FAILPOINT", f"retire_part:0:1:{tmp_path / 'fp'}")
    with pytest.raises(OSError, match="injected fault at retire_part"):
        run_library(spec)
    monkeypatch.delenv("EMBEDPIPE_FAILPOINT")
    b.write_bytes(saved)
    summary = run_library(spec)
    ids = sorted(read_set(tmp_path / "out", "mean"))
    assert ids == [*range(20), *range(100, 120)]
    assert summary.rows == SetFolder(str(tmp_path / "out"), "mean").meta().rows_written == 40
    assert scan_set(str(tmp_path / "out"), "mean").collect().height == 40


def test_a_rerun_leaves_a_shard_of_skipped_rows_as_it_is(tmp_path, tiny_model_dir):
    """A shard whose every row is skipped has a marker and no part: an incremental rerun with
    nothing to do rewrote that marker (its generation -1, as its missing hashes said)."""
    write_corpus(tmp_path / "c" / "a.parquet", [1], ["a text"])
    write_corpus(tmp_path / "c" / "b.parquet", [2], ["   "])
    spec = job(tmp_path / "c", tmp_path / "out", tiny_model_dir)
    run_library(spec)
    before = tree_digest(tmp_path / "out" / "sets")
    summary = run_library(spec, verify=True)
    assert summary.embedded == 0 and summary.skipped == {"empty_text": 1}
    assert tree_digest(tmp_path / "out" / "sets") == before
