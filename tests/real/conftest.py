"""The real pair's tests: 135 M and 268 M parameter models, where a second intra-op thread halves the time
(the tiny models of the rest of the suite run faster on one)."""

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)
