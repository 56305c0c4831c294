"""Cross-tokenizer logit KD (`kvdistill.losses.cross_vocab`): boundaries, vocabulary map, loss math."""

import pytest
import torch
import torch.nn.functional as F

from kvdistill.losses import logit_kd_sum
from kvdistill.losses.cross_vocab import (
    cross_vocab_div,
    cross_vocab_kd_sum,
    shared_boundaries,
    vocab_intersection,
)


def _ends(pieces: list[str]) -> list[int]:
    """Last-character index of each token of a tokenization given as its pieces."""
    out, n = [], 0
    for p in pieces:
        n += len(p)
        out.append(n - 1)
    return out


def test_shared_boundaries_on_a_hand_made_pair():
    # "Tom has 12 apples" split two ways; boundaries shared after "Tom", " has", " 12", " apples"
    s = ["Tom", " has", " 1", "2", " apples"]
    t = ["To", "m", " has", " 12", " app", "les"]
    assert "".join(s) == "".join(t)
    s_ends = torch.tensor([[-1, *_ends(s)]])  # a BOS without characters first
    t_ends = torch.tensor([[*_ends(t), -1, -1]])  # the teacher's row right-padded
    pos, ok = shared_boundaries(s_ends, t_ends)
    assert ok.tolist() == [[False, True, True, False, True, True]]
    assert pos[ok].tolist() == [1, 2, 3, 5]  # "m", " has", " 12", "les"


def test_shared_boundaries_left_padding_and_batch():
    s_ends = torch.tensor([[-1, -1, 2, 5], [0, 1, 2, 3]])
    t_ends = torch.tensor([[5, 2, -1], [3, 1, -1]])  # any order, any padding side
    pos, ok = shared_boundaries(s_ends, t_ends)
    assert ok.tolist() == [[False, False, True, True], [False, True, False, True]]
    assert pos[0, 2:].tolist() == [1, 0] and pos[1, 1].item() == 1 and pos[1, 3].item() == 0


def test_vocab_intersection_exact_unique_strings():
    s = ["a", "b", "ab", "x", "x", None]  # "x" twice on the student side: ambiguous
    t = ["ab", "c", "a", "x", "b"]
    si, ti = vocab_intersection(s, t)
    assert list(zip(si.tolist(), ti.tolist())) == [(0, 2), (1, 4), (2, 0)]


def _logits(M=5, V=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, V, generator=g) * 2, torch.randn(M, V, generator=g) * 2


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_identical_tokenizers_reduce_to_ordinary_kd(kind):
    s, t = _logits()
    ids = torch.arange(s.shape[-1])
    w = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0])
    got = cross_vocab_kd_sum(s, t, ids, ids, w, kind, temperature=2.0)
    labels = torch.zeros(s.shape[0], 2, dtype=torch.long)  # one target per row
    ref = sum(w[i] * logit_kd_sum(s[i, None, None].expand(1, 2, -1), t[i, None, None].expand(1, 2, -1),
                                  labels[i : i + 1], kind, 2.0) for i in range(s.shape[0]))
    torch.testing.assert_close(got, ref)


def test_permuted_vocabulary_gives_the_same_loss_after_mapping():
    s, t = _logits()
    V = s.shape[-1]
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(1))  # teacher id perm[i] = student id i
    t_perm = torch.empty_like(t)
    t_perm[:, perm] = t
    strings = [f"tok{i}" for i in range(V)]
    t_strings = [None] * V
    for i, p in enumerate(perm.tolist()):
        t_strings[p] = strings[i]
    si, ti = vocab_intersection(strings, t_strings)
    w = torch.ones(s.shape[0])
    ids = torch.arange(V)
    torch.testing.assert_close(cross_vocab_kd_sum(s, t_perm, si, ti, w), cross_vocab_kd_sum(s, t, ids, ids, w))


def test_disjoint_parts_mix_shared_kl_and_sorted_l1_by_teacher_mass():
    """Hand computation on a 3+2 / 3+1 vocabulary, with padded head rows past the real size."""
    s, t = _logits(M=2, V=6)
    si, ti = torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1])
    got = cross_vocab_kd_sum(s, t, si, ti, torch.ones(2), student_vocab=5, teacher_vocab=4)
    ps, pt = s[:, :5].softmax(-1), t[:, :4].softmax(-1)
    m = pt[:, ti].sum(-1)
    qs, qt = ps[:, si] / ps[:, si].sum(-1, keepdim=True), pt[:, ti] / pt[:, ti].sum(-1, keepdim=True)
    kl = (qt * (qt.log() - qs.log())).sum(-1)
    rs, rt = ps[:, 3:5].sort(-1, descending=True).values, pt[:, 3:4]
    uld = (rs - F.pad(rt, (0, 1))).abs().sum(-1)
    torch.testing.assert_close(got, (m * kl + (1 - m) * uld).sum())


def test_masked_positions_contribute_nothing_and_gradient_reaches_only_the_student():
    s, t = _logits()
    s.requires_grad_()
    si, ti = torch.tensor([0, 3, 4, 7]), torch.tensor([1, 2, 5, 8])
    w = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    loss = cross_vocab_kd_sum(s, t, si, ti, w)
    (g,) = torch.autograd.grad(loss, s)
    assert g[1].abs().max() == 0 and g[3].abs().max() == 0 and g[0].abs().max() > 0
    s2 = s.detach().clone()
    s2[1] += torch.randn(s.shape[-1])
    torch.testing.assert_close(cross_vocab_kd_sum(s2, t, si, ti, w), loss.detach())
    assert float(cross_vocab_kd_sum(t, t, si, si, torch.ones(5))) == pytest.approx(0.0, abs=1e-5)  # same dists


def test_tail_past_tail_tokens_is_one_bucket():
    """With `tail_tokens` below the tails' length, ULD compares the largest tail probabilities one by one and the
    rest as one mass (by hand); at any length it never exceeds the full sorted L1."""
    s, t = _logits(M=3, V=8)
    si, ti = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])
    ps, pt = s.softmax(-1), t.softmax(-1)
    m = pt[:, ti].sum(-1)
    qs, qt = ps[:, si] / ps[:, si].sum(-1, keepdim=True), pt[:, ti] / pt[:, ti].sum(-1, keepdim=True)
    kl = (qt * (qt.log() - qs.log())).sum(-1)
    rs = ps[:, 3:].sort(-1, descending=True).values  # [M, 5] the student's tail, sorted
    rt = pt[:, [0, 1, 2, 6, 7]].sort(-1, descending=True).values
    for n in (1, 2):
        uld = (rs[:, :n] - rt[:, :n]).abs().sum(-1) + (rs[:, n:].sum(-1) - rt[:, n:].sum(-1)).abs()
        got = cross_vocab_div(s, t, si, ti, 0.0, tail_tokens=n)
        torch.testing.assert_close(got, m * kl + (1 - m) * uld)
        assert (got <= cross_vocab_div(s, t, si, ti, 0.0, tail_tokens=5) + 1e-6).all()
