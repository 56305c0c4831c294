"""KV losses: hand-computed values, masking, padding invariance, reductions, segments, registry."""

from __future__ import annotations

import math

import pytest
import torch

from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.losses import LOSSES, aligned_kv_loss, build_kv_loss
from kvdistill.losses.kv import dot_and_norms


def _pair(s, t):
    """Hand vectors -> [L=1, B=1, T=n, F] tensors and a full mask."""
    s, t = torch.tensor(s, dtype=torch.float32), torch.tensor(t, dtype=torch.float32)
    return s[None, None], t[None, None], torch.ones(1, s.shape[0])


@pytest.mark.parametrize(
    ("kind", "kwargs", "expected"),
    [
        ("mse", {}, (2.5 + 0.0) / 2),  # [1, 2] vs [0, 0]; [1, 1] vs [1, 1]
        ("cosine", {}, (1.0 + 0.0) / 2),
        ("smooth_l1", {}, (0.8125 + 0.0) / 2),  # diffs 0.5 -> 0.125, 2 -> 1.5
    ],
)
def test_known_values_simple(kind, kwargs, expected):
    if kind == "smooth_l1":
        s, t, m = _pair([[0.5, 2.0], [1, 1]], [[0.0, 0.0], [1, 1]])
    elif kind == "cosine":
        s, t, m = _pair([[1.0, 0.0], [2, 2]], [[0.0, 3.0], [1, 1]])
    else:
        s, t, m = _pair([[1.0, 2.0], [1, 1]], [[0.0, 0.0], [1, 1]])
    loss, _ = build_kv_loss(kind, **kwargs)(s, t, m)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_mercator_table():
    # 100 x [0.707, 0.707] vs [0.707, 0.707]: same direction -> direction loss 0, magnitude log(100)^2
    s, t, m = _pair([[70.7, 70.7], [1.0, 0.0], [1.0, 1.0]], [[0.707, 0.707], [0.0, 1.0], [-2.0, -2.0]])
    fn = build_kv_loss("mercator", beta=0.0, reduction="sum")
    loss, metrics = fn(s[:, :, :1], t[:, :, :1], m[:, :1])
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["mercator_magnitude"].item() == pytest.approx(math.log(100) ** 2, rel=1e-5)
    loss, _ = build_kv_loss("mercator", beta=0.01)(s[:, :, :1], t[:, :, :1], m[:, :1])
    assert loss.item() == pytest.approx(0.01 * math.log(100) ** 2, rel=1e-5)  # 0.2121
    loss, metrics = fn(s, t, m)  # orthogonal -> 1, opposite (norm ratio 1/2) -> 2
    assert loss.item() == pytest.approx(0.0 + 1.0 + 2.0, abs=1e-5)
    assert metrics["cos_sim_per_layer"].tolist() == pytest.approx([(1 + 0 - 1) / 3], abs=1e-5)
    hybrid, _ = build_kv_loss("hybrid")(s, t, m)
    mse, _ = build_kv_loss("mse")(s, t, m)
    assert hybrid.item() == pytest.approx(0.8 * 1.0 + 0.2 * mse.item(), rel=1e-5)


def test_structural_per_head_values_and_5d_requirement():
    s = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])[None, None]  # [L=1, B=1, T=1, H=2, D=2]
    t = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])[None, None]
    loss, _ = build_kv_loss("structural")(s, t, torch.ones(1, 1))
    assert loss.item() == pytest.approx((0.0 + (1.0 + 0.1 * 1.0)) / 2, abs=1e-6)
    with pytest.raises(ValueError, match=r"structured \[L, B, T, H, D\].*\(1, 1, 1, 4\)"):
        build_kv_loss("structural")(s.flatten(3), t.flatten(3), torch.ones(1, 1))


def _batch(T=6, F=4, L=3):
    s = torch.randn(L, 2, T, F, requires_grad=True)
    t = torch.randn(L, 2, T, F)
    mask = torch.ones(2, T)
    mask[1, -2:] = 0
    seg = torch.tensor([[PROMPT, PROMPT, REASONING, REASONING, REASONING, ANSWER]] * 2)
    seg[1, -2:] = PAD
    return s, t, mask, seg


@pytest.mark.parametrize("kind", [k for k in LOSSES if k != "structural"])
def test_masked_positions_change_nothing(kind):
    s, t, mask, seg = _batch()
    fn = build_kv_loss(kind)
    ref, ref_m = fn(s, t, mask, seg)
    s2, t2 = s.detach().clone(), t.clone()
    s2[:, 1, -2:] = 1e6
    t2[:, 1, -2:] = float("nan")
    out, out_m = fn(s2, t2, mask, seg)
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(out_m["cos_sim_per_layer"], ref_m["cos_sim_per_layer"])
    torch.testing.assert_close(out_m["norm_ratio"], ref_m["norm_ratio"])


@pytest.mark.parametrize("kind", list(LOSSES))
def test_invariant_to_padding_amount_and_sum_over_count_is_mean(kind):
    s, t, mask, seg = _batch()
    if kind == "structural":
        s, t = s.detach().view(3, 2, 6, 2, 2), t.view(3, 2, 6, 2, 2)
    fn = build_kv_loss(kind, normalize_target=True)
    ref, ref_m = fn(s, t, mask, seg)
    pad = 5  # five more padding positions of garbage on every sample
    s_p = torch.cat([s, 50 * torch.randn(*s.shape[:2], pad, *s.shape[3:])], dim=2)
    t_p = torch.cat([t, 50 * torch.randn(*t.shape[:2], pad, *t.shape[3:])], dim=2)
    mask_p = torch.cat([mask, torch.zeros(2, pad)], dim=1)
    seg_p = torch.cat([seg, torch.full((2, pad), PAD)], dim=1)
    out, out_m = fn(s_p, t_p, mask_p, seg_p)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out_m["cos_sim"], ref_m["cos_sim"])
    total, sum_m = build_kv_loss(kind, normalize_target=True, reduction="sum")(s, t, mask, seg)
    assert sum_m["num_tokens"].item() == 10
    torch.testing.assert_close(total / sum_m["num_tokens"], ref)


def test_segment_weights_and_per_segment_metrics():
    s, t, mask, seg = _batch()
    fn = build_kv_loss("mse", segment_weights={PROMPT: 0.0, ANSWER: 2.0})
    loss, metrics = fn(s, t, mask, seg)
    assert set(k for k in metrics if k.startswith("loss_")) == {
        "loss_prompt",
        "loss_reasoning",
        "loss_answer",
    }
    # sample 0: reasoning 3 x 1 + answer 1 x 2; sample 1: reasoning 2 x 1 (the rest padded); prompts weigh 0
    assert metrics["num_tokens"].item() == pytest.approx(3 + 2 * 1 + 2)
    s2 = s.detach().clone()
    s2[:, :, :2] += 10  # prompt tokens: no effect on the loss
    torch.testing.assert_close(fn(s2, t, mask, seg)[0], loss.detach())
    # by hand: weighted mean of per-token losses (mean over layers and features)
    per_token = (s.detach() - t).pow(2).mean(-1).mean(0)  # [B, T]
    w = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 1, 1, 0, 0]], dtype=torch.float)
    assert loss.item() == pytest.approx(((per_token * w).sum() / w.sum()).item(), rel=1e-5)
    assert metrics["loss_prompt"].item() == pytest.approx(per_token[:, :2].mean().item(), rel=1e-5)
    only_prompt = seg.clone()
    only_prompt[mask.bool()] = PROMPT
    assert set(k for k in fn(s, t, mask, only_prompt)[1] if k.startswith("loss_")) == {"loss_prompt"}


@pytest.mark.parametrize("kind", list(LOSSES))
def test_all_masked_returns_zero_with_grad(kind):
    shape = (2, 2, 3, 2, 4) if kind == "structural" else (2, 2, 3, 4)
    s = torch.zeros(shape, requires_grad=True)
    loss, metrics = build_kv_loss(kind, normalize_target=True)(s, torch.zeros(shape), torch.zeros(2, 3))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.isfinite(s.grad).all() and metrics["num_tokens"].item() == 0
    assert torch.isfinite(metrics["cos_sim"])


@pytest.mark.parametrize("kind", list(LOSSES))
def test_grad_reaches_student_and_fp32_upcast(kind):
    shape = (2, 2, 3, 2, 4) if kind == "structural" else (2, 2, 3, 8)
    s = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randn(shape, dtype=torch.bfloat16)
    loss, metrics = build_kv_loss(kind)(s, t, torch.ones(2, 3))
    assert loss.dtype == torch.float32 and not metrics["cos_sim"].requires_grad
    loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_normalize_target_equalises_layer_scales():
    s, t, mask, _ = _batch()
    scale = torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1, 1)
    fn = build_kv_loss("mse", normalize_target=True)
    torch.testing.assert_close(fn(s * scale, t * scale, mask)[0], fn(s, t, mask)[0])
    assert build_kv_loss("mse")(s * scale, t * scale, mask)[0] > 100 * build_kv_loss("mse")(s, t, mask)[0]


def test_errors_and_registry():
    assert set(LOSSES) == {"mse", "smooth_l1", "cosine", "mercator", "hybrid", "structural"}
    with pytest.raises(ValueError, match="unknown KV loss"):
        build_kv_loss("kl")
    with pytest.raises(ValueError, match=r"student \(1, 2, 3, 4\) and teacher \(1, 2, 3, 5\)"):
        build_kv_loss("mse")(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask must be \[B, T\] = \[2, 3\]"):
        build_kv_loss("mse")(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match="reduction"):
        build_kv_loss("mse", reduction="none")


def test_aligned_kv_loss_averages_keys_and_values():
    from kvdistill.align.aligner import AlignedKV

    s, t, mask, seg = _batch()
    aligned = AlignedKV(s, s, t, -t, mask.bool(), seg, torch.arange(3))
    loss, metrics = aligned_kv_loss(build_kv_loss("cosine"), aligned)
    lk = build_kv_loss("cosine")(s, t, mask, seg)[0]
    lv = build_kv_loss("cosine")(s, -t, mask, seg)[0]
    torch.testing.assert_close(loss, (lk + lv) / 2)
    assert metrics["cos_sim"].abs().item() < 1e-5  # +cos and -cos cancel
    assert "k_loss_reasoning" in metrics and "v_cos_sim_per_layer" in metrics


def test_dot_and_norms_values_and_gradients_equal_autograd_of_the_plain_ops():
    s = torch.randn(3, 2, 5, 4, 6, dtype=torch.float64)
    t = torch.randn(3, 2, 5, 4, 6, dtype=torch.float64)
    s[0, 0, 0] = 0.0  # zero rows: the norm's gradient there is 0, not NaN
    t[1, 1, 2, 3] = 0.0
    gs = [torch.randn(3, 2, 5, 4, dtype=torch.float64) for _ in range(3)]

    def grads(fn):
        a, b = s.clone().requires_grad_(), t.clone().requires_grad_()
        outs = fn(a, b)
        return outs, torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, gs)), [a, b])

    outs, got = grads(dot_and_norms)
    ref_outs, want = grads(lambda a, b: ((a * b).sum(-1), a.norm(dim=-1), b.norm(dim=-1)))
    for x, y in zip([*outs, *got], [*ref_outs, *want]):
        torch.testing.assert_close(x, y)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()


@pytest.mark.parametrize("kind", ["cosine", "mercator", "hybrid"])
def test_loss_gradients_equal_the_plain_formula(kind):
    """The losses through `dot_and_norms` give the values and gradients of the textbook formula."""
    s = torch.randn(2, 2, 6, 8, requires_grad=True)  # [L, B, T, F]; the losses compute in fp32
    t = torch.randn(2, 2, 6, 8, requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    loss, _ = build_kv_loss(kind, **({} if kind == "cosine" else {"beta": 0.01}))(s, t, mask)
    cos = torch.nn.functional.cosine_similarity(s, t, dim=-1, eps=1e-8)  # [L, B, T]
    mercator = (1 - cos) + 0.01 * (s.norm(dim=-1).log() - t.norm(dim=-1).log()) ** 2
    elem = {"cosine": 1 - cos, "mercator": mercator, "hybrid": 0.8 * mercator + 0.2 * (s - t).pow(2).mean(-1)}[kind]
    ref = (elem.mean(0) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, ref)
    for a, b in zip(torch.autograd.grad(loss, [s, t]), torch.autograd.grad(ref, [s, t])):
        torch.testing.assert_close(a, b)
