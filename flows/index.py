"""The index flow: one Prefect task per set, each bringing ``OUT/index/<set>`` up to date."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.progress import phase_printer
from pipeline.index import IndexRequest, index_set, index_targets
from pipeline.lease import writer_lease
from pipeline.settings import load_settings


@task(name="index-set", task_run_name="index {set_name}", cache_policy=NO_CACHE,
      persist_result=False)
def index_set_task(out: str, set_name: str, kind: str, memory_budget: str,
                   rebuild: bool, progress: bool = False) -> dict:
    req = IndexRequest(out=out, set_name=set_name, kind=kind, memory_budget=memory_budget,
                       rebuild=rebuild)
    logger = get_run_logger()
    show = phase_printer(progress)

    def say(msg: str) -> None:
        logger.info(msg)
        show(msg.strip())

    result = index_set(req, say=say)
    logger.info(result.summary())
    return result.model_dump(mode="json")


@flow(name="index", log_prints=True)
def index_flow(out: str, set_name: str | None = None, kind: str = "auto",
               memory_budget: str = "4GB", rebuild: bool = False,
               lease_wait: float = 0.0, progress: bool = False) -> list[dict]:
    """Index one set, or every set under OUT, holding OUT's writer lease (waiting up to
    ``lease_wait`` s for another writer); returns each set's IndexResult as JSON."""
    load_settings().export_env()  # the lease's TTL, S3 endpoint: as this installation sets them
    names = index_targets(out, set_name, kind, memory_budget, lease_wait)
    with writer_lease(out, "index", wait=lease_wait) as lease:
        results = []
        for name in names:
            lease.check()
            results.append(index_set_task(out, name, kind, memory_budget, rebuild, progress))
        return results
