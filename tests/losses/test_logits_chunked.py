"""Chunked CE + logit KD from hidden states (`kvdistill.losses.chunked`) equals the unchunked losses."""

import pytest
import torch
import torch.nn.functional as F

from kvdistill.commands.profile import measure
from kvdistill.losses import chunked, logit_kd_sum, token_ce_sum
from kvdistill.losses.chunked import KDTeacher, chunked_head_loss, resolve_chunk_tokens
from kvdistill.losses.cross_vocab import cross_vocab_kd_sum

B, T, D, V = 2, 7, 6, 13


def _close(got, ref):
    """Equal to 1e-5 of the reference's largest magnitude: fp32 rounding (each of the two paths is ~2e-7 of it
    from a float64 reference on an Intel host, up to 2.3e-6 between them on an AMD EPYC one, whose kernels block
    the sums otherwise), where an elementwise rtol would fail on a gradient's near-zero entries."""
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.detach().abs().max()))


def _problem(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g, requires_grad=True)  # [B, T, d] student final hidden states
    w = torch.randn(V, D, generator=g, requires_grad=True)  # [V, d] student head
    b = torch.randn(V, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = -100  # a prompt: no CE, no KD
    labels[1, -1] = -100  # padding
    th = torch.randn(B, T, 4, generator=g)  # teacher 1: hidden + head of another width
    tw, tb = torch.randn(V + 2, 4, generator=g), torch.randn(V + 2, generator=g)  # padded past the vocab
    tl = torch.randn(B, T, V, generator=g) * 2  # teacher 2: logits
    return h, w, b, labels, (th, tw, tb), tl


def _reference(h, w, b, labels, t1, tl, kind, temp, beta, sw):
    """token_ce_sum and logit_kd_sum on the full logits: the unchunked path."""
    logits = F.linear(h, w, b)  # [B, T, V]
    t1_logits = F.linear(t1[0], t1[1], t1[2])
    ce = token_ce_sum(logits, labels)
    kd = (logit_kd_sum(logits, t1_logits, labels, kind, temp, sw[0], beta=beta, vocab_size=V)
          + logit_kd_sum(logits, tl, labels, kind, temp, sw[1], beta=beta, vocab_size=V))
    return ce, kd


def _chunked(h, w, b, labels, t1, tl, kind, temp, beta, sw, chunk, ce_scale, kd_scale):
    """The same through chunked_head_loss: positions 0..T-2 predict labels 1..T-1, flattened to N."""
    flat = lambda x: x[:, :-1].flatten(0, 1)  # noqa: E731  [B, T-1, ...] -> [N, ...]
    targets = labels[:, 1:].flatten()  # [N]
    valid = (targets != -100).float()  # [N]
    kd_w = torch.stack([valid * sw[0].repeat_interleave(T - 1), valid * sw[1].repeat_interleave(T - 1)])  # [2, N]
    teachers = [(flat(t1[0]), t1[1], t1[2]), (flat(tl), None, None)]
    return chunked_head_loss(flat(h), w, b, targets, teachers, kd_w, ce_weights=ce_scale, kd_scale=kd_scale,
                             kind=kind, beta=beta, temperature=temp, vocab_size=V, chunk_tokens=chunk)


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)])
@pytest.mark.parametrize("chunk", [0, 1, 4, 5])
def test_chunked_equals_unchunked_loss_and_gradients(kind, beta, chunk):
    h, w, b, labels, t1, tl = _problem()
    sw, temp, ce_scale, kd_scale = torch.tensor([[1.0, 0.5], [0.25, 2.0]]), 2.0, 0.7, 1.3
    ce, kd = _reference(h, w, b, labels, t1, tl, kind, temp, beta, sw)
    ref = ce_scale * ce + kd_scale * kd
    ref_grads = torch.autograd.grad(ref, (h, w, b))
    loss, ce_c, kd_c = _chunked(h, w, b, labels, t1, tl, kind, temp, beta, sw, chunk, ce_scale, kd_scale)
    grads = torch.autograd.grad(loss * 3.0, (h, w, b))  # an upstream gradient scales all three
    for got, r in ((loss, ref), (ce_c, ce), (kd_c, kd), *zip(grads, (3.0 * g for g in ref_grads))):
        _close(got, r)


def test_masked_tokens_contribute_nothing():
    """Changing the logits of a masked position changes neither the loss nor any other gradient."""
    h, w, b, labels, t1, tl = _problem(bias=False)
    sw = torch.ones(2, B)
    loss, _, _ = _chunked(h, w, b, labels, t1, tl, "forward_kl", 1.0, 0.5, sw, 3, 1.0, 1.0)
    gh, gw = torch.autograd.grad(loss, (h, w))
    h2, tl2 = h.detach().clone(), tl.clone()
    h2[0, 1] += 5.0  # position 1 of sample 0 predicts label 2: masked
    tl2[0, 1] -= 3.0
    h2.requires_grad_()
    loss2, _, _ = _chunked(h2, w, b, labels, t1, tl2, "forward_kl", 1.0, 0.5, sw, 3, 1.0, 1.0)
    gh2, gw2 = torch.autograd.grad(loss2, (h2, w))
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(gw2, gw)
    assert gh2[0, 1].abs().max() == 0 and gh[0, 1].abs().max() == 0


def test_temperature_scales_like_hinton():
    """At identical student and teacher the KD is 0 at any temperature; the T² factor is applied."""
    h, w, b, labels, t1, tl = _problem()
    sw = torch.ones(2, B)
    kd = {t: _chunked(h, w, b, labels, t1, tl, "forward_kl", t, 0.5, sw, 4, 0.0, 1.0)[2] for t in (1.0, 4.0)}
    ref = {t: _reference(h, w, b, labels, t1, tl, "forward_kl", t, 0.5, sw)[1] for t in (1.0, 4.0)}
    torch.testing.assert_close(kd[4.0], ref[4.0])
    assert float(kd[4.0]) != pytest.approx(float(kd[1.0]), rel=1e-3)
    logits = F.linear(h, w, b).detach()
    flat = logits[:, :-1].flatten(0, 1)
    same = chunked_head_loss(h[:, :-1].flatten(0, 1), w, b, labels[:, 1:].flatten(), [(flat, None, None)],
                             torch.ones(1, flat.shape[0]), ce_weights=0.0, temperature=3.0, chunk_tokens=2)[0]
    # the head's logits in chunks of 2 rows vs all at once: fp32 rounding apart (up to 1.1e-5 after T² = 9 on an
    # AMD EPYC host), where a missing or wrong T² or a mismatched pair gives O(0.1)
    assert float(same.detach()) == pytest.approx(0.0, abs=1e-4)


def test_bf16_hidden_gets_a_bf16_gradient_close_to_fp32():
    h, w, b, labels, t1, tl = _problem()
    sw = torch.ones(2, B)
    loss, _, _ = _chunked(h, w, b, labels, t1, tl, "jsd", 1.0, 0.5, sw, 4, 1.0, 1.0)
    (gh,) = torch.autograd.grad(loss, h)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    loss_b, _, _ = _chunked(hb, wb, b.detach().bfloat16(), labels, t1, tl, "jsd", 1.0, 0.5, sw, 4, 1.0, 1.0)
    ghb, gwb = torch.autograd.grad(loss_b, (hb, wb))
    assert ghb.dtype == torch.bfloat16 and gwb.dtype == torch.bfloat16
    torch.testing.assert_close(ghb.float(), gh, atol=0.1, rtol=0.1)


def test_resolve_chunk_tokens():
    assert resolve_chunk_tokens(0, 10**6, 10**6, 896) == 0
    assert resolve_chunk_tokens(256, 10, 10, 8) == 256
    assert resolve_chunk_tokens(None, 2048, 151_936, 896) == 224  # Qwen2.5-0.5B head: chunks of d / 4
    assert resolve_chunk_tokens(None, 2048, 262_144, 640) == 160  # Gemma-3-270m's
    assert resolve_chunk_tokens(None, 2048, 151_936, 64) == 128  # at least 128
    assert resolve_chunk_tokens(None, 64, 1000, 64) == 0  # tiny: one pass
    assert resolve_chunk_tokens(None, 64, 1000, 64, rows=64) == 0  # KD reads every row: the same
    # KD reads fewer rows than B·T (an answer selection): chunked, so only those rows go through the head
    assert resolve_chunk_tokens(None, 64, 1000, 64, rows=20) == 128
    assert resolve_chunk_tokens(0, 64, 1000, 64, rows=20) == 0  # off stays off


def test_per_token_ce_weights():
    """A [N] CE weight: the weighted sum of per-token CE (0: a token distilled but not learned)."""
    h, w, b, labels, _, _ = _problem()
    hf, targets = h[:, :-1].flatten(0, 1), labels[:, 1:].flatten()  # [N, d], [N]
    cw = torch.rand(targets.shape[0], generator=torch.Generator().manual_seed(3))
    loss, ce, _ = chunked_head_loss(hf, w, b, targets, ce_weights=cw, chunk_tokens=4)
    per_tok = F.cross_entropy(F.linear(hf, w, b), targets, ignore_index=-100, reduction="none")  # [N]
    torch.testing.assert_close(loss, (per_tok * cw).sum())
    torch.testing.assert_close(ce, per_tok.sum())
    torch.testing.assert_close(torch.autograd.grad(loss, w)[0], torch.autograd.grad((per_tok * cw).sum(), w)[0])


@pytest.mark.parametrize("temp", [1.0, 2.0])  # 1: log p_s from CE's logsumexp
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_row_blocks_equal_one_block(kind, temp, monkeypatch):
    """Softmax temporaries a few rows at a time (as at real vocabulary sizes) change nothing."""
    h, w, b, labels, t1, tl = _problem()
    sw = torch.tensor([[1.0, 0.5], [0.25, 2.0]])
    ce, kd = _reference(h, w, b, labels, t1, tl, kind, temp, 0.3, sw)
    ref_grads = torch.autograd.grad(ce + kd, (h, w, b))
    monkeypatch.setattr(chunked, "ROW_BLOCK", 2 * V)  # 2 rows per block, 3 blocks in a chunk of 5
    loss, _, kd_c = _chunked(h, w, b, labels, t1, tl, kind, temp, 0.3, sw, 5, 1.0, 1.0)
    torch.testing.assert_close(kd_c, kd, atol=1e-5, rtol=1e-5)
    for g, r in zip(torch.autograd.grad(loss, (h, w, b)), ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


VT, K, NT = 11, 7, 17  # the cross-vocab teacher: its tokenizer's size (head padded by 2 rows), shared tokens, rows


def _cross_problem(seed=1, given_logits=False):
    """A same-vocab teacher's logits and a cross-vocab teacher (hidden + head, or its logits), each of its own rows
    `[NT, ...]` paired with the student's `N` rows by an index; the cross teacher at some rows only (its shared
    boundaries: weight 0 elsewhere, two whole row blocks of 2 rows among them)."""
    g = torch.Generator().manual_seed(seed)
    h, w, b, labels, _, _ = _problem(seed)
    n = B * (T - 1)
    t_h, t_w, t_b = torch.randn(NT, 5, generator=g), torch.randn(VT + 2, 5, generator=g), torch.randn(VT + 2, generator=g)
    head = (F.linear(t_h, t_w, t_b), None, None) if given_logits else (t_h, t_w, t_b)
    si, ti = torch.randperm(V, generator=g)[:K].sort().values, torch.randperm(VT, generator=g)[:K]
    cross_w = (torch.rand(n, generator=g) > 0.3) * torch.rand(n, generator=g)  # [N]
    cross_w[4:8] = 0
    same_logits = torch.randn(NT, V, generator=g) * 2  # [NT, V]
    same_rows, cross_rows = torch.randint(0, NT, (n,), generator=g), torch.randint(0, NT, (n,), generator=g)
    return h, w, b, labels, (same_logits, same_rows), (head, cross_rows, si, ti), cross_w


def _mixed_check(kind, temp, chunk, given_logits=False):
    """CE + a same-vocab and a cross-vocab teacher read through row indices, chunked, against the dense losses."""
    h, w, b, labels, (tl, same_rows), (head, rows, si, ti), cross_w = _cross_problem(given_logits=given_logits)
    beta, ce_scale, kd_scale = 0.3, 0.7, 1.3
    hf, targets = h[:, :-1].flatten(0, 1), labels[:, 1:].flatten()  # [N, d], [N]
    valid = (targets != -100).float()  # [N] the same-vocab teacher reads the targets' rows, the cross one its own
    s = F.linear(hf, w, b)  # [N, V]
    t_cross = (head[0] if head[1] is None else F.linear(*head))[rows]  # [N, VT + 2]
    kd = (logit_kd_sum(s[:, None].expand(-1, 2, -1), tl[same_rows][:, None].expand(-1, 2, -1),
                       F.pad(targets[:, None], (1, 0)), kind, temp, valid, beta=beta)
          + cross_vocab_kd_sum(s, t_cross, si, ti, cross_w, kind, temp, beta, student_vocab=V, teacher_vocab=VT))
    ref = ce_scale * F.cross_entropy(s, targets, ignore_index=-100, reduction="sum") + kd_scale * kd
    ref_grads = torch.autograd.grad(ref, (h, w, b))
    teachers = [KDTeacher((tl, None, None), same_rows), KDTeacher(head, rows, si, ti, VT)]
    loss, _, kd_c = chunked_head_loss(hf, w, b, targets, teachers, torch.stack([valid, cross_w]), ce_weights=ce_scale,
                                      kd_scale=kd_scale, kind=kind, beta=beta, temperature=temp, vocab_size=V,
                                      chunk_tokens=chunk)
    for got, r in ((loss, ref), (kd_c, kd), *zip(torch.autograd.grad(loss, (h, w, b)), ref_grads)):
        _close(got, r)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temp", [1.0, 2.0])
@pytest.mark.parametrize("chunk", [0, 1, 4, 5])
def test_cross_vocab_chunked_equals_dense(kind, temp, chunk, monkeypatch):
    """Cross-vocab KD through `chunked_head_loss` (its rows by an index, blocks of 2 rows, some without a shared
    boundary) = `cross_vocab_kd_sum` on the full logits, beside a same-vocab teacher and CE; gradients too."""
    monkeypatch.setattr(chunked, "ROW_BLOCK", 2 * V)
    _mixed_check(kind, temp, chunk)


def test_cross_vocab_chunked_from_given_teacher_logits():
    _mixed_check("forward_kl", 2.0, 4, given_logits=True)


def _wrong_normalisation(z):
    return z - z.logsumexp(0, keepdim=True)  # over the rows, not the vocabulary


def _rows_ignored(t, sl, vocab, orig=chunked._teacher_logits):
    return orig(KDTeacher(t.head, None, t.student_ids, t.teacher_ids, t.vocab), sl, vocab)


@pytest.mark.parametrize("name,planted", [("log_probs", _wrong_normalisation), ("_teacher_logits", _rows_ignored)])
def test_a_planted_bug_fails_the_comparison(name, planted, monkeypatch):
    """The comparison above can fail: log-probabilities normalised over the wrong axis, or a teacher's row index
    ignored (row i read for student row i), each breaks it."""
    monkeypatch.setattr(chunked, name, planted)
    with pytest.raises(AssertionError):
        _mixed_check("reverse_kl", 2.0, 4)


def test_kd_peak_memory_is_ce_peak_plus_one_chunk(monkeypatch):
    """Peak bytes allocated in fwd + bwd (torch.profiler): CE holds the head's and hidden states' gradients and
    one chunk's `[n, V]` logits (their gradient made in place); KD from any number of teachers one chunk more."""
    n_tok, d, v, chunk = 64, 8, 4096, 32
    chunk_bytes, slack = chunk * v * 4, chunk * v * 4 // 4  # slack: row blocks of 2 rows and [n]-sized tensors
    monkeypatch.setattr(chunked, "ROW_BLOCK", 2 * v)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n_tok, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n_tok,), generator=g)
    heads = [(torch.randn(n_tok, d, generator=g), torch.randn(v, d, generator=g), None) for _ in range(2)]

    def peak(teachers, kind="forward_kl"):
        def step():
            h.grad = w.grad = None
            chunked_head_loss(h, w, None, targets, teachers, torch.ones(len(teachers), n_tok), kind=kind,
                              chunk_tokens=chunk)[0].backward()
        return measure(step)[2]

    ce = peak([])
    grads = (v + n_tok) * d * 4  # grad_w, grad_h
    assert ce <= grads + chunk_bytes + slack
    for teachers, kind in (([heads[0]], "forward_kl"), (heads, "forward_kl"), (heads, "reverse_kl")):
        assert peak(teachers, kind) <= ce + chunk_bytes + slack, (len(teachers), kind)
