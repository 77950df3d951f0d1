"""Prefect flows over ``pipeline.run``: embed, backfill and the nightly incremental run.

Each flow validates the job, plans and checks everything in the flow (``prepare``), runs one
Prefect task per shard on the chosen task runner, then records the run (``finalize``). Task
retries (bounded) cover transient errors; errors in the input are never retried.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

from flows.progress import phase_printer
from pipeline.assembly import inherit_encoder, resolve_job
from pipeline.config import EmbedJob
from pipeline.errors import ConfigError, CorpusError, EmbedpipeError, FingerprintError, ModelError
from pipeline.job import ShardRequest, ShardResult, embed_shard
from pipeline.lease import LeaseLost, check_held, writer_lease
from pipeline.run import RunPlan, finalize, prepare

TASK_RETRIES = 2


class ShardFailed(EmbedpipeError):
    """A shard kept failing after its retries; the run can be resumed."""

PERMANENT = (CorpusError, ConfigError, FingerprintError, ModelError, LeaseLost)


def _transient(task, task_run, state) -> bool:
    """Retry anything but errors in the input or configuration (those fail the same again)."""
    try:
        state.result()
    except PERMANENT:
        return False
    except Exception:
        return True
    return False


@task(
    name="embed-shard",
    task_run_name="shard {request[shard][id]}",
    retries=TASK_RETRIES,
    retry_delay_seconds=1,
    retry_condition_fn=_transient,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def embed_shard_task(request: dict) -> dict:
    """One shard into every set that needs it (the model comes from the worker's cache)."""
    return embed_shard(ShardRequest.model_validate(request)).model_dump()


def make_runner(job: EmbedJob) -> TaskRunner:
    """The task runner named by the job: threads, processes, or Dask (address or local)."""
    if job.runner == "threads":
        return ThreadPoolTaskRunner(max_workers=job.workers)
    if job.runner == "processes":
        return ProcessPoolTaskRunner(max_workers=job.workers, initializer=exit_with_parent,
                                     initargs=(os.getpid(),))
    from prefect_dask import DaskTaskRunner

    if job.dask_address:
        return DaskTaskRunner(address=job.dask_address)
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={
            "n_workers": job.workers,
            "threads_per_worker": 1,
            "processes": True,
            "dashboard_address": None,
        },
    )


def exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """In a processes-runner worker: end the worker once the run's process (pid ``parent``)
    is gone (killed, out of memory), also where it went while the worker started. Nothing
    else ends it: it waits on its task queue for good, holding its model (690 MB each with
    MiniLM, still there minutes after the rerun had finished)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _run_shards(plan: RunPlan, progress: bool) -> list[ShardResult]:
    """Submit every shard, wait for all, then raise the first failure (if any)."""
    results: list[ShardResult] = []
    failure: tuple[str, Exception] | None = None
    bar = _bar(plan, progress)
    with make_runner(plan.job) as runner:
        futures = {
            runner.submit(embed_shard_task, {"request": r.model_dump(mode="json")}): r.shard.id
            for r in plan.requests
        }
        for future in as_completed(list(futures)):
            try:
                result = ShardResult.model_validate(future.result())
            except Exception as exc:  # keep the others running: their shards will be done
                failure = failure or (futures[future], exc)
                continue
            results.append(result)
            check_held(plan.job.out)  # a writer that lost OUT's lease stops here
            if bar is not None:
                bar.update(result.rows + sum(result.skipped.values()))
    if bar is not None:
        bar.close()
    if failure is not None:
        shard, exc = failure
        if isinstance(exc, EmbedpipeError):
            raise exc
        how = ("its worker process died (killed, or out of memory)" if _worker_died(exc)
               else f"failed after {TASK_RETRIES} retries")
        raise ShardFailed(
            f"shard {shard} {how}: {type(exc).__name__}: {exc}; "
            f"{len(results)}/{len(plan.requests)} shards finished, rerun to resume"
        ) from exc
    return results


def _worker_died(exc: Exception) -> bool:
    """Whether ``exc`` says a shard's worker process died: its task's retries died with it
    (the processes runner), or Dask gave up after the workers it tried died."""
    from concurrent.futures.process import BrokenProcessPool

    if isinstance(exc, BrokenProcessPool):
        return True
    killed = sys.modules.get("distributed")  # loaded where the Dask runner ran
    return killed is not None and isinstance(exc, killed.KilledWorker)


def _bar(plan: RunPlan, progress: bool) -> Any:
    if not (progress and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=plan.rows_todo, unit="rows", unit_scale=True, desc="embed", file=sys.stderr)


def _run(job: dict, verify: bool, progress: bool, keep_current: bool = True) -> dict:
    started = time.perf_counter()
    spec = resolve_job(job, keep_current)  # EMBEDPIPE_*: this installation's defaults
    say = phase_printer(progress)
    say(f"scanning corpus {spec.corpus}")

    def load_embedder():  # only when the sets' keys do not tell (see pipeline.run.job_keys)
        from pipeline.embedder import get_embedder

        say(f"loading model {spec.encoder.model or 'all-MiniLM-L6-v2 (packaged)'}")
        return get_embedder(spec.encoder, spec.poolers)

    with writer_lease(spec.out, flow_run.flow_name or "embed", wait=spec.lease_wait) as lease:
        plan = prepare(spec, load_embedder, verify=verify, lease=lease.token)
        planned = time.perf_counter()
        say(f"{len(plan.requests)} of {len(plan.shards)} shards to run, {plan.rows_todo:,} rows")
        logger = get_run_logger()
        logger.info(
            "%d shards planned, %d already done, %d to run",
            len(plan.shards),
            plan.done_shards,
            len(plan.requests),
        )
        results = _run_shards(plan, progress) if plan.requests else []
        lease.check()
        summary = finalize(plan, results, time.perf_counter() - planned, planned - started)
    logger.info(summary.line())
    _summary_artifact(summary)
    return summary.model_dump() | {"line": summary.line()}


def _summary_artifact(summary) -> None:
    """The run's numbers as a table artifact in the Prefect UI."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(table=[summary.table_row()], key="embed-summary",
                          description=summary.line())


@flow(name="embed")
def embed_flow(job: dict, progress: bool = False) -> dict:
    """Embed a corpus into every configured set; resumes where an earlier run stopped."""
    return _run(job, verify=False, progress=progress)


@flow(name="backfill")
def backfill_flow(job: dict, progress: bool = False) -> dict:
    """Add the job's sets to an OUT that already has sets, leaving the existing ones alone.

    A job naming no model takes the encoder of the sets already there."""
    return _run(inherit_encoder(job), verify=False, progress=progress, keep_current=False)


@flow(name="nightly")
def nightly_flow(job: dict, progress: bool = False) -> dict:
    """Incremental run: re-read every shard, embed only new or changed rows, record deletions."""
    return _run(job, verify=True, progress=progress)
