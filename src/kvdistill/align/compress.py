"""Rationale compression for the privileged-teacher mode (KaVa, arXiv 2510.02312).

In this mode the teacher reads question + full rationale + answer, while the student sees a
shorter rationale (or none). Before time alignment, each sample's teacher REASONING segment is
cut down to exactly as many positions as the student has in its own reasoning segment; the
`segment` mode of `kvdistill.align.time.time_index` then maps student reasoning token i to the
i-th kept teacher position, with no interpolation.

Which positions to keep (`COMPRESSIONS`):
    rkv: R-KV style (arXiv 2505.24133) attention importance minus key redundancy, see `rkv_scores`.
    uniform: evenly spaced over the candidates in time order.
    random: a uniformly random subset (seeded by a `torch.Generator`).

Approximation: a cache holds keys and values but no queries, so `rkv_scores` uses the *keys* at
the query positions (the ANSWER tokens by default) in place of their queries. Keys and queries of
one token are different projections of the same hidden state, so this measures how similar the
rationale keys are to what the answer tokens carry, not the teacher's true attention.

Everything is batched: sort / gather / scatter over `[B, T]`, no loop over samples or layers.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kvdistill.cache import ANSWER, PAD, REASONING, KVCache

Compression = Literal["rkv", "uniform", "random"]
COMPRESSIONS = ("rkv", "uniform", "random")


def _check_method(method: str) -> None:
    if method not in COMPRESSIONS:
        raise ValueError(f"unknown compression method {method!r}; expected one of {COMPRESSIONS}")


def _pack(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Positions of the True entries of `mask` `[B, T]`, packed left in time order.

    Returns:
        idx: `[B, N]` positions (N = max count; slots past a sample's count hold arbitrary positions).
        valid: `[B, N]` bool, True for the first `mask[b].sum()` slots.
    """
    n = mask.sum(1)  # [B]
    N = int(n.max()) if mask.numel() else 0
    idx = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices[:, :N]  # [B, N]
    valid = torch.arange(N, device=mask.device) < n.unsqueeze(1)  # [B, N]
    return idx, valid


def _take_time(keys: Tensor, idx: Tensor) -> Tensor:
    """`keys[:, b, :, idx[b], :]` for every b: `[L, B, H, T, D]`, `[B, N]` -> `[L, B, H, N, D]`."""
    L, B, H, _, D = keys.shape
    return keys.gather(3, idx.view(1, B, 1, -1, 1).expand(L, B, H, idx.shape[1], D))


def rkv_scores(keys: Tensor, query_mask: Tensor, candidate_mask: Tensor, lam: float = 0.1) -> Tensor:
    """R-KV score of every candidate position: importance minus redundancy.

    importance[b, j] = mean over layers l, heads h and query tokens q of
        `softmax_j(k[l, b, h, q] · k[l, b, h, j] / sqrt(D))`, the softmax taken over the
        candidates of sample b only, with the query's *key* standing in for its query (no queries
        are cached); then min-max normalised per sample to [0, 1] over its candidates (all equal,
        or a single candidate -> 0). A sample with no query token has importance 0, so only
        redundancy ranks its candidates.
    redundancy[b, j] = mean over layers and heads of the mean cosine similarity between
        k[l, b, h, j] and the keys of the sample's other candidates (0 with a single candidate).
    score = `(1 - lam) * importance - lam * redundancy`, -inf at non-candidates.

    Cost: the importance logits are `[L, B, H, Q, C]` (Q query, C candidate tokens, padded to the
    batch maximum); redundancy is computed from per-head key sums, linear in C.

    Args:
        keys: `[L, B, H, T, D]` cached keys (any float dtype; scored in float32).
        query_mask: `[B, T]` bool, the tokens whose attention defines importance.
        candidate_mask: `[B, T]` bool, the positions to score.
        lam: weight of redundancy in [0, 1].

    Returns:
        `[B, T]` float32 scores, -inf where `candidate_mask` is False.
    """
    L, B, H, T, D = keys.shape
    query_mask, candidate_mask = query_mask.bool(), candidate_mask.bool()
    qi, qv = _pack(query_mask)  # [B, Q]
    ci, cv = _pack(candidate_mask)  # [B, C]
    C = ci.shape[1]
    q = _take_time(keys, qi).float()  # [L, B, H, Q, D]
    c = _take_time(keys, ci).float()  # [L, B, H, C, D]

    # importance: attention from the (key-approximated) queries, over candidates only
    logits = q @ c.transpose(-1, -2) / math.sqrt(D)  # [L, B, H, Q, C]
    logits = logits.masked_fill(~cv.view(1, B, 1, 1, C), torch.finfo(logits.dtype).min)
    attn = logits.softmax(-1) * cv.view(1, B, 1, 1, C)  # [L, B, H, Q, C]; 0 rows if no candidates
    w = qv.float() / qv.sum(1, keepdim=True).clamp(min=1)  # [B, Q] mean over real queries (0 if none)
    imp = torch.einsum("lbhqc,bq->bc", attn, w) / (L * H)  # [B, C]
    has = cv.any(1, keepdim=True)  # [B, 1]
    lo = torch.where(cv, imp, math.inf).amin(1, keepdim=True)  # [B, 1]
    hi = torch.where(cv, imp, -math.inf).amax(1, keepdim=True)  # [B, 1]
    lo, hi = torch.where(has, lo, 0.0), torch.where(has, hi, 0.0)
    imp = (imp - lo) / (hi - lo).clamp(min=1e-6)  # [B, C] in [0, 1]; all-equal -> 0

    # redundancy: mean cosine with the other candidates = (u_j · sum_k u_k - u_j · u_j) / (n - 1)
    u = F.normalize(c, dim=-1) * cv.view(1, B, 1, C, 1)  # [L, B, H, C, D] unit keys, 0 at pad slots
    total = u.sum(3, keepdim=True)  # [L, B, H, 1, D]
    cos_others = ((u * total).sum(-1) - (u * u).sum(-1)).mean((0, 2))  # [B, C] summed cosines
    red = cos_others / (cv.sum(1, keepdim=True) - 1).clamp(min=1)  # [B, C]

    score = torch.where(cv, (1 - lam) * imp - lam * red, -math.inf)  # [B, C]
    slot = torch.where(cv, ci, T)  # [B, C] pad slots write to a dump column
    out = score.new_full((B, T + 1), -math.inf)
    return out.scatter(1, slot, score)[:, :T]  # [B, T]


def _top_k(key: Tensor, cand: Tensor, k: Tensor) -> Tensor:
    """Keep the `k[b]` candidates with the largest `key` (ties: earlier position first)."""
    T = cand.shape[1]
    order = key.masked_fill(~cand, -math.inf).argsort(dim=1, descending=True, stable=True)  # [B, T]
    # candidates first, even if some candidate key is -inf
    order = order.gather(1, (~cand).gather(1, order).to(torch.uint8).argsort(dim=1, stable=True))  # [B, T]
    take = torch.arange(T, device=cand.device) < k.unsqueeze(1)  # [B, T] rank < k
    return torch.zeros_like(cand).scatter(1, order, take)  # [B, T]


def _uniform(cand: Tensor, n: Tensor, k: Tensor) -> Tensor:
    """Keep candidate ranks `round(i * (n - 1) / (k - 1))`, i < k (k = 1: `round((n - 1) / 2)`).

    Rounding is half up, in exact integer arithmetic; the ranks are distinct since k <= n.
    """
    B, T = cand.shape
    rank = cand.long().cumsum(1) - 1  # [B, T] rank among the sample's candidates
    K = int(k.max()) if B else 0
    i = torch.arange(K, device=cand.device).unsqueeze(0)  # [1, K]
    n1, d = (n - 1).clamp(min=0).unsqueeze(1), (k - 1).unsqueeze(1)  # [B, 1]
    num = torch.where(d > 0, i * n1, n1)  # [B, K]  u = num / den
    den = torch.where(d > 0, d, 2).expand_as(num)  # [B, K]
    r = (2 * num + den) // (2 * den)  # [B, K] floor(u + 1/2)
    r = torch.where(i < k.unsqueeze(1), r, T)  # unused slots -> dump column
    chosen = torch.zeros(B, T + 1, dtype=torch.bool, device=cand.device)
    chosen = chosen.scatter(1, r, torch.ones_like(r, dtype=torch.bool))[:, :T]  # [B, T] by rank
    return cand & chosen.gather(1, rank.clamp(min=0))  # [B, T]


def select_positions(
    scores: Tensor | None,
    candidate_mask: Tensor,
    num_slots: Tensor,
    method: Compression = "rkv",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Choose, per sample, exactly `min(num_slots[b], #candidates[b])` candidate positions.

    Args:
        scores: `[B, T]` scores for "rkv" (e.g. from `rkv_scores`; higher is kept first, ties go to
            the earlier position); ignored (may be None) for "uniform" and "random".
        candidate_mask: `[B, T]` bool, the positions that may be chosen.
        num_slots: `[B]` long, positions to keep per sample (0 drops all; negative counts as 0).
        method: "rkv" (top scores), "uniform" (evenly spaced candidate ranks
            `round(i * (n - 1) / (k - 1))`, rounded half up; k = 1 keeps the centre) or "random"
            (uniform without replacement).
        generator: random source for "random"; must live on the device of `candidate_mask`.

    Returns:
        `[B, T]` bool, True at the kept candidates.
    """
    _check_method(method)
    cand = candidate_mask.bool()
    B, T = cand.shape
    n = cand.sum(1)  # [B]
    num_slots = torch.as_tensor(num_slots, device=cand.device).long().expand(B)
    k = torch.minimum(num_slots.clamp(min=0), n)  # [B]
    if method == "uniform":
        return _uniform(cand, n, k)
    if method == "random":
        key = torch.rand(B, T, generator=generator, device=cand.device)  # [B, T]
    else:
        if scores is None:
            raise ValueError("method 'rkv' needs scores (see rkv_scores)")
        key = scores.detach().float().nan_to_num(nan=-math.inf)  # [B, T]
    return _top_k(key, cand, k)


def compress_cache(
    kv: KVCache,
    num_slots: Tensor,
    *,
    method: Compression = "rkv",
    lam: float = 0.1,
    segment: int = REASONING,
    query_segment: int = ANSWER,
    generator: torch.Generator | None = None,
) -> tuple[KVCache, Tensor]:
    """Keep `num_slots[b]` positions of each sample's `segment` and every other real token.

    The kept tokens of each sample are packed left in their original order into a new time axis of
    length `T' = max kept count`, right-padded (attention_mask 0, segment_ids PAD, zero K/V and
    hidden states). Input padding may be left or right. Gathers are differentiable; the selection
    itself is not (it is computed without grad).

    Args:
        kv: cache with keys/values `[L, B, H, T, D]`, attention_mask `[B, T]`, segment_ids `[B, T]`
            (required) and optional hidden_states `[L+1, B, T, d]`.
        num_slots: `[B]` long, positions of `segment` to keep per sample (typically the student's
            reasoning token counts); a sample with fewer candidates keeps them all.
        method: one of `COMPRESSIONS`.
        lam: redundancy weight of "rkv" (see `rkv_scores`).
        segment: segment id to compress (candidates: its real tokens).
        query_segment: segment id whose tokens act as queries for "rkv" importance.
        generator: random source for "random".

    Returns:
        (compressed `KVCache` with time length T', `[B, T']` long original positions of the kept
        tokens, 0 at pad slots).
    """
    _check_method(method)
    if kv.segment_ids is None:
        raise ValueError("compress_cache needs segment_ids to find the segment to compress")
    B = kv.keys.shape[1]
    real = kv.attention_mask.bool()  # [B, T]
    seg = kv.segment_ids.long()  # [B, T]
    cand = real & (seg == segment)  # [B, T]
    scores = None
    if method == "rkv":
        with torch.no_grad():
            scores = rkv_scores(kv.keys, real & (seg == query_segment), cand, lam)  # [B, T]
    keep = (real & ~cand) | select_positions(scores, cand, num_slots, method, generator)  # [B, T]

    pos, new_mask = _pack(keep)  # [B, T'], [B, T']
    pos = torch.where(new_mask, pos, 0)  # [B, T']
    Tn = pos.shape[1]
    m5 = new_mask.view(1, B, 1, Tn, 1)
    keys = _take_time(kv.keys, pos).masked_fill(~m5, 0)  # [L, B, H, T', D]
    values = _take_time(kv.values, pos).masked_fill(~m5, 0)  # [L, B, H, T', D]
    hidden = kv.hidden_states
    if hidden is not None:
        idx = pos.view(1, B, Tn, 1).expand(hidden.shape[0], B, Tn, hidden.shape[-1])
        hidden = hidden.gather(2, idx).masked_fill(~new_mask.view(1, B, Tn, 1), 0)  # [L+1, B, T', d]
    out = replace(
        kv,
        keys=keys,
        values=values,
        attention_mask=new_mask.to(kv.attention_mask.dtype),  # [B, T']
        segment_ids=torch.where(new_mask, kv.segment_ids.gather(1, pos), PAD),  # [B, T']
        hidden_states=hidden,
    )
    return out, pos
