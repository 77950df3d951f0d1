"""Poolers: named strategies that turn token states into one vector (see base.py)."""

from pipeline.poolers.base import REGISTRY, Pooler, build_pooler, register

__all__ = ["REGISTRY", "Pooler", "build_pooler", "register"]
