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


@pytest.fixture(scope="session")
def real_pair() -> dict:
    """The real pretrained pair as HF directories: {"teacher": Gemma-3-270m, "student": SmolLM2-135M-Instruct}.

    Converted once from the pip-shipped GGUF files (`kvdistill real-pair`, cached by hash). Skipped where
    `scripts/real_pair.sh` has not installed them, except under KVDISTILL_REQUIRE_REAL_PAIR=1 (scripts/test.sh,
    CI), where a missing pair fails: the real-pair tests must run there.
    """
    from kvdistill.gguf import GGUFError
    from kvdistill.real_pair import STUDENT, TEACHER
    from kvdistill.real_pair import real_pair as convert

    try:
        dirs = convert()
    except GGUFError as err:
        if os.environ.get("KVDISTILL_REQUIRE_REAL_PAIR") == "1":
            raise
        pytest.skip(f"the real pair is not installed: {err}")
    return {"teacher": str(dirs[TEACHER]), "student": str(dirs[STUDENT])}


@pytest.fixture(scope="session")
def real_models(real_pair) -> dict:
    """The real pair loaded once, fp32, eval mode: {"teacher": (model, tokenizer), "student": (model, tokenizer)}.
    Shared by the session: a test that trains or edits weights loads its own copy."""
    from kvdistill.models import load_model, load_tokenizer

    return {role: (load_model(path, dtype="fp32").eval(), load_tokenizer(path)) for role, path in real_pair.items()}
