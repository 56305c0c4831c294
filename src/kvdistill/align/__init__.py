"""Alignment of a teacher's KV cache to the student's: time -> layer -> head -> dim.

A plain list of re-exports: add a module's public names below as one import line each.
"""

# ruff: noqa: F401
from kvdistill.align.projectors import (
    PROJECTOR_KINDS,
    ElasticBottleneck,
    LinearProjector,
    build_projector,
    param_count,
)
