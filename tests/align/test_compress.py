"""Rationale compression: R-KV scoring, position selection, cache packing, time-alignment contract."""

from __future__ import annotations

import math

import pytest
import torch

from kvdistill.align.compress import COMPRESSIONS, compress_cache, rkv_scores, select_positions
from kvdistill.align.time import time_index
from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING, KVCache

P, R, A, X = PROMPT, REASONING, ANSWER, PAD


def _seg(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ids `[B, T]` from rows of P/R/A/X, and the matching attention mask."""
    seg = torch.tensor(rows)
    return (seg != X).long(), seg


def _e(i: int, D: int = 16, scale: float = 4.0) -> torch.Tensor:
    v = torch.zeros(D)
    v[i] = scale
    return v


def _keys_from(rows: list[list[torch.Tensor]], L: int = 2, H: int = 2) -> torch.Tensor:
    """`[L, B, H, T, D]` keys, the same vector in every layer and head."""
    k = torch.stack([torch.stack(r) for r in rows])  # [B, T, D]
    return k[None, :, None].expand(L, -1, H, -1, -1).contiguous()


def _reference_scores(keys, qmask, cmask, lam):
    """Loop-by-loop reading of the documented formula."""
    L, B, H, T, D = keys.shape
    out = torch.full((B, T), -math.inf)
    for b in range(B):
        cj = cmask[b].nonzero().flatten().tolist()
        qj = qmask[b].nonzero().flatten().tolist()
        if not cj:
            continue
        imp = torch.zeros(len(cj))
        red = torch.zeros(len(cj))
        for layer in range(L):
            for h in range(H):
                k = keys[layer, b, h].double()
                for q in qj:
                    imp += (torch.stack([k[q] @ k[j] for j in cj]) / math.sqrt(D)).softmax(0).float()
                for a, j in enumerate(cj):
                    others = [torch.cosine_similarity(k[j], k[o], 0) for o in cj if o != j]
                    red[a] += (sum(others) / len(others)).item() if others else 0.0
        imp = imp / (L * H * max(len(qj), 1))
        red = red / (L * H)
        rng = (imp.max() - imp.min()).clamp(min=1e-6)
        imp = (imp - imp.min()) / rng
        out[b, cj] = (1 - lam) * imp - lam * red
    return out


def test_rkv_scores_match_reference_and_mask_non_candidates():
    mask, seg = _seg([[P, R, R, R, R, R, A, A], [X, P, R, R, R, R, R, A], [P, R, R, R, X, X, X, X]])
    keys = torch.randn(2, 3, 2, 8, 6)
    real = mask.bool()
    cand, query = real & (seg == R), real & (seg == A)  # sample 2 has no answer token
    scores = rkv_scores(keys, query, cand, lam=0.3)
    assert torch.isinf(scores[~cand]).all() and (scores[~cand] < 0).all()
    torch.testing.assert_close(scores, _reference_scores(keys, query, cand, 0.3), rtol=1e-4, atol=1e-5)
    # no query token: importance 0, the score is -lam * redundancy only
    only_red = rkv_scores(keys, query, cand, lam=1.0)
    torch.testing.assert_close(scores[2, cand[2]], 0.3 * only_red[2, cand[2]])


def test_rkv_keeps_the_keys_the_answer_attends_to():
    # candidates whose keys align with the answer keys (e0 / e1) vs mutually orthogonal noise (e2..)
    mask, seg = _seg([[P, R, R, R, R, R, R, R, A, A, X], [X, P, P, R, R, R, R, R, R, R, A]])
    important = {0: {3, 5}, 1: {4, 9}}
    rows = []
    for b in range(2):
        noise, row = iter(range(2, 15)), []
        for t, s in enumerate(seg[b].tolist()):
            if s == A:
                row.append(_e(0) + _e(1))
            elif s == R and t in important[b]:
                row.append(_e(0) if t % 2 else _e(1))
            elif s == R:
                row.append(_e(next(noise), scale=1.0))
            else:
                row.append(_e(15, scale=1.0))
        rows.append(row)
    keys = _keys_from(rows)
    cand = mask.bool() & (seg == R)
    scores = rkv_scores(keys, mask.bool() & (seg == A), cand, lam=0.01)
    keep = select_positions(scores, cand, torch.tensor([2, 2]), "rkv")
    assert [set(k.nonzero().flatten().tolist()) for k in keep] == [important[0], important[1]]


def test_rkv_redundancy_drops_a_duplicate_for_a_distinct_key():
    # three answer tokens look at e0, one at e1. Candidates: e0 twice (most important, identical),
    # e1 (less important, distinct), two orthogonal noise keys.
    mask, seg = _seg([[P, R, R, R, R, R, A, A, A, A]])
    ks = [_e(7, scale=1.0), _e(0), _e(2), _e(0), _e(1), _e(3), _e(0), _e(0), _e(0), _e(1)]
    keys = _keys_from([ks])
    cand, query = mask.bool() & (seg == R), mask.bool() & (seg == A)
    slots = torch.tensor([2])
    low = select_positions(rkv_scores(keys, query, cand, lam=0.0), cand, slots, "rkv")
    assert low[0].nonzero().flatten().tolist() == [1, 3]  # both duplicates
    high = select_positions(rkv_scores(keys, query, cand, lam=0.75), cand, slots, "rkv")
    assert high[0].nonzero().flatten().tolist() == [1, 4]  # one duplicate + the distinct key


def test_uniform_picks_evenly_spaced_ranks():
    # 10 candidates at positions 2..11 (sample 0), 5 candidates behind left padding (sample 1)
    mask, seg = _seg([[P, P, *[R] * 10, A], [X, X, X, X, X, X, P, R, R, R, R, R, A]])
    cand = mask.bool() & (seg == R)

    def picked(slots):
        keep = select_positions(None, cand, torch.tensor(slots), "uniform")
        return [k.nonzero().flatten().tolist() for k in keep]

    # ranks round(i * 9 / 3) = 0 3 6 9; round(i * 4 / 1) = 0 4
    assert picked([4, 2]) == [[2, 5, 8, 11], [7, 11]]
    # ranks round(i * 9 / 2) = 0 4.5->5 9 (half up); k=1: centre round(4 / 2) = 2
    assert picked([3, 1]) == [[2, 7, 11], [9]]
    assert picked([1, 0]) == [[7], []]  # centre of 0..9 is 4.5 -> rank 5
    assert picked([10, 99]) == [list(range(2, 12)), [7, 8, 9, 10, 11]]


def test_random_is_reproducible_with_a_seeded_generator():
    cand = torch.ones(3, 40, dtype=torch.bool)
    slots = torch.tensor([5, 5, 5])

    def draw(seed):
        return select_positions(None, cand, slots, "random", torch.Generator().manual_seed(seed))

    a, b, c = draw(0), draw(0), draw(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a[0], a[1])  # samples draw independently
    assert a.sum(1).tolist() == [5, 5, 5]


@pytest.mark.parametrize("method", COMPRESSIONS)
def test_every_method_keeps_min_of_slots_and_candidates(method):
    mask, seg = _seg(
        [
            [P, R, R, R, R, R, A, X],
            [X, P, R, R, R, R, A, A],
            [P, R, R, R, A, X, X, X],
            [P, P, R, R, R, R, R, A],
        ]
    )
    cand = mask.bool() & (seg == R)  # 5, 4, 3, 5 candidates
    slots = torch.tensor([0, 2, 100, 5])
    scores = rkv_scores(torch.randn(2, 4, 2, 8, 4), mask.bool() & (seg == A), cand)
    keep = select_positions(scores, cand, slots, method, torch.Generator().manual_seed(0))
    assert keep.sum(1).tolist() == [0, 2, 3, 5]
    assert not (keep & ~cand).any()


def _batch(hidden: bool = True):
    """Three samples: right padding, left padding, no padding; rationales of 6, 5 and 2 tokens."""
    mask, seg = _seg(
        [
            [P, P, R, R, R, R, R, R, A, A, X, X],
            [X, X, X, P, R, R, R, R, R, A, A, A],
            [P, P, P, P, R, R, A, A, A, A, A, A],
        ]
    )
    L, B, H, T, D = 3, 3, 2, 12, 4
    keys, values = torch.randn(L, B, H, T, D), torch.randn(L, B, H, T, D)
    hs = torch.randn(L + 1, B, T, 5) if hidden else None
    return KVCache(keys, values, mask, seg, hs)


@pytest.mark.parametrize("method", COMPRESSIONS)
def test_compress_cache_packs_kept_tokens(method):
    kv = _batch()
    slots = torch.tensor([3, 0, 7])
    out, pos = compress_cache(kv, slots, method=method, generator=torch.Generator().manual_seed(0))
    real, seg = kv.attention_mask.bool(), kv.segment_ids
    n_kept = real.sum(1) - (real & (seg == R)).sum(1) + torch.tensor([3, 0, 2])  # [7, 7, 12]
    T2 = int(n_kept.max())
    assert out.keys.shape == (3, 3, 2, T2, 4) and out.values.shape == out.keys.shape
    assert out.hidden_states.shape == (4, 3, T2, 5)
    assert pos.shape == out.attention_mask.shape == out.segment_ids.shape == (3, T2)
    assert pos.dtype == torch.long
    assert out.attention_mask.sum(1).tolist() == n_kept.tolist()
    assert (out.segment_ids == R).sum(1).tolist() == [3, 0, 2]
    for b in range(3):
        n = int(n_kept[b])
        m = out.attention_mask[b]
        assert m[:n].all() and not m[n:].any()  # packed left, right padded
        p = pos[b, :n]
        assert (p[1:] > p[:-1]).all()  # original time order
        assert (pos[b, n:] == 0).all() and (out.segment_ids[b, n:] == PAD).all()
        # every prompt and answer token kept, in order
        for s in (P, A):
            assert (
                p[out.segment_ids[b, :n] == s].tolist()
                == (real[b] & (seg[b] == s)).nonzero().flatten().tolist()
            )
        assert torch.equal(out.segment_ids[b, :n], seg[b, p])
        torch.testing.assert_close(out.keys[:, b, :, :n], kv.keys[:, b, :, p], rtol=0, atol=0)
        torch.testing.assert_close(out.values[:, b, :, :n], kv.values[:, b, :, p], rtol=0, atol=0)
        torch.testing.assert_close(out.hidden_states[:, b, :n], kv.hidden_states[:, b, p], rtol=0, atol=0)
        assert not out.keys[:, b, :, n:].any() and not out.values[:, b, :, n:].any()
        assert not out.hidden_states[:, b, n:].any()


def test_compress_cache_uniform_exact_positions_and_no_hidden_states():
    kv = _batch(hidden=False)
    out, pos = compress_cache(kv, torch.tensor([3, 1, 2]), method="uniform")
    assert out.hidden_states is None
    # sample 0: rationale at 2..7 -> ranks 0, round(2.5)=3, 5 -> 2, 5, 7
    # sample 1: rationale at 4..8 -> centre rank 2 -> 6 ; sample 2: both rationale tokens
    assert pos[0, : int(out.attention_mask[0].sum())].tolist() == [0, 1, 2, 5, 7, 8, 9]
    assert pos[1, : int(out.attention_mask[1].sum())].tolist() == [3, 6, 9, 10, 11]
    assert pos[2].tolist() == list(range(12))
    assert out.keys.shape[3] == 12


def test_compress_cache_keeps_autograd():
    kv = _batch()
    kv.keys.requires_grad_(True)
    out, pos = compress_cache(kv, torch.tensor([2, 2, 2]))
    out.keys.sum().backward()
    touched = kv.keys.grad.ne(0).any(4).any(2).any(0)  # [B, T]
    kept = torch.zeros(touched.shape).scatter_add(1, pos, out.attention_mask.float()) > 0  # [B, T]
    assert torch.equal(touched, kept)


@pytest.mark.parametrize("method", COMPRESSIONS)
def test_time_alignment_reads_the_kept_reasoning_in_order(method):
    kv = _batch()  # teacher rationales: 6, 5, 2 tokens
    s_mask, s_seg = _seg(
        [
            [P, P, R, R, R, A, A, X, X],
            [X, X, P, R, A, A, A, A, A],  # one reasoning token
            [P, R, R, A, X, X, X, X, X],
        ]
    )
    s_count = ((s_seg == R) & s_mask.bool()).sum(1)  # [3, 1, 2]
    out, pos = compress_cache(kv, s_count, method=method, lam=0.0, generator=torch.Generator().manual_seed(3))
    idx = time_index(out.attention_mask, out.segment_ids, s_mask, s_seg, "segment")
    for b in range(3):
        s_r = (s_mask[b].bool() & (s_seg[b] == R)).nonzero().flatten()
        t_r = (out.attention_mask[b].bool() & (out.segment_ids[b] == R)).nonzero().flatten()
        assert len(t_r) == len(s_r)
        assert idx.valid[b, s_r].all()
        assert idx.lo[b, s_r].tolist() == t_r.tolist()  # student token i -> i-th kept teacher position
        assert (idx.lam[b, s_r] == 0).all()
        assert (kv.segment_ids[b, pos[b, t_r]] == R).all()  # and they are teacher reasoning tokens


def test_unknown_method_names_the_options():
    kv = _batch()
    with pytest.raises(ValueError, match=r"rkv.*uniform.*random"):
        compress_cache(kv, torch.tensor([1, 1, 1]), method="topk")
    with pytest.raises(ValueError, match=r"rkv.*uniform.*random"):
        select_positions(None, kv.attention_mask.bool(), torch.tensor([1, 1, 1]), "topk")


def test_compress_cache_needs_segment_ids():
    kv = _batch()
    kv.segment_ids = None
    with pytest.raises(ValueError, match="segment_ids"):
        compress_cache(kv, torch.tensor([1, 1, 1]))
