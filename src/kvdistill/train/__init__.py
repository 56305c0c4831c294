"""Training recipe: `KVDistillConfig`, `KVDistillModel`, `KVDistillTrainer`, `kvdistill train`."""

from kvdistill.train.config import ConfigError, KVDistillConfig, TeacherConfig, parse_config

__all__ = ["ConfigError", "KVDistillConfig", "TeacherConfig", "parse_config"]
