"""Layer (L) alignment: a mapping matrix `M [L_s, L_t]` mixes teacher layers into student layers.

Row `l` of `M` holds the weights of the teacher layers that student layer `l` learns from; a row
sums to 1, or is all zero when that student layer is not distilled (`last_k` leaves the lower
layers unmapped). `apply_layer_map` is one einsum over the layer axis (the reference);
`sparse_layer_map` lists each row's teacher layers and weights, which `resample_kv` folds into
the time gather (what `KVAligner` runs).

Builders:
    proportional: student layer l -> teacher layer `floor(l * (L_t - 1) / (L_s - 1) + 0.5)`
        (round half up; a one-layer student maps to the teacher's last layer).
    last_k: the student's last k layers -> the teacher's last k layers, one to one, aligned at the
        top (student L_s-1 <-> teacher L_t-1, ...); the other student layers are unmapped.
    json: a map saved by `save_layer_map` (e.g. the CKA top-k map of `kvdistill layer-map`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvdistill.io import write_text_atomic

LAYER_MAP_FORMAT = "kvdistill.layer_map/v1"
LAYER_MAP_KINDS = ("proportional", "last_k", "json")
_ROW_TOL = 1e-4


def proportional_map(L_s: int, L_t: int) -> Tensor:
    """One-hot `[L_s, L_t]`: student layer l -> teacher layer `round(l * (L_t - 1) / (L_s - 1))`."""
    _check_counts(L_s, L_t)
    if L_s == 1:
        cols = [L_t - 1]
    else:
        cols = [math.floor(i * (L_t - 1) / (L_s - 1) + 0.5) for i in range(L_s)]
    M = torch.zeros(L_s, L_t)
    M[torch.arange(L_s), torch.tensor(cols)] = 1.0
    return M


def last_k_map(L_s: int, L_t: int, k: int) -> Tensor:
    """`[L_s, L_t]`: student layer `L_s - j` <- teacher layer `L_t - j` for j = 1..k; other rows zero."""
    _check_counts(L_s, L_t)
    if not 1 <= k <= min(L_s, L_t):
        raise ValueError(f"last_k needs 1 <= k <= min(L_s={L_s}, L_t={L_t}), got k={k}")
    M = torch.zeros(L_s, L_t)
    j = torch.arange(1, k + 1)
    M[L_s - j, L_t - j] = 1.0
    return M


def apply_layer_map(M: Tensor, x: Tensor) -> Tensor:
    """Mix the layer axis (axis 0) of `x [L_t, ...]` with `M [L_s, L_t]` -> `[L_s, ...]`."""
    if M.dim() != 2 or M.shape[1] != x.shape[0]:
        raise ValueError(
            f"layer map {tuple(M.shape)} expects {M.shape[-1]} teacher layers on axis 0, "
            f"got a tensor of shape {tuple(x.shape)}"
        )
    return torch.einsum("st,t...->s...", M.to(device=x.device, dtype=x.dtype), x)


def sparse_layer_map(M: Tensor) -> tuple[Tensor, Tensor]:
    """The non-zero entries of each row of `M [L_s, L_t]`: teacher layers `[L_s, k]` and weights `[L_s, k]`.

    `k` is the largest number of non-zero weights in a row (1 for proportional and last_k maps, the
    top-k of a CKA map); shorter rows are padded with weight 0. `resample_kv` reads these layers
    in the same gather as the time alignment, so `apply_layer_map` never runs on a full cache.
    """
    k = max(int((M != 0).sum(1).max()), 1)
    weights, layers = M.topk(k, dim=1)  # [L_s, k]; weights are non-negative
    return layers, weights


def mapped_rows(M: Tensor) -> Tensor:
    """Indices `[L_m]` of the student layers with a non-zero row (the distilled layers)."""
    return (M.abs().sum(1) > 0).nonzero().flatten()


def validate_layer_map(
    M: Tensor, student_layers: int | None = None, teacher_layers: int | None = None
) -> Tensor:
    """Check a mapping matrix: 2-D, the expected size, non-negative, rows summing to 1 (or 0)."""
    M = torch.as_tensor(M, dtype=torch.float32)
    if M.dim() != 2:
        raise ValueError(f"a layer map must be a [L_s, L_t] matrix, got shape {tuple(M.shape)}")
    expected = (student_layers, teacher_layers)
    if None not in expected and tuple(M.shape) != expected:
        raise ValueError(
            f"layer map is for {M.shape[0]} student x {M.shape[1]} teacher layers, but the models have "
            f"{student_layers} x {teacher_layers} (expected shape ({student_layers}, {teacher_layers}), "
            f"got {tuple(M.shape)}); re-run `kvdistill layer-map` for this model pair"
        )
    if not torch.isfinite(M).all() or (M < 0).any():
        raise ValueError("layer map weights must be finite and non-negative")
    sums = M.sum(1)
    bad = ((sums - 1).abs() > _ROW_TOL) & (sums.abs() > _ROW_TOL)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"layer map rows must sum to 1 (or 0 for an unmapped layer); rows {rows} sum to "
            f"{[round(float(sums[r]), 4) for r in rows]}"
        )
    if not (sums > _ROW_TOL).any():
        raise ValueError("layer map maps no student layer (all rows are zero)")
    return M


def _check_counts(L_s: int, L_t: int) -> None:
    if L_s < 1 or L_t < 1:
        raise ValueError(f"layer counts must be >= 1, got L_s={L_s}, L_t={L_t}")


def save_layer_map(
    path: str | Path,
    matrix: Tensor,
    *,
    similarity: Tensor | None = None,
    provenance: dict[str, Any] | None = None,
) -> None:
    """Write `matrix [L_s, L_t]` (and the similarity it came from) as layer-map JSON.

    Format `kvdistill.layer_map/v1`: `student_layers`, `teacher_layers`, `matrix`, `pairs`
    (per student layer its teacher layers and weights, largest first), `similarity` (or null) and
    `provenance` (free-form: models, config hashes `student_config_hash` / `teacher_config_hash`,
    samples, k, date).
    """
    M = validate_layer_map(matrix.detach().cpu())
    L_s, L_t = M.shape
    if similarity is not None and tuple(similarity.shape) != (L_s, L_t):
        raise ValueError(f"similarity must be [L_s, L_t] = [{L_s}, {L_t}], got {tuple(similarity.shape)}")
    pairs = []
    for i in range(L_s):
        row = M[i]
        order = [t for t in row.argsort(descending=True).tolist() if row[t] > 0]
        pairs.append({"student": i, "teacher": order, "weight": [float(row[t]) for t in order]})
    doc = {
        "format": LAYER_MAP_FORMAT,
        "student_layers": L_s,
        "teacher_layers": L_t,
        "matrix": M.tolist(),
        "pairs": pairs,
        "similarity": None if similarity is None else similarity.detach().cpu().float().tolist(),
        "provenance": provenance or {},
    }
    write_text_atomic(path, json.dumps(doc, indent=1))


def read_layer_map(path: str | Path) -> dict[str, Any]:
    """The raw layer-map document (format checked), with `matrix` rebuilt from `pairs` if absent."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"layer map {path} not found; create it with `kvdistill layer-map`")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"layer map {path} is not valid JSON ({e}); write it again with `kvdistill layer-map`") from e
    if not isinstance(doc, dict) or doc.get("format") != LAYER_MAP_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path} is not a layer map: format {found!r}, expected {LAYER_MAP_FORMAT!r}; pass a file "
                         "written by `kvdistill layer-map`")
    if doc.get("matrix") is None:
        L_s, L_t = int(doc["student_layers"]), int(doc["teacher_layers"])
        M = torch.zeros(L_s, L_t)
        for p in doc.get("pairs", []):
            M[p["student"], p["teacher"]] = torch.tensor(p["weight"], dtype=torch.float32)
        doc["matrix"] = M.tolist()
    return doc


def load_layer_map(
    path: str | Path,
    student_layers: int,
    teacher_layers: int,
    *,
    student_hash: str | None = None,
    teacher_hash: str | None = None,
    check_hashes: bool = True,
) -> Tensor:
    """Read a layer-map JSON and check that it belongs to this model pair.

    Args:
        path: the JSON written by `save_layer_map`.
        student_layers, teacher_layers: the decoder-layer counts of the models in use.
        student_hash, teacher_hash: config hashes of the models in use; compared with the
            `provenance` hashes when both sides have one and `check_hashes` is True.

    Returns:
        `M [L_s, L_t]` float32.

    Raises:
        ValueError: other layer counts (re-run `kvdistill layer-map`), other config hashes
            (override with `--ignore_layer_map_hash`), or a malformed matrix.
    """
    doc = read_layer_map(path)
    M = torch.tensor(doc["matrix"], dtype=torch.float32)
    declared = (doc.get("student_layers", M.shape[0]), doc.get("teacher_layers", M.shape[-1]))
    if M.dim() != 2 or tuple(M.shape) != tuple(declared):
        raise ValueError(
            f"layer map {path}: matrix shape {tuple(M.shape)} disagrees with its header {declared}"
        )
    if tuple(M.shape) != (student_layers, teacher_layers):
        raise ValueError(
            f"layer map {path} is for {M.shape[0]} student x {M.shape[1]} teacher layers, but the models have "
            f"{student_layers} x {teacher_layers}; re-run `kvdistill layer-map` for this model pair"
        )
    prov = doc.get("provenance") or {}
    if check_hashes:
        for side, given in (("student", student_hash), ("teacher", teacher_hash)):
            saved = prov.get(f"{side}_config_hash")
            if given is not None and saved is not None and str(given) != str(saved):
                raise ValueError(
                    f"layer map {path} was computed for another {side} model (config hash {saved}, "
                    f"this {side} has {given}); re-run `kvdistill layer-map`, or pass "
                    "--ignore_layer_map_hash to use it anyway"
                )
    return validate_layer_map(M, student_layers, teacher_layers)


def build_layer_map(
    kind: str,
    L_s: int,
    L_t: int,
    *,
    k: int = 1,
    path: str | Path | None = None,
    student_hash: str | None = None,
    teacher_hash: str | None = None,
    check_hashes: bool = True,
) -> Tensor:
    """A mapping matrix `[L_s, L_t]` by name: "proportional", "last_k" (uses `k`) or "json" (uses `path`)."""
    if kind == "proportional":
        return proportional_map(L_s, L_t)
    if kind == "last_k":
        return last_k_map(L_s, L_t, k)
    if kind == "json":
        if path is None:
            raise ValueError("layer map kind 'json' needs a path")
        return load_layer_map(
            path, L_s, L_t, student_hash=student_hash, teacher_hash=teacher_hash, check_hashes=check_hashes
        )
    raise ValueError(f"unknown layer map kind {kind!r}; expected one of {LAYER_MAP_KINDS}")
