"""Attention-map loss: the teacher's attention probabilities matched by the student's own.

The relation loss (`relation.py`) compares self-relations of keys, `softmax(K Kᵀ)`: a proxy, since a
cache holds no queries. This loss compares what the models attend to. Per student layer l, head h
and query row i (post-RoPE queries q and keys k, causal, padding masked):

    A^s_{l,h}[i] = softmax_{j <= i}(q^s_{l,h,i} · k^s_{l,kv(h),j} / sqrt(D_s))
    A^t_{l,h}[i] = sum_{l'} M[l, l'] sum_{h'} W[h, h'] softmax_{j <= i}(q^t_{l',h',i} · k^t_{l',kv(h'),j} / sqrt(D_t))
    loss_i       = mean_{l, h} KL(A^t_{l,h}[i] ‖ A^s_{l,h}[i])

`kv(h)` is the KV head a query head reads (grouped-query attention: `h // (H_q / H_kv)`). The hooked
queries carry their model's own logit scale (`cache.capture_queries`; Gemma3 scales by
`query_pre_attn_scalar**-0.5`), so `/ sqrt(D)` gives each model's own map. The teacher's queries
and keys are time-aligned onto the student's positions first, so both maps are over the student's
tokens. The teacher target is a convex mix of maps (not the map of mixed
queries and keys): over teacher layers by the layer map `M [L_s, L_t]` (rows sum to 1), and over
teacher heads by `W [H_s, H_t]` (`head_groups`): each side's query heads split the unit interval
into equal parts and a student head averages the teacher heads overlapping its part, weighted by
the overlap. With `H_t = R * H_s` this is the mean of R consecutive teacher heads; with
`H_t < H_s` a teacher head serves several student heads.

Rows are weighted, selected and reduced as in the relation loss (`RowKLLoss`), and the per-row KL
is the same chunked custom-autograd `_RowKL` (rows = queries, keys = keys, plus the causal mask):
with `chunk_size=C` no `[B, H, T, T]` map is kept beyond one chunk's `[L, B, H, C, T]` in the
backward. Cost per chunk: the student's map (kept for backward as `Q - P`) and the teacher's maps
of the teacher layers M reads, `O((L_s·H_s + L_t·H_t)·B·C·T)` memory and as many dot products.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kvdistill.losses.relation import _FILL, RowKLLoss, _check_bt, _RowKL, key_bias, row_logits, valid_keys

# future keys: another large negative bias, smaller than _FILL so that key mask + causal mask + a
# logit stays finite (a row whose keys are all masked must not hold -inf: NaN in its gradient)
_CAUSAL = _FILL / 4


def head_groups(student_heads: int, teacher_heads: int) -> Tensor:
    """`W [H_s, H_t]`, rows summing to 1: teacher head h' covers `[h'/H_t, (h'+1)/H_t)` of the unit
    interval, student head h covers `[h/H_s, (h+1)/H_s)`, and `W[h, h']` is their overlap over
    `1/H_s`. `H_t = R H_s`: R consecutive teacher heads averaged; equal counts: the identity."""
    s = torch.arange(student_heads + 1) * teacher_heads  # the edges in units of 1 / (H_s H_t)
    t = torch.arange(teacher_heads + 1) * student_heads
    lo = torch.maximum(s[:-1, None], t[None, :-1])
    hi = torch.minimum(s[1:, None], t[None, 1:])
    overlap = (hi - lo).clamp_min(0).double()  # [H_s, H_t]
    return (overlap / overlap.sum(1, keepdim=True)).float()


def _heads_first(q: Tensor, k: Tensor, side: str) -> tuple[Tensor, Tensor]:
    """fp32 queries `[L, B, T, H_q, D]` scaled by `1 / sqrt(D)` and keys `[L, B, T, H_kv, D]` -> both
    `[L, B, H_q, T, D]`, each query head beside the KV head it reads."""
    if q.dim() != 5 or k.dim() != 5 or q.shape[:3] != k.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention loss: {side} queries [L, B, T, H_q, D] and keys [L, B, T, H_kv, D] expected, "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    h_q, h_kv = q.shape[3], k.shape[3]
    if h_q % h_kv:
        raise ValueError(f"attention loss: {side} has {h_q} query heads, not a multiple of its {h_kv} KV heads")
    q = (q.float() * (1.0 / math.sqrt(q.shape[-1]))).transpose(2, 3)  # [L, B, H_q, T, D]
    k = k.float().transpose(2, 3).repeat_interleave(h_q // h_kv, dim=2)  # [L, B, H_q, T, D]
    return q, k


class AttentionMapLoss(RowKLLoss):
    """KL of the teacher's (mixed) attention maps from the student's, per query row.

    Call as `loss, metrics = fn(student_q, student_k, teacher_q, teacher_k, mask, segment_ids,
    layer_mix=M, rows=None)`. Args of the constructor: see `RowKLLoss`.
    """

    name = "attention"

    def row_kl(self, s_q: Tensor, s_k: Tensor, t_q: Tensor, t_k: Tensor, mix: Tensor, heads: Tensor,
               keys: Tensor, rows: slice) -> Tensor:
        """`[L, B, C]` per-row KL of the query rows `rows`, mean over the student's heads.

        `s_q, s_k [L, B, H_s, T, D_s]`, `t_q, t_k [L_t, B, H_t, T, D_t]` (`_heads_first`), `mix [L, L_t]`,
        `heads [H_s, H_t]`, `keys [B, T]` bool.
        """
        L, B, H = s_q.shape[:3]
        L_t, _, H_t, T = t_q.shape[:4]
        j = torch.arange(T, device=keys.device)
        causal = torch.zeros(len(j[rows]), T, device=keys.device).masked_fill(j > j[rows, None], _CAUSAL)  # [C, T]
        with torch.no_grad():  # the teacher: a constant target
            z = row_logits(t_q[:, :, :, rows].flatten(0, 2), t_k.flatten(0, 2), key_bias(keys, (L_t, B, H_t)))
            p = z.add_(causal).softmax(-1).unflatten(0, (L_t, B, H_t))  # [L_t, B, H_t, C, T]
            p = torch.einsum("ml,hg,lbgct->mbhct", mix, heads, p)  # [L, B, H, C, T] convex mix of maps
            z_t = p.flatten(0, 2).log_().clamp_min_(_FILL)  # [N, C, T]; log 0 -> _FILL (softmax gives 0)
        kl = _RowKL.apply(s_q[:, :, :, rows].flatten(0, 2), s_k.flatten(0, 2), key_bias(keys, (L, B, H)), z_t,
                          causal, self.fused(s_q.device))  # [N, C]
        return kl.unflatten(0, (L, B, H)).mean(2)  # [L, B, C]

    def forward(
        self, student_q: Tensor, student_k: Tensor, teacher_q: Tensor, teacher_k: Tensor, mask: Tensor,
        segment_ids: Tensor | None = None, *, layer_mix: Tensor | None = None, rows: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        """Masked, weighted attention-map KL.

        Args:
            student_q, student_k: `[L, B, T, H_q, D_s]`, `[L, B, T, H_kv, D_s]` post-RoPE (with graph).
            teacher_q, teacher_k: `[L_t, B, T, H_qt, D_t]`, `[L_t, B, T, H_kvt, D_t]` post-RoPE, time-aligned
                onto the student's T positions (detached here).
            mask: `[B, T]` bool/float validity of rows and keys.
            segment_ids: `[B, T]` optional segment ids (0 prompt, 1 reasoning, 2 answer, -1 pad).
            layer_mix: `[L, L_t]` convex rows mixing the teacher layers' maps; None: `L_t == L`, identity.
            rows: `[B, T]` bool, the query rows the loss reads; None: every valid row.

        Returns:
            `(loss, metrics)` as the relation loss, its metrics named `attention_kl*`.
        """
        s_q, s_k = _heads_first(student_q, student_k, "student")  # [L, B, H, T, D_s]
        t_q, t_k = (x.to(s_q.device) for x in _heads_first(teacher_q.detach(), teacher_k.detach(), "teacher"))
        L, B, _, T = s_q.shape[:4]
        if t_q.shape[1] != B or t_q.shape[3] != T:
            raise ValueError(f"attention loss: teacher [B, T] = {tuple(t_q.shape[1:4:2])} differs from the "
                             f"student's {(B, T)} (align the teacher first)")
        _check_bt(B, T, mask=mask, segment_ids=segment_ids, rows=rows)
        mix = torch.eye(L) if layer_mix is None else layer_mix.float()
        if tuple(mix.shape) != (L, t_q.shape[0]):
            raise ValueError(f"attention loss: layer_mix must be [L_s, L_t] = [{L}, {t_q.shape[0]}], got "
                             f"{tuple(mix.shape)}")
        mix, heads = mix.to(s_q.device), head_groups(s_q.shape[2], t_q.shape[2]).to(s_q.device)
        mask = mask.to(s_q.device)
        segment_ids = None if segment_ids is None else segment_ids.to(s_q.device)
        keys = valid_keys(mask, segment_ids)  # [B, T]
        kl = self.chunked(lambda r: self.row_kl(s_q, s_k, t_q, t_k, mix, heads, keys, r), T, s_q.requires_grad)
        return self.reduce(kl, mask, segment_ids, rows)  # kl [L, B, T]


def aligned_attention_loss(loss_fn: AttentionMapLoss, aligned: Any, rows: Tensor | None = None
                           ) -> tuple[Tensor, dict[str, Any]]:
    """`loss_fn` on an aligner's `attention_inputs` (duck-typed: student/teacher queries and keys,
    layer_mix, mask, segment_ids), reading the query rows `rows [B, T]` (None: all)."""
    return loss_fn(aligned.student_queries, aligned.student_keys, aligned.teacher_queries, aligned.teacher_keys,
                   aligned.mask, aligned.segment_ids, layer_mix=aligned.layer_mix, rows=rows)
