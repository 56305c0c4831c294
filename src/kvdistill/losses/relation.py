"""MiniLMv2-style relation loss: match the self-relations of student and teacher KV over time.

No projector is needed: each side is compared with itself first, so the feature sizes may differ.
For each side, the features `X [L, B, T, F]` (a 5-D `[L, B, T, H, D]` input is flattened to
`F = H * D`) are split into `R` relation heads `X_r [L, B, T, d]`, `d = F / R`, and

    A_r = softmax_keys(X_r X_rᵀ / sqrt(d) / temperature)          # [L, B, R, T, T]

where invalid key columns (mask == 0 or segment -1) are left out of the softmax. The loss of a
query token i is

    loss_i = mean_{layers, r} KL(A_r^teacher[i] ‖ A_r^student[i])
           = mean_{layers, r} sum_{valid j} A^t_ij (log A^t_ij - log A^s_ij)

in fp32. Rows (queries) are weighted by `mask * segment_weight[segment]` (kv.token_weights) and, when
given, a row selection `rows [B, T]` (`relation_rows`, `select_rows`); segment weights and the
selection apply to rows only: every valid token is a key. `reduction="mean"` divides the weighted
sum by the weighted token count, `"sum"` returns the weighted sum. The teacher is a constant target
(detached here). A batch without a valid token returns 0 (with a graph, no NaN).

These are self-relations of keys (or values), not attention: the cache holds no queries. The
attention-map loss (`losses/attention.py`) matches softmax(Q Kᵀ) and shares this module's chunked
row KL (`_RowKL`, `RowKLLoss`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from kvdistill.cache import PAD, SEGMENT_NAMES
from kvdistill.losses.kv import REDUCTIONS, segment_losses, token_weights

logger = logging.getLogger(__name__)

# bias of masked keys: finite, so 0 * _FILL is 0 (no NaN) and a row without keys is uniform, and still
# finite after adding real logits; exp(_FILL - max) is exactly 0
_FILL = torch.finfo(torch.float32).min / 2


def _row_kl_terms(z_t: Tensor, z_s: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row `KL(P ‖ Q)` `[N, C]` and `Q - P` `[N, C, T]` from teacher and student logits `[N, C, T]`."""
    p = z_t.softmax(-1)
    kl = (p * (torch.log_softmax(z_t, -1) - torch.log_softmax(z_s, -1))).sum(-1)
    return kl, torch.softmax(z_s, -1) - p


@functools.cache
def fused_row_kl_terms(device_type: str) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None:
    """`_row_kl_terms` compiled (torch.compile, dynamic shapes) for one device type, or None where it
    cannot be built (no C++ compiler, no Triton): the caller then runs the eager ops.

    Eager, the four row softmaxes are separate passes over `[N, C, T]` buffers, each recomputing its
    exponentials; compiled, they fuse into a pass or two per row: half the time on CPU at the evidence
    demo's shapes (N 1024, C = T = 66: 17 -> 8 ms on one thread), a third of a relation-KV step.
    """
    fn = torch.compile(_row_kl_terms, dynamic=True)
    try:  # compile now, on a tiny input, so a missing toolchain shows here and not mid-training
        z = torch.zeros(2, 3, 3, device=device_type)
        fn(z, z)
    except Exception as e:  # any backend failure means: use the eager ops
        logger.warning("relation loss: torch.compile is unavailable on %s (%s: %s); using the eager ops "
                       "(same result, slower; relation_compile: false silences this)",
                       device_type, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    return fn


def row_logits(rows: Tensor, keys: Tensor, bias: Tensor, out: Tensor | None = None) -> Tensor:
    """`rows keysᵀ + bias` `[N, C, T]` from rows `[N, C, d]`, keys `[N, T, d]` and a key bias `[N, T, 1]`
    (0 or _FILL per key), the bias added as one more feature: cheaper than baddbmm."""
    rows = torch.cat([rows, torch.ones_like(rows[..., :1])], -1)  # [N, C, d + 1]
    return torch.bmm(rows, torch.cat([keys, bias], -1).transpose(1, 2), out=out)


def key_bias(keys: Tensor, lead: tuple[int, ...]) -> Tensor:
    """`[N, T, 1]` key bias (0 valid, _FILL masked) of valid keys `[B, T]` for rows flattened from
    `[*lead, ...]` with the batch at `lead[1]` (`N = prod(lead)`, e.g. `(L, B, R)`)."""
    bias = torch.zeros(keys.shape, device=keys.device).masked_fill(~keys, _FILL)  # [B, T]
    shape = [1] * len(lead)
    shape[1] = keys.shape[0]
    return bias.view(*shape, keys.shape[1], 1).expand(*lead, keys.shape[1], 1).flatten(0, len(lead) - 1)


class _RowKL(torch.autograd.Function):
    """Per-row `KL(P ‖ Q) = sum_j P_j (log P_j - log Q_j)` over the keys j of a constant teacher
    `P = softmax(z_t)` and the student `Q = softmax(s_rows s_keysᵀ + bias [+ row_bias])`.

    `z_t [N, C, T]` are the teacher's logits (any per-row shift; its log-probabilities will do),
    computed by the caller: the relation loss's `t_rows t_keysᵀ + bias`, the attention loss's log of
    a mixture of maps. It is consumed: its buffer is reused for the student's logits.
    `row_bias [C, T]` (or None) is added to every row block, e.g. the causal mask of attention.
    The gradient w.r.t. the student logits is `(Q - P) * grad` (0 on masked keys, where both are 0).
    Only `Q - P` is kept for backward (not autograd's chain of `[N, C, T]` temporaries). `fused` is
    `fused_row_kl_terms(...)` or None.
    """

    @staticmethod
    def forward(ctx: Any, s_rows: Tensor, s_keys: Tensor, bias: Tensor, z_t: Tensor, row_bias: Tensor | None,
                fused: Callable | None) -> Tensor:
        # rows [N, C, d], keys [N, T, d], bias [N, T, 1]: 0 or _FILL per key, z_t [N, C, T]
        if fused is not None:
            z_s = row_logits(s_rows, s_keys, bias)  # [N, C, T]
            kl, dq = fused(z_t, z_s if row_bias is None else z_s.add_(row_bias))  # [N, C], [N, C, T]
        else:
            p = z_t.softmax(-1)  # [N, C, T]; exactly 0 on masked keys
            p_log_p = torch.einsum("nct,nct->nc", p, torch.log_softmax(z_t, -1, out=z_t))  # [N, C]
            z_s = row_logits(s_rows, s_keys, bias, out=z_t)  # [N, C, T] student, in the teacher's buffer
            if row_bias is not None:
                z_s.add_(row_bias)
            log_q = torch.log_softmax(z_s, -1, out=z_s)  # in place
            kl = p_log_p - torch.einsum("nct,nct->nc", p, log_q)  # [N, C]
            dq = torch.softmax(log_q, -1, out=z_s).sub_(p)  # Q - P, in place
        ctx.save_for_backward(s_rows, s_keys, dq)
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        s_rows, s_keys, dq = ctx.saved_tensors  # dq = Q - P [N, C, T]; the logits' grad is dq * g
        g = grad.unsqueeze(-1)  # [N, C, 1]
        # g scales rows, so it goes on the small operands; bmm is faster with dq as the right operand
        d_rows = (s_keys.transpose(1, 2) @ dq.transpose(1, 2)).transpose(1, 2) * g  # [N, C, d] dq g s_keys
        d_keys = ((s_rows * g).transpose(1, 2) @ dq).transpose(1, 2)  # [N, T, d] (dq g)ᵀ s_rows
        return d_rows, d_keys, None, None, None, None


ROW_SEGMENTS = {name: sid for sid, name in SEGMENT_NAMES.items()}


def parse_rows(spec: str, option: str = "relation_rows") -> tuple[int, ...] | str | None:
    """A row selection (`relation_rows`, `logit_kd_rows`) -> None (all rows), segment ids (e.g. `(2,)` for
    "answer"), or a field name.

    `all` | `answer` | segment names, comma-separated (`prompt,reasoning,answer`) | `field:<name>`.
    Raises ValueError naming `option` and the accepted forms.
    """
    spec = str(spec).strip()
    if spec == "all":
        return None
    if spec.startswith("field:"):
        if not spec[6:].strip():
            raise ValueError(f"{option} field: needs a name, e.g. field:result (a token_fields name)")
        return spec[6:].strip()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in ROW_SEGMENTS]
    if not names or bad:
        raise ValueError(f"{option} {spec!r}: expected all, answer, segment names from "
                         f"{tuple(ROW_SEGMENTS)} separated by commas, or field:<name>")
    return tuple(ROW_SEGMENTS[n] for n in names)


def select_rows(spec: str, segment_ids: Tensor, token_fields: dict[str, Tensor] | None = None,
                option: str = "relation_rows") -> Tensor | None:
    """`[B, T]` bool: the rows a selection `spec` (option `option`, named in errors) reads, or None for all rows.

    Segments by their ids; `field:<name>` where the task's per-token field `token_fields[name]`
    `[B, T]` is > 0 (a 0/1 mask; tokens no span covers hold IGNORE = -100, never selected).
    """
    rows = parse_rows(spec, option)
    if rows is None:
        return None
    if isinstance(rows, str):
        if not token_fields or rows not in token_fields:
            raise ValueError(f"{option} field:{rows}: the batch has no token field {rows!r} (it has "
                             f"{sorted(token_fields or {})}); write it per record under token_fields")
        return token_fields[rows].to(segment_ids.device) > 0
    return torch.isin(segment_ids, torch.tensor(rows, device=segment_ids.device))


class RowKLLoss(nn.Module):
    """What the relation and attention losses share: chunking over query rows, the row weights and
    selection, the reduction and the metrics. A subclass computes the per-row KL `[L, B, C]`.

    Args:
        reduction: "mean" (divide by the weighted selected-row count) or "sum".
        segment_weights: `{segment_id: weight}` for query rows; unlisted segments weigh 1, padding 0.
        chunk_size: query rows per chunk; None computes all rows at once.
        compile: run the row softmaxes compiled (`fused_row_kl_terms`; the eager ops where
            torch.compile cannot build). Same result to float rounding.
        eps: floor for counts.
    """

    name = "row"

    def __init__(self, *, reduction: str = "mean", segment_weights: dict[int, float] | None = None,
                 chunk_size: int | None = None, compile: bool = True, eps: float = 1e-8):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None (no chunking), got {chunk_size}")
        if segment_weights and any(w < 0 for w in segment_weights.values()):
            raise ValueError(f"segment weights must be >= 0, got {segment_weights}")
        self.reduction = reduction
        self.segment_weights = {int(k): float(v) for k, v in (segment_weights or {}).items()}
        self.chunk_size = chunk_size
        self.compile = bool(compile)
        self.eps = eps

    def fused(self, device: torch.device) -> Callable | None:
        return fused_row_kl_terms(device.type) if self.compile else None

    def chunked(self, fn: Callable[[slice], Tensor], T: int, grad: bool) -> Tensor:
        """`fn(rows)` -> `[L, B, C]` per-row KL of the query rows `rows`, over all T rows: `[L, B, T]`.

        With `chunk_size=C`, C rows at a time (each softmax still sees all T keys), under activation
        checkpointing when a gradient is needed: only the inputs are kept, each chunk's `[N, C, T]`
        buffers are recomputed in the backward one chunk at a time.
        """
        if self.chunk_size is None or self.chunk_size >= T:
            return fn(slice(0, T))
        if grad and torch.is_grad_enabled():
            fn = partial(checkpoint, fn, use_reentrant=False)
        return torch.cat([fn(slice(i, i + self.chunk_size)) for i in range(0, T, self.chunk_size)], -1)

    def reduce(self, kl: Tensor, mask: Tensor, segment_ids: Tensor | None, rows: Tensor | None
               ) -> tuple[Tensor, dict[str, Any]]:
        """Loss and metrics of the per-row KL `kl [L, B, T]`: rows weighted by mask x segment weight,
        the loss over the selected `rows [B, T]` (None: all)."""
        w_all = token_weights(mask, segment_ids, self.segment_weights)  # [B, T] row weights
        sel = torch.ones_like(w_all, dtype=torch.bool) if rows is None else rows.to(w_all.device).bool()
        w = w_all * sel
        per_token = torch.where(w > 0, kl.mean(0), 0.0)  # [B, T]; unread rows contribute 0
        total = (per_token * w).sum()
        loss = total if self.reduction == "sum" else total / w.sum().clamp_min(self.eps)
        return loss, self._metrics(kl.detach(), w_all, sel, mask, segment_ids)

    @torch.no_grad()
    def _metrics(self, kl: Tensor, w_all: Tensor, sel: Tensor, mask: Tensor, segment_ids: Tensor | None
                 ) -> dict[str, Any]:
        w = w_all * sel
        count = w.sum()
        per_layer = (torch.where(w > 0, kl, 0.0) * w).sum((1, 2)) / count.clamp_min(self.eps)  # [L]
        n = self.name
        metrics: dict[str, Any] = {f"{n}_kl": per_layer.mean(), f"{n}_kl_per_layer": per_layer, "num_tokens": count}
        # the per-row KL on the rows the loss reads and on the others, however the loss is configured
        per_row = kl.mean(0)  # [B, T]
        for part, weight in (("selected", w), ("other", w_all * ~sel)):
            if weight.sum() > 0:
                metrics[f"{n}_kl_{part}"] = (torch.where(weight > 0, per_row, 0.0) * weight).sum() / weight.sum()
        if segment_ids is not None:
            metrics.update(segment_losses(per_row, mask.bool(), segment_ids))
        return metrics


class RelationKVLoss(RowKLLoss):
    """KL between the teacher's and the student's per-head self-relation matrices over time.

    Call as `loss, metrics = fn(student, teacher, mask, segment_ids, rows=None)`.

    Memory: unchunked, the peak is about `4 bytes * c * L * B * R * T^2`, c ~ 2 fp32 `[L, B, R, T, T]`
    buffers (teacher probs, shared logits; one of them, `Q - P`, is kept for backward), i.e. O(L·B·R·T²). With
    `chunk_size=C`, query rows are processed C at a time (each softmax still sees all T keys) under
    activation checkpointing, so the peak is O(L·B·R·C·T) plus the inputs; the result is the same.

    Args:
        relation_heads: R, the number of equal feature chunks per side (F_s and F_t divisible by R).
        temperature: softmax temperature (> 0) applied after the `1 / sqrt(F / R)` scale.
        reduction, segment_weights, chunk_size, compile, eps: see `RowKLLoss`.
    """

    name = "relation"

    def __init__(self, *, relation_heads: int = 8, temperature: float = 1.0, **kwargs: Any):
        super().__init__(**kwargs)
        if relation_heads < 1:
            raise ValueError(f"relation_heads must be >= 1, got {relation_heads}; use e.g. 1 or 8")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}; use e.g. 1.0")
        self.relation_heads = int(relation_heads)
        self.temperature = float(temperature)

    def split_heads(self, x: Tensor, side: str) -> Tensor:
        """`[L, B, T, F]` or `[L, B, T, H, D]` -> fp32 `[L, B, R, T, F / R]`."""
        if x.dim() not in (4, 5):
            raise ValueError(
                f"relation loss expects {side} [L, B, T, F] or [L, B, T, H, D], got {tuple(x.shape)}"
            )
        x = x.float().flatten(3)  # [L, B, T, F]
        feat, r = x.shape[-1], self.relation_heads
        if feat % r:
            raise ValueError(
                f"relation loss: {side} feature size {feat} is not divisible by relation_heads={r}; "
                f"choose relation_heads dividing {feat} (e.g. {math.gcd(feat, r)})"
            )
        return x.unflatten(3, (r, feat // r)).transpose(2, 3)  # [L, B, R, T, d]

    def row_kl(self, s: Tensor, t: Tensor, s_rows: Tensor, t_rows: Tensor, keys: Tensor) -> Tensor:
        """KL of the teacher's relation rows from the student's, mean over relation heads.

        Args:
            s, t: `[L, B, R, T, d_s]`, `[L, B, R, T, d_t]` all tokens (the keys).
            s_rows, t_rows: `[L, B, R, C, d_s]`, `[L, B, R, C, d_t]` the query rows.
            keys: `[B, T]` bool, valid key columns.

        Returns:
            `[L, B, C]` per-row KL, averaged over relation heads.
        """
        L, B, R = s.shape[:3]
        bias = key_bias(keys, (L, B, R))  # [N, T, 1], N = L*B*R

        def scaled(rows: Tensor, d: int) -> Tensor:  # [N, C, d]; the scale costs less here than on [C, T]
            return (rows * (1.0 / (math.sqrt(d) * self.temperature))).flatten(0, 2)

        z_t = row_logits(scaled(t_rows, t.shape[-1]), t.flatten(0, 2), bias)  # [N, C, T] teacher
        kl = _RowKL.apply(scaled(s_rows, s.shape[-1]), s.flatten(0, 2), bias, z_t, None, self.fused(s.device))
        return kl.unflatten(0, (L, B, R)).mean(2)  # [L, B, C]

    def forward(
        self, student: Tensor, teacher: Tensor, mask: Tensor, segment_ids: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        """Masked, weighted relation KL.

        Args:
            student: `[L, B, T, F_s]` or `[L, B, T, H_s, D_s]` aligned student KV (with graph).
            teacher: `[L, B, T, F_t]` or `[L, B, T, H_t, D_t]` aligned teacher KV (detached here).
            mask: `[B, T]` bool/float validity.
            segment_ids: `[B, T]` optional segment ids (0 prompt, 1 reasoning, 2 answer, -1 pad).
            rows: `[B, T]` bool, the query rows the loss reads (`select_rows`); None: every valid row.

        Returns:
            `(loss, metrics)`: a scalar, and detached metrics `relation_kl` (weighted mean per-token
            KL over the rows read), `relation_kl_per_layer [L]`, `relation_kl_selected` /
            `relation_kl_other` (the rows read / the other valid rows), `loss_<segment>` for each
            segment present, `num_tokens`.
        """
        if student.shape[:3] != teacher.shape[:3]:
            raise ValueError(
                f"relation loss: student {tuple(student.shape)} and teacher {tuple(teacher.shape)} "
                "must share [L, B, T] (align the teacher first)"
            )
        B, T = student.shape[1:3]
        _check_bt(B, T, mask=mask, segment_ids=segment_ids, rows=rows)
        s = self.split_heads(student, "student")  # [L, B, R, T, d_s]
        t = self.split_heads(teacher.detach(), "teacher").to(s.device)  # [L, B, R, T, d_t]
        mask = mask.to(s.device)
        segment_ids = None if segment_ids is None else segment_ids.to(s.device)
        keys = valid_keys(mask, segment_ids)  # [B, T]
        kl = self.chunked(lambda r: self.row_kl(s, t, s[:, :, :, r], t[:, :, :, r], keys), T, s.requires_grad)
        return self.reduce(kl, mask, segment_ids, rows)  # kl [L, B, T]


def valid_keys(mask: Tensor, segment_ids: Tensor | None) -> Tensor:
    """`[B, T]` bool: tokens every row may read (mask > 0, not padding)."""
    return mask > 0 if segment_ids is None else (mask > 0) & (segment_ids != PAD)


def _check_bt(B: int, T: int, **tensors: Tensor | None) -> None:
    for name, x in tensors.items():
        if x is not None and tuple(x.shape) != (B, T):
            raise ValueError(f"{name} must be [B, T] = [{B}, {T}], got {tuple(x.shape)}")
