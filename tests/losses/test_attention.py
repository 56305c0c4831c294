"""Attention-map loss: zero on identity, full-map reference, chunking, masks, gradients, head groups."""

from __future__ import annotations

import math

import pytest
import torch

from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.losses.attention import AttentionMapLoss, head_groups
from kvdistill.losses.kv import token_weights

SEG_W = {PROMPT: 0.5, REASONING: 2.0}


def _batch(L=2, Lt=3, B=2, T=7, Hs=(4, 2), Ht=(6, 3), Ds=4, Dt=6):
    """Student q/k `[L, B, T, H, D]` with GQA, a teacher with other L/H/D, padding at the end of row 1."""
    sq, sk = torch.randn(L, B, T, Hs[0], Ds), torch.randn(L, B, T, Hs[1], Ds)
    tq, tk = torch.randn(Lt, B, T, Ht[0], Dt), torch.randn(Lt, B, T, Ht[1], Dt)
    mix = torch.rand(L, Lt)
    mix = mix / mix.sum(1, keepdim=True)
    mask = torch.ones(B, T)
    mask[1, -2:] = 0
    seg = torch.tensor([[PROMPT, PROMPT, REASONING, REASONING, REASONING, ANSWER, ANSWER]] * B)[:, :T]
    seg[1, -2:] = PAD
    return sq, sk, tq, tk, mix, mask, seg


def _maps(q, k):
    """Full attention probabilities `[L, B, H_q, T, T]` in float64: causal, GQA (repeat_kv)."""
    q, k = q.double().transpose(2, 3), k.double().transpose(2, 3)  # [L, B, H, T, D]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    T = q.shape[3]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(future, -math.inf), future


def _reference(sq, sk, tq, tk, mix, mask, seg, seg_w=None, rows=None, reduction="mean"):
    """The definition with full `[L, B, H, T, T]` maps (float64 autograd): mixed teacher maps, KL per row."""
    keys = ((mask > 0) & (seg != PAD))[None, :, None, None, :]  # [1, B, 1, 1, T]
    z_s, _ = _maps(sq, sk)
    z_t, _ = _maps(tq, tk)
    log_q = z_s.masked_fill(~keys, -math.inf).log_softmax(-1)
    p_t = z_t.masked_fill(~keys, -math.inf).softmax(-1).nan_to_num(0.0)  # [L_t, B, H_t, T, T]
    W = head_groups(sq.shape[3], tq.shape[3]).double()
    p = torch.einsum("ml,hg,lbgct->mbhct", mix.double(), W, p_t)  # [L, B, H, T, T]
    terms = torch.where(p > 0, p * (p.log() - log_q), 0.0)
    kl = terms.nan_to_num(0.0).sum(-1).mean((0, 2))  # [B, T]
    w = token_weights(mask, seg, seg_w).double()
    if rows is not None:
        w = w * rows
    total = (torch.where(w > 0, kl, 0.0) * w).sum()
    return total if reduction == "sum" else total / w.sum()


def test_identical_is_zero_with_padding():
    sq, sk, _, _, _, mask, seg = _batch()
    sq[:, 1, -2:] = 1e3  # garbage on padding
    loss, m = AttentionMapLoss(chunk_size=3)(sq, sk, sq.clone(), sk.clone(), mask, seg)
    assert abs(loss.item()) < 1e-6 and m["attention_kl"].abs() < 1e-6


@pytest.mark.parametrize(("reduction", "compile"), [("mean", False), ("sum", False), ("mean", True)])
def test_matches_full_map_reference(reduction, compile):
    sq, sk, tq, tk, mix, mask, seg = _batch()
    loss, m = AttentionMapLoss(segment_weights=SEG_W, reduction=reduction, compile=compile)(
        sq, sk, tq, tk, mask, seg, layer_mix=mix)
    ref = _reference(sq, sk, tq, tk, mix, mask, seg, SEG_W, reduction=reduction)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert m["attention_kl_per_layer"].shape == (2,)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_chunked_equals_unchunked_and_gradient_matches_the_reference(chunk_size):
    sq, sk, tq, tk, mix, mask, seg = _batch()
    rows = torch.rand(2, 7) > 0.4
    s = [x.clone().requires_grad_(True) for x in (sq, sk)]
    s64 = [x.double().requires_grad_(True) for x in (sq, sk)]
    loss, _ = AttentionMapLoss(segment_weights=SEG_W, chunk_size=chunk_size)(*s, tq, tk, mask, seg, layer_mix=mix,
                                                                            rows=rows)
    ref = _reference(*s64, tq, tk, mix, mask, seg, SEG_W, rows=rows.double())
    loss.backward()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for a, b in zip(s, s64):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-6)


def test_gradient_reaches_student_only():
    sq, sk, tq, tk, mix, mask, seg = _batch()
    sq.requires_grad_(True), sk.requires_grad_(True), tq.requires_grad_(True), tk.requires_grad_(True)
    loss, _ = AttentionMapLoss(chunk_size=2)(sq, sk, tq, tk, mask, seg, layer_mix=mix)
    loss.backward()
    assert tq.grad is None and tk.grad is None
    assert sq.grad.abs().sum() > 0 and sk.grad.abs().sum() > 0


def test_masked_rows_and_columns_contribute_nothing():
    """Garbage at padded positions (both sides) and teacher changes on unselected rows change nothing."""
    sq, sk, tq, tk, mix, mask, seg = _batch()
    rows = torch.zeros(2, 7, dtype=torch.bool)
    rows[:, 4:6] = True
    fn = AttentionMapLoss(chunk_size=2)
    s = [x.clone().requires_grad_(True) for x in (sq, sk)]
    loss, m = fn(*s, tq, tk, mask, seg, layer_mix=mix, rows=rows)
    loss.backward()
    grads = [x.grad.clone() for x in s]
    assert s[0].grad[:, 1, -2:].abs().max() == 0 and s[1].grad[:, 1, -2:].abs().max() == 0  # padded: no grad

    sq2, sk2, tq2, tk2 = sq.clone(), sk.clone(), tq.clone(), tk.clone()
    for x in (sq2, sk2, tq2, tk2):
        x[:, 1, -2:] = 1e4 * torch.randn_like(x[:, 1, -2:])  # padded columns and rows
    tq2[:, :, :4] = torch.randn_like(tq2[:, :, :4])  # the teacher's unselected query rows
    s2 = [x.requires_grad_(True) for x in (sq2, sk2)]
    loss2, m2 = fn(*s2, tq2, tk2, mask, seg, layer_mix=mix, rows=rows)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
    for a, b in zip(s2, grads):
        torch.testing.assert_close(a.grad[:, 0], b[:, 0])
        torch.testing.assert_close(a.grad[:, 1, :-2], b[:, 1, :-2])
    assert m["attention_kl_selected"] == pytest.approx(float(m["attention_kl"]))
    assert float(m2["attention_kl_other"]) != pytest.approx(float(m["attention_kl_other"]))  # reported, not read


def test_head_groups():
    torch.testing.assert_close(head_groups(2, 6), torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1.]]) / 3)
    torch.testing.assert_close(head_groups(3, 3), torch.eye(3))
    torch.testing.assert_close(head_groups(4, 2), torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1.]]))
    # 2 student heads over 3 teacher heads: the middle one is shared half and half
    torch.testing.assert_close(head_groups(2, 3), torch.tensor([[2, 1, 0], [0, 1, 2.]]) / 3)


def test_bad_shapes_name_the_problem():
    sq, sk, tq, tk, mix, mask, seg = _batch()
    with pytest.raises(ValueError, match="layer_mix must be"):
        AttentionMapLoss()(sq, sk, tq, tk, mask, seg)  # 3 teacher layers, no mix
    with pytest.raises(ValueError, match="not a multiple of its 3 KV heads"):
        AttentionMapLoss()(sq, sk, tq[..., :4, :], tk, mask, seg, layer_mix=mix)
