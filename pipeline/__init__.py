"""embedpipe library: encoders, poolers, planning, storage, sets, indexes. No Prefect here.

Importing it runs nothing: the CPU's bf16 safety check runs where a model is first loaded
(``pipeline.models.loader``).
"""

from pipeline.errors import EmbedpipeError

__all__ = ["EmbedpipeError"]
