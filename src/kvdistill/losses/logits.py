"""Token-level losses on logits: the student's LM cross-entropy and logit KD.

Both return *sums* over labelled positions, in fp32, so the trainer can divide by the global
token count under gradient accumulation and data parallelism. Which positions logit KD reads is
`kd_targets` (the `logit_kd_rows` option), given to the KD losses in `labels`' convention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvdistill.cache import PAD
from kvdistill.losses.relation import select_rows

LOGIT_KD_KINDS = ("forward_kl", "reverse_kl", "jsd")
LABELLED = "labels"  # logit_kd_rows' default: the labelled targets CE learns (not a row selection)


def log_probs(z: Tensor) -> Tensor:
    """`log_softmax(z, -1)` as `z - logsumexp(z)`: on long fp32 rows torch's CPU `log_softmax` rounds worse (a KD
    sum at V 49,152 off by 3.8e-6 relative to fp64, this form by 2e-8); it is also TRL's arithmetic (its
    chunked divergence subtracts the logsumexp), so the two trainers' losses agree."""
    return z - z.logsumexp(-1, keepdim=True)


def token_ce_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of next-token CE over labelled positions, in fp32. logits `[B, T, V]`, labels `[B, T]`."""
    return F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def kd_targets(rows: str, input_ids: Tensor, labels: Tensor, attention_mask: Tensor, segment_ids: Tensor,
               token_fields: dict[str, Tensor] | None = None) -> Tensor:
    """`[B, T]` the next-token targets logit KD reads, in `labels`' convention: position t is distilled where
    `targets[:, t + 1] != -100` (its distribution is its prediction of token t + 1; the last position predicts
    nothing).

    rows: `LABELLED` (`labels` itself: the distributions that predict the reasoning and answer tokens), or a
    row selection (`select_rows`: `all`, segment names, `field:<name>`) read as the *positions* distilled: the
    distribution at each selected real row whose next token is real. That is the row a KV, relation or
    attention loss with the same selection reads, so the two channels compare the same positions (SPEC 13).
    """
    if rows == LABELLED:
        return labels
    real = (attention_mask > 0) & (segment_ids != PAD)  # [B, T]
    sel = select_rows(rows, segment_ids, token_fields, option="logit_kd_rows")  # [B, T] or None: all
    at = real if sel is None else real & sel  # [B, T] the rows whose distributions are distilled
    target = real & F.pad(at[:, :-1], (1, 0), value=False)  # [B, T] token t + 1 of each such row t
    return input_ids.masked_fill(~target, -100)


def generalized_jsd(student: Tensor, teacher: Tensor, beta: float = 0.5) -> Tensor:
    """Per-position generalized Jensen-Shannon divergence of TRL's GKD, on log-probabilities.

    `beta * KL(t || m) + (1 - beta) * KL(s || m)` with the mixture `m = (1 - beta) s + beta t`;
    as in TRL, `beta = 0` is the forward KL(t || s) and `beta = 1` the reverse KL(s || t) exactly
    (the mixture form would tend to 0 there), and 0.5 is the symmetric Jensen-Shannon divergence.

    Args:
        student, teacher: `[..., V]` log-probabilities (log_softmax already applied, any temperature).
        beta: in [0, 1].

    Returns:
        `[...]` divergences.
    """
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    log_b, log_1b = torch.log(torch.tensor(beta)), torch.log(torch.tensor(1.0 - beta))
    m = torch.logsumexp(torch.stack([student + log_1b, teacher + log_b]), 0)  # [..., V]
    return beta * (teacher.exp() * (teacher - m)).sum(-1) + (1 - beta) * (student.exp() * (student - m)).sum(-1)


def kind_beta(kind: str, beta: float = 0.5) -> float:
    """The generalized-JSD beta of a logit KD kind: forward_kl 0, reverse_kl 1, jsd `beta`."""
    if kind not in LOGIT_KD_KINDS:
        raise ValueError(f"logit KD kind must be one of {LOGIT_KD_KINDS}, got {kind!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized JSD beta must be in [0, 1], got {beta}")
    return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(kind, beta)


def logit_kd_sum(
    student: Tensor, teacher: Tensor, labels: Tensor, kind: str, temperature: float,
    sample_weight: Tensor | None = None, beta: float = 0.5, vocab_size: int | None = None,
) -> Tensor:
    """Sum over labelled positions of a divergence between teacher and student next-token dists.

    Args:
        student, teacher: `[B, T, V]` logits on the same tokens.
        labels: `[B, T]` next-token targets (-100: not a target): position t is compared where
            `labels[:, t + 1] != -100`; the labels (prompt and padding never enter) or `kd_targets`.
        kind: "forward_kl" (KL(t || s), mode-covering), "reverse_kl" (KL(s || t), mode-seeking) or
            "jsd" (TRL's generalized JSD with `beta`; 0.5 = Jensen-Shannon), see `generalized_jsd`.
        temperature: softmax temperature; the sum is scaled by `temperature**2` (Hinton et al.).
        sample_weight: `[B]` scales each sample's terms (per-sample fusion weights; None: all 1).
        beta: the generalized JSD's beta (kind "jsd" only).
        vocab_size: the tokenizer's real size: embedding matrices are often padded past it (Qwen2.5-0.5B
            151,936 rows, Qwen2-7B 152,064 for one tokenizer), so both are cut to it (None: the smaller).
    """
    b = kind_beta(kind, beta)
    V = vocab_size or min(student.shape[-1], teacher.shape[-1])
    s = log_probs(student[:, :-1, :V].float() / temperature)  # [B, T-1, V]
    t = log_probs(teacher[:, :-1, :V].float() / temperature)
    div = generalized_jsd(s, t, b)  # [B, T-1]
    valid = (labels[:, 1:] != -100).float()  # [B, T-1]
    if sample_weight is not None:
        valid = valid * sample_weight[:, None]
    return (div * valid).sum() * temperature**2
