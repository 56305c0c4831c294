"""KV distillation losses: compare aligned student and teacher KV, masked and segment-weighted.

Every loss takes two tensors of the same shape, flat `[L, B, T, F]` or structured
`[L, B, T, H, D]`, plus a token mask `[B, T]` and optional segment ids `[B, T]`:

1. an element loss is computed per (layer, token, head) over the last axis (the cosine is taken
   over the last axis; axes between T and the last are averaged);
2. the per-token loss is its mean over layers (and heads);
3. tokens are weighted by `mask * segment_weight[segment]` (padding segment -1 weighs 0);
4. `reduction="mean"` divides the weighted sum by the weighted token count, so the value does not
   depend on padding or on how many tokens a batch holds; `reduction="sum"` returns the weighted
   sum, for a trainer that divides by the *global* token count under gradient accumulation
   (`metrics["num_tokens"]` is the local count).

Everything is computed in fp32. A batch without a valid token returns 0 (with a graph, no NaN).
The student side carries gradients; the teacher side is not detached here, because with
`direction="teacher_to_student"` it carries the projectors' graph (the teacher model itself was
already detached by the aligner).

Losses (`LOSSES`, `build_kv_loss(name, **kwargs)`):
    mse         mean over features of (s - t)^2
    smooth_l1   mean over features of smooth_l1(s - t; beta)
    cosine      1 - cos(s, t)
    mercator    alpha * (1 - cos(s, t)) + beta * (log|s| - log|t|)^2    (alpha=1, beta in {0, 0.01})
    hybrid      w * mercator + (1 - w) * mse                            (w=0.8)
    structural  per head of a 5-D input: (1 - cos(s_h, t_h)) + mse_weight * mse(s_h, t_h), averaged
                over heads; a flat input is rejected (it has no heads to keep apart)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvdistill.cache import PAD, SEGMENT_NAMES

REDUCTIONS = ("mean", "sum")


def token_weights(
    mask: Tensor, segment_ids: Tensor | None, segment_weights: dict[int, float] | None = None
) -> Tensor:
    """Token weights `[B, T]` float: `mask * segment_weights.get(segment, 1)`, 0 on padding (-1).

    Args:
        mask: `[B, T]` bool/float validity.
        segment_ids: `[B, T]` optional segment ids; None weighs every masked token 1.
        segment_weights: `{segment_id: weight}`; segments not listed weigh 1.
    """
    w = mask.float()
    if segment_ids is None:
        return w
    seg = segment_ids.long()
    seg_w = torch.ones_like(w)
    for sid, weight in (segment_weights or {}).items():  # a handful of segments, not tokens
        seg_w = torch.where(seg == sid, weight, seg_w)
    return w * torch.where(seg == PAD, 0.0, seg_w)


@torch.no_grad()
def segment_losses(per_token: Tensor, real: Tensor, segment_ids: Tensor) -> dict[str, Tensor]:
    """`{"loss_<segment>": mean of per_token [B, T] over the real tokens [B, T] of that segment}` for
    each segment present; segment weights are not applied (a metric, not the loss)."""
    per_token = torch.where(real, per_token, 0.0)
    out = {}
    for sid, seg_name in SEGMENT_NAMES.items():  # 3 segments
        in_seg = (real & (segment_ids == sid)).float()
        n = in_seg.sum()
        if n > 0:
            out[f"loss_{seg_name}"] = (per_token * in_seg).sum() / n
    return out


class _DotAndNorms(torch.autograd.Function):
    """`(Σ s·t, |s|, |t|)` over the last axis, with a backward of two passes per input.

    Autograd through `(s * t).sum(-1)`, `s.norm(-1)` and `t.norm(-1)` runs a chain of full-size
    elementwise ops per term (the norm's backward alone divides, masks and multiplies); here the
    gradient of every term is a per-row scalar times `s` or `t`, summed in one `addcmul`.
    """

    @staticmethod
    def forward(ctx, s: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        dot = torch.linalg.vecdot(s, t)  # [...]
        s_norm, t_norm = torch.linalg.vector_norm(s, dim=-1), torch.linalg.vector_norm(t, dim=-1)
        ctx.save_for_backward(s, t, s_norm, t_norm)
        return dot, s_norm, t_norm

    @staticmethod
    def backward(ctx, g_dot: Tensor, g_s: Tensor, g_t: Tensor) -> tuple[Tensor | None, Tensor | None]:
        s, t, s_norm, t_norm = ctx.saved_tensors

        def grad(x: Tensor, x_norm: Tensor, g_norm: Tensor, other: Tensor) -> Tensor:
            # d|x|/dx = x / |x|, taken as 0 at x = 0 (as torch's norm does)
            c = torch.where(x_norm > 0, g_norm / x_norm, 0.0).unsqueeze(-1)  # [..., 1]
            return (x * c).addcmul_(other, g_dot.unsqueeze(-1))  # [..., F]

        return (
            grad(s, s_norm, g_s, t) if ctx.needs_input_grad[0] else None,
            grad(t, t_norm, g_t, s) if ctx.needs_input_grad[1] else None,
        )


def dot_and_norms(s: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`(Σ s·t, |s|, |t|)` over the last axis of two same-shape tensors, e.g. `[L, B, T, F] -> [L, B, T]`.

    Equal to `(s * t).sum(-1), s.norm(dim=-1), t.norm(dim=-1)`, values and gradients, with a
    cheaper backward (`_DotAndNorms`).
    """
    return _DotAndNorms.apply(s, t)


class KVLoss(nn.Module):
    """Base class: masking, segment weights, target normalisation, reduction and metrics.

    Subclasses implement `element_loss`. Call as `loss, metrics = fn(student, teacher, mask, segment_ids)`.

    Args:
        reduction: "mean" (divide by the weighted valid-token count) or "sum".
        normalize_target: divide student and teacher by the teacher's per-layer std over valid
            tokens (detached), as KaVa does: the target's direction and relative scale are kept,
            but layers with large activations no longer dominate magnitude-sensitive losses.
        segment_weights: `{segment_id: weight}`; segments not listed weigh 1, padding (-1) 0.
            E.g. `{0: 0.0}` keeps prompt tokens out of the loss.
        eps: floor for norms and counts.
    """

    name = "base"

    def __init__(
        self,
        *,
        reduction: str = "mean",
        normalize_target: bool = False,
        segment_weights: dict[int, float] | None = None,
        eps: float = 1e-8,
    ):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if segment_weights and any(w < 0 for w in segment_weights.values()):
            raise ValueError(f"segment weights must be >= 0, got {segment_weights}")
        self.reduction = reduction
        self.normalize_target = normalize_target
        self.segment_weights = {int(k): float(v) for k, v in (segment_weights or {}).items()}
        self.eps = eps

    def element_loss(self, s: Tensor, t: Tensor, cos: Tensor, s_norm: Tensor, t_norm: Tensor) -> Tensor:
        """Loss per (layer, token[, head]) from fp32 `s, t [L, B, T, ..., F]`; returns `[L, B, T, ...]`."""
        raise NotImplementedError

    def check_input(self, student: Tensor, teacher: Tensor) -> None:
        if student.shape != teacher.shape:
            raise ValueError(
                f"{self.name} loss: student {tuple(student.shape)} and teacher {tuple(teacher.shape)} "
                "must have the same shape (align the teacher first)"
            )
        if student.dim() not in (4, 5):
            raise ValueError(
                f"{self.name} loss expects [L, B, T, F] or [L, B, T, H, D], got {tuple(student.shape)}"
            )

    def token_weights(self, mask: Tensor, segment_ids: Tensor | None) -> Tensor:
        """`[B, T]` float: mask x segment weight, 0 on padding."""
        return token_weights(mask, segment_ids, self.segment_weights)

    def forward(
        self, student: Tensor, teacher: Tensor, mask: Tensor, segment_ids: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Any]]:
        """Masked, weighted KV loss.

        Args:
            student: `[L, B, T, F]` or `[L, B, T, H, D]` aligned student KV (with graph).
            teacher: same shape, aligned teacher KV.
            mask: `[B, T]` bool/float validity (e.g. `AlignedKV.mask`).
            segment_ids: `[B, T]` optional segment ids (0 prompt, 1 reasoning, 2 answer, -1 pad).

        Returns:
            `(loss, metrics)`: a scalar, and detached metrics `cos_sim`, `cos_sim_per_layer [L]`,
            `norm_ratio`, `loss_<segment>` for each segment present, `num_tokens`.
        """
        self.check_input(student, teacher)
        L, B, T = student.shape[:3]
        if tuple(mask.shape) != (B, T):
            raise ValueError(
                f"mask must be [B, T] = [{B}, {T}] to match {tuple(student.shape)}, got {tuple(mask.shape)}"
            )
        if segment_ids is not None and tuple(segment_ids.shape) != (B, T):
            raise ValueError(f"segment_ids must be [B, T] = [{B}, {T}], got {tuple(segment_ids.shape)}")
        s, t = student.float(), teacher.float()
        w = self.token_weights(mask.to(s.device), None if segment_ids is None else segment_ids.to(s.device))
        if self.normalize_target:
            std = self._layer_std(t.detach(), w > 0)  # [L]
            shape = (L,) + (1,) * (t.dim() - 1)
            s, t = s / std.view(shape), t / std.view(shape)

        dot, s_norm, t_norm = dot_and_norms(s, t)  # [L, B, T, ...] each
        cos = dot / (s_norm * t_norm).clamp_min(self.eps)  # [L, B, T, ...]
        elem = self.element_loss(s, t, cos, s_norm, t_norm)  # [L, B, T, ...]
        raw = _token_mean(elem)  # [B, T]: mean over layers and heads
        per_token = torch.where(w > 0, raw, torch.zeros_like(raw))  # garbage at pads never leaks
        total = (per_token * w).sum()
        count = w.sum()
        loss = total if self.reduction == "sum" else total / count.clamp_min(self.eps)
        metrics = self._metrics(cos, s_norm, t_norm, raw.detach(), w, mask, segment_ids)
        metrics.update(self.extra_metrics(s, t, cos, s_norm, t_norm, w))
        return loss, metrics

    def extra_metrics(self, s, t, cos, s_norm, t_norm, w) -> dict[str, Any]:
        return {}

    def _layer_std(self, t: Tensor, valid: Tensor) -> Tensor:
        """Per-layer std of `t [L, B, T, ..., F]` over valid tokens and all features -> `[L]`."""
        m = valid.float().view(1, *valid.shape, *([1] * (t.dim() - 3)))  # [1, B, T, 1...]
        per_tok = t[0, 0, 0].numel()
        n = (m.sum() * per_tok).clamp_min(1.0)
        dims = tuple(range(1, t.dim()))
        mean = (t * m).sum(dims) / n  # [L]
        var = (((t - mean.view(-1, *([1] * (t.dim() - 1)))) ** 2) * m).sum(dims) / n
        return var.sqrt().clamp_min(self.eps)

    @torch.no_grad()
    def _metrics(self, cos, s_norm, t_norm, per_token, w, mask, segment_ids) -> dict[str, Any]:
        count = w.sum()
        denom = count.clamp_min(self.eps)
        valid = w > 0
        cos_l = torch.where(valid, _mid_mean(cos), 0.0)  # [L, B, T]
        cos_per_layer = (cos_l * w).sum((1, 2)) / denom  # [L]
        ratio = torch.where(valid, _token_mean(s_norm / t_norm.clamp_min(self.eps)), 0.0)  # [B, T]
        metrics: dict[str, Any] = {
            "cos_sim": cos_per_layer.mean(),
            "cos_sim_per_layer": cos_per_layer,
            "norm_ratio": (ratio * w).sum() / denom,
            "num_tokens": count,
        }
        if segment_ids is not None:
            metrics.update(segment_losses(per_token, mask.to(per_token.device).bool(), segment_ids.to(per_token.device)))
        return metrics


def _token_mean(x: Tensor) -> Tensor:
    """`[L, B, T, ...] -> [B, T]`: mean over layers and the axes after T."""
    return x.mean(dim=(0, *range(3, x.dim())))


def _mid_mean(x: Tensor) -> Tensor:
    """`[L, B, T, ...] -> [L, B, T]`: mean over the axes after T."""
    return x.mean(dim=tuple(range(3, x.dim()))) if x.dim() > 3 else x


class MSEKVLoss(KVLoss):
    """Mean squared error over features. Example: `MSEKVLoss()(s, t, mask)`."""

    name = "mse"

    def element_loss(self, s, t, cos, s_norm, t_norm):
        return (s - t).pow(2).mean(-1)


class SmoothL1KVLoss(KVLoss):
    """Smooth L1 (Huber / beta) over features: robust to the outlier channels of real KV caches."""

    name = "smooth_l1"

    def __init__(self, *, beta: float = 1.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.beta = beta

    def element_loss(self, s, t, cos, s_norm, t_norm):
        return F.smooth_l1_loss(s, t, reduction="none", beta=self.beta).mean(-1)


class CosineKVLoss(KVLoss):
    """`1 - cos(s, t)` over the last axis: direction only."""

    name = "cosine"

    def element_loss(self, s, t, cos, s_norm, t_norm):
        return 1.0 - cos


class MercatorKVLoss(KVLoss):
    """`alpha * (1 - cos(s, t)) + beta * (log|s| - log|t|)^2`.

    Direction matters more than magnitude for RoPE keys, so `beta` defaults to 0 (documented
    options: 0, 0.01). Metrics add `mercator_direction` and `mercator_magnitude` (unweighted terms).

    Example:
        >>> s = torch.tensor([0.707, 0.707]).expand(1, 1, 1, 2) * 100
        >>> t = torch.tensor([0.707, 0.707]).expand(1, 1, 1, 2)
        >>> MercatorKVLoss(beta=0.01)(s, t, torch.ones(1, 1))[0]  # 0.01 * log(100)^2 = 0.2121
    """

    name = "mercator"

    def __init__(self, *, alpha: float = 1.0, beta: float = 0.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.alpha, self.beta = alpha, beta

    def _terms(self, cos, s_norm, t_norm) -> tuple[Tensor, Tensor]:
        direction = 1.0 - cos
        magnitude = (s_norm.clamp_min(self.eps).log() - t_norm.clamp_min(self.eps).log()).pow(2)
        return direction, magnitude

    def element_loss(self, s, t, cos, s_norm, t_norm):
        direction, magnitude = self._terms(cos, s_norm, t_norm)
        return self.alpha * direction + self.beta * magnitude

    @torch.no_grad()
    def extra_metrics(self, s, t, cos, s_norm, t_norm, w):
        direction, magnitude = self._terms(cos, s_norm, t_norm)
        denom, valid = w.sum().clamp_min(self.eps), w > 0
        return {
            "mercator_direction": (torch.where(valid, _token_mean(direction), 0.0) * w).sum() / denom,
            "mercator_magnitude": (torch.where(valid, _token_mean(magnitude), 0.0) * w).sum() / denom,
        }


class HybridKVLoss(MercatorKVLoss):
    """`weight * mercator + (1 - weight) * mse`, weight 0.8."""

    name = "hybrid"

    def __init__(self, *, weight: float = 0.8, alpha: float = 1.0, beta: float = 0.0, **kwargs: Any):
        super().__init__(alpha=alpha, beta=beta, **kwargs)
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"hybrid weight must be in [0, 1], got {weight}")
        self.weight = weight

    def element_loss(self, s, t, cos, s_norm, t_norm):
        mercator = super().element_loss(s, t, cos, s_norm, t_norm)
        return self.weight * mercator + (1.0 - self.weight) * (s - t).pow(2).mean(-1)


class StructuralKVLoss(KVLoss):
    """Per-head loss for structured `[L, B, T, H, D]` input: `(1 - cos_h) + mse_weight * mse_h`.

    Each head is compared on its own (direction over D, plus a small MSE term that also pins the
    magnitude), then heads are averaged; a flat input would compare heads mixed together, so it
    is rejected. Use with `KVAligner(mode="structured")`.
    """

    name = "structural"

    def __init__(self, *, mse_weight: float = 0.1, **kwargs: Any):
        super().__init__(**kwargs)
        self.mse_weight = mse_weight

    def check_input(self, student: Tensor, teacher: Tensor) -> None:
        super().check_input(student, teacher)
        if student.dim() != 5:
            raise ValueError(
                f"structural loss needs structured [L, B, T, H, D] input, got {tuple(student.shape)}; "
                "use KVAligner(mode='structured') or a flat loss (mse, cosine, mercator, ...)"
            )

    def element_loss(self, s, t, cos, s_norm, t_norm):
        return (1.0 - cos) + self.mse_weight * (s - t).pow(2).mean(-1)  # [L, B, T, H]


LOSSES: dict[str, type[KVLoss]] = {
    "mse": MSEKVLoss,
    "smooth_l1": SmoothL1KVLoss,
    "cosine": CosineKVLoss,
    "mercator": MercatorKVLoss,
    "hybrid": HybridKVLoss,
    "structural": StructuralKVLoss,
}


def build_kv_loss(kind: str, **kwargs: Any) -> KVLoss:
    """A KV loss by name, e.g. `build_kv_loss("mercator", beta=0.01, segment_weights={0: 0.0})`."""
    if kind not in LOSSES:
        raise ValueError(f"unknown KV loss {kind!r}; expected one of {tuple(LOSSES)}")
    return LOSSES[kind](**kwargs)


def aligned_kv_loss(loss_fn: nn.Module, aligned: Any) -> tuple[Tensor, dict[str, Any]]:
    """Mean of the key and value losses of an `AlignedKV` (duck-typed: keys/values/mask/segment_ids).

    `loss_fn` is any loss called as `loss_fn(student, teacher, mask, segment_ids) -> (loss, metrics)`
    (a `KVLoss` or a `RelationKVLoss`). Metrics: the key metrics prefixed `k_`, the value metrics
    `v_`, and every metric both have (e.g. `cos_sim`, `cos_sim_per_layer`, `relation_kl`) as the
    mean of the two; `num_tokens` is the key side's.
    """
    lk, mk = loss_fn(aligned.student_keys, aligned.teacher_keys, aligned.mask, aligned.segment_ids)
    lv, mv = loss_fn(aligned.student_values, aligned.teacher_values, aligned.mask, aligned.segment_ids)
    metrics: dict[str, Any] = {f"k_{k}": v for k, v in mk.items()}
    metrics.update({f"v_{k}": v for k, v in mv.items()})
    metrics.update({k: (v + mv[k]) / 2 for k, v in mk.items() if k in mv})
    metrics["num_tokens"] = mk["num_tokens"]
    return (lk + lv) / 2, metrics
