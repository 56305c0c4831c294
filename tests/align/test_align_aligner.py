"""KVAligner: shapes per mode, identity, gradients, save/load, shape errors, summary."""

from __future__ import annotations

import pytest
import torch

from kvdistill.align.aligner import KVAligner
from kvdistill.align.heads import flatten_heads
from kvdistill.align.layer_map import apply_layer_map, last_k_map
from kvdistill.align.time import resample
from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING, KVCache
from kvdistill.losses import aligned_kv_loss, build_kv_loss


def _cache(L, H, T, D, B=2, *, grad=False, pad=0, segments=True) -> KVCache:
    keys = torch.randn(L, B, H, T, D, requires_grad=grad)
    values = torch.randn(L, B, H, T, D, requires_grad=grad)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[-1, -pad:] = 0
    seg = torch.tensor([_segments(T, 0)] * (B - 1) + [_segments(T, pad)]) if segments else None
    return KVCache(keys, values, mask, seg)


def _segments(T: int, pad: int) -> list[int]:
    n = T - pad  # a third prompt, then reasoning, one answer token, then padding
    return [PROMPT] * (n // 3) + [REASONING] * (n - n // 3 - 1) + [ANSWER] + [PAD] * pad


def test_flat_shapes_and_mask():
    teacher, student = _cache(4, 2, 9, 8, pad=2), _cache(3, 1, 6, 4, pad=1)
    out = KVAligner(mode="flat")(teacher, student)
    for t in (out.student_keys, out.student_values, out.teacher_keys, out.teacher_values):
        assert t.shape == (3, 2, 6, 4)  # [L_s, B, T_s, H_s*D_s]
    assert out.mask.shape == (2, 6) and out.mask.dtype == torch.bool
    assert out.mask[1].tolist() == [True] * 5 + [False]
    assert torch.equal(out.segment_ids, student.segment_ids)


def test_structured_and_student_to_teacher_shapes():
    teacher, student = _cache(4, 2, 9, 8), _cache(3, 1, 6, 4)
    out = KVAligner(mode="structured", share_heads=False)(teacher, student)
    assert out.teacher_keys.shape == out.student_keys.shape == (3, 2, 6, 1, 4)  # [L_s, B, T_s, H_s, D_s]
    out = KVAligner(mode="flat", direction="student_to_teacher")(teacher, student)
    assert out.teacher_values.shape == out.student_values.shape == (3, 2, 6, 16)  # teacher's F = 2 * 8
    out = KVAligner(mode="structured", direction="student_to_teacher")(teacher, student)
    assert out.student_keys.shape == (3, 2, 6, 2, 8)


@pytest.mark.parametrize("projector", ["linear", "elastic"])
def test_structured_identity_returns_its_input(projector):
    teacher = _cache(3, 2, 5, 4)
    student = _cache(3, 2, 5, 4)
    aligner = KVAligner(
        mode="structured", time_mode="index", projector=projector, init="identity", dropout=0.3
    )
    out = aligner(teacher, student)  # train mode: the identity must hold with dropout on too
    torch.testing.assert_close(out.teacher_keys, teacher.keys.transpose(2, 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.teacher_values, teacher.values.transpose(2, 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.student_keys, student.keys.transpose(2, 3))


@pytest.mark.parametrize("direction", ["teacher_to_student", "student_to_teacher"])
@pytest.mark.parametrize("mode", ["flat", "structured"])
def test_gradients_reach_projectors_and_student_never_teacher(mode, direction):
    teacher, student = _cache(4, 2, 9, 8, grad=True), _cache(3, 1, 6, 4, grad=True)
    aligner = KVAligner(mode=mode, direction=direction, projector="elastic")
    out = aligner(teacher, student)
    loss = sum(
        ((s - t) ** 2).mean()
        for s, t in [(out.student_keys, out.teacher_keys), (out.student_values, out.teacher_values)]
    )
    loss.backward()
    assert teacher.keys.grad is None and teacher.values.grad is None
    assert student.keys.grad is not None and student.keys.grad.abs().sum() > 0
    assert student.values.grad.abs().sum() > 0
    grads = {n: p.grad for n, p in aligner.named_parameters()}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values()), list(grads)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "flat", "projector": "elastic", "share_layers": False},
        {"mode": "structured", "share_heads": False, "init": "orthogonal"},
    ],
)
@pytest.mark.parametrize("as_file", [False, True])
def test_save_load_identical_outputs(tmp_path, kwargs, as_file):
    teacher, student = _cache(4, 2, 9, 8), _cache(3, 1, 6, 4)
    aligner = KVAligner(**kwargs, layer_map=last_k_map(3, 4, 2)).eval()
    with torch.no_grad():  # move away from the initialisation so loading really matters
        aligner.setup(teacher, student)
        for p in aligner.parameters():
            p.add_(0.01 * torch.randn_like(p))
        ref = aligner(teacher, student)
    target = tmp_path / ("a.safetensors" if as_file else "aligner_dir")
    aligner.save(target)
    loaded = KVAligner.load(target).eval()
    assert loaded.dims == aligner.dims
    with torch.no_grad():
        out = loaded(teacher, student)
    assert out.teacher_keys.shape[0] == 2  # last_k: only the top 2 student layers
    torch.testing.assert_close(out.teacher_keys, ref.teacher_keys, rtol=0, atol=0)
    torch.testing.assert_close(out.teacher_values, ref.teacher_values, rtol=0, atol=0)


def test_wrong_shapes_and_layer_counts_raise_naming_both():
    aligner = KVAligner()
    aligner.setup(_cache(4, 2, 9, 8), _cache(3, 1, 6, 4))
    with pytest.raises(ValueError, match=r"teacher_layers: expected 4, got 5"):
        aligner(_cache(5, 2, 9, 8), _cache(3, 1, 6, 4))
    with pytest.raises(ValueError, match=r"student_key_dim: expected 4, got 6"):
        aligner(_cache(4, 2, 9, 8), _cache(3, 1, 6, 6))
    wrong_map = KVAligner(layer_map=last_k_map(3, 5, 1))
    with pytest.raises(ValueError, match=r"expected shape \(3, 4\), got \(3, 5\)"):
        wrong_map(_cache(4, 2, 9, 8), _cache(3, 1, 6, 4))
    with pytest.raises(ValueError, match="batch size 2 != student batch size 1"):
        KVAligner()(_cache(4, 2, 9, 8), _cache(3, 1, 6, 4, B=1, segments=False))
    with pytest.raises(ValueError, match="unknown mode"):
        KVAligner(mode="cubic")


def test_project_values_false_needs_matching_dims():
    out = KVAligner(project_values=False)(_cache(4, 2, 9, 4), _cache(3, 2, 6, 4))
    assert out.teacher_values.shape == (3, 2, 6, 8) and not out.teacher_values.requires_grad
    with pytest.raises(ValueError, match="project_values=False needs equal value feature sizes"):
        KVAligner(project_values=False).setup(_cache(4, 2, 9, 8), _cache(3, 1, 6, 4))


def test_summary_and_repr_report_parameters():
    aligner = KVAligner(projector="linear")
    assert "not built" in aligner.summary()
    aligner.setup(_cache(4, 2, 9, 8), _cache(3, 1, 6, 4))
    counts = aligner.param_counts()
    assert counts["key_proj"] == counts["value_proj"] == 16 * 4 + 4
    assert counts["total"] == 2 * (16 * 4 + 4)
    text = aligner.summary()
    assert "136" in text and "3 of 3 student layers" in text
    assert "teacher L=4 H=2 D=8 -> student L=3 H=1 D=4" in repr(aligner)


@pytest.mark.parametrize(
    "M",
    [
        torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.25, 0.75]]),  # soft (CKA top-k)
        torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]),  # one-hot
        torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),  # last_k: one distilled layer
    ],
)
def test_layer_maps_match_einsum_reference(M):
    teacher, student = _cache(3, 2, 5, 4), _cache(2, 2, 5, 4)
    aligner = KVAligner(mode="structured", time_mode="index", init="identity", layer_map=M)
    out = aligner(teacher, student)
    rows = (M.sum(1) > 0).nonzero().flatten()
    ref = torch.einsum("st,tbhkd->sbkhd", M[rows], teacher.keys)  # [L_m, B, T, H, D]
    torch.testing.assert_close(out.teacher_keys, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.student_keys, student.keys[rows].transpose(2, 3))
    assert out.student_layers.tolist() == rows.tolist()


def _perturbed_flat_aligner(teacher, student, **kwargs):
    """A flat linear aligner for these caches, its weights moved off their init, and a function giving
    `(loss, [every gradient, aligned teacher keys, aligned teacher values])` on the fused or the plain path."""
    aligner = KVAligner(mode="flat", projector="linear", **kwargs)
    aligner.setup(teacher, student)
    with torch.no_grad():
        for p in aligner.parameters():
            p.add_(0.1 * torch.randn_like(p))
    loss_fn = build_kv_loss("mercator", beta=0.01)
    params = [*aligner.parameters(), student.keys, student.values]

    def loss_and_grads(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        aligner.fused = fused
        out = aligner(teacher, student)
        loss, _ = aligned_kv_loss(loss_fn, out)
        return loss, [*torch.autograd.grad(loss, params), out.teacher_keys, out.teacher_values]

    return aligner, loss_and_grads


@pytest.mark.parametrize(
    "kwargs",
    [
        {"time_mode": "segment"},
        {"time_mode": "index", "share_layers": False},  # per-layer projectors: one weight set per group
        {"time_mode": "global", "project_values": False},  # values take the plain stages
    ],
)
@pytest.mark.parametrize("soft_map", [False, True])
def test_fused_path_equals_plain_stages_and_primitives(kwargs, soft_map):
    """Flat linear aligner: fused gather + projection == the stages one by one == resample, einsum,
    flatten, projector written out here; loss values and every gradient."""
    teacher, student = _cache(4, 2, 9, 8, pad=2), _cache(3, 2, 9, 8 if "project_values" in kwargs else 4, grad=True, pad=1)
    M = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.3, 0.7]]) if soft_map else None
    aligner, loss_and_grads = _perturbed_flat_aligner(teacher, student, layer_map=M, **kwargs)
    fused, plain = loss_and_grads(True), loss_and_grads(False)
    torch.testing.assert_close(fused[0], plain[0])
    for a, b in zip(fused[1], plain[1]):
        torch.testing.assert_close(a, b)
    # the primitives: time resample of every teacher layer, layer-map einsum, flatten, projector
    idx = aligner.time_index(teacher, student)
    x = apply_layer_map(aligner.layer_map[aligner.layer_index], resample(teacher.keys, idx, time_dim=3))
    proj = aligner.k_proj.proj
    ref = flatten_heads(x)  # [L_m, B, T_s, H*D]
    ref = proj(ref) if proj.groups == 1 else torch.einsum("lbtf,lof->lbto", ref, proj.weight) + proj.bias[:, None, None]
    torch.testing.assert_close(fused[1][-2], ref)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("soft_map", [False, True])
def test_fused_path_projects_a_smaller_teacher_first(heads, soft_map, monkeypatch):
    """A teacher whose mapped layers hold fewer tokens than the aligned rows (Gemma-3-270m's 18 layers for
    SmolLM2's 30): the fused path projects the teacher rows, then gathers the projection (the chunked
    gather-then-project never runs), with the plain stages' loss and every gradient."""
    import kvdistill.align.projectors as projectors

    teacher, student = _cache(2, heads, 7, 8, pad=2), _cache(4, 3, 9, 4, grad=True, pad=1)  # 2*7 < 4*9 rows
    M = torch.tensor([[1.0, 0.0], [0.7, 0.3], [0.2, 0.8], [0.0, 1.0]]) if soft_map else None
    _, loss_and_grads = _perturbed_flat_aligner(teacher, student, layer_map=M)
    plain = loss_and_grads(False)
    monkeypatch.setattr(projectors._BagLinear, "apply", None)  # calling it would fail: the path is project-first
    fused = loss_and_grads(True)
    torch.testing.assert_close(fused[0], plain[0])
    for a, b in zip(fused[1], plain[1]):
        torch.testing.assert_close(a, b)
