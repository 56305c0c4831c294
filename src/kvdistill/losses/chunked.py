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

A teacher with another tokenizer (`KDTeacher` with its shared token ids) is read the same way: its
rows paired with the student's by an index (the shared character boundaries), its chunk of logits
in a buffer of its own, its divergence (`cross_vocab.cross_vocab_div`) and gradient taken through
autograd a block of rows at a time, so it too never makes more than one `[n, V_t]` buffer.

The loss is one scalar, `Σ ce_weight_i · CE_i + kd_scale · KD sum`, because a precomputed gradient
needs the weights of its terms at forward time; the plain CE and KD sums come back detached for logging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvdistill.losses.cross_vocab import cross_vocab_div, rest_ids
from kvdistill.losses.logits import generalized_jsd, kind_beta, log_probs

AUTO_MIN_LOGITS = 2**26  # auto chunks above 64M logits (256 MB in fp32) whatever the rows read
MIN_CHUNK_TOKENS = 128  # auto's smallest chunk: a narrow head's matmuls stay wide enough to run at speed

# a teacher: (logits [N, V_t], None, None) or (hidden [N, d_t], head weight [V_t, d_t], head bias [V_t] | None)
TeacherHead = tuple[Tensor, Tensor | None, Tensor | None]


def resolve_chunk_tokens(option: int | None, n_tokens: int, vocab: int, hidden: int, rows: int | None = None) -> int:
    """Tokens per chunk for the `logit_chunk_tokens` option: 0 unchunked, n > 0 chunks of n tokens, None auto.

    Auto chunks when `n_tokens × vocab > AUTO_MIN_LOGITS` or when logit KD reads fewer than `n_tokens` rows
    (`rows`, None: not known): the chunked path puts only the rows a loss reads through the head, where the
    logits path makes every position's logits and KD's fp32 log-probabilities of each. Its chunk is `hidden / 4`
    tokens (at least `MIN_CHUNK_TOKENS`): one fp32 `[chunk, vocab]` buffer is then a quarter of the head's
    gradient `[vocab, hidden]`, so CE's peak (that gradient + one buffer) and KD's (+ one more) are 5 and 6
    quarters of it at any head shape: KD / CE = 1.2.
    """
    if option is not None:
        return option
    chunk = n_tokens * vocab > AUTO_MIN_LOGITS or (rows is not None and rows < n_tokens)
    return auto_chunk_tokens(hidden) if chunk else 0


def auto_chunk_tokens(hidden: int) -> int:
    """Auto's tokens per chunk for a head of width `hidden` (`resolve_chunk_tokens`)."""
    return max(MIN_CHUNK_TOKENS, hidden // 4)


@dataclass
class KDTeacher:
    """One teacher as `chunked_head_loss` reads it: its `TeacherHead` and which of its rows each student row reads.

    rows: `[N]` long, the row of `head` paired with each student row (any row where its KD weight is 0); None:
        row i with row i.
    student_ids, teacher_ids: `[K]` a teacher with another tokenizer: the tokens both vocabularies share
        (`cross_vocab.vocab_intersection`); its KD is `cross_vocab_div`. None: the student's vocabulary.
    vocab: that teacher's tokenizer size, its head's rows past it dropped (None: all).
    """

    head: TeacherHead
    rows: Tensor | None = None
    student_ids: Tensor | None = None
    teacher_ids: Tensor | None = None
    vocab: int | None = None

    @property
    def cross(self) -> bool:
        return self.student_ids is not None


ROW_BLOCK = 2**20  # elements of a row block's temporaries (4 MiB in fp32, 6 rows at V = 151,936)


def _row_blocks(x: Tensor) -> list[slice]:
    """Slices of `x`'s rows, `ROW_BLOCK` elements each: softmax temporaries are a block's, never `[n, V]`."""
    step = max(1, ROW_BLOCK // max(x.shape[1], 1))
    return [slice(r, r + step) for r in range(0, x.shape[0], step)]


def _tempered(x: Tensor, T: float) -> Tensor:
    """`x / T`, without a copy at T = 1 (the usual case)."""
    return x if T == 1 else x / T


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """`(a * b).sum(-1)` `[rows]` of two row blocks: `vecdot` is 4× faster than a batched matmul of `[1, V]` by
    `[V, 1]` on a CPU, and rounds 20× closer to float64."""
    return torch.linalg.vecdot(a, b)


def _teacher_logits(t: KDTeacher, sl: slice, vocab: int | None) -> Tensor:
    """A teacher's fp32 logits `[n, vocab]` at the rows paired with student rows `sl`, in a buffer of their own
    (the caller writes into it): its given logits copied, or its hidden states through the first `vocab` rows of
    its head (padded rows never made)."""
    x, w, b = t.head
    if w is None:
        x = x[:, :vocab]  # [N_t, vocab] a view
        return x[sl].to(torch.float32, copy=True) if t.rows is None else x[t.rows[sl]].float()  # gather: a copy
    h = x[sl] if t.rows is None else x[t.rows[sl]]  # [n, d_t]
    return F.linear(h, w[:vocab], None if b is None else b[:vocab]).float()


def _by_autograd(div: Callable[..., Tensor], zr: Tensor, T: float, *args) -> tuple[Tensor, Tensor]:
    """`(div(u, *args) [rows], d Σ div / du [rows, V])` at the tempered logits u = `zr / T`, for a divergence
    without a gradient in closed form (the generalized JSD, cross-vocabulary KD), a block of rows at a time."""
    u = _tempered(zr, T).detach().requires_grad_()
    with torch.enable_grad():
        d = div(u, *args)  # [rows]
        (gu,) = torch.autograd.grad(d.sum(), u)
    return d.detach(), gu


def _teachers(teachers: list[KDTeacher], sl: slice, kd_w: Tensor, beta: float, T: float, vocab: int
              ) -> tuple[Tensor | list[Tensor], Tensor]:
    """The same-vocabulary teachers' side of a chunk (rows `sl`), each teacher's logits made and folded in, a block
    of rows at a time; `kd_w [K, n]` their token weights.

    KL is linear in the teacher's probabilities (forward) or log-probabilities (reverse), so K teachers fold
    into one `[n, vocab]` sum `acc` = Σ_k w_k p_k (forward KL) or Σ_k w_k log p_k (reverse KL), in the first
    teacher's buffer: with the student's logits, two `[n, V]` buffers live, however many teachers.
    Returns `(acc, ent)`, `ent [n]` = Σ_k w_k Σ_v p_k log p_k (forward KL; zeros otherwise). The generalized
    JSD is not linear in either: it gets each teacher's log-probs `[n, vocab]` (a list) and zeros.
    """
    acc, ent, jsd = None, kd_w.new_zeros(kd_w.shape[1]), [] if 0.0 < beta < 1.0 else None
    for t, wk in zip(teachers, kd_w):
        lt = _teacher_logits(t, sl, vocab)  # [n, vocab], made w_k p_k or (w_k) log p_k in place
        if T != 1:
            lt.div_(T)
        for r in _row_blocks(lt):
            x = lt[r]  # [rows, vocab]
            if beta == 0.0:  # w_k p_k = w_k e / Σ e with e = exp(x - max x): one exp per logit
                x.sub_(x.amax(-1, keepdim=True))
                e = x.exp()
                s = e.sum(-1)  # [rows]
                ent[r] += wk[r] * (_rowdot(e, x) / s - s.log())  # Σ_v p log p, log p = x - log s
                scale = (wk[r] / s)[:, None]
                if acc is None:
                    torch.mul(e, scale, out=x)
                else:
                    acc[r].addcmul_(e, scale)
                continue
            x.sub_(x.logsumexp(-1, keepdim=True))  # log p_k, as `log_probs`
            if jsd is None:
                x.mul_(wk[r, None])
                if acc is not None:
                    acc[r] += x
        if jsd is not None:
            jsd.append(lt)
        elif acc is None:
            acc = lt
        del lt  # a later teacher's buffer goes once folded into acc
    return (jsd if jsd is not None else acc), ent


def _jsd_sum(u: Tensor, teachers: list[Tensor], wk: Tensor, beta: float) -> Tensor:
    """`[rows]` Σ_k w_k JSD_beta(p_k || softmax(u)): the teachers' log-probs `[rows, vocab]`, weights `wk [K, rows]`."""
    ls = log_probs(u)  # [rows, vocab]
    return sum(generalized_jsd(ls, lt, beta) * w for lt, w in zip(teachers, wk))


def _cross_sum(u: Tensor, lt: Tensor, t: KDTeacher, wk: Tensor, beta: float, rest: tuple[Tensor, Tensor]) -> Tensor:
    """`[rows]` w · `cross_vocab_div` of a cross-vocabulary teacher's tempered logits `lt [rows, V_t]`."""
    return cross_vocab_div(u, lt, t.student_ids, t.teacher_ids, beta, rest=rest) * wk


def _kd_block(zr: Tensor, lse: Tensor | None, acc: Tensor | list[Tensor], r: slice, ent: Tensor, kd_w: Tensor,
              beta: float, T: float) -> tuple[Tensor, Tensor]:
    """`(Σ_k w_k div_k [rows], its gradient w.r.t. the tempered logits u = z / T [rows, vocab])` of a block of
    rows for the same-vocabulary teachers: `zr` the student's logits `[rows, vocab]`, `lse` their logsumexp
    `[rows]` when it is u's too (T = 1, the whole head compared; else None), `acc`, `ent` from `_teachers`.
    Forward KL with `lse` given does not come here: `_chunk_grad` makes its gradient with CE's."""
    wk, W = kd_w[:, r], kd_w[:, r].sum(0)[:, None]  # [K, rows], [rows, 1]
    if isinstance(acc, list):  # generalized JSD
        return _by_autograd(_jsd_sum, zr, T, [lt[r] for lt in acc], wk, beta)
    ls = zr - lse[:, None] if lse is not None else log_probs(_tempered(zr, T))  # [rows, vocab] log p_s
    a = acc[r]
    if beta == 0.0:  # Σ_k w_k KL(p_k || p_s) = ent - Σ_v acc log p_s;  d/du = W p_s - acc
        div = ent[r] - _rowdot(a, ls)
        return div, ls.exp_().mul_(W).sub_(a)
    # Σ_k w_k KL(p_s || p_k) = Σ_v p_s (W log p_s - acc);  d/du = p_s (W log p_s - acc - that)
    ps = ls.exp()
    d = ls.mul_(W).sub_(a)
    div = _rowdot(ps, d)
    return div, d.sub_(div[:, None]).mul_(ps)


def _chunk_grad(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, teachers: list[KDTeacher], sl: slice,
                kd_w: Tensor, ce_w: Tensor, kd_scale: float, beta: float, temperature: float, vocab: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(d total / d z, weighted CE, CE sum, KD sum)` of one chunk: the student's hidden states `h [n, d]`
    through its head, the teachers' rows paired with rows `sl`, per-token CE weights `ce_w [n]`, per-teacher
    token weights `kd_w [K, n]` (0: not distilled).

    The gradient is made in the student's logits' own buffer, a block of rows at a time: CE alone holds one
    `[n, V_s]` buffer, KD one more (`_teachers`' sum of the same-vocabulary teachers; the generalized JSD one per
    teacher, and one per cross-vocabulary teacher). CE, forward and reverse KL have their gradients in closed
    form; the generalized JSD's and cross-vocabulary KD's go through autograd. Forward KL at T = 1 on the whole
    head (the default) reads CE's own softmax: its gradient `W p_s - acc` is made in the same passes.
    """
    T = temperature
    same = [i for i, t in enumerate(teachers) if not t.cross]
    same_w = kd_w[same]  # [K_same, n]
    acc, ent = _teachers([teachers[i] for i in same], sl, same_w, beta, T, vocab) if same else (None, None)
    cross = []  # (teacher, its weights [n], its tempered logits [n, V_t] in a buffer of their own, the rest ids)
    for t, wk in zip(teachers, kd_w):
        if t.cross:
            lt = _teacher_logits(t, sl, t.vocab)
            rest = rest_ids(vocab, t.student_ids), rest_ids(lt.shape[1], t.teacher_ids)
            cross.append((t, wk, lt if T == 1 else lt.div_(T), rest))
    z = F.linear(h, weight, bias).float()  # [n, V_s], becomes the gradient in place
    valid = (targets != -100).float()  # [n]
    a = valid * ce_w  # [n] d total / d CE_i
    tgt = targets.clamp(min=0)[:, None]  # [n, 1]
    ce_tok = -z.gather(1, tgt)[:, 0] * valid  # [n], + lse below
    kd_tok = torch.zeros_like(a)  # [n] Σ_k w_k div_k
    whole = T == 1 and vocab == z.shape[1]  # KD's student distribution is CE's softmax
    fused = same and beta == 0.0 and whole  # forward KL: its gradient W p_s - acc is made with CE's
    for r in _row_blocks(z):
        zr = z[r]  # [rows, V_s]
        lse = torch.logsumexp(zr, -1)  # [rows]
        ce_tok[r] += lse * valid[r]
        gu = None  # [rows, vocab] d Σ_k w_k div_k / du
        if same and not fused:
            kd_tok[r], gu = _kd_block(zr[:, :vocab], lse if whole else None, acc, r, ent, same_w, beta, T)
        for t, wk, lt, rest in cross:
            if not wk[r].any():  # no shared boundary in the block: its divergence would be weighted by 0
                continue
            div, g = _by_autograd(_cross_sum, zr[:, :vocab], T, lt[r], t, wk[r], beta, rest)
            kd_tok[r] += div
            gu = g if gu is None else gu.add_(g)
        zr.sub_(lse[:, None])  # log p_s
        coef = a[r]  # [rows] d CE / dz = a (p_s - onehot): the onehot below
        if fused:  # Σ_k w_k KL(p_k || p_s) = ent - Σ_v acc log p_s;  d/dz = W p_s - acc
            kd_tok[r] += ent[r] - _rowdot(acc[r], zr)
            coef = coef + kd_scale * same_w[:, r].sum(0)
        zr.exp_().mul_(coef[:, None])
        if fused:
            zr.sub_(acc[r], alpha=kd_scale)
        if gu is not None:
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
    teachers: Sequence[TeacherHead | KDTeacher] = (),
    kd_weights: Tensor | None = None,
    *,
    ce_weights: Tensor | float = 1.0,
    kd_scale: float = 1.0,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`Σ_i ce_weights_i × CE_i + kd_scale × Σ_teachers KD sum` from hidden states, a chunk of tokens at a time.

    Equal, to float rounding, to `token_ce_sum` + `logit_kd_sum` (same kinds: `kind_beta`) and `cross_vocab_kd_sum`
    on the full logits `hidden @ weight.T + bias`, and so are its gradients to `hidden`, `weight` and `bias`.

    Args:
        hidden: `[N, d]` the student's final hidden states at the positions a loss reads.
        weight, bias: the student's head `[V_s, d]`, `[V_s]` (or None).
        targets: `[N]` next-token ids, -100 where no CE.
        teachers: per teacher a `TeacherHead` (`(logits [N, V], None, None)` or `(hidden [N, d_t], weight [V, d_t],
            bias)`, row i paired with student row i, the student's vocabulary) or a `KDTeacher` (its rows paired
            by an index; another vocabulary). No gradient reaches them.
        kd_weights: `[K, N]` weight of each teacher's KD at each token (0: not distilled, e.g. the prompt or, for
            another vocabulary, a position without a shared boundary; a fusion weight otherwise). Needed when
            `teachers` is not empty.
        ce_weights: weight of each token's CE, `[N]` or one for all (e.g. 1 / the global token count;
            0 for a token that is distilled but not learned).
        kind, beta, temperature: the divergence, as in `logit_kd_sum`.
        vocab_size: the student tokenizer's real size, KD compares the first `vocab_size` logits (None: the
            smallest head of the student's vocabulary).
        chunk_tokens: tokens per chunk; 0 or ≥ N is one chunk (None: `auto_chunk_tokens` of the head's width).

    Returns:
        `(loss, ce_sum, kd_sum)`: the differentiable scalar and its two sums, detached.

    Example:
        >>> h, w = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
        >>> teacher = (torch.randn(6, 10), None, None)  # its logits
        >>> loss, ce, kd = chunked_head_loss(h, w, None, torch.randint(0, 10, (6,)), [teacher], torch.ones(1, 6),
        ...                                  chunk_tokens=4)
        >>> loss.backward()
    """
    b = kind_beta(kind, beta)
    teachers = [t if isinstance(t, KDTeacher) else KDTeacher(t) for t in teachers]
    kd_w = hidden.new_zeros((0, hidden.shape[0]), dtype=torch.float32) if not teachers else kd_weights.float()
    widths = [t.head[0].shape[-1] if t.head[1] is None else t.head[1].shape[0] for t in teachers if not t.cross]
    vocab = vocab_size or min([weight.shape[0], *widths])
    chunk = auto_chunk_tokens(weight.shape[1]) if chunk_tokens is None else chunk_tokens
    chunk = chunk if 0 < chunk < hidden.shape[0] else max(hidden.shape[0], 1)
    ce_w = torch.as_tensor(ce_weights, dtype=torch.float32, device=hidden.device).expand(hidden.shape[0])  # [N]
    return _ChunkedHeadLoss.apply(hidden, weight, bias, targets, teachers, kd_w, ce_w, kd_scale, b, temperature,
                                  vocab, chunk)
