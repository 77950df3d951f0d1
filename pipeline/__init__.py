"""embedpipe library: encoders, poolers, planning, storage, sets and indexes. Never imports Prefect."""

from pipeline.errors import EmbedpipeError

__all__ = ["EmbedpipeError"]
