"""The nightly deployment: the incremental run (and by default the index catch-up, in the same
flow run) on a cron schedule, served by this process.

What would fail every scheduled run is refused before anything is served: a bad --cron or
--name, a model, pooler, device or dtype that the run's model load would refuse
(``pipeline.assembly.check_runs``), and a Prefect server that does not answer
(``flows.runtime.check_server``)."""

from __future__ import annotations

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment

from flows.embed import nightly_flow
from flows.live import embed_and_index_flow
from pipeline.assembly import job_params
from pipeline.config import EmbedJob
from pipeline.errors import ConfigError


def nightly_deployment(job: EmbedJob, cron: str, name: str = "nightly",
                       index: bool = True) -> RunnerDeployment:
    """A deployment running the incremental flow over ``job`` on ``cron`` (UTC); with
    ``index``, each run then catches up the sets' indexes (nightly to live). One run at a
    time, as ``infra/prefect.yaml``'s nightly: a run due while one still runs waits in the
    queue (it would otherwise fail at once on OUT's writer lease, and that night be lost)."""
    _check_cron(cron)
    _check_name(name)
    flow, what = ((embed_and_index_flow, "incremental embedding and index catch-up") if index
                  else (nightly_flow, "incremental embedding"))
    return flow.to_deployment(
        name=name,
        cron=cron,
        concurrency_limit=ConcurrencyLimitConfig(
            limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        parameters={"job": job_params(job)},
        description=f"{what} of {job.corpus} into {job.out}",
        tags=["embedpipe"],
    )


def _check_cron(cron: str) -> None:
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)
    except ValueError:
        raise ConfigError(f"invalid schedule --cron {cron!r}: not a valid cron expression "
                          '(minute hour day-of-month month day-of-week, e.g. "0 2 * * *" '
                          "for 02:00 UTC)") from None


def _check_name(name: str) -> None:
    """Prefect's rule for names: not empty, none of its banned characters."""
    from prefect.types import BANNED_CHARACTERS

    if not name or any(c in name for c in BANNED_CHARACTERS):
        raise ConfigError(f"invalid deployment --name {name!r}: give a non-empty name "
                          f"without any of {' '.join(BANNED_CHARACTERS)}")


def serve(deployment: RunnerDeployment) -> None:
    """Register the deployment and run its scheduled flow runs until interrupted."""
    from prefect import serve as prefect_serve

    prefect_serve(deployment)
