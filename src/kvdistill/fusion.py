"""Multi-teacher fusion: how N teachers' KV targets become one training signal.

| kind | what is combined | weights |
|---|---|---|
| `loss_sum` | per-teacher losses | fixed (the teachers' `weight`, normalised) |
| `kv_mean` | aligned teacher KVs (student space), then one loss | fixed |
| `learned` | per-teacher losses | `softmax(logits)`, logits trained with the aligners |
| `correctness` | per-teacher losses, per sample | teachers whose answer to that problem is right |

Per-sample weights are folded into each teacher's token mask, so every kind reduces to
"per-teacher masks + per-teacher weights", and the losses stay plain masked sums.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FUSIONS = ("loss_sum", "kv_mean", "learned", "correctness")


class TeacherFusion(nn.Module):
    """Teacher weights for a fusion kind.

    Args:
        kind: one of `FUSIONS`.
        weights: `[N]` fixed non-negative weights (normalised to sum to 1).
        correctness: `[num_records, N]` 0/1 table (only for `correctness`): did teacher n answer
            record i right.

    Example:
        >>> fusion = TeacherFusion("loss_sum", [1.0, 3.0])
        >>> fusion.teacher_weights()
        tensor([0.2500, 0.7500])
    """

    def __init__(self, kind: str, weights: list[float], correctness: Tensor | None = None):
        super().__init__()
        if kind not in FUSIONS:
            raise ValueError(f"fusion kind {kind!r} is not one of {FUSIONS}")
        w = torch.as_tensor(weights, dtype=torch.float32)
        if w.dim() != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"teacher weights must be a non-empty list of non-negative numbers, got {weights}")
        if kind == "correctness" and (correctness is None or correctness.shape[1] != len(w)):
            raise ValueError("fusion: correctness needs a [num_records, num_teachers] correctness table")
        self.kind = kind
        self.register_buffer("fixed", w / w.sum(), persistent=False)  # [N]
        # learned: start from the fixed weights, trained with the aligners' learning rate
        self.logits = nn.Parameter(self.fixed.log()) if kind == "learned" else None
        self.register_buffer("correctness", None if correctness is None else correctness.float(), persistent=False)

    @property
    def num_teachers(self) -> int:
        return self.fixed.numel()

    def teacher_weights(self) -> Tensor:
        """`[N]` global weights (sum to 1)."""
        return torch.softmax(self.logits, dim=0) if self.logits is not None else self.fixed

    def sample_weights(self, index: Tensor) -> Tensor:
        """`[B, N]` per-sample teacher weights; rows sum to 1.

        For `correctness`, teachers that got sample `b` right share its weight (in proportion to
        their fixed weights); when none did, all teachers keep their fixed weights.
        """
        w = self.teacher_weights().unsqueeze(0).expand(index.shape[0], -1)  # [B, N]
        if self.kind != "correctness":
            return w
        right = self.correctness.to(index.device)[index]  # [B, N]
        right = torch.where(right.sum(1, keepdim=True) > 0, right, torch.ones_like(right))
        w = w * right
        return w / w.sum(1, keepdim=True)


def fuse_kv(targets: Tensor, masks: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Weighted average of aligned teacher targets (`kv_mean`).

    Args:
        targets: `[N, L, B, T, ...]` aligned teacher tensors, all in the student's space.
        masks: `[N, B, T]` validity of each teacher's target.
        weights: `[B, N]` per-sample teacher weights.

    Returns:
        (fused `[L, B, T, ...]`, mask `[B, T]`): at each token, the average over the teachers valid
        there, renormalised; tokens no teacher covers get mask 0.
    """
    w = weights.transpose(0, 1)[:, :, None] * masks.float()  # [N, B, T]
    total = w.sum(0)  # [B, T]
    norm = w / total.clamp(min=1e-12)  # [N, B, T]
    extra = targets.dim() - 4  # feature dims after T
    shaped = norm.reshape(*norm.shape, *([1] * extra)).unsqueeze(1)  # [N, 1, B, T, 1...]
    fused = (targets * shaped).sum(0)  # [L, B, T, ...]
    return fused, (total > 0).float()
