"""Teacher-side helpers: the derangement behind the shuffled-teacher control."""

import pytest
import torch

from kvdistill.teachers import derangement


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
