"""Training pooling heads for the ``learned`` pooler over a frozen encoder."""

from pipeline.training.config import TrainConfig
from pipeline.training.trainer import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
