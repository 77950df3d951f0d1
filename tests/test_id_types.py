"""A corpus rewritten by another tool may store its ids as another type of the same values
(polars writes ``large_string`` where pandas wrote ``string``; ``int32`` becomes ``int64``): the
sets go on in the type they store, as long as it holds every id; else one line says how."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _flowkit import job, read_set, run_library, same_vectors, text_for

import embedpipe
from pipeline.corpus import id_type_holds
from pipeline.errors import CorpusError, FingerprintError
from pipeline.index import open_index, read_meta
from pipeline.index.build import IndexRequest, index_set
from pipeline.sets import SetFolder


def _ids(dtype: pa.DataType, rows: int) -> pa.Array:
    """Ids 0.. of ``dtype``; as text, "doc-0".."""
    text = pa.types.is_string(dtype) or pa.types.is_large_string(dtype)
    return pa.array([f"doc-{i}" if text else i for i in range(rows)], dtype)


def _write(path: Path, ids: pa.Array, rows: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    texts = pa.array([text_for(i) for i in range(rows)], pa.string())
    pq.write_table(pa.table({"id": ids, "text": texts}), path, row_group_size=10)
    return path


def _embedded_then_rewritten(tmp_path: Path, model: Path, stored: pa.DataType,
                             rewritten: pa.DataType) -> tuple[Path, Path]:
    """A set made from 30 rows of ``stored`` ids, then its corpus rewritten with 45 rows of
    ``rewritten`` ids: (corpus, OUT)."""
    corpus, out = tmp_path / "c" / "a.parquet", tmp_path / "out"
    _write(corpus, _ids(stored, 30), 30)
    run_library(job(corpus, out, model))
    _write(corpus, _ids(rewritten, 45), 45)
    return corpus, out


def _part_types(out: Path, name: str = "mean") -> set[pa.DataType]:
    parts = sorted((out / "sets" / name).glob("part-*.parquet"))
    assert parts
    return {pq.read_schema(p).field("id").type for p in parts}


@pytest.mark.parametrize(("stored", "rewritten"), [
    (pa.string(), pa.large_string()), (pa.large_string(), pa.string()),
    (pa.int64(), pa.int32()), (pa.int64(), pa.uint32()),
])
def test_a_rewritten_corpus_goes_on_in_the_sets_id_type(
        tmp_path: Path, tiny_model_dir: Path, stored: pa.DataType, rewritten: pa.DataType
        ) -> None:
    corpus, out = _embedded_then_rewritten(tmp_path, tiny_model_dir, stored, rewritten)

    for incremental in (False, True):
        summary = run_library(job(corpus, out, tiny_model_dir), verify=incremental)
        assert summary.rows == 45
    assert _part_types(out) == {stored}
    assert SetFolder(str(out), "mean").read_meta().id_type == str(stored)
    fresh = tmp_path / "fresh"
    run_library(job(corpus, fresh, tiny_model_dir))
    assert same_vectors(read_set(out, "mean"), read_set(fresh, "mean"), atol=1e-5)

    index_set(IndexRequest(out=str(out), set_name="mean"), say=lambda _: None)
    handle = open_index(str(out), read_meta(str(out), "mean"))
    assert handle.idmap.ids.type == stored and len(handle.idmap.ids) == 45


@pytest.mark.parametrize(("stored", "rewritten"), [
    (pa.int32(), pa.int64()), (pa.uint64(), pa.int64()), (pa.int64(), pa.string()),
])
def test_a_corpus_whose_ids_the_set_cannot_hold_is_refused_before_writing(
        tmp_path: Path, tiny_model_dir: Path, stored: pa.DataType, rewritten: pa.DataType
        ) -> None:
    corpus, out = _embedded_then_rewritten(tmp_path, tiny_model_dir, stored, rewritten)
    before = read_set(out, "mean")  # the 30 rows' vectors

    with pytest.raises(FingerprintError) as caught:
        run_library(job(corpus, out, tiny_model_dir))
    message = str(caught.value)
    assert "\n" not in message
    assert (f"set 'mean' in {out} stores {stored} ids, the corpus has {rewritten} ids"
            in message and f"cast the corpus's id column to {stored}" in message)
    assert same_vectors(read_set(out, "mean"), before)


def test_id_type_holds() -> None:
    holds = [("string", "large_string"), ("large_string", "string"), ("int64", "int32"),
             ("int64", "uint32"), ("uint64", "uint8"), ("int16", "int16")]
    refused = [("int32", "int64"), ("uint64", "int64"), ("int64", "uint64"),
               ("string", "int64"), ("int64", "string"), ("uint32", "int8")]
    assert all(id_type_holds(a, b) for a, b in holds)
    assert not any(id_type_holds(a, b) for a, b in refused)


def test_uint64_ids_beyond_int64_are_searched_with_their_snippets(tmp_path: Path,
                                                                  tiny_model_dir: Path) -> None:
    """The snippets' lookup built its ids as int64 first: every search of such a set failed
    with an OverflowError's traceback (query, ``embedpipe.search``, serve's start)."""
    corpus, out = tmp_path / "c" / "a.parquet", tmp_path / "out"
    big = [2**63 + i for i in range(20)]
    _write(corpus, pa.array(big, pa.uint64()), 20)
    run_library(job(corpus, out, tiny_model_dir))
    index_set(IndexRequest(out=str(out), set_name="mean", kind="flat"), say=lambda _: None)
    (hits,) = embedpipe.search(str(out), text_for(3), k=1)
    assert (hits[0].id, hits[0].snippet) == (big[3], text_for(3))


def test_unsigned_files_beside_uint64_ones_share_uint64(tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    """uint32 ids beside uint64 ones beyond int64: uint64 holds both (it was refused as
    'other files' ids are signed'); a signed file beside them is still refused."""
    folder, out = tmp_path / "c", tmp_path / "out"
    big = [2**63 + i for i in range(10)]
    _write(folder / "a.parquet", pa.array(big, pa.uint64()), 10)
    _write(folder / "b.parquet", pa.array(range(100, 110), pa.uint32()), 10)
    assert run_library(job(folder, out, tiny_model_dir)).rows == 20
    assert SetFolder(str(out), "mean").meta().id_type == "uint64"
    assert sorted(read_set(out, "mean")) == list(range(100, 110)) + big
    _write(folder / "c.parquet", pa.array(range(20, 30), pa.int8()), 10)
    with pytest.raises(CorpusError, match="other files' ids are signed"):
        run_library(job(folder, tmp_path / "out2", tiny_model_dir))
    # uint64 ids within int64 beside uint32 ones stay int64, as sets made before hold them
    _write(folder / "a.parquet", pa.array(range(10), pa.uint64()), 10)
    (folder / "c.parquet").unlink()
    run_library(job(folder, tmp_path / "out3", tiny_model_dir))
    assert SetFolder(str(tmp_path / "out3"), "mean").meta().id_type == "int64"
