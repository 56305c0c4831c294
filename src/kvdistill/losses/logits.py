"""Token-level losses on logits: the student's LM cross-entropy and logit KD.

Both return *sums* over labelled positions, in fp32, so the trainer can divide by the global
token count under gradient accumulation and data parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOGIT_KD_KINDS = ("forward_kl", "reverse_kl", "jsd")


def token_ce_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of next-token CE over labelled positions, in fp32. logits `[B, T, V]`, labels `[B, T]`."""
    return F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def logit_kd_sum(
    student: Tensor, teacher: Tensor, labels: Tensor, kind: str, temperature: float,
    sample_weight: Tensor | None = None,
) -> Tensor:
    """Sum over labelled positions of a divergence between teacher and student next-token dists.

    Args:
        student, teacher: `[B, T, V]` logits on the same tokens.
        labels: `[B, T]` (-100: not a target, so prompt and padding never enter).
        kind: "forward_kl" (KL(t || s), mode-covering), "reverse_kl" (KL(s || t), mode-seeking) or
            "jsd" (Jensen-Shannon, beta = 0.5).
        temperature: softmax temperature; the sum is scaled by `temperature**2` (Hinton et al.).
        sample_weight: `[B]` scales each sample's terms (per-sample fusion weights; None: all 1).
    """
    if kind not in LOGIT_KD_KINDS:
        raise ValueError(f"logit KD kind must be one of {LOGIT_KD_KINDS}, got {kind!r}")
    V = min(student.shape[-1], teacher.shape[-1])  # embedding matrices are often padded past the vocab
    s = F.log_softmax(student[:, :-1, :V].float() / temperature, -1)  # [B, T-1, V]
    t = F.log_softmax(teacher[:, :-1, :V].float() / temperature, -1)
    if kind == "forward_kl":
        div = (t.exp() * (t - s)).sum(-1)
    elif kind == "reverse_kl":
        div = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logsumexp(torch.stack([s, t]), 0) - torch.log(torch.tensor(2.0))
        div = 0.5 * ((s.exp() * (s - m)).sum(-1) + (t.exp() * (t - m)).sum(-1))
    valid = (labels[:, 1:] != -100).float()  # [B, T-1]
    if sample_weight is not None:
        valid = valid * sample_weight[:, None]
    return (div * valid).sum() * temperature**2
