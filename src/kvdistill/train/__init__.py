"""Training recipe: `KVDistillConfig`, `KVDistillModel`, `KVDistillTrainer`, `kvdistill train`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdistill.train.config import ConfigError, KVDistillConfig, TeacherConfig, parse_config

if TYPE_CHECKING:
    from kvdistill.train.trainer import KVDistillTrainer

__all__ = ["ConfigError", "KVDistillConfig", "KVDistillTrainer", "TeacherConfig", "parse_config"]


def __getattr__(name: str) -> Any:  # the trainer (and all it imports) only when asked for
    if name == "KVDistillTrainer":
        from kvdistill.train.trainer import KVDistillTrainer

        return KVDistillTrainer
    raise AttributeError(f"module 'kvdistill.train' has no attribute {name!r}")
