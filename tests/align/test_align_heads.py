"""Head alignment: flatten order, uniform head mixing, shared / per-head / per-layer projectors."""

from __future__ import annotations

import pytest
import torch

from kvdistill.align.heads import HeadMixer, HeadwiseProjector, flatten_heads, time_major, uniform_head_mix
from kvdistill.align.projectors import build_projector


def test_flatten_heads_order():
    x = torch.randn(2, 3, 4, 5, 6)  # [L, B, H, T, D]
    flat = flatten_heads(x)
    assert flat.shape == (2, 3, 5, 24)
    torch.testing.assert_close(flat[1, 2, 3, 2 * 6 : 3 * 6], x[1, 2, 2, 3])
    torch.testing.assert_close(time_major(x)[1, 2, 3, 2], x[1, 2, 2, 3])


@pytest.mark.parametrize(("h_out", "h_in"), [(2, 4), (4, 2), (2, 3), (3, 3), (1, 5)])
def test_uniform_head_mix_rows_sum_to_one(h_out, h_in):
    W = uniform_head_mix(h_out, h_in)
    assert W.shape == (h_out, h_in)
    torch.testing.assert_close(W.sum(1), torch.ones(h_out))
    torch.testing.assert_close(W.sum(0), torch.full((h_in,), h_out / h_in))  # every input head used equally


def test_uniform_head_mix_documented_values():
    torch.testing.assert_close(uniform_head_mix(2, 4), torch.tensor([[0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5]]))
    torch.testing.assert_close(uniform_head_mix(4, 2), torch.tensor([[1.0, 0], [1, 0], [0, 1], [0, 1]]))
    torch.testing.assert_close(uniform_head_mix(2, 3), torch.tensor([[2 / 3, 1 / 3, 0], [0, 1 / 3, 2 / 3]]))
    torch.testing.assert_close(uniform_head_mix(3, 3), torch.eye(3))


def test_head_mixer_averages_pairs_and_per_layer_groups():
    x = torch.randn(2, 1, 3, 4, 5)  # [L, B, T, H_in, D]
    out = HeadMixer(4, 2)(x)
    torch.testing.assert_close(out[:, :, :, 1], (x[:, :, :, 2] + x[:, :, :, 3]) / 2)
    per_layer = HeadMixer(4, 2, groups=2)
    with torch.no_grad():
        per_layer.weight[1] = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1]])
    out = per_layer(x)
    torch.testing.assert_close(out[1, :, :, 1], x[1, :, :, 3])
    torch.testing.assert_close(out[0, :, :, 1], (x[0, :, :, 2] + x[0, :, :, 3]) / 2)
    with pytest.raises(ValueError, match=r"H=4.*\(2, 1, 3, 3, 5\)"):
        HeadMixer(4, 2)(torch.randn(2, 1, 3, 3, 5))


@pytest.mark.parametrize(
    ("share_layers", "share_heads"), [(True, True), (False, True), (True, False), (False, False)]
)
def test_headwise_projector_matches_loop(share_layers, share_heads):
    L, B, T, H, D = 3, 2, 4, 2, 5
    groups = (1 if share_layers else L) * (1 if share_heads else H)
    proj = build_projector("linear", D, 3, groups=groups, init="orthogonal")
    module = HeadwiseProjector(proj, share_layers=share_layers, share_heads=share_heads)
    x = torch.randn(L, B, T, H, D)
    out = module(x)
    assert out.shape == (L, B, T, H, 3)
    W = proj.proj.weight.view(-1, 3, D)  # [G, D_out, D_in]
    for li in range(L):
        for h in range(H):
            g = (0 if share_layers else li) * (1 if share_heads else H) + (0 if share_heads else h)
            torch.testing.assert_close(
                out[li, :, :, h], x[li, :, :, h] @ W[g].T + proj.proj.bias.view(-1, 3)[g]
            )
