"""Teacher-side helpers: the derangement behind the shuffled-teacher control, the teacher cache."""

import pytest
import torch

from kvdistill.cache import KVCache
from kvdistill.teachers import TeacherCache, derangement


@pytest.mark.parametrize("n", [2, 3, 4, 7, 16])
def test_derangement_is_a_permutation_without_fixed_points(n):
    g = torch.Generator().manual_seed(n)
    seen = set()
    for _ in range(200):
        p = derangement(n, g)
        assert sorted(p.tolist()) == list(range(n))
        assert (p != torch.arange(n)).all()
        seen.add(tuple(p.tolist()))
    assert len(seen) > 1 or n == 2  # random, not one fixed rotation (n = 2 has one derangement)
    if n == 3:  # both derangements of 3 elements occur
        assert seen == {(1, 2, 0), (2, 0, 1)}


def test_derangement_needs_two_elements():
    with pytest.raises(ValueError, match="at least 2"):
        derangement(1)


def test_teacher_cache_round_trip_through_take_and_add():
    """A batch `put` then read back `get`s its real tokens and pads as the collator does; an entry taken out
    (a capture writing it) and `add`ed back (a capture read) gives the same batch."""
    L, B, H, T, D = 2, 2, 3, 4, 5
    keys, values = torch.randn(L, B, H, T, D), torch.randn(L, B, H, T, D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])  # record 7 has 2 real tokens
    seg = torch.tensor([[0, 1, 1, 2], [0, 2, -1, -1]])
    cache, key, index = TeacherCache(), ("t", "post_rope", False, False, False), torch.tensor([3, 7])
    cache.put(key, index, KVCache(keys, values, mask, seg), None)
    assert len(cache) == 2 and cache.has(key, index) and cache.missing(key, torch.tensor([7, 9])) == [9]
    kv, _ = cache.get(key, index, torch.device("cpu"))
    assert torch.equal(kv.keys[:, 0], keys[:, 0]) and torch.equal(kv.values[:, 1, :, :2], values[:, 1, :, :2])
    assert torch.equal(kv.keys[:, 1, :, 2:], torch.zeros(L, H, 2, D))  # right padding
    assert torch.equal(kv.attention_mask, mask) and torch.equal(kv.segment_ids, seg)
    entry = cache.take(key, 7)
    assert entry["keys"].shape == (2, L, H, D) and not cache.has(key, index)  # [T_i, L, H, D]
    cache.add(key, 7, entry)
    again, _ = cache.get(key, index, torch.device("cpu"))
    assert torch.equal(again.keys, kv.keys) and torch.equal(again.values, kv.values)
