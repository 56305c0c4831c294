"""CE and logit KD from final hidden states, a chunk of tokens at a time: never the N×V logits.

At real vocabulary sizes the logits dominate memory: fp32 `[N, V]` for the student, again for
each teacher, and again for the softmax temporaries and the gradient (2,048 tokens × 151,936 ×
4 B = 1.2 GB per copy). Like Liger's fused linear cross-entropy, `chunked_head_loss` projects one
chunk of hidden states through the head, computes that chunk's loss *and its gradient* in the
forward, and keeps only the gradients of the hidden states `[N, d]` and of the head `[V, d]` (the
size of the weight's own gradient). The backward only scales them by the incoming gradient, so it
costs no recompute: CE is three matmuls (logits, the hidden states' and the head's gradients), KD
one more per teacher given by its head. The peak holds, beside those gradients, one `[n, V]` buffer
for CE (the logits, turned into their gradient in place) and one more for KD (the teachers'
distributions, summed), plus softmax temporaries of `ROW_BLOCK` elements.

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


ROW_BLOCK = 2**20  # elements of a row block's temporaries (4 MiB in fp32, 6 rows at V = 151,936)


def _row_blocks(x: Tensor) -> list[slice]:
    """Slices of `x`'s rows, `ROW_BLOCK` elements each: softmax temporaries are a block's, never `[n, V]`."""
    step = max(1, ROW_BLOCK // max(x.shape[1], 1))
    return [slice(r, r + step) for r in range(0, x.shape[0], step)]


def _tempered(x: Tensor, T: float) -> Tensor:
    """`x / T`, without a copy at T = 1 (the usual case)."""
    return x if T == 1 else x / T


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """`(a * b).sum(-1)` `[n]` of two `[n, V]` without an `[n, V]` product temporary."""
    return torch.bmm(a[:, None], b[:, :, None])[:, 0, 0]


def _teacher_logits(x: Tensor, w: Tensor | None, b: Tensor | None, vocab: int) -> Tensor:
    """A teacher's fp32 logits `[n, vocab]` in a buffer of their own (the caller writes into it): its given
    logits copied, or its hidden states through the first `vocab` rows of its head (padded rows never made)."""
    if w is None:
        return x[:, :vocab].to(torch.float32, copy=True)
    return F.linear(x, w[:vocab], None if b is None else b[:vocab]).float()


def _teachers(teachers: list, sl: slice, kd_w: Tensor, beta: float, T: float, vocab: int
              ) -> tuple[Tensor | list[Tensor], Tensor]:
    """The teachers' side of a chunk (rows `sl`), each teacher's logits made and folded in, a block of rows at a time.

    KL is linear in the teacher's probabilities (forward) or log-probabilities (reverse), so K teachers fold
    into one `[n, vocab]` sum `acc` = Σ_k w_k p_k (forward KL) or Σ_k w_k log p_k (reverse KL), in the first
    teacher's buffer: with the student's logits, two `[n, V]` buffers live, however many teachers.
    Returns `(acc, ent)`, `ent [n]` = Σ_k w_k Σ_v p_k log p_k (forward KL; zeros otherwise). The generalized
    JSD is not linear in either: it gets each teacher's log-probs `[n, vocab]` (a list) and zeros.
    """
    acc, ent, jsd = None, kd_w.new_zeros(kd_w.shape[1]), [] if 0.0 < beta < 1.0 else None
    for (x, w, b), wk in zip(teachers, kd_w):
        lt = _teacher_logits(x[sl], w, b, vocab)  # [n, vocab]
        for r in _row_blocks(lt):
            lp = F.log_softmax(_tempered(lt[r], T), -1)  # [rows, vocab] log p_k
            if jsd is not None:
                lt[r] = lp
                continue
            if beta == 0.0:
                p = lp.exp()
                ent[r] += wk[r] * _rowdot(p, lp)
                lp = p
            lp.mul_(wk[r, None])
            if acc is None:
                lt[r] = lp
            else:
                acc[r] += lp
        if jsd is not None:
            jsd.append(lt)
        elif acc is None:
            acc = lt
        del lt  # a later teacher's buffer goes once folded into acc
    return (jsd if jsd is not None else acc), ent


def _kd_block(zr: Tensor, lse: Tensor | None, acc: Tensor | list[Tensor], r: slice, ent: Tensor, kd_w: Tensor,
              beta: float, T: float) -> tuple[Tensor, Tensor]:
    """`(Σ_k w_k div_k [rows], its gradient w.r.t. the tempered logits u = z / T [rows, vocab])` of a block of
    rows: `zr` the student's logits `[rows, vocab]`, `lse` their logsumexp `[rows]` when it is u's too (T = 1,
    the whole head compared; else None), `acc`, `ent` from `_teachers`."""
    wk, W = kd_w[:, r], kd_w[:, r].sum(0)[:, None]  # [K, rows], [rows, 1]
    if isinstance(acc, list):  # generalized JSD: through autograd, a block at a time
        u = _tempered(zr, T).detach().requires_grad_()
        with torch.enable_grad():
            ls = F.log_softmax(u, -1)
            div = sum(generalized_jsd(ls, lt[r], beta) * w for lt, w in zip(acc, wk))  # [rows]
            (gu,) = torch.autograd.grad(div.sum(), u)
        return div.detach(), gu
    ls = zr - lse[:, None] if lse is not None else F.log_softmax(_tempered(zr, T), -1)  # [rows, vocab] log p_s
    a = acc[r]
    if beta == 0.0:  # Σ_k w_k KL(p_k || p_s) = ent - Σ_v acc log p_s;  d/du = W p_s - acc
        div = ent[r] - _rowdot(a, ls)
        return div, ls.exp_().mul_(W).sub_(a)
    # Σ_k w_k KL(p_s || p_k) = Σ_v p_s (W log p_s - acc);  d/du = p_s (W log p_s - acc - that)
    ps = ls.exp()
    d = ls.mul_(W).sub_(a)
    div = _rowdot(ps, d)
    return div, d.sub_(div[:, None]).mul_(ps)


def _chunk_grad(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, teachers: list, sl: slice,
                kd_w: Tensor, ce_w: Tensor, kd_scale: float, beta: float, temperature: float, vocab: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(d total / d z, weighted CE, CE sum, KD sum)` of one chunk: the student's hidden states `h [n, d]`
    through its head, the teachers' heads (`TeacherHead`, rows `sl`), per-token CE weights `ce_w [n]`,
    per-teacher token weights `kd_w [K, n]` (0: not distilled).

    The gradient is made in the student's logits' own buffer, a block of rows at a time: CE alone holds one
    `[n, V_s]` buffer, KD one more (`_teachers`' sum; the generalized JSD one per teacher). CE, forward and
    reverse KL have their gradients in closed form; the generalized JSD's go through autograd.
    """
    T = temperature
    acc, ent = _teachers(teachers, sl, kd_w, beta, T, vocab) if teachers else (None, None)
    z = F.linear(h, weight, bias).float()  # [n, V_s], becomes the gradient in place
    valid = (targets != -100).float()  # [n]
    a = valid * ce_w  # [n] d total / d CE_i
    tgt = targets.clamp(min=0)[:, None]  # [n, 1]
    ce_tok = -z.gather(1, tgt)[:, 0] * valid  # [n], + lse below
    kd_tok = torch.zeros_like(a)  # [n] Σ_k w_k div_k
    for r in _row_blocks(z):
        zr = z[r]  # [rows, V_s]
        lse = torch.logsumexp(zr, -1)  # [rows]
        ce_tok[r] += lse * valid[r]
        if teachers:
            kd_tok[r], gu = _kd_block(zr[:, :vocab], lse if T == 1 and vocab == z.shape[1] else None, acc, r, ent,
                                      kd_w, beta, T)
        zr.sub_(lse[:, None]).exp_().mul_(a[r, None])  # d CE / dz = a (softmax - onehot): the onehot below
        if teachers:
            zr[:, :vocab].add_(gu, alpha=kd_scale * T)  # T² × (1/T) of du/dz
    z.scatter_add_(1, tgt, -a[:, None])
    return z, (ce_tok * ce_w).sum(), ce_tok.sum(), kd_tok.sum() * T**2


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
            g, ce_weighted, ce, kd = _chunk_grad(h, weight, bias, targets[sl], teachers, sl, kd_w[:, sl], ce_w[sl],
                                                 kd_scale, beta, temperature, vocab)  # g [n, V_s]
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
