"""Multi-teacher fusion: weights per kind and the weighted average of aligned teacher KVs."""

import pytest
import torch

from kvdistill.fusion import TeacherFusion, fuse_kv


def test_fixed_weights_are_normalised():
    f = TeacherFusion("loss_sum", [1.0, 3.0])
    torch.testing.assert_close(f.teacher_weights(), torch.tensor([0.25, 0.75]))
    w = f.sample_weights(torch.tensor([0, 5, 7]))  # [B, N]
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.75]] * 3))
    assert f.logits is None and not list(f.parameters())  # fixed: nothing to train


def test_kv_mean_uses_the_fixed_weights():
    torch.testing.assert_close(
        TeacherFusion("kv_mean", [2.0, 2.0]).teacher_weights(), torch.tensor([0.5, 0.5])
    )


@pytest.mark.parametrize("weights", [[], [-1.0, 1.0], [0.0, 0.0]])
def test_bad_weights_are_rejected(weights):
    with pytest.raises(ValueError, match="non-negative"):
        TeacherFusion("loss_sum", weights)


def test_unknown_kind_and_missing_table_are_rejected():
    with pytest.raises(ValueError, match="not one of"):
        TeacherFusion("vote", [1.0])
    with pytest.raises(ValueError, match="correctness table"):
        TeacherFusion("correctness", [1.0, 1.0])
    with pytest.raises(ValueError, match="correctness table"):
        TeacherFusion("correctness", [1.0, 1.0], torch.ones(4, 3))


def test_learned_weights_are_softmax_of_logits_and_get_gradients():
    f = TeacherFusion("learned", [1.0, 3.0])
    # initialised at the fixed weights
    torch.testing.assert_close(f.teacher_weights(), torch.tensor([0.25, 0.75]))
    with torch.no_grad():
        f.logits.copy_(torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(f.teacher_weights(), torch.softmax(torch.tensor([0.0, 1.0]), 0))
    assert [n for n, _ in f.named_parameters()] == ["logits"]
    # d/dz of w·c for softmax weights w: w * (c - w·c)
    c = torch.tensor([2.0, -1.0])
    (f.sample_weights(torch.tensor([0, 1])) * c).sum().backward()
    w = torch.softmax(torch.tensor([0.0, 1.0]), 0)
    torch.testing.assert_close(f.logits.grad, 2 * w * (c - (w * c).sum()))


def test_correctness_weights_per_sample():
    table = torch.tensor(
        [
            [1, 0, 0],  # only teacher 0 right
            [1, 1, 0],  # teachers 0 and 1 right: they share by their fixed weights
            [0, 0, 0],  # nobody right: fixed weights
            [1, 1, 1],  # all right: fixed weights
        ]
    )
    f = TeacherFusion("correctness", [1.0, 3.0, 4.0], table)
    w = f.sample_weights(torch.tensor([0, 1, 2, 3, 1]))  # [B, N]
    fixed = torch.tensor([1.0, 3.0, 4.0]) / 8
    expected = torch.stack(
        [
            torch.tensor([1.0, 0.0, 0.0]),
            torch.tensor([0.25, 0.75, 0.0]),
            fixed,
            fixed,
            torch.tensor([0.25, 0.75, 0.0]),
        ]
    )
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(w.sum(1), torch.ones(5))


def test_correctness_equal_weights_share_evenly():
    f = TeacherFusion("correctness", [1.0, 1.0, 1.0], torch.tensor([[0, 1, 1]]))
    torch.testing.assert_close(f.sample_weights(torch.tensor([0])), torch.tensor([[0.0, 0.5, 0.5]]))


def test_fuse_kv_weighted_average_is_exact():
    # N=2 teachers, L=1, B=2, T=2, F=1
    a = torch.tensor([[[[1.0], [2.0]], [[3.0], [4.0]]]])  # [L, B, T, F]
    b = torch.tensor([[[[5.0], [6.0]], [[7.0], [8.0]]]])
    masks = torch.ones(2, 2, 2)  # [N, B, T]
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5]])  # [B, N]
    fused, mask = fuse_kv(torch.stack([a, b]), masks, weights)
    expected = torch.tensor([[[[0.25 * 1 + 0.75 * 5], [0.25 * 2 + 0.75 * 6]], [[5.0], [6.0]]]])
    torch.testing.assert_close(fused, expected)
    torch.testing.assert_close(mask, torch.ones(2, 2))


def test_fuse_kv_structured_feature_dims():
    # structured targets carry [H, D] after T: the weights broadcast over both
    targets = torch.randn(3, 2, 2, 4, 2, 5)  # [N, L, B, T, H, D]
    weights = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    fused, _ = fuse_kv(targets, torch.ones(3, 2, 4), weights)
    expected = torch.einsum("nlbthd,bn->lbthd", targets, weights)
    torch.testing.assert_close(fused, expected)


def test_fuse_kv_invalid_teacher_does_not_contribute_and_uncovered_token_is_masked():
    # N=2, L=1, B=1, T=3, F=2
    a = torch.tensor([[[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]]])
    b = torch.tensor([[[[9.0, 9.0], [8.0, 8.0], [100.0, -100.0]]]])
    masks = torch.tensor(
        [
            [[1.0, 0.0, 0.0]],  # teacher a: valid only at t=0
            [[1.0, 1.0, 0.0]],  # teacher b: valid at t=0,1; nobody covers t=2
        ]
    )
    weights = torch.tensor([[0.5, 0.5]])
    fused, mask = fuse_kv(torch.stack([a, b]), masks, weights)
    torch.testing.assert_close(mask, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(fused[0, 0, 0], torch.tensor([5.0, 5.0]))  # both valid: mean
    torch.testing.assert_close(fused[0, 0, 1], torch.tensor([8.0, 8.0]))  # only b, renormalised to weight 1
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused[0, 0, 2], torch.zeros(2))  # no teacher: zero target, masked out


def test_fuse_kv_zero_weight_teacher_is_ignored():
    targets = torch.stack([torch.full((1, 1, 2, 3), 1.0), torch.full((1, 1, 2, 3), 50.0)])  # [N, L, B, T, F]
    fused, mask = fuse_kv(targets, torch.ones(2, 1, 2), torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(fused, torch.ones(1, 1, 2, 3))
    torch.testing.assert_close(mask, torch.ones(1, 2))
