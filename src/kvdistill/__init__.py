"""kvdistill: multi-teacher KV-cache distillation with 4D alignment for causal LMs.

    from kvdistill import KVDistillConfig, KVDistillTrainer, TeacherConfig

The names below load on first use (PEP 562): `import kvdistill` and `kvdistill --help` import neither
torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it (imported by name, so the root depends on no layer: modules
# low in the import contracts still read `__version__` from here)
_LAZY = {
    "KVDistillConfig": "kvdistill.train.config",
    "TeacherConfig": "kvdistill.train.config",
    "KVDistillTrainer": "kvdistill.train.trainer",
}
__all__ = ["KVDistillConfig", "KVDistillTrainer", "TeacherConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kvdistill' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
