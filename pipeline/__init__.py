"""embedpipe library: encoders, poolers, planning, storage, sets, indexes. No Prefect here.

Importing it runs nothing: the CPU kernel settings (AMX cap, oneDNN caches) are made where a
model is first loaded (``pipeline.models.loader``).
"""

from pipeline.errors import EmbedpipeError

__all__ = ["EmbedpipeError"]
