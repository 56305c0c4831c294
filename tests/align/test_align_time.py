"""Time alignment: exact interpolation, identity, segment boundaries, padding, errors."""

from __future__ import annotations

import pytest
import torch

from kvdistill.align.layer_map import apply_layer_map, sparse_layer_map
from kvdistill.align.time import resample, resample_kv, time_index
from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING


def _linear_signal(mask: torch.Tensor) -> torch.Tensor:
    """x[b, t] = 3 * (rank of t among the valid tokens) + 1, shaped [L=2, B, H=1, T, D=2]."""
    rank = (mask.cumsum(1) - 1).float()  # [B, T]
    x = 3 * rank + 1
    return torch.stack([x, -x], -1)[None, :, None].expand(2, -1, 1, -1, -1).contiguous()


@pytest.mark.parametrize("left_pad", [False, True])
def test_interpolation_is_exact_on_linear_signals(left_pad):
    # teacher: 5 valid of 7 (2 pads), student: 4 valid of 6 -> u = i * 4 / 3
    t_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    s_mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    if left_pad:
        t_mask, s_mask = t_mask.flip(1), s_mask.flip(1)
    x = _linear_signal(t_mask)
    idx = time_index(t_mask, None, s_mask, None, mode="global")
    out = resample(x, idx, time_dim=3)  # [L, B, H, T_s, D]
    u = torch.arange(4) * 4 / 3
    valid = idx.valid[0]
    assert valid.tolist() == s_mask[0].bool().tolist()
    torch.testing.assert_close(out[0, 0, 0, valid, 0], 3 * u + 1)
    torch.testing.assert_close(out[1, 0, 0, valid, 1], -(3 * u + 1))


def test_index_mode_is_identity_when_lengths_match():
    x = torch.randn(3, 2, 2, 5, 4)
    mask = torch.ones(2, 5)
    idx = time_index(mask, None, mask, None, mode="index")
    torch.testing.assert_close(resample(x, idx, time_dim=3), x, rtol=0, atol=0)
    # segment mode with identical segments is the identity too
    seg = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, 1, 2]])
    torch.testing.assert_close(resample(x, time_index(mask, seg, mask, seg), time_dim=3), x)


def test_index_mode_rejects_different_lengths():
    with pytest.raises(ValueError, match=r"teacher T=7 and student T=5"):
        time_index(torch.ones(1, 7), None, torch.ones(1, 5), None, mode="index")


def test_segment_boundaries_respected_with_padding_and_per_sample_lengths():
    P, R, A = PROMPT, REASONING, ANSWER
    # teacher: sample 0 right-padded, sample 1 left-padded; segment lengths differ per sample
    t_seg = torch.tensor(
        [
            [P, P, P, R, R, R, R, R, A, A, PAD, PAD],
            [PAD, PAD, PAD, P, P, R, R, R, R, A, A, A],
        ]
    )
    s_seg = torch.tensor(
        [
            [PAD, PAD, P, P, R, R, R, A, A],  # left-padded student
            [P, P, P, P, R, R, A, PAD, PAD],
        ]
    )
    t_mask, s_mask = (t_seg >= 0).long(), (s_seg >= 0).long()
    idx = time_index(t_mask, t_seg, s_mask, s_seg, mode="segment")
    assert torch.equal(idx.valid, s_mask.bool())
    b = torch.arange(2)[:, None]
    for pos in (idx.lo, idx.hi):  # every read stays inside the student token's own segment
        read_seg = t_seg[b, pos]
        assert torch.equal(read_seg[idx.valid], s_seg[idx.valid])
    # the values: teacher x = 10 * segment + rank-in-segment; sample 0 reasoning: 3 students over 5 teachers
    rank = torch.zeros_like(t_seg, dtype=torch.float)
    for s in (P, R, A):
        m = t_seg == s
        rank += (m.cumsum(1) - 1).clamp(min=0) * m
    x = (10 * t_seg.clamp(min=0) + rank)[None, :, None, :, None]  # [1, B, 1, T_t, 1]
    out = resample(x, idx, time_dim=3)[0, :, 0, :, 0]  # [B, T_s]
    torch.testing.assert_close(out[0, 2:], torch.tensor([0.0, 2.0, 10.0, 12.0, 14.0, 20.0, 21.0]))
    # sample 1: prompt 4 students over 2 teachers -> u = i/3; reasoning 2 over 4 -> 0, 3; answer 1 over 3 -> centre 1
    torch.testing.assert_close(out[1, :7], torch.tensor([0.0, 1 / 3, 2 / 3, 1.0, 10.0, 13.0, 21.0]))


def test_segment_empty_on_teacher_side_is_invalid():
    t_seg = torch.tensor([[PROMPT, PROMPT, ANSWER, ANSWER]])  # no reasoning at all
    s_seg = torch.tensor([[PROMPT, REASONING, REASONING, ANSWER]])
    idx = time_index(torch.ones(1, 4), t_seg, torch.ones(1, 4), s_seg)
    assert idx.valid.tolist() == [[True, False, False, True]]


def test_segment_mode_needs_segments_on_both_sides():
    seg = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="the student cache has none"):
        time_index(torch.ones(1, 3), seg, torch.ones(1, 3), None)


def test_resample_hidden_states_matches_kv_layout_and_keeps_grad():
    t_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    s_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    idx = time_index(t_mask, None, s_mask, None, mode="global")
    kv = torch.randn(3, 2, 1, 6, 4, requires_grad=True)  # [L, B, H, T, D]
    hidden = kv[:, :, 0].detach().clone().requires_grad_(True)  # [L, B, T, d]
    out_kv = resample(kv, idx, time_dim=3)
    out_h = resample(hidden, idx, time_dim=2)
    assert out_kv.shape == (3, 2, 1, 4, 4) and out_h.shape == (3, 2, 4, 4)
    torch.testing.assert_close(out_kv[:, :, 0], out_h)
    out_h.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_resample_kv_is_time_major_resample_with_layer_pick():
    t_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]])
    s_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    idx = time_index(t_mask, None, s_mask, None, mode="global")
    x = torch.randn(4, 2, 3, 7, 5)  # [L, B, H, T, D]
    ref = resample(x, idx, time_dim=3).transpose(2, 3)  # [L, B, T_s, H, D]
    torch.testing.assert_close(resample_kv(x, idx), ref)
    torch.testing.assert_close(resample_kv(x, idx, torch.tensor([3, 0, 0])), ref[[3, 0, 0]])
    # a non-contiguous cache (e.g. a transposed view) reads the same rows
    x_nc = x.transpose(3, 4).contiguous().transpose(3, 4)
    assert not x_nc.is_contiguous()
    torch.testing.assert_close(resample_kv(x_nc, idx), ref)
    # gradients flow back to the source rows when the cache needs them
    x_g = x.clone().requires_grad_()
    resample_kv(x_g, idx).sum().backward()
    assert x_g.grad is not None and x_g.grad[:, 0, :, 5:].abs().sum() == 0  # padded teacher rows unused


@pytest.mark.parametrize("mode", ["segment", "index"])
def test_resample_kv_with_a_soft_layer_map_is_resample_then_einsum(mode):
    """The fused gather equals the plain stages: `resample` over time, then the layer map's einsum."""
    P, R, A = PROMPT, REASONING, ANSWER
    t_seg = torch.tensor([[P, P, R, R, R, R, A, PAD], [PAD, P, P, P, R, R, R, A]])
    s_seg = torch.tensor([[P, R, R, R, R, A, PAD, PAD], [P, P, R, R, R, A, A, PAD]])
    if mode == "index":
        s_seg = t_seg
    idx = time_index(t_seg >= 0, t_seg, s_seg >= 0, s_seg, mode=mode)
    x = torch.randn(5, 2, 3, 8, 4, dtype=torch.float64)  # [L_t, B, H, T_t, D]
    M = torch.zeros(3, 5, dtype=torch.float64)  # a CKA-like top-2 map, and one row of a single layer
    M[0, [0, 1]] = torch.tensor([0.7, 0.3], dtype=torch.float64)
    M[1, [2, 4]] = torch.tensor([0.5, 0.5], dtype=torch.float64)
    M[2, 3] = 1.0
    ref = apply_layer_map(M, resample(x, idx, time_dim=3)).transpose(2, 3)  # [L_s, B, T_s, H, D]
    layers, weights = sparse_layer_map(M)
    torch.testing.assert_close(resample_kv(x, idx, layers, weights), ref)
    # bf16 caches stay bf16, within bf16 rounding of the fp64 reference
    out_bf16 = resample_kv(x.bfloat16(), idx, layers, weights)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.double(), ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("left_pad", [False, True])
def test_char_ends_pair_each_student_token_with_the_teacher_token_holding_its_last_character(left_pad):
    """With `char_ends`, tokens pair by text, not by rank: a teacher <bos> (no characters) shifts nothing, byte
    pieces of one character (equal ends) read its one token, EOS reads EOS, a chat template's own text (-2) reads
    nothing, and a character past a truncated teacher has no source."""
    P, R, A = PROMPT, REASONING, ANSWER
    # text "ab 東x", teacher: <bos> "ab" " 東" "x" <eos> (right-padded); student: "a" "b" " " 東 東 東 "x" <eos>
    t_ends = torch.tensor([[-1, 1, 3, 4, -1, -1], [-1, 1, 3, -1, -1, -1]])  # row 1: cut after " 東"
    t_seg = torch.tensor([[P, P, R, R, A, PAD], [P, P, R, PAD, PAD, PAD]])
    s_ends = torch.tensor([[0, 1, 2, 3, 3, 3, 4, -1], [-2, 0, 1, 2, 3, 3, 4, -2]])  # row 1: template text around
    s_seg = torch.tensor([[P, P, R, R, R, R, R, A], [P, P, P, R, R, R, R, A]])
    t_mask, s_mask = (t_seg >= 0).long(), torch.ones_like(s_seg)
    pad = int(left_pad) * (t_mask == 0).sum(1, keepdim=True)  # [B, 1] teacher positions shift under left padding
    if left_pad:  # each teacher row's padding moved to its front
        t_ends, t_seg, t_mask = (torch.stack([r.roll(int(n)) for r, n in zip(x, pad)]) for x in (t_ends, t_seg, t_mask))
    idx = time_index(t_mask, t_seg, s_mask, s_seg, src_ends=t_ends, tgt_ends=s_ends)
    want = torch.tensor([[1, 1, 2, 2, 2, 2, 3, 4], [0, 1, 1, 2, 2, 2, 0, 0]]) + pad
    valid = torch.tensor([[True] * 8, [False, True, True, True, True, True, False, False]])
    assert torch.equal(idx.valid, valid)
    assert torch.equal(idx.lo[valid], want[valid]) and torch.equal(idx.hi[valid], want[valid])
    assert (idx.lam == 0).all()
    # without char ends the same segments resample by rank: the student's first token reads <bos>
    assert time_index(t_mask, t_seg, s_mask, s_seg).lo[0, 0] == pad[0, 0]
