"""Logit KD from a teacher with another tokenizer: shared boundaries, shared tokens, sorted probabilities.

The student and the teacher read the same text in their own tokens. Their next-token distributions
are comparable where both have just finished a token at the same character: both then predict what
follows the same prefix. Three steps:

1. Positions (`shared_boundaries`): student position i pairs with the teacher position j whose token
   ends at the same character (char offsets of each tokenization of the same text). Elsewhere, where
   one side is in the middle of a token, the position is **skipped**: a student token that ends
   inside a teacher token has no teacher distribution over "what comes after this character" (the
   teacher's next token starts earlier), and merging the teacher's probabilities over the span by
   the chain rule would need a teacher forward per candidate continuation. Specials without
   characters (BOS, EOS, padding) pair with nothing.
2. Vocabulary (`vocab_intersection`): token ids whose decoded strings are equal on both sides, each
   string unique on both sides (the tokenizers' own look-up; `teachers.vocab_map` caches it per pair).
3. Loss (`cross_vocab_kd_sum`) at each shared boundary, with `m` = the teacher's probability mass on
   the shared tokens (detached):

       m · D(teacher ∩ || student ∩) + (1 - m) · Σ |sort(p_s rest) - sort(p_t rest)|

   D is the logit-KD divergence (`generalized_jsd`: forward/reverse KL, JSD) between both
   distributions restricted to the shared tokens and renormalised; the second term is ULD's
   (Boizard et al. 2024) sorted-probability L1 over the tokens outside the intersection, the
   shorter side padded with zeros: it ignores which token is which and matches the shapes of the
   tails. The mixing by `m` needs no weight to tune and makes identical (or permuted) vocabularies
   reduce to the plain divergence exactly (m = 1). Everything is scaled by `temperature**2` as in
   `logit_kd_sum`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kvdistill.losses.logits import generalized_jsd, kind_beta


def shared_boundaries(student_ends: Tensor, teacher_ends: Tensor) -> tuple[Tensor, Tensor]:
    """For every student position, the teacher position whose token ends at the same character.

    Args:
        student_ends: `[B, T_s]` character index where each student token ends (any monotone convention
            shared by both sides, e.g. its last character); -1 for tokens without characters and padding.
        teacher_ends: `[B, T_t]` the same for the teacher's tokenization of the same text.

    Returns:
        `(teacher_pos [B, T_s] long, shared [B, T_s] bool)`: `teacher_pos` is meaningful where `shared`.
    """
    big = torch.iinfo(torch.long).max
    t_key = torch.where(teacher_ends >= 0, teacher_ends, big)  # [B, T_t] no-char tokens sort last
    t_sorted, order = t_key.sort(-1)  # any padding side, any specials: sorted per row
    s_ends = student_ends.contiguous()
    k = torch.searchsorted(t_sorted, s_ends).clamp(max=t_sorted.shape[-1] - 1)  # [B, T_s]
    shared = (t_sorted.gather(1, k) == s_ends) & (s_ends >= 0)
    return order.gather(1, k), shared


def vocab_intersection(student_strings: Sequence[str | None], teacher_strings: Sequence[str | None]
                       ) -> tuple[Tensor, Tensor]:
    """Ids of the tokens whose decoded strings are equal on both sides: `(student_ids [K], teacher_ids [K])`.

    `*_strings[i]` is token i's decoded string (None: leave it out, e.g. ids past the tokenizer's real size).
    A string that several ids of one side decode to is ambiguous and left out. Sorted by student id.
    """

    def unique(strings: Sequence[str | None]) -> dict[str, int]:
        seen: dict[str, int] = {}
        dup = set()
        for i, s in enumerate(strings):
            if s is None:
                continue
            if s in seen:
                dup.add(s)
            seen[s] = i
        return {s: i for s, i in seen.items() if s not in dup}

    s_map, t_map = unique(student_strings), unique(teacher_strings)
    pairs = sorted((i, t_map[s]) for s, i in s_map.items() if s in t_map)
    ids = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)  # [K, 2]
    return ids[:, 0], ids[:, 1]


def _rest(n: int, shared_ids: Tensor) -> Tensor:
    """`[n - K]` ids of `range(n)` outside `shared_ids`."""
    keep = torch.ones(n, dtype=torch.bool, device=shared_ids.device)
    keep[shared_ids] = False
    return keep.nonzero()[:, 0]


def cross_vocab_kd_sum(
    student: Tensor, teacher: Tensor, student_ids: Tensor, teacher_ids: Tensor, weight: Tensor,
    kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
    student_vocab: int | None = None, teacher_vocab: int | None = None,
) -> Tensor:
    """Weighted sum over aligned positions of the cross-vocabulary divergence (module docstring).

    Args:
        student: `[M, V_s]` student logits at the shared boundaries.
        teacher: `[M, V_t]` teacher logits at the same boundaries (no gradient needed).
        student_ids, teacher_ids: `[K]` the vocabulary intersection (`vocab_intersection`).
        weight: `[M]` per-position weight (0: contributes nothing, e.g. a masked position).
        kind, beta, temperature: the divergence on the intersection, as in `logit_kd_sum`.
        student_vocab, teacher_vocab: each tokenizer's real size; logits past it are padding rows of the
            embedding and are dropped (None: all columns).

    Returns:
        Scalar fp32 sum.
    """
    b = kind_beta(kind, beta)
    T = temperature
    s = student[:, :student_vocab].float() / T  # [M, V_s]
    t = teacher[:, :teacher_vocab].float() / T  # [M, V_t]
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    ls_k, lt_k = F.log_softmax(s[:, student_ids], -1), F.log_softmax(t[:, teacher_ids], -1)  # [M, K] renormalised
    mass = lt[:, teacher_ids].logsumexp(-1).exp().detach()  # [M] teacher mass on the shared tokens
    shared = generalized_jsd(ls_k, lt_k, b)  # [M]
    rest_s, rest_t = _rest(s.shape[-1], student_ids), _rest(t.shape[-1], teacher_ids)
    ps = ls[:, rest_s].exp().sort(-1, descending=True).values  # [M, V_s - K]
    pt = lt[:, rest_t].exp().sort(-1, descending=True).values  # [M, V_t - K]
    n = max(ps.shape[-1], pt.shape[-1])
    uld = (F.pad(ps, (0, n - ps.shape[-1])) - F.pad(pt, (0, n - pt.shape[-1]))).abs().sum(-1)  # [M]
    return ((mass * shared + (1 - mass) * uld) * weight).sum() * T**2
