"""Loading: real from_pretrained on local dirs, fast clear errors otherwise."""

import time

import pytest
import torch

from kvdistill.models import ModelLoadError, config_hash, load_model, load_tokenizer


def test_local_roundtrip_and_dtype(tiny_world):
    model = load_model(tiny_world.models["student"], dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = load_tokenizer(tiny_world.models["student"])
    assert tok.pad_token_id is not None and tok.eos_token_id is not None


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model directory"):
        load_model(str(tmp_path / "nope"))


def test_unreachable_hub_id_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        load_model("someorg/surely-not-cached-model")
    with pytest.raises(ModelLoadError, match="local"):
        load_tokenizer("someorg/surely-not-cached-model")
    assert time.monotonic() - t0 < 30  # no minute-long retry loop


def test_quantization_needs_bitsandbytes(tiny_world):
    pytest.importorskip("torch")
    try:
        import bitsandbytes  # noqa: F401

        pytest.skip("bitsandbytes installed")
    except ImportError:
        pass
    with pytest.raises(ModelLoadError, match="bitsandbytes"):
        load_model(tiny_world.models["student"], quantization="4bit")


def test_config_hash_stable_and_discriminating(tiny_world):
    a = load_model(tiny_world.models["student"])
    b = load_model(tiny_world.models["student"], dtype="bf16")
    c = load_model(tiny_world.models["qwen2_teacher"])
    assert config_hash(a) == config_hash(b) != config_hash(c)
