"""CE and logit KD from final hidden states, a chunk of tokens at a time: never the N×V logits.

At real vocabulary sizes the logits dominate memory: fp32 `[N, V]` for the student, again for
each teacher, and again for the softmax temporaries and the gradient (2,048 tokens × 151,936 ×
4 B = 1.2 GB per copy). Like Liger's fused linear cross-entropy, `chunked_head_loss` projects one
chunk of hidden states through the head, computes that chunk's loss *and its gradient* in the
forward, and keeps only the gradients of the hidden states `[N, d]` and of the head `[V, d]` (the
size of the weight's own gradient). The backward only scales them by the incoming gradient, so it
costs no recompute: the time is about that of plain CE (three matmuls), and the peak holds one
chunk's `[n, V]` temporaries instead of all N rows'.

The loss is one scalar, `Σ ce_weight_i · CE_i + kd_scale · KD sum`, because a precomputed gradient
needs the weights of its terms at forward time; the plain CE and KD sums come back detached for logging.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kvdistill.losses.logits import generalized_jsd, kind_beta

AUTO_CHUNK_TOKENS = 1024  # the auto chunk (`logit_chunk_tokens` unset): 1,024 × 151,936 fp32 = 0.6 GB per copy
AUTO_MIN_LOGITS = 2**26  # auto chunks only above 64M logits (256 MB in fp32): below, one pass is cheaper

# a teacher: (logits [N, V_t], None, None) or (hidden [N, d_t], head weight [V_t, d_t], head bias [V_t] | None)
TeacherHead = tuple[Tensor, Tensor | None, Tensor | None]


def resolve_chunk_tokens(option: int | None, n_tokens: int, vocab: int) -> int:
    """Tokens per chunk for the `logit_chunk_tokens` option: None auto (`AUTO_CHUNK_TOKENS` when
    `n_tokens × vocab > AUTO_MIN_LOGITS`, else 0), 0 unchunked, n > 0 chunks of n tokens."""
    if option is None:
        return AUTO_CHUNK_TOKENS if n_tokens * vocab > AUTO_MIN_LOGITS else 0
    return option


def _logits(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """A chunk's fp32 logits `[n, V]`: `x` is logits already, or hidden states through the head."""
    return (x if weight is None else F.linear(x, weight, bias)).float()


def _tempered(x: Tensor, T: float) -> Tensor:
    """`x / T`, without an `[n, V]` copy at T = 1 (the usual case)."""
    return x if T == 1 else x / T


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """`(a * b).sum(-1)` `[n]` of two `[n, V]` without an `[n, V]` product temporary."""
    return torch.bmm(a[:, None], b[:, :, None])[:, 0, 0]


def _chunk_grad(z: Tensor, targets: Tensor, teachers: list, sl: slice, kd_w: Tensor, ce_w: Tensor,
                kd_scale: float, beta: float, temperature: float, vocab: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(d total / d z, weighted CE, CE sum, KD sum)` of one chunk: student logits `z [n, V_s]`, the teachers'
    heads (`TeacherHead`, rows `sl`), per-token CE weights `ce_w [n]`, per-teacher token weights `kd_w [K, n]`
    (0: not distilled).

    CE, forward and reverse KL have their gradients in closed form, computed in place (a handful of
    `[n, V]` buffers: memory is the point of chunking); the generalized JSD's mixture goes through autograd.
    """
    T = temperature
    # the student's log-probs first, so the logits can go as soon as CE's gradient is made: the caller
    # passed their only reference, and one [n, V] buffer fewer lives while the teachers' are made
    ls = F.log_softmax(_tempered(z[:, :vocab], T), -1) if teachers else None  # [n, V]
    z_kd = z[:, :vocab].detach() if teachers and 0.0 < beta < 1.0 else None  # the JSD's autograd reads them
    valid = (targets != -100).float()  # [n]
    tgt = targets.clamp(min=0)[:, None]  # [n, 1]
    lse = torch.logsumexp(z, -1)  # [n]
    ce_tok = (lse - z.gather(1, tgt)[:, 0]) * valid  # [n]
    g = (z - lse[:, None]).exp_()  # [n, V_s] softmax: d CE / dz = softmax - onehot
    del z
    g.scatter_add_(1, tgt, -torch.ones_like(tgt, dtype=g.dtype)).mul_((valid * ce_w)[:, None])
    ce_weighted, ce = (ce_tok * ce_w).sum(), ce_tok.sum()
    kd = g.new_zeros(())
    if not teachers:
        return g, ce_weighted, ce, kd
    gv = g[:, :vocab]  # the KD gradient lands on the first `vocab` logits
    for (x, w, b), wk in zip(teachers, kd_w):
        lt = F.log_softmax(_tempered(_logits(x[sl], w, b)[:, :vocab], T), -1)  # [n, V] teacher log-probs
        c = (kd_scale * T * wk)[:, None]  # [n, 1]: T² × (1/T) of d(z/T)/dz, times the token's weight
        if beta == 0.0:  # forward KL(t || s) = sum p_t log p_t - sum p_t log p_s; d/dz = (p_s - p_t) / T
            pt = lt.exp()
            div = _rowdot(pt, lt)  # [n]
            del lt
            div = div - _rowdot(pt, ls)
            gv.add_(pt.sub_(ls.exp()).mul_(-c))
        elif beta == 1.0:  # reverse KL(s || t): d/dz = p_s (log p_s - log p_t - KL) / T
            ps, d = ls.exp(), lt.neg_().add_(ls)  # d = log p_s - log p_t
            div = _rowdot(ps, d)
            gv.add_(d.sub_(div[:, None]).mul_(ps).mul_(c))
        else:
            zz = z_kd.requires_grad_()
            with torch.enable_grad():
                div = generalized_jsd(F.log_softmax(zz / T, -1), lt, beta)  # [n]
                (gz,) = torch.autograd.grad((div * wk).sum() * kd_scale * T**2, zz)
            gv.add_(gz)
            div = div.detach()
        kd = kd + (div * wk).sum() * T**2
    return g, ce_weighted, ce, kd


class _ChunkedHeadLoss(torch.autograd.Function):
    """Forward computes the loss and its gradients chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teachers, kd_w, ce_w, kd_scale, beta, temperature,
                vocab, chunk):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None  # [N, d]
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # [V_s, d]
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None  # [V_s]
        ce_total = ce_sum = kd_sum = hidden.new_zeros((), dtype=torch.float32)
        for lo in range(0, hidden.shape[0], chunk):
            sl = slice(lo, lo + chunk)
            h = hidden[sl]  # [n, d]
            # only this chunk's logits [n, V_s] live, and only inside _chunk_grad (which frees them early)
            g, ce_weighted, ce, kd = _chunk_grad(F.linear(h, weight, bias).float(), targets[sl], teachers, sl,
                                                 kd_w[:, sl], ce_w[sl], kd_scale, beta, temperature, vocab)
            if need_h:
                grad_h[sl] = g.to(weight.dtype) @ weight  # [n, d]
            if need_w:
                grad_w.addmm_(g.T, h.float())  # [V_s, d]
            if need_b:
                grad_b += g.sum(0)
            del g  # else it would live on beside the next chunk's logits
            ce_total, ce_sum, kd_sum = ce_total + ce_weighted, ce_sum + ce, kd_sum + kd
        # not save_for_backward: backward hands these over and drops them, so autograd can take the [V, d]
        # weight gradient as it is instead of copying it into .grad
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(ce_sum, kd_sum)
        return ce_total + kd_scale * kd_sum, ce_sum, kd_sum

    @staticmethod
    def backward(ctx, grad_total, _grad_ce, _grad_kd):
        grads, ctx.grads = ctx.grads, None  # d total / d (hidden, weight, bias), for grad_total = 1
        one = bool(grad_total == 1)  # the usual case (loss.backward()): no [V, d]-sized copy
        grad_h, grad_w, grad_b = (
            None if g is None else (g if one else g * grad_total).to(dtype)
            for g, dtype in zip(grads, ctx.dtypes)
        )
        return grad_h, grad_w, grad_b, *([None] * 9)


def chunked_head_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    teachers: Sequence[TeacherHead] = (),
    kd_weights: Tensor | None = None,
    *,
    ce_weights: Tensor | float = 1.0,
    kd_scale: float = 1.0,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int = AUTO_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor, Tensor]:
    """`Σ_i ce_weights_i × CE_i + kd_scale × Σ_teachers KD sum` from hidden states, a chunk of tokens at a time.

    Equal, to float rounding, to `token_ce_sum` / `logit_kd_sum` on the full logits `hidden @ weight.T + bias`
    (same kinds: `kind_beta`), and so are its gradients to `hidden`, `weight` and `bias`.

    Args:
        hidden: `[N, d]` the student's final hidden states at the positions that predict a target.
        weight, bias: the student's head `[V_s, d]`, `[V_s]` (or None).
        targets: `[N]` next-token ids, -100 where no CE.
        ce_weights: weight of each token's CE, `[N]` or one for all (e.g. 1 / the global token count;
            0 for a token that is distilled but not learned).
        teachers: per teacher `(logits [N, V_t], None, None)` or `(hidden [N, d_t], weight [V_t, d_t], bias)`;
            no gradient reaches them.
        kd_weights: `[K, N]` weight of each teacher's KD at each token (0: not distilled, e.g. the prompt;
            a fusion weight otherwise). Needed when `teachers` is not empty.
        kind, beta, temperature: the divergence, as in `logit_kd_sum`.
        vocab_size: the tokenizer's real size, KD compares the first `vocab_size` logits (None: the smallest head).
        chunk_tokens: tokens per chunk; 0 or ≥ N is one chunk.

    Returns:
        `(loss, ce_sum, kd_sum)`: the differentiable scalar and its two sums, detached.
    """
    b = kind_beta(kind, beta)
    teachers = list(teachers)
    kd_w = hidden.new_zeros((0, hidden.shape[0]), dtype=torch.float32) if not teachers else kd_weights.float()
    vocab = vocab_size or min([weight.shape[0]] + [x.shape[-1] if w is None else w.shape[0] for x, w, _ in teachers])
    chunk = chunk_tokens if 0 < chunk_tokens < hidden.shape[0] else max(hidden.shape[0], 1)
    ce_w = torch.as_tensor(ce_weights, dtype=torch.float32, device=hidden.device).expand(hidden.shape[0])  # [N]
    return _ChunkedHeadLoss.apply(hidden, weight, bias, targets, teachers, kd_w, ce_w, kd_scale, b, temperature,
                                  vocab, chunk)
