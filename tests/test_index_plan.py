"""Index planning is pure: invariants over sizes and budgets (hypothesis), and known choices."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import ConfigError
from pipeline.index.plan import (
    FLAT_MAX_ROWS,
    HEADROOM,
    HNSW_MAX_ROWS,
    NAMED_KINDS,
    nlist_for,
    parse_bytes,
    plan_index,
)

rows_st = st.integers(1, 50_000_000)
dims_st = st.sampled_from([8, 32, 64, 128, 256, 384, 768, 1024])
budgets_st = st.integers(1_000_000, 64_000_000_000)


@settings(max_examples=300, deadline=None)
@given(rows=rows_st, dim=dims_st, budget=budgets_st)
def test_auto_plans_fit_the_budget_or_fail_clearly(rows, dim, budget):
    try:
        plan = plan_index(rows, dim, "ip", budget)
    except ConfigError as exc:
        assert "too small" in str(exc) and "--memory-budget" in str(exc)
        return
    assert plan.kind in NAMED_KINDS
    assert plan.memory_estimate <= budget * HEADROOM
    if plan.kind == "flat":
        assert rows <= FLAT_MAX_ROWS
    if plan.kind == "hnsw":
        assert rows <= HNSW_MAX_ROWS
    if plan.kind.startswith("ivf"):
        assert plan.nlist and plan.nlist & (plan.nlist - 1) == 0  # a power of two
        assert 0 < plan.train_rows <= rows
        assert rows >= plan.nlist  # every list can get a centroid
    if plan.kind == "ivfpq":
        m, bits = map(int, plan.factory.split(",PQ")[1].split("x"))
        assert dim % m == 0 and m <= dim // 4
        # every codebook trains on 39 rows a centroid, or is 1 bit where nothing would
        assert 39 * 2**bits <= min(rows, plan.train_rows) or bits == 1


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5_000_000), dim=dims_st, budget=budgets_st)
def test_more_budget_never_gives_a_lossier_index(rows, dim, budget):
    order = {"flat": 0, "hnsw": 0, "ivf": 1, "ivfsq": 2, "ivfpq": 3}
    try:
        small = plan_index(rows, dim, "l2", budget)
    except ConfigError:
        return
    big = plan_index(rows, dim, "l2", budget * 4)
    assert order[big.kind] <= order[small.kind]


@given(rows=st.integers(1, 10**9))
def test_nlist_is_a_bounded_power_of_two(rows):
    nlist = nlist_for(rows)
    assert nlist & (nlist - 1) == 0
    assert 1 <= nlist <= 65_536
    assert nlist <= max(rows // 39, 1) or nlist == 1


@pytest.mark.parametrize(
    ("rows", "dim", "budget", "kind"),
    [
        (1_000, 384, "4GB", "flat"),
        (50_000, 384, "4GB", "flat"),
        (200_000, 384, "4GB", "hnsw"),
        (1_000_000, 384, "4GB", "ivf"),
        (1_000_000, 384, "2GB", "ivfsq"),
        (10_000_000, 384, "2GB", "ivfpq"),
        (200_000, 384, "400MB", "ivfsq"),
        (200_000, 384, "300MB", "ivfpq"),
    ],
)
def test_auto_choices_at_several_sizes(rows, dim, budget, kind):
    assert plan_index(rows, dim, "ip", parse_bytes(budget)).kind == kind


def test_named_kinds_and_factory_strings():
    assert plan_index(10_000, 64, "ip", 10**9, "hnsw").factory == "HNSW32"
    # codebooks of 256 centroids want 9,984 rows: 800 train 16 (it took 204 s to train 96
    # codebooks of 256, to a recall@10 under 0.91)
    assert plan_index(800, 16, "ip", 10**9, "ivfpq").factory == "IVF16,PQ4x4"
    assert plan_index(100_000, 64, "ip", 10**9, "ivfpq").factory.endswith("x8")
    assert plan_index(100_000, 64, "ip", 10**9, "ivf").factory == "IVF512,Flat"
    plan = plan_index(100_000, 64, "ip", 10**9, "OPQ16,IVF256,PQ16")
    assert (plan.kind, plan.factory) == ("factory", "OPQ16,IVF256,PQ16")
    with pytest.raises(ConfigError, match="empty set"):
        plan_index(0, 64, "ip", 10**9)


@pytest.mark.parametrize(
    ("text", "value"),
    [("4GB", 4_000_000_000), ("512MB", 512_000_000), ("2GiB", 2**31), ("1.5G", 1_500_000_000),
     ("1000", 1000), (" 3 kb ", 3000)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "four GB", "4XB", "-1GB", "0"])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(ConfigError, match="memory budget"):
        parse_bytes(text)


def test_planning_imports_without_faiss_and_the_package_names_resolve():
    """The CLI's ``--kind`` help reads NAMED_KINDS: that import must not load FAISS; the
    package's lazily loaded names all resolve to their modules' objects."""
    code = ("import sys, pipeline.index.plan as p; print(','.join(p.NAMED_KINDS)); "
            "print('faiss' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [",".join(NAMED_KINDS), "False"]
    import pipeline.index as package

    for name in package.__all__:
        assert getattr(package, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        package.nope  # noqa: B018
