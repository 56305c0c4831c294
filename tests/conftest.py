"""Shared fixtures: offline Hub, fixed seeds, one thread, and the tiny model world."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

# 2 shared cores: one intra-op thread keeps the tiny models fast and the suite predictable.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    """Tokenizers, tiny random-init models and data saved to disk, loaded like a user would."""
    from kvdistill.tiny import build_tiny_world

    return build_tiny_world(tmp_path_factory.mktemp("tiny_world"))
