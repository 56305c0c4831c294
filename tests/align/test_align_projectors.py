"""Dim projectors: reference sizes, identity init, grouped (unshared) weights, ablation flags."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvdistill.align import projectors
from kvdistill.align.projectors import (
    PROJECTOR_KINDS,
    ElasticBottleneck,
    LinearProjector,
    bag_linear,
    build_projector,
)
from kvdistill.report import param_count


def test_reference_sizes_seed_001():
    # Qwen-14B (5120) -> Qwen-1.5B (1536); built on the meta device: no memory, no init cost.
    with torch.device("meta"):
        lin = build_projector("linear", 5120, 1536)
        ela = build_projector("elastic", 5120, 1536, mlp_ratio=1.0)
    assert param_count(lin) == 5120 * 1536 + 1536 == 7_865_856  # the prototype's "7.87M" (one projector)
    assert 2 * param_count(ela) == 2 * (2 * 5120 + 5120 * 5120 + 5120 + 5120 * 1536 + 1536) == 68_191_232


@pytest.mark.parametrize("kind", PROJECTOR_KINDS)
def test_shapes_and_kinds(kind):
    proj = build_projector(kind, 12, 5, dropout=0.0)
    assert proj(torch.randn(2, 3, 4, 12)).shape == (2, 3, 4, 5)
    assert isinstance(proj, LinearProjector if kind == "linear" else ElasticBottleneck)


@pytest.mark.parametrize("kind", PROJECTOR_KINDS)
def test_identity_init_is_exact_identity_when_dims_match(kind):
    proj = build_projector(kind, 8, 8, init="identity", dropout=0.5)
    x = torch.randn(3, 7, 8)
    proj.train()  # the elastic branch is zero at init, so even dropout cannot change the output
    torch.testing.assert_close(proj(x), x, rtol=0, atol=0)


def test_identity_scale_when_dims_differ():
    x = torch.randn(5, 8)
    down = build_projector("linear", 8, 2, init="identity-scale")
    torch.testing.assert_close(down(x), x[:, :2] * 2.0)  # sqrt(8 / 2) keeps the expected norm
    up = build_projector("linear", 2, 4, init="identity")
    torch.testing.assert_close(up(x[:, :2]), torch.cat([x[:, :2], torch.zeros(5, 2)], dim=1))
    ela = build_projector("elastic", 8, 2, init="identity", dropout=0.0)
    torch.testing.assert_close(ela(x), x[:, :2] * 2.0)


def test_identity_elastic_without_residual_is_not_identity():
    # LayerNorm + SiLU sit between the two identity matrices: documented, not a pass-through.
    proj = build_projector("elastic", 6, 6, init="identity", residual=False, dropout=0.0)
    x = torch.randn(4, 6)
    assert not torch.allclose(proj(x), x)


def test_orthogonal_init():
    proj = build_projector("linear", 6, 6, init="orthogonal")
    w = proj.proj.weight
    torch.testing.assert_close(w @ w.T, torch.eye(6), atol=1e-5, rtol=0)


def test_ablation_flags_remove_layernorm_and_silu():
    full = build_projector("elastic", 8, 4)
    bare = build_projector("elastic", 8, 4, layernorm=False, activation=False)
    assert param_count(full) - param_count(bare) == 2 * 8
    assert isinstance(bare.norm, nn.Identity) and isinstance(bare.act, nn.Identity)
    assert build_projector("elastic", 8, 4, mlp_ratio=0.5).d_hidden == 4


def test_trainable_false_freezes():
    proj = build_projector("elastic", 8, 4, trainable=False)
    assert param_count(proj, trainable_only=True) == 0 and param_count(proj) > 0


@pytest.mark.parametrize("kind", PROJECTOR_KINDS)
def test_grouped_matches_independent_projectors(kind):
    G = 3
    grouped = build_projector(kind, 6, 4, groups=G, dropout=0.0, init="orthogonal")
    x = torch.randn(G, 2, 5, 6)  # [G, B, T, d]
    out = grouped(x)
    for g in range(G):  # reference: group g alone, with its slice of the weights
        single = build_projector(kind, 6, 4, dropout=0.0)
        sd = {k: v[g] for k, v in grouped.state_dict().items()}
        single.load_state_dict(sd)
        torch.testing.assert_close(out[g], single(x[g]))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown projector kind"):
        build_projector("conv", 4, 4)
    with pytest.raises(ValueError, match="unknown init"):
        build_projector("linear", 4, 4, init="kaiming")
    with pytest.raises(ValueError, match="last dim 4"):
        build_projector("linear", 4, 2)(torch.randn(3, 5))
    with pytest.raises(ValueError, match="G=2"):
        build_projector("linear", 4, 2, groups=2)(torch.randn(3, 5, 4))


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("chunk_numel", [1 << 19, 40])  # one chunk per group; several (and a ragged last one)
def test_bag_linear_equals_linear_of_the_gathered_rows(monkeypatch, groups, chunk_numel):
    """Chunked gather + projection (never storing the gathered input) == gather, then the projector."""
    monkeypatch.setattr(projectors, "_BAG_CHUNK_NUMEL", chunk_numel)
    G, N, H, K, D = 3, 7, 2, 4, 5
    table = torch.randn(40, D, dtype=torch.float64)
    rows = torch.randint(0, 40, (G, N, H, K))
    weights = torch.rand(G, N, H, K, dtype=torch.float64)
    proj = LinearProjector(H * D, 6, groups=groups).double().proj
    gathered = torch.nn.functional.embedding_bag(
        rows.reshape(-1, K), table, per_sample_weights=weights.reshape(-1, K), mode="sum"
    ).view(G, N, H * D)
    ref = proj(gathered)  # [G, N, 6]
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [proj.weight, proj.bias], grad_out)
    out = bag_linear(table, rows, weights, proj)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out, [proj.weight, proj.bias], grad_out), ref_grads)


def test_bag_linear_casts_a_bf16_table_per_chunk():
    table = torch.randn(30, 4).bfloat16()
    rows, weights = torch.randint(0, 30, (1, 5, 2, 2)), torch.rand(1, 5, 2, 2)
    proj = LinearProjector(8, 3).proj  # fp32 weights
    out = bag_linear(table, rows, weights, proj)
    gathered = torch.nn.functional.embedding_bag(
        rows.reshape(-1, 2), table, per_sample_weights=weights.reshape(-1, 2).bfloat16(), mode="sum"
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, proj(gathered.float().view(1, 5, 8)))
    with pytest.raises(ValueError, match="expects 8 features"):
        bag_linear(table, rows[..., :1, :], weights[..., :1, :], proj)
