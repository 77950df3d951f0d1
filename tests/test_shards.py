"""Invariants of shard planning (pure code): coverage, stable ids, growth behaviour."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.names import file_name
from pipeline.shards import FileLayout, Shard, plan_shards, shard_id

group_sizes = st.lists(st.integers(min_value=0, max_value=50), min_size=0, max_size=30)
corpora = st.dictionaries(
    st.from_regex(r"[a-z]{1,6}(/[a-z]{1,6})?\.parquet", fullmatch=True),
    group_sizes,
    min_size=1,
    max_size=5,
)
targets = st.integers(min_value=1, max_value=120)


def layouts(corpus: dict[str, list[int]]) -> list[FileLayout]:
    return [
        FileLayout(name=n, url=f"/data/{n}", group_rows=tuple(g), group_bytes=tuple(g))
        for n, g in corpus.items()
    ]


@settings(max_examples=200, deadline=None)
@given(corpora, targets)
def test_every_row_group_in_exactly_one_shard(corpus, target):
    shards = plan_shards(layouts(corpus), target)
    seen = [(s.file, g) for s in shards for g in s.groups]
    expected = [(n, g) for n in sorted(corpus) for g in range(len(corpus[n]))]
    assert sorted(seen) == sorted(expected)
    assert len(seen) == len(set(seen))
    assert len({s.id for s in shards}) == len(shards)
    for s in shards:
        assert s.rows == sum(corpus[s.file][s.first_group : s.end_group])
        assert s.offset == sum(corpus[s.file][: s.first_group])
        assert s.id == shard_id(s.file, s.first_group, s.end_group)


@settings(max_examples=200, deadline=None)
@given(corpora, targets)
def test_closed_shards_are_minimal_and_only_the_tail_is_short(corpus, target):
    shards = plan_shards(layouts(corpus), target)
    for name, groups in corpus.items():
        mine = [s for s in shards if s.file == name]
        for s in mine[:-1]:
            assert s.rows >= target
            assert s.rows - groups[s.end_group - 1] < target  # closed at the first chance


@settings(max_examples=200, deadline=None)
@given(corpora, targets, group_sizes, st.from_regex(r"[a-z]{1,6}\.parquet", fullmatch=True))
def test_growth_keeps_closed_shards(corpus, target, appended, new_file):
    before = plan_shards(layouts(corpus), target)
    grown = {n: g + appended for n, g in corpus.items()}
    grown.setdefault(new_file, [5, 5])
    after = plan_shards(layouts(grown), target)
    after_ids = {s.id: s for s in after}
    for name in corpus:
        mine = [s for s in before if s.file == name]
        for s in mine[:-1]:  # every closed shard keeps its id and signature
            assert after_ids[s.id].signature == s.signature
        if mine and not appended:
            assert mine[-1].id in after_ids
    # planning is deterministic and independent of the order files are listed in
    assert plan_shards(list(reversed(layouts(grown))), target) == after


def test_ids_depend_on_name_and_range_only():
    def plan(url: str) -> list:
        return plan_shards([FileLayout(name="x/a.parquet", url=url, group_rows=(3, 3))], 3)

    a, b = plan("/one/x/a.parquet"), plan("s3://b/x/a.parquet")
    assert [s.id for s in a] == [s.id for s in b]
    assert a[0].id.startswith("a-") and a[0].id.endswith("-g00000-00001")
    other = plan_shards([FileLayout(name="y/a.parquet", url="/y/a.parquet", group_rows=(3, 3))], 3)
    assert {s.id for s in other}.isdisjoint({s.id for s in a})


def test_signature_tracks_group_sizes():
    one = plan_shards([FileLayout(name="a", url="a", group_rows=(4,), group_bytes=(100,))], 10)
    two = plan_shards([FileLayout(name="a", url="a", group_rows=(4,), group_bytes=(101,))], 10)
    assert one[0].id == two[0].id and one[0].signature != two[0].signature


RANGES = st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 30), st.integers(1, 12)),
                  max_size=40)


@settings(max_examples=300, deadline=None)
@given(markers=RANGES, shards=RANGES)
def test_a_shards_overlapping_markers_are_those_a_scan_of_all_finds(markers, shards):
    """``MarkerRanges`` (bisection) finds exactly the markers a scan of every one finds, for
    overlapping markers of any widths (left by runs of other --rows-per-shard)."""
    from pipeline.run import MarkerRanges
    from pipeline.sets import ShardMarker

    found = {f"m{i}": ShardMarker(shard=f"m{i}", file=file, first_group=first,
                                  end_group=first + width, signature="s", rows=1, generation=1)
             for i, (file, first, width) in enumerate(markers)}
    ranges = MarkerRanges(found)
    for file, first, width in shards:
        shard = Shard(id="s", file=file, url=file, first_group=first, end_group=first + width,
                      offset=0, rows=1, signature="s")
        scan = sorted(m.shard for m in found.values()
                      if shard.overlaps(m.file, m.first_group, m.end_group))
        assert ranges.overlapping(shard) == scan


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=60), st.integers(0, 99_999), st.integers(0, 99_999))
def test_every_shard_id_is_a_plain_file_name(stem, first, end):
    """A corpus file named "-2024-01.parquet" made a shard id starting with "-", which OUT's
    own name check refused: such a file could never be embedded."""
    assert file_name(shard_id(f"data/{stem}.parquet", first, end), "shard id")
