"""The nightly deployment: the incremental run (and by default the index catch-up, in the same
flow run) on a cron schedule, served by this process."""

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
    flow, what = ((embed_and_index_flow, "incremental embedding and index catch-up") if index
                  else (nightly_flow, "incremental embedding"))
    try:
        return flow.to_deployment(
            name=name,
            cron=cron,
            concurrency_limit=ConcurrencyLimitConfig(
                limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
            parameters={"job": job_params(job)},
            description=f"{what} of {job.corpus} into {job.out}",
            tags=["embedpipe"],
        )
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"invalid schedule --cron {cron!r}: {first}") from None


def serve(deployment: RunnerDeployment) -> None:
    """Register the deployment and run its scheduled flow runs until interrupted."""
    from prefect import serve as prefect_serve

    prefect_serve(deployment)
