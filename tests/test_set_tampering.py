"""Tampered set files cannot reach outside OUT: `index` and `embed` fail with one line and a
sentinel folder next to OUT, which each traversal name points into, is left untouched.

Attacks: a ``_SET.json`` whose ``name`` is ``../../x`` (the index would be written to
``OUT/index/../../x``); done markers whose shard ids are ``../../evil`` and
``../../../../sentinel/evil`` (a run retiring them would read and delete ``_hashes/<id>`` and
``_done/<id>``); a ``_changes`` file naming ``../x.parquet`` and a part in the sentinel folder
(an index catch-up would add that file's vectors)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import (
    job,
    out_digest,
    read_set,
    run_library,
    same_vectors,
    text_for,
    tree_digest,
    write_corpus,
)

from flows.cli import main
from pipeline.sets import SetFolder

ROWS = 40


@pytest.fixture
def site(tmp_path, tiny_model_dir) -> dict:
    """OUT with a real set, a corpus, and sentinel folders where the traversals point."""
    corpus = write_corpus(tmp_path / "c.parquet", list(range(ROWS)),
                          [text_for(i) for i in range(ROWS)])
    out = tmp_path / "out"
    run_library(job(corpus, out, tiny_model_dir))
    for folder in ("x", "sentinel"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "keep.txt").write_text("untouched")
    flat = pa.array(np.ones(ROWS * 32, np.float32))
    foreign = pa.table({"id": pa.array(range(1000, 1000 + ROWS)),
                        "embedding": pa.FixedSizeListArray.from_arrays(flat, 32)})
    for name in ("evil.parquet", "x.parquet"):
        pq.write_table(foreign, tmp_path / "sentinel" / name)
    (tmp_path / "sentinel" / "evil.json").write_text("{}")
    return {"tmp": tmp_path, "out": out, "corpus": corpus, "model": tiny_model_dir}


def outside(site: dict) -> dict[str, str]:
    """Digest of everything next to OUT (the sentinels, the corpus)."""
    return {k: v for k, v in tree_digest(site["tmp"]).items() if not k.startswith("out/")}


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"embedpipe {command}: error: "), err
    return err


def embed_args(site: dict) -> list[str]:
    return ["embed", str(site["corpus"]), str(site["out"]), "--model", str(site["model"]),
            "--device", "cpu", "--dtype", "fp32", "--rows-per-shard", "10"]


def test_a_set_json_naming_another_set_is_refused(site, capsys, prefect_api):
    meta_path = site["out"] / "sets" / "mean" / "_SET.json"
    meta_path.write_text(json.dumps(json.loads(meta_path.read_text()) | {"name": "../../x"}))
    before, inside = outside(site), out_digest(site["out"])
    for args, command in ((["index", str(site["out"]), "--set", "mean"], "index"),
                          (["index", str(site["out"])], "index"),
                          (embed_args(site), "embed")):
        assert main(args) == 1
        err = one_line_error(capsys, command)
        assert "names set '../../x', not 'mean'" in err
    assert outside(site) == before
    assert out_digest(site["out"]) == inside and not (site["out"] / "index").exists()


@pytest.mark.parametrize("shard", ["../../evil", "../../../../sentinel/evil"])
def test_a_marker_with_a_traversal_shard_id_is_refused(site, capsys, prefect_api, shard):
    done = site["out"] / "sets" / "mean" / "_done"
    marker = json.loads(next(done.glob("*.json")).read_text()) | {"shard": shard}
    (done / "tampered.json").write_text(json.dumps(marker))
    before, inside = outside(site), out_digest(site["out"])
    assert main(embed_args(site)) == 1
    assert f"invalid file name '{shard}'" in one_line_error(capsys, "embed")
    assert outside(site) == before
    assert out_digest(site["out"]) == inside


@pytest.mark.parametrize("part", ["../x.parquet", "../../../sentinel/x.parquet"])
def test_a_changes_file_naming_a_file_outside_the_set_is_refused(site, capsys, prefect_api,
                                                                 part):
    assert main(["index", str(site["out"]), "--memory-budget", "1GB"]) == 0
    capsys.readouterr()
    folder = site["out"] / "sets" / "mean"
    meta = json.loads((folder / "_SET.json").read_text())
    (folder / "_SET.json").write_text(json.dumps(meta | {"generation": 2}))
    body = {"generation": 2, "parts": [part], "deleted_ids": []}
    (folder / "_changes" / "000002.json").write_text(json.dumps(body))
    before, index = outside(site), tree_digest(site["out"] / "index")
    assert main(["index", str(site["out"])]) == 1
    assert f"invalid file name '{part}'" in one_line_error(capsys, "index")
    assert outside(site) == before and tree_digest(site["out"] / "index") == index


def test_sentinels_are_really_where_the_traversals_point(site):
    """The attacks above aim at real files: each traversal, resolved, lands on a sentinel."""
    out: Path = site["out"]
    assert (out / "index" / "../../x").resolve() == site["tmp"] / "x"
    hashes = out / "sets" / "mean" / "_hashes" / "../../../../sentinel/evil.parquet"
    assert hashes.resolve() == site["tmp"] / "sentinel" / "evil.parquet"
    assert (out / "sets" / "mean" / "../../../sentinel/x.parquet").resolve().exists()


def test_a_set_json_that_is_not_text_is_one_line(site, capsys):
    """A ``_SET.json`` of bytes that are not UTF-8 (a PNG written over it) failed every command
    with a UnicodeDecodeError traceback; like any file that is not JSON, it is one line."""
    (site["out"] / "sets" / "mean" / "_SET.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert main(["index", str(site["out"]), "--set", "mean"]) != 0
    err = one_line_error(capsys, "index")
    assert "_SET.json is not valid JSON" in err, err


def test_a_done_shard_whose_part_is_gone_is_redone(site):
    """Its marker was trusted: a rerun ran nothing, _SET.json counted the rows and readers
    and the index silently lacked them (found by an adversarial review)."""
    out, folder = site["out"], SetFolder(str(site["out"]), "mean")
    before = read_set(out, "mean")
    shard = sorted(folder.read_markers())[0]
    lost = folder.read_marker(shard).rows
    Path(folder.part_url(shard)).unlink()
    summary = run_library(job(site["corpus"], out, site["model"]))
    assert (summary.embedded, summary.rows, lost > 0) == (lost, ROWS, True)
    assert same_vectors(read_set(out, "mean"), before, atol=1e-6)
    assert folder.meta().rows_written == ROWS


@pytest.mark.parametrize("linked", ["sets/mean", "index/mean", "sets/mean/_done"])
def test_a_folder_in_out_linked_elsewhere_is_refused_before_any_write(site, capsys,
                                                                      prefect_api, linked):
    """A folder of OUT that is a symbolic link took a writer's files, and its pruning, outside
    OUT: an embed of a grown corpus wrote its parts into the link's target, an index rebuild
    replaced the files there. Now every writer refuses it in one line, before any work."""
    assert main(["index", str(site["out"]), "--memory-budget", "1GB"]) == 0
    capsys.readouterr()
    grown = write_corpus(site["tmp"] / "grown.parquet", list(range(ROWS + 10)),
                         [text_for(i, "v2") for i in range(ROWS + 10)])
    folder = site["out"] / linked
    elsewhere = site["tmp"] / "elsewhere"
    folder.rename(elsewhere)
    folder.symlink_to(elsewhere, target_is_directory=True)
    before, inside = outside(site), out_digest(site["out"])
    embed = [*embed_args(site)[:1], str(grown), *embed_args(site)[2:]]
    index = ["index", str(site["out"]), "--set", "mean", "--rebuild"]
    every = ["index", str(site["out"]), "--rebuild"]  # a linked set was no set: "no sets"
    for args, command in ((embed, "embed"), (index, "index"), (every, "index")):
        assert main(args) == 1
        err = one_line_error(capsys, command)
        assert f"{str(folder)!r} is a symbolic link to {str(elsewhere)!r}" in err, err
    assert outside(site) == before and out_digest(site["out"]) == inside


@pytest.mark.parametrize("deleted", [["x"], [1.5], [2**64], [[3]]])
def test_a_changes_file_with_ids_not_of_the_sets_type_is_one_line(site, capsys, prefect_api,
                                                                  deleted):
    """An index catch-up turned them into Arrow ids: a traceback (a string, a list, an int
    beyond int64), or a float truncated to another row's id, which the index then lost."""
    assert main(["index", str(site["out"]), "--memory-budget", "1GB"]) == 0
    capsys.readouterr()
    folder = site["out"] / "sets" / "mean"
    meta = json.loads((folder / "_SET.json").read_text())
    (folder / "_SET.json").write_text(json.dumps(meta | {"generation": 2}))
    changes = folder / "_changes" / "000002.json"
    changes.write_text(json.dumps({"generation": 2, "parts": [], "deleted_ids": deleted}))
    index = tree_digest(site["out"] / "index")
    assert main(["index", str(site["out"])]) == 1
    assert f"{changes}: its ids are not the set's int64" in one_line_error(capsys, "index")
    assert tree_digest(site["out"] / "index") == index


def test_a_removal_record_with_ids_not_of_the_sets_type_is_one_line(site, capsys,
                                                                    prefect_api):
    """A string id in an int64 set's removal record went on into the run's changes file, and
    every later index catch-up failed on it until a rebuild."""
    record = site["out"] / "sets" / "mean" / "_removed" / "000002-s.json"
    record.parent.mkdir(exist_ok=True)
    record.write_text(json.dumps({"generation": 2, "ids": ["7"]}))
    assert main(embed_args(site)) == 1
    err = one_line_error(capsys, "embed")
    assert f"{record}: its ids are not the set's int64" in err
    assert err.endswith(f"index {site['out']} --set mean --rebuild): the rows it names left "
                        "the set")  # removed by hand, its ids would stay in the index
    assert not (site["out"] / "sets" / "mean" / "_changes" / "000002.json").exists()


def test_a_part_whose_ids_are_not_the_sets_type_is_one_line(site, capsys, prefect_api):
    """Every part of a set stores the set's id type; an int32 one among int64 ones failed an
    index build with an Arrow traceback when its ids were joined to the others."""
    folder = SetFolder(str(site["out"]), "mean")
    url = folder.part_url(sorted(folder.read_markers())[-1])
    table = pq.read_table(url)
    pq.write_table(table.set_column(0, "id", table.column("id").cast(pa.int32())), url)
    before = out_digest(site["out"])
    assert main(["index", str(site["out"]), "--set", "mean"]) == 1
    assert f"{url}: its ids are int32, not the set's int64" in one_line_error(capsys, "index")
    assert out_digest(site["out"]) == before


def test_a_hashes_file_whose_ids_are_not_the_sets_type_is_one_line(site, capsys,
                                                                    prefect_api):
    """A rerun joins each shard's stored keys to the rows it reads: string ids in an int64
    set's ``_hashes`` files failed it after its retries with a polars traceback."""
    hashes = sorted((site["out"] / "sets" / "mean" / "_hashes").glob("*.parquet"))
    for url in hashes:
        table = pq.read_table(url)
        pq.write_table(table.set_column(0, "id", table.column("id").cast(pa.string())), url)
    write_corpus(site["corpus"], list(range(ROWS)), [f"changed {text_for(i)}" for i in range(ROWS)])
    def kept() -> dict[str, str]:  # but the run's list of moved-from shards, for a rerun
        return {k: v for k, v in out_digest(site["out"]).items() if "/_moved/" not in k}

    inside = kept()
    assert main(embed_args(site)) == 1
    err = one_line_error(capsys, "embed")
    assert any(f"{url}: its ids are string, not the set's int64" in err for url in hashes), err
    assert kept() == inside
