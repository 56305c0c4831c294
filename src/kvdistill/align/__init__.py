"""Alignment of a teacher's KV cache to the student's: time -> layer -> head -> dim.

A plain list of re-exports: add a module's public names below as one import line each.
"""

# ruff: noqa: F401, I001
from kvdistill.align.projectors import (
    PROJECTOR_KINDS,
    ElasticBottleneck,
    LinearProjector,
    build_projector,
)
from kvdistill.align.time import TIME_MODES, TimeIndex, resample, time_index
from kvdistill.align.layer_map import (
    LAYER_MAP_KINDS,
    apply_layer_map,
    build_layer_map,
    last_k_map,
    load_layer_map,
)
from kvdistill.align.layer_map import (
    mapped_rows,
    proportional_map,
    read_layer_map,
    save_layer_map,
    validate_layer_map,
)
from kvdistill.align.heads import HeadMixer, HeadwiseProjector, flatten_heads, time_major, uniform_head_mix
from kvdistill.align.aligner import AlignedKV, KVAligner, cache_dims
from kvdistill.align.cka import POOLINGS, StreamingCKA, cka_matrix, linear_cka, pool_features, topk_layer_map
from kvdistill.align.compress import COMPRESSIONS, compress_cache, rkv_scores, select_positions
