"""Hidden-state loss: CODI's alignment of the student's hidden state at the answer marker."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from kvdistill.cache import ANSWER


def answer_position(segment_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the first answer token per sample `[B]`, and whether there is one `[B]`."""
    is_answer = segment_ids == ANSWER  # [B, T]
    return is_answer.float().argmax(1), is_answer.any(1)


def codi_sum(student: Tensor, teacher: Tensor, weight: Tensor) -> Tensor:
    """CODI: smooth-L1 between student and (projected) teacher hidden states at the answer marker,
    divided by the target's std (as in the CODI paper).

    Args:
        student: `[B, d]` the student's hidden state at its first answer token (with graph).
        teacher: `[B, d]` the teacher's, projected to the student's width.
        weight: `[B]` per-sample weight (0 for a sample without an answer on either side).

    Returns:
        the weighted *sum* over samples; the caller divides by the global sample count. The std is
        per sample, so a sample's term does not depend on the rest of its micro-batch.
    """
    per = F.smooth_l1_loss(student.float(), teacher.float(), reduction="none").mean(-1)  # [B]
    return (per / teacher.float().std(-1).detach().clamp(min=1e-6) * weight).sum()
