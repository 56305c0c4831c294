"""Relation loss: zero on identity, slow reference, invariances, padding, chunking, gradients, args."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.losses import KVLoss, RelationKVLoss, aligned_kv_loss, build_kv_loss, relation
from kvdistill.losses.kv import token_weights
from kvdistill.losses.relation import (
    _FILL,
    _row_kl_terms,
    _RowKL,
    fused_row_kl_terms,
    parse_rows,
    row_logits,
    select_rows,
)

SEG_W = {PROMPT: 0.0, REASONING: 2.0, ANSWER: 0.5}


def _batch(L=2, B=2, T=6, Fs=8, Ft=12):
    """Random student/teacher with tail padding in row 1 and all three segments."""
    s, t = torch.randn(L, B, T, Fs), torch.randn(L, B, T, Ft)
    mask = torch.ones(B, T)
    mask[1, -2:] = 0
    seg = torch.tensor([[PROMPT, PROMPT, REASONING, REASONING, ANSWER, ANSWER]] * B)[:, :T]
    seg[1, -2:] = PAD
    return s, t, mask, seg


def _reference(s, t, mask, seg, R, tau=1.0, seg_w=None, reduction="mean"):
    """Slow loops over layers, batch, relation heads and rows."""
    L, B, T = s.shape[:3]
    s, t = s.flatten(3).double(), t.flatten(3).double()
    ds, dt = s.shape[-1] // R, t.shape[-1] // R
    total, count = 0.0, 0.0
    for b in range(B):
        keys = [j for j in range(T) if mask[b, j] > 0 and seg[b, j] != PAD]
        for i in range(T):
            w = 0.0 if (mask[b, i] == 0 or seg[b, i] == PAD) else float(mask[b, i])
            w *= (seg_w or {}).get(int(seg[b, i]), 1.0)
            if w == 0:
                continue
            row = 0.0
            for layer in range(L):
                for r in range(R):
                    xs, xt = s[layer, b, :, r * ds : (r + 1) * ds], t[layer, b, :, r * dt : (r + 1) * dt]
                    ls = torch.stack([xs[i] @ xs[j] for j in keys]) / math.sqrt(ds) / tau
                    lt = torch.stack([xt[i] @ xt[j] for j in keys]) / math.sqrt(dt) / tau
                    ps, pt = ls.softmax(0), lt.softmax(0)
                    row += sum(float(pt[k] * (pt[k].log() - ps[k].log())) for k in range(len(keys)))
            total += w * row / (L * R)
            count += w
    return total if reduction == "sum" else total / count


def test_identical_is_zero_with_padding_and_masked_segment():
    s, _, mask, seg = _batch()
    s[1, 1, -2:] = 1e3  # garbage on padding
    for fn in (RelationKVLoss(relation_heads=2), RelationKVLoss(relation_heads=4, segment_weights={PROMPT: 0.0})):
        loss, metrics = fn(s, s.clone(), mask, seg)
        assert abs(loss.item()) < 1e-6
        assert abs(metrics["relation_kl"].item()) < 1e-6
    other = torch.randn_like(s)
    assert RelationKVLoss(relation_heads=2)(s, other, mask, seg)[0].item() > 1e-3  # the test can fail


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_slow_reference(reduction, compile):
    s, t, mask, seg = _batch()
    mask[0, 2] = 0.5  # a fractional weight: row weight and key validity
    fn = RelationKVLoss(relation_heads=2, temperature=0.7, reduction=reduction, segment_weights=SEG_W, compile=compile)
    loss, metrics = fn(s, t, mask, seg)
    ref = _reference(s, t, mask, seg, R=2, tau=0.7, seg_w=SEG_W, reduction=reduction)
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert metrics["num_tokens"].item() == pytest.approx(float(token_weights(mask, seg, SEG_W).sum()))
    assert set(metrics) >= {"relation_kl", "relation_kl_per_layer", "num_tokens", "loss_prompt", "loss_answer"}
    if reduction == "mean":
        assert metrics["relation_kl"].item() == pytest.approx(loss.item(), rel=1e-5)
    # prompt rows weigh 0 in the loss but still have a per-segment metric
    assert metrics["loss_prompt"].item() > 0


def _block_orthogonal(F, R):
    d = F // R
    return torch.block_diag(*[torch.linalg.qr(torch.randn(d, d))[0] for _ in range(R)])


@pytest.mark.parametrize(("R", "Ft"), [(4, 16), (1, 12)])
def test_invariant_to_orthogonal_teacher_rotation(R, Ft):
    s, t, mask, seg = _batch(Fs=16, Ft=Ft)
    fn = RelationKVLoss(relation_heads=R)
    base = fn(s, t, mask, seg)[0]
    rotated = fn(s, t @ _block_orthogonal(Ft, R), mask, seg)[0]
    assert rotated.item() == pytest.approx(base.item(), rel=1e-5, abs=1e-6)
    # a rotation mixing the relation-head chunks does change the loss
    if R > 1:
        mixed = fn(s, t @ torch.linalg.qr(torch.randn(Ft, Ft))[0], mask, seg)[0]
        assert abs(mixed.item() - base.item()) > 1e-4


def test_invariant_to_head_layout_and_teacher_size():
    s, t, mask, seg = _batch(Fs=16, Ft=16)
    fn = RelationKVLoss(relation_heads=4)
    flat = fn(s, t, mask, seg)[0]
    for shape in ((2, 8), (4, 4)):
        five_d = fn(s.unflatten(-1, shape), t.unflatten(-1, shape), mask, seg)[0]
        assert five_d.item() == pytest.approx(flat.item(), rel=1e-6)
    s, t, mask, seg = _batch(Fs=16, Ft=24)
    loss, _ = fn(s, t.unflatten(-1, (3, 8)), mask, seg)
    assert torch.isfinite(loss) and loss.item() > 0
    assert loss.item() == pytest.approx(_reference(s, t, mask, seg, R=4), rel=1e-5)


def test_feature_size_not_divisible_names_both_numbers():
    s, t, mask, seg = _batch(Fs=16, Ft=12)
    with pytest.raises(ValueError, match=r"teacher feature size 12 .*relation_heads=8"):
        RelationKVLoss(relation_heads=8)(s, t, mask, seg)
    with pytest.raises(ValueError, match="share"):
        RelationKVLoss(relation_heads=4)(s, t[:, :, :-1], mask, seg)


def test_gradient_reaches_student_only():
    s, t, mask, seg = _batch()
    s.requires_grad_(True)
    t.requires_grad_(True)
    loss, metrics = RelationKVLoss(relation_heads=2, segment_weights=SEG_W)(s, t, mask, seg)
    loss.backward()
    assert t.grad is None
    assert s.grad is not None and torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    assert s.grad[1, 1, -2:].abs().max() == 0  # padded tokens are neither rows nor keys
    assert not any(v.requires_grad for v in metrics.values())


def test_padding_columns_never_matter():
    s, t, mask, seg = _batch()
    fn = RelationKVLoss(relation_heads=2, segment_weights=SEG_W)
    base = fn(s, t, mask, seg)[0]
    # garbage on existing padding, and a real-mask token marked as padding segment
    s2, t2 = s.clone(), t.clone()
    s2[:, 1, -2:], t2[:, 1, -2:] = 1e4, -3e3
    assert fn(s2, t2, mask, seg)[0].item() == pytest.approx(base.item(), rel=1e-6)
    # extra padded tokens appended
    s3 = torch.cat([s, 50 * torch.randn(2, 2, 3, 8)], dim=2)
    t3 = torch.cat([t, 50 * torch.randn(2, 2, 3, 12)], dim=2)
    m3 = torch.cat([mask, torch.zeros(2, 3)], dim=1)
    g3 = torch.cat([seg, torch.full((2, 3), PAD)], dim=1)
    assert fn(s3, t3, m3, g3)[0].item() == pytest.approx(base.item(), rel=1e-6)
    # mask 1 but segment -1 is not a key either
    m4 = torch.cat([mask, torch.ones(2, 3)], dim=1)
    assert fn(s3, t3, m4, g3)[0].item() == pytest.approx(base.item(), rel=1e-6)
    # whereas a valid extra token does change the rows' key set
    assert abs(fn(s3, t3, m4, torch.cat([seg, torch.full((2, 3), ANSWER)], 1))[0].item() - base.item()) > 1e-4


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_equals_unchunked(reduction):
    s, t, mask, seg = _batch(T=10)
    seg = torch.where(mask > 0, torch.randint(0, 3, (2, 10)), PAD)
    kw = dict(relation_heads=4, reduction=reduction, segment_weights=SEG_W)
    s1, s2 = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    full, mf = RelationKVLoss(**kw)(s1, t, mask, seg)
    chunked, mc = RelationKVLoss(chunk_size=3, **kw)(s2, t, mask, seg)
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)
    assert mc.keys() == mf.keys()
    for k in mf:
        torch.testing.assert_close(mc[k], mf[k])
    full.backward()
    chunked.backward()
    torch.testing.assert_close(s2.grad, s1.grad)
    with torch.no_grad():
        assert RelationKVLoss(chunk_size=3, **kw)(s, t, mask, seg)[0].item() == pytest.approx(full.item(), rel=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_valid_token_is_zero_with_graph(reduction):
    s, t, mask, seg = _batch()
    s.requires_grad_(True)
    for m, g in ((torch.zeros_like(mask), seg), (mask, torch.full_like(seg, PAD))):
        s.grad = None
        loss, metrics = RelationKVLoss(relation_heads=2, reduction=reduction)(s, t, m, g)
        assert loss.item() == 0 and torch.isfinite(loss)
        loss.backward()
        assert torch.isfinite(s.grad).all() and s.grad.abs().max() == 0
        assert metrics["num_tokens"].item() == 0 and torch.isfinite(metrics["relation_kl"])


def test_temperature_direction_and_bad_args():
    s, t, mask, seg = _batch()
    losses = [RelationKVLoss(relation_heads=2, temperature=tau)(s, t, mask, seg)[0].item() for tau in (0.5, 1, 4)]
    assert losses[0] > losses[1] > losses[2] > 0
    for kwargs, match in [
        ({"relation_heads": 0}, "relation_heads"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"reduction": "max"}, "reduction"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"segment_weights": {0: -1.0}}, "segment weights"),
    ]:
        with pytest.raises(ValueError, match=match):
            RelationKVLoss(**kwargs)


def test_aligned_kv_loss_with_relation_is_mean_of_k_and_v():
    sk, tk, mask, seg = _batch()
    sv, tv, _, _ = _batch()
    fn = RelationKVLoss(relation_heads=2)
    aligned = SimpleNamespace(student_keys=sk, teacher_keys=tk, student_values=sv, teacher_values=tv, mask=mask,
                              segment_ids=seg)
    loss, metrics = aligned_kv_loss(fn, aligned)
    lk, mk = fn(sk, tk, mask, seg)
    lv, mv = fn(sv, tv, mask, seg)
    assert loss.item() == pytest.approx((lk.item() + lv.item()) / 2, rel=1e-6)
    assert metrics["relation_kl"].item() == pytest.approx((mk["relation_kl"] + mv["relation_kl"]).item() / 2)
    assert metrics["num_tokens"].item() == mk["num_tokens"].item()
    assert {"k_relation_kl", "v_relation_kl", "k_loss_answer", "v_num_tokens"} <= set(metrics)


def test_token_weights_function_matches_kvloss():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.5, 0.0]])
    seg = torch.tensor([[PROMPT, REASONING, ANSWER, ANSWER, PAD]])
    expected = torch.tensor([[0.0, 2.0, 1.0, 0.5, 0.0]])
    torch.testing.assert_close(token_weights(mask, seg, {PROMPT: 0.0, REASONING: 2.0}), expected)
    torch.testing.assert_close(token_weights(mask, None, {PROMPT: 0.0}), mask)
    kv = KVLoss(segment_weights={PROMPT: 0.0, REASONING: 2.0})
    torch.testing.assert_close(kv.token_weights(mask, seg), expected)
    s, t = torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)
    loss, _ = build_kv_loss("mse", segment_weights={PROMPT: 0.0, REASONING: 2.0})(s, t, mask, seg)
    per_token = (s - t).pow(2).mean((0, 3))  # [1, 5]
    assert loss.item() == pytest.approx(((per_token * expected).sum() / expected.sum()).item(), rel=1e-6)


def test_row_kl_hand_written_backward_passes_gradcheck():
    """float64 gradcheck of the custom backward, with masked keys (garbage features) and a keyless row."""
    N, C, T = 3, 4, 5
    s_rows, s_keys = torch.randn(N, C, 2, dtype=torch.float64), torch.randn(N, T, 2, dtype=torch.float64)
    t_rows, t_keys = torch.randn(N, C, 3, dtype=torch.float64), torch.randn(N, T, 3, dtype=torch.float64)
    bias = torch.zeros(N, T, 1, dtype=torch.float64)
    bias[0, -2:], s_keys[0, -2:] = _FILL, 1e4  # masked keys with garbage
    bias[2] = _FILL  # no key at all

    def fn(rows, keys):
        return _RowKL.apply(rows, keys, bias, row_logits(t_rows, t_keys, bias), None, None)

    assert torch.autograd.gradcheck(fn, (s_rows.requires_grad_(True), s_keys.requires_grad_(True)))
    s_keys.grad = None
    fn(s_rows, s_keys).sum().backward()
    assert s_keys.grad[0, -2:].abs().max() == 0 and s_keys.grad[2].abs().max() == 0


def _autograd_loss(s, t, mask, seg, R, tau=1.0, seg_w=None, reduction="mean"):
    """Plain float64 autograd version of the docstring formula (vectorised, no custom backward)."""
    keys = ((mask > 0) & (seg != PAD))[None, :, None, None, :]  # [1, B, 1, 1, T]

    def log_rel(x):  # [L, B, R, T, T]
        x = x.double().flatten(3).unflatten(3, (R, -1)).transpose(2, 3)
        return (x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1]) / tau).masked_fill(~keys, -1e30).log_softmax(-1)

    log_s, log_t = log_rel(s), log_rel(t)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean((0, 2))  # [B, T]
    w = token_weights(mask, seg, seg_w).double()
    total = (kl * w).sum()
    return total if reduction == "sum" else total / w.sum()


@pytest.mark.parametrize(("chunk_size", "compile"), [(None, True), (4, True), (None, False)])
def test_gradient_matches_plain_autograd(chunk_size, compile):
    s, t, mask, seg = _batch(T=10, Fs=8, Ft=12)
    seg = torch.where(mask > 0, torch.randint(0, 3, (2, 10)), PAD)
    fn = RelationKVLoss(relation_heads=2, temperature=0.7, segment_weights=SEG_W, chunk_size=chunk_size,
                        compile=compile)
    s1, s2 = s.clone().requires_grad_(True), s.double().requires_grad_(True)
    loss = fn(s1, t, mask, seg)[0]
    ref = _autograd_loss(s2, t, mask, seg, R=2, tau=0.7, seg_w=SEG_W)
    loss.backward()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(s1.grad.double(), s2.grad, rtol=1e-4, atol=1e-6)


def test_backward_twice_with_retain_graph():
    s, t, mask, seg = _batch()
    s.requires_grad_(True)
    loss, _ = RelationKVLoss(relation_heads=2)(s, t, mask, seg)
    loss.backward(retain_graph=True)
    first = s.grad.clone()
    loss.backward()
    torch.testing.assert_close(s.grad, 2 * first)


def test_compiled_row_terms_equal_the_eager_ops():
    """The fused (compiled) row terms give the eager KL and Q - P, masked keys and a keyless row included."""
    fused = fused_row_kl_terms("cpu")
    if fused is None:
        pytest.skip("torch.compile cannot build on this machine (the eager path is tested above)")
    N, C, T = 5, 7, 9
    z_t, z_s = torch.randn(N, C, T) * 3, torch.randn(N, C, T) * 3
    z_t[0, :, -3:] += _FILL  # masked keys, as the bias makes them
    z_s[0, :, -3:] += _FILL
    z_t[2], z_s[2] = _FILL, _FILL  # a row block without any key: uniform on both sides, KL 0
    kl, dq = fused(z_t, z_s)
    ref_kl, ref_dq = _row_kl_terms(z_t, z_s)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dq, ref_dq, rtol=1e-5, atol=1e-6)
    assert dq[0, :, -3:].abs().max() == 0 and kl[2].abs().max() < 1e-6
    p, q = z_t.softmax(-1), z_s.softmax(-1)  # the definition, on a row with all keys
    assert kl[1, 0].item() == pytest.approx((p[1, 0] * (p[1, 0].log() - q[1, 0].log())).sum().item(), rel=1e-5)


def test_compile_failure_falls_back_to_the_eager_ops(monkeypatch, caplog):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    fused_row_kl_terms.cache_clear()
    monkeypatch.setattr(relation.torch, "compile", broken)
    try:
        with caplog.at_level("WARNING"):
            assert fused_row_kl_terms("cpu") is None
        assert "torch.compile is unavailable on cpu (RuntimeError: no C++ compiler)" in caplog.text
        s, t, mask, seg = _batch()
        loss, _ = RelationKVLoss(relation_heads=2)(s, t, mask, seg)  # still computed, by the eager ops
        assert loss.item() == pytest.approx(_reference(s, t, mask, seg, R=2), rel=1e-5)
    finally:
        fused_row_kl_terms.cache_clear()


def test_parse_and_select_rows():
    seg = torch.tensor([[PROMPT, REASONING, ANSWER, ANSWER, PAD]])
    assert parse_rows("all") is None and select_rows("all", seg) is None
    assert parse_rows("answer") == (ANSWER,) and parse_rows(" prompt, answer ") == (PROMPT, ANSWER)
    assert select_rows("answer", seg).tolist() == [[False, False, True, True, False]]
    assert select_rows("prompt,reasoning", seg).tolist() == [[True, True, False, False, False]]
    field = torch.tensor([[1, 0, -100, 1, -100]])  # a 0/1 mask; -100 where no span covers the token
    assert select_rows("field:result", seg, {"result": field}).tolist() == [[True, False, False, True, False]]
    for bad in ("answers", "", "field:", "prompt,,x"):
        with pytest.raises(ValueError, match="relation_rows"):
            parse_rows(bad)
    with pytest.raises(ValueError, match="no token field 'result'"):
        select_rows("field:result", seg, {"other": field})


def test_rows_select_the_loss_and_split_the_metrics():
    """The loss reads only the selected rows (the reference over them); the metrics split the rest."""
    s, t, mask, seg = _batch()
    rows = select_rows("reasoning,answer", seg)
    fn = RelationKVLoss(relation_heads=2, chunk_size=4)
    loss, m = fn(s, t, mask, seg, rows=rows)
    # rows outside the selection are still keys, so the reference keeps them as keys and weighs them 0
    expected = _reference(s, t, mask, seg, R=2, seg_w={PROMPT: 0.0})
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert float(m["relation_kl_selected"]) == pytest.approx(loss.item(), rel=1e-5)
    assert float(m["relation_kl_other"]) == pytest.approx(_reference(s, t, mask, seg, R=2,
                                                                      seg_w={REASONING: 0.0, ANSWER: 0.0}), rel=1e-5)
    _, m_all = fn(s, t, mask, seg)
    assert "relation_kl_other" not in m_all and float(m_all["relation_kl_selected"]) == pytest.approx(
        float(m_all["relation_kl"]))
