"""MiniLMv2-style relation loss: match the self-relations of student and teacher KV over time.

No projector is needed: each side is compared with itself first, so the feature sizes may differ.
For each side, the features `X [L, B, T, F]` (a 5-D `[L, B, T, H, D]` input is flattened to
`F = H * D`) are split into `R` relation heads `X_r [L, B, T, d]`, `d = F / R`, and

    A_r = softmax_keys(X_r X_rᵀ / sqrt(d) / temperature)          # [L, B, R, T, T]

where invalid key columns (mask == 0 or segment -1) are left out of the softmax. The loss of a
query token i is

    loss_i = mean_{layers, r} KL(A_r^teacher[i] ‖ A_r^student[i])
           = mean_{layers, r} sum_{valid j} A^t_ij (log A^t_ij - log A^s_ij)

in fp32. Rows (queries) are weighted by `mask * segment_weight[segment]` (kv.token_weights);
segment weights apply to rows only: every valid token is a key. `reduction="mean"` divides the
weighted sum by the weighted token count, `"sum"` returns the weighted sum. The teacher is a
constant target (detached here). A batch without a valid token returns 0 (with a graph, no NaN).
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

from kvdistill.cache import PAD
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


class _RowKL(torch.autograd.Function):
    """Per-row `KL(P ‖ Q) = sum_j P_j (log P_j - log Q_j)` over the keys j of the constant teacher
    `P = softmax(t_rows t_keysᵀ + bias)` and the student `Q = softmax(s_rows s_keysᵀ + bias)`.

    The gradient w.r.t. the student logits is `(Q - P) * grad` (0 on masked keys, where both are 0).
    Only `Q - P` is kept for backward (not autograd's chain of `[N, C, T]` temporaries). `fused` is
    `fused_row_kl_terms(...)` or None; the eager ops share one logits buffer between the sides.
    """

    @staticmethod
    def forward(ctx: Any, s_rows: Tensor, s_keys: Tensor, t_rows: Tensor, t_keys: Tensor, bias: Tensor,
                fused: Callable | None) -> Tensor:
        # rows [N, C, d], keys [N, T, d] (d per side), bias [N, T, 1]: 0 or _FILL per key

        def logits(rows: Tensor, keys: Tensor, out: Tensor | None = None) -> Tensor:  # [N, C, T]
            rows = torch.cat([rows, torch.ones_like(rows[..., :1])], -1)  # the bias as one more feature:
            return torch.bmm(rows, torch.cat([keys, bias], -1).transpose(1, 2), out=out)  # cheaper than baddbmm

        z = logits(t_rows, t_keys)  # [N, C, T] teacher
        if fused is not None:
            kl, dq = fused(z, logits(s_rows, s_keys))  # [N, C], [N, C, T]
        else:
            p = z.softmax(-1)  # [N, C, T]; exactly 0 on masked keys
            p_log_p = torch.einsum("nct,nct->nc", p, torch.log_softmax(z, -1, out=z))  # [N, C]
            log_q = torch.log_softmax(logits(s_rows, s_keys, out=z), -1, out=z)  # [N, C, T] student, in place
            kl = p_log_p - torch.einsum("nct,nct->nc", p, log_q)  # [N, C]
            dq = torch.softmax(log_q, -1, out=z).sub_(p)  # Q - P, in place
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


class RelationKVLoss(nn.Module):
    """KL between the teacher's and the student's per-head self-relation matrices over time.

    Call as `loss, metrics = fn(student, teacher, mask, segment_ids)`.

    Memory: unchunked, the peak is about `4 bytes * c * L * B * R * T^2`, c ~ 2 fp32 `[L, B, R, T, T]`
    buffers (teacher probs, shared logits; one of them, `Q - P`, is kept for backward), i.e. O(L·B·R·T²). With
    `chunk_size=C`, query rows are processed C at a time (each softmax still sees all T keys) under
    activation checkpointing, so the peak is O(L·B·R·C·T) plus the inputs; the result is the same.

    Args:
        relation_heads: R, the number of equal feature chunks per side (F_s and F_t divisible by R).
        temperature: softmax temperature (> 0) applied after the `1 / sqrt(F / R)` scale.
        reduction: "mean" (divide by the weighted valid-token count) or "sum".
        segment_weights: `{segment_id: weight}` for query rows; unlisted segments weigh 1, padding 0.
        chunk_size: query rows per chunk; None computes all rows at once.
        compile: run the row softmaxes compiled (`fused_row_kl_terms`; the eager ops where
            torch.compile cannot build). Same result to float rounding.
        eps: floor for counts.
    """

    name = "relation"

    def __init__(
        self,
        *,
        relation_heads: int = 8,
        temperature: float = 1.0,
        reduction: str = "mean",
        segment_weights: dict[int, float] | None = None,
        chunk_size: int | None = None,
        compile: bool = True,
        eps: float = 1e-8,
    ):
        super().__init__()
        if relation_heads < 1:
            raise ValueError(f"relation_heads must be >= 1, got {relation_heads}; use e.g. 1 or 8")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}; use e.g. 1.0")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None (no chunking), got {chunk_size}")
        if segment_weights and any(w < 0 for w in segment_weights.values()):
            raise ValueError(f"segment weights must be >= 0, got {segment_weights}")
        self.relation_heads = int(relation_heads)
        self.temperature = float(temperature)
        self.reduction = reduction
        self.segment_weights = {int(k): float(v) for k, v in (segment_weights or {}).items()}
        self.chunk_size = chunk_size
        self.compile = bool(compile)
        self.eps = eps

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
        L, B, R, T = s.shape[:4]
        bias = torch.zeros(keys.shape, device=s.device).masked_fill(~keys, _FILL)  # [B, T]
        bias = bias[None, :, None, :, None].expand(L, B, R, T, 1).flatten(0, 2)  # [N, T, 1], N = L*B*R

        def scaled(rows: Tensor, d: int) -> Tensor:  # [N, C, d]; the scale costs less here than on [C, T]
            return (rows * (1.0 / (math.sqrt(d) * self.temperature))).flatten(0, 2)

        s_rows, t_rows = scaled(s_rows, s.shape[-1]), scaled(t_rows, t.shape[-1])
        fused = fused_row_kl_terms(s.device.type) if self.compile else None
        kl = _RowKL.apply(s_rows, s.flatten(0, 2), t_rows, t.flatten(0, 2), bias, fused)  # [N, C]
        return kl.unflatten(0, (L, B, R)).mean(2)  # [L, B, C]

    def forward(
        self, student: Tensor, teacher: Tensor, mask: Tensor, segment_ids: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Any]]:
        """Masked, weighted relation KL.

        Args:
            student: `[L, B, T, F_s]` or `[L, B, T, H_s, D_s]` aligned student KV (with graph).
            teacher: `[L, B, T, F_t]` or `[L, B, T, H_t, D_t]` aligned teacher KV (detached here).
            mask: `[B, T]` bool/float validity.
            segment_ids: `[B, T]` optional segment ids (0 prompt, 1 reasoning, 2 answer, -1 pad).

        Returns:
            `(loss, metrics)`: a scalar, and detached metrics `relation_kl` (weighted mean per-token
            KL over valid rows), `relation_kl_per_layer [L]`, `loss_<segment>` for each segment
            present, `num_tokens`.
        """
        if student.shape[:3] != teacher.shape[:3]:
            raise ValueError(
                f"relation loss: student {tuple(student.shape)} and teacher {tuple(teacher.shape)} "
                "must share [L, B, T] (align the teacher first)"
            )
        B, T = student.shape[1:3]
        if tuple(mask.shape) != (B, T):
            raise ValueError(f"mask must be [B, T] = [{B}, {T}], got {tuple(mask.shape)}")
        if segment_ids is not None and tuple(segment_ids.shape) != (B, T):
            raise ValueError(f"segment_ids must be [B, T] = [{B}, {T}], got {tuple(segment_ids.shape)}")
        s = self.split_heads(student, "student")  # [L, B, R, T, d_s]
        t = self.split_heads(teacher.detach(), "teacher").to(s.device)  # [L, B, R, T, d_t]
        mask = mask.to(s.device)
        segment_ids = None if segment_ids is None else segment_ids.to(s.device)
        w = token_weights(mask, segment_ids, self.segment_weights)  # [B, T] row weights
        keys = mask > 0 if segment_ids is None else (mask > 0) & (segment_ids != PAD)  # [B, T]

        if self.chunk_size is None or self.chunk_size >= T:
            kl = self.row_kl(s, t, s, t, keys)  # [L, B, T]
        else:
            fn = self.row_kl
            if torch.is_grad_enabled() and s.requires_grad:  # keep only inputs, recompute chunks in backward
                fn = partial(checkpoint, self.row_kl, use_reentrant=False)
            parts = []
            for i in range(0, T, self.chunk_size):  # rows only: every row needs all keys
                rows = slice(i, i + self.chunk_size)
                parts.append(fn(s, t, s[:, :, :, rows], t[:, :, :, rows], keys))  # [L, B, C]
            kl = torch.cat(parts, dim=-1)  # [L, B, T]

        valid = w > 0
        per_token = torch.where(valid, kl.mean(0), 0.0)  # [B, T]; invalid rows contribute 0
        total = (per_token * w).sum()
        count = w.sum()
        loss = total if self.reduction == "sum" else total / count.clamp_min(self.eps)
        return loss, self._metrics(kl.detach(), w, mask, segment_ids)

    @torch.no_grad()
    def _metrics(self, kl: Tensor, w: Tensor, mask: Tensor, segment_ids: Tensor | None) -> dict[str, Any]:
        count = w.sum()
        denom = count.clamp_min(self.eps)
        per_layer = (torch.where(w > 0, kl, 0.0) * w).sum((1, 2)) / denom  # [L]
        metrics: dict[str, Any] = {
            "relation_kl": per_layer.mean(),
            "relation_kl_per_layer": per_layer,
            "num_tokens": count,
        }
        if segment_ids is not None:
            metrics.update(segment_losses(kl.mean(0), mask.bool(), segment_ids))  # kl.mean(0): [B, T]
        return metrics
