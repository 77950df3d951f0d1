"""Nightly to live: the incremental embed, then the index catch-up, in ONE parent flow run.

``embed_and_index_flow`` runs the embed flow (``verify=True``: the nightly incremental run that
re-reads every shard) as a sub-flow, then one index task per set of the job. Each index
catches up with the set's changes and rebuilds only when catch-up says it must (kind changed,
a changes file missing, recall fell after catch-up). A running ``serve`` picks up the new
index generation by itself.
"""

from __future__ import annotations

from prefect import flow

from flows.embed import embed_flow, nightly_flow
from flows.index import index_set_task
from pipeline.assembly import resolve_job
from pipeline.index.plan import parse_bytes
from pipeline.lease import writer_lease


@flow(name="embed-and-index")
def embed_and_index_flow(job: dict, verify: bool = True, kind: str = "auto",
                         memory_budget: str = "4GB", progress: bool = False) -> dict:
    """Embed (incrementally when ``verify``), then bring each set's index up to date."""
    parse_bytes(memory_budget)  # a bad budget fails before any vector is computed
    spec = resolve_job(job, keep_current=False)  # the lease's wait and TTL: as installed
    run = nightly_flow if verify else embed_flow
    with writer_lease(spec.out, "embed-and-index", wait=spec.lease_wait) as lease:
        summary = run(job, progress=progress)
        results = []
        for name in summary["sets"]:
            lease.check()
            results.append(index_set_task(spec.out, name, kind, memory_budget, False, progress))
    return summary | {"index": results}
