"""embedpipe library: encoders, poolers, planning, storage, sets, indexes. No Prefect here."""

from pipeline.errors import EmbedpipeError
from pipeline.hardware import make_cpu_bf16_safe

# Before torch runs its first CPU kernel: never let oneDNN take an AMX path that traps here.
make_cpu_bf16_safe()

__all__ = ["EmbedpipeError"]
