"""CE and logit KD from final hidden states, a chunk of tokens at a time: never the N×V logits.

At real vocabulary sizes the logits dominate memory: fp32 `[N, V]` for the student, again for
each teacher, and again for the softmax temporaries and the gradient (2,048 tokens × 151,936 ×
4 B = 1.2 GB per copy). Like Liger's fused linear cross-entropy, `chunked_head_loss` projects one
chunk of hidden states through the head, computes that chunk's loss *and its gradient* in the
forward, and keeps only the gradients of the hidden states `[N, d]` and of the head `[V, d]` (the
size of the weight's own gradient). The backward only scales them by the incoming gradient, so it
costs no recompute: the time is about that of plain CE (three matmuls), and the peak holds one
chunk's `[n, V]` temporaries instead of all N rows'.

The loss is one scalar, `ce_scale * CE sum + kd_scale * KD sum`, because a precomputed gradient
needs the weights of its terms at forward time; the two sums come back detached for logging.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kvdistill.losses.logits import generalized_jsd, kind_beta

AUTO_CHUNK_TOKENS = 1024  # the chunk of `logit_chunk_tokens: -1`: 1,024 × 151,936 fp32 = 0.6 GB per copy
AUTO_MIN_LOGITS = 2**26  # `-1` chunks only above 64M logits (256 MB in fp32): below, one pass is cheaper

# a teacher: (logits [N, V_t], None, None) or (hidden [N, d_t], head weight [V_t, d_t], head bias [V_t] | None)
TeacherHead = tuple[Tensor, Tensor | None, Tensor | None]


def resolve_chunk_tokens(option: int, n_tokens: int, vocab: int) -> int:
    """Tokens per chunk for the `logit_chunk_tokens` option: -1 auto (`AUTO_CHUNK_TOKENS` when
    `n_tokens × vocab > AUTO_MIN_LOGITS`, else 0), 0 unchunked, n > 0 chunks of n tokens."""
    if option < 0:
        return AUTO_CHUNK_TOKENS if n_tokens * vocab > AUTO_MIN_LOGITS else 0
    return option


def _logits(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """A chunk's fp32 logits `[n, V]`: `x` is logits already, or hidden states through the head."""
    return (x if weight is None else F.linear(x, weight, bias)).float()


def _chunk_loss(z: Tensor, targets: Tensor, teachers: list[Tensor], kd_w: Tensor, ce_scale: float,
                kd_scale: float, beta: float, temperature: float, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """`(total, ce_sum, kd_sum)` of one chunk: student logits `z [n, V_s]`, teacher logits `[n, V_t]` each,
    per-teacher token weights `kd_w [K, n]` (0: not distilled)."""
    ce = F.cross_entropy(z, targets, ignore_index=-100, reduction="sum") if ce_scale else z.new_zeros(())
    kd = z.new_zeros(())
    if teachers:
        s = F.log_softmax(z[:, :vocab] / temperature, -1)  # [n, V]
        for t, w in zip(teachers, kd_w):
            t = F.log_softmax(t[:, :vocab].float() / temperature, -1)  # [n, V]
            kd = kd + (generalized_jsd(s, t, beta) * w).sum()
        kd = kd * temperature**2
    return ce_scale * ce + kd_scale * kd, ce, kd


class _ChunkedHeadLoss(torch.autograd.Function):
    """Forward computes the loss and its gradients chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teachers, kd_w, ce_scale, kd_scale, beta, temperature,
                vocab, chunk):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None  # [N, d]
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # [V_s, d]
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None  # [V_s]
        total = ce_sum = kd_sum = hidden.new_zeros((), dtype=torch.float32)
        for lo in range(0, hidden.shape[0], chunk):
            sl = slice(lo, lo + chunk)
            h = hidden[sl]  # [n, d]
            z = F.linear(h, weight, bias).float().requires_grad_()  # [n, V_s]: only this chunk's logits live
            t = [_logits(x[sl], w, b) for x, w, b in teachers]  # [n, V_t] each
            with torch.enable_grad():
                loss, ce, kd = _chunk_loss(z, targets[sl], t, kd_w[:, sl], ce_scale, kd_scale, beta,
                                           temperature, vocab)
                (g,) = torch.autograd.grad(loss, z)  # [n, V_s] dloss/dlogits
            if need_h:
                grad_h[sl] = g.to(weight.dtype) @ weight  # [n, d]
            if need_w:
                grad_w.addmm_(g.T, h.float())  # [V_s, d]
            if need_b:
                grad_b += g.sum(0)
            total, ce_sum, kd_sum = total + loss.detach(), ce_sum + ce.detach(), kd_sum + kd.detach()
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(ce_sum, kd_sum)
        return total, ce_sum, kd_sum

    @staticmethod
    def backward(ctx, grad_total, _grad_ce, _grad_kd):
        grad_h, grad_w, grad_b = ctx.saved_tensors  # d total / d input, for grad_total = 1
        w_dtype, b_dtype = ctx.dtypes
        grad_h = None if grad_h is None else grad_h * grad_total.to(grad_h.dtype)
        grad_w = None if grad_w is None else (grad_w * grad_total).to(w_dtype)
        grad_b = None if grad_b is None else (grad_b * grad_total).to(b_dtype)
        return grad_h, grad_w, grad_b, *([None] * 9)


def chunked_head_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    teachers: Sequence[TeacherHead] = (),
    kd_weights: Tensor | None = None,
    *,
    ce_scale: float = 1.0,
    kd_scale: float = 1.0,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int = AUTO_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor, Tensor]:
    """`ce_scale × CE sum + kd_scale × Σ_teachers KD sum` from hidden states, one chunk of tokens at a time.

    Equal, to float rounding, to `token_ce_sum` / `logit_kd_sum` on the full logits `hidden @ weight.T + bias`
    (same kinds: `kind_beta`), and so are its gradients to `hidden`, `weight` and `bias`.

    Args:
        hidden: `[N, d]` the student's final hidden states at the positions that predict a target.
        weight, bias: the student's head `[V_s, d]`, `[V_s]` (or None).
        targets: `[N]` next-token ids, -100 where no CE.
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
    return _ChunkedHeadLoss.apply(hidden, weight, bias, targets, teachers, kd_w, ce_scale, kd_scale, b, temperature,
                                  vocab, chunk)
