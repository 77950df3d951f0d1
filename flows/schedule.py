"""The nightly deployment: ``nightly_flow`` with a cron schedule, served by this process."""

from __future__ import annotations

from prefect.deployments.runner import RunnerDeployment

from flows.embed import nightly_flow
from pipeline.config import EmbedJob
from pipeline.errors import ConfigError


def nightly_deployment(job: EmbedJob, cron: str, name: str = "nightly") -> RunnerDeployment:
    """A deployment running the incremental flow over ``job`` on ``cron`` (UTC)."""
    try:
        return nightly_flow.to_deployment(
            name=name,
            cron=cron,
            parameters={"job": job.model_dump(mode="json")},
            description=f"incremental embedding of {job.corpus} into {job.out}",
            tags=["embedpipe"],
        )
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"invalid schedule --cron {cron!r}: {first}") from None


def serve(deployment: RunnerDeployment) -> None:
    """Register the deployment and run its scheduled flow runs until interrupted."""
    from prefect import serve as prefect_serve

    prefect_serve(deployment)
