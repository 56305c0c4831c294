"""KV extraction: shapes per family, gradients, and that the keys are the ones the model uses."""

import pytest
import torch
from transformers import DynamicCache

from kvdistill.cache import KVCache, extract_kv, forward_with_kv, stack_cache
from kvdistill.data import DistillCollator, load_records
from kvdistill.models import load_model, load_tokenizer

FAMILIES = ["qwen2_teacher", "llama_teacher", "student", "mistral", "gpt2"]


def _batch(world, name, n=2):
    tok = load_tokenizer(world.models[name])
    return DistillCollator(tok, max_length=160)(load_records(world.data_dir, "test", limit=n))


def _expected(cfg):
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    return layers, kv, getattr(cfg, "head_dim", None) or hidden // heads


@pytest.mark.parametrize("name", FAMILIES)
def test_kv_shapes_per_family(tiny_world, name):
    model = load_model(tiny_world.models[name], dtype="fp32")
    batch = _batch(tiny_world, name)
    kv = extract_kv(model, batch["input_ids"], batch["attention_mask"], batch["segment_ids"],
                    output_hidden_states=True)
    L, H, D = _expected(model.config)
    B, T = batch["input_ids"].shape
    assert kv.keys.shape == (L, B, H, T, D) == kv.values.shape
    assert kv.hidden_states.shape[:3] == (L + 1, B, T)
    assert not kv.keys.requires_grad and not kv.values.requires_grad


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("key_space", ["post_rope", "hidden"])
def test_extracting_the_cache_runs_the_lm_head_on_one_position(tiny_world, name, key_space):
    """`extract_kv` reads no logits, so the head (a [T, V] matmul: most of a 262k-vocabulary model's forward)
    sees the last position only; `forward_with_kv` for the student keeps every position's logits."""
    model = load_model(tiny_world.models[name], dtype="fp32")
    batch = _batch(tiny_world, name)
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    kv = extract_kv(model, batch["input_ids"], batch["attention_mask"], key_space=key_space)
    out, _ = forward_with_kv(model, batch["input_ids"], batch["attention_mask"], key_space=key_space)
    T = batch["input_ids"].shape[1]
    assert seen == [1, T] and out.logits.shape[1] == T and kv.keys.shape[3] == T


def test_gqa_keeps_real_kv_heads(tiny_world):
    model = load_model(tiny_world.models["student"], dtype="fp32")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    batch = _batch(tiny_world, "student")
    kv = extract_kv(model, batch["input_ids"], batch["attention_mask"])
    assert kv.num_heads == model.config.num_key_value_heads


def test_student_kv_carries_gradient_teacher_does_not(tiny_world):
    student = load_model(tiny_world.models["student"], dtype="fp32")
    batch = _batch(tiny_world, "student")
    out, kv = forward_with_kv(student, batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
    assert kv.keys.requires_grad and kv.values.requires_grad
    (kv.keys.square().mean() + kv.values.square().mean()).backward()
    k_proj = student.model.layers[0].self_attn.k_proj.weight
    assert k_proj.grad is not None and k_proj.grad.abs().sum() > 0
    assert torch.isfinite(out.loss)

    teacher = load_model(tiny_world.models["qwen2_teacher"], dtype="fp32")
    tkv = extract_kv(teacher, batch["input_ids"], batch["attention_mask"])
    assert not tkv.keys.requires_grad and tkv.keys.grad_fn is None


@pytest.mark.parametrize("name", ["llama_teacher", "gpt2"])
def test_extracted_cache_reproduces_decoding(tiny_world, name):
    """Decoding the last token from a cache rebuilt out of our stack equals the full forward."""
    model = load_model(tiny_world.models[name], dtype="fp32").eval()
    ids = _batch(tiny_world, name, n=1)["input_ids"]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits[:, -1]
        kv = extract_kv(model, ids[:, :-1], mask[:, :-1])
        cache = DynamicCache(config=model.config)
        for layer in range(kv.num_layers):
            cache.update(kv.keys[layer].clone(), kv.values[layer].clone(), layer)
        step = model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)


def test_pre_rope_keys(tiny_world):
    """RoPE rotates by position: at position 0 it is the identity, later it is not."""
    model = load_model(tiny_world.models["llama_teacher"], dtype="fp32")
    batch = _batch(tiny_world, "llama_teacher")
    post = extract_kv(model, batch["input_ids"], batch["attention_mask"])
    pre = extract_kv(model, batch["input_ids"], batch["attention_mask"], key_space="pre_rope")
    assert pre.keys.shape == post.keys.shape
    torch.testing.assert_close(pre.keys[:, :, :, 0], post.keys[:, :, :, 0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(pre.keys[:, :, :, 5:], post.keys[:, :, :, 5:], atol=1e-3)
    torch.testing.assert_close(pre.values, post.values)


def test_hidden_key_space_is_the_residual_stream_as_keys_and_values(tiny_world):
    """key_space hidden: keys and values are each layer's output hidden state `[L, B, 1, T, d]`, with the graph
    to the student's weights; no queries."""
    model = load_model(tiny_world.models["llama_teacher"], dtype="fp32")
    batch = _batch(tiny_world, "llama_teacher")
    out, kv = forward_with_kv(model, batch["input_ids"], batch["attention_mask"], key_space="hidden")
    ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    L, d = model.config.num_hidden_layers, model.config.hidden_size
    assert kv.keys.shape == (L, 2, 1, batch["input_ids"].shape[1], d) and kv.keys is kv.values
    torch.testing.assert_close(kv.keys[:, :, 0], torch.stack(ref.hidden_states[1:]))
    torch.testing.assert_close(out.logits, ref.logits)
    kv.keys.sum().backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None
    with pytest.raises(ValueError, match="no queries"):
        forward_with_kv(model, batch["input_ids"], batch["attention_mask"], key_space="hidden", queries=True)


def test_legacy_tuple_cache_stacks():
    legacy = tuple((torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)) for _ in range(6))
    k, v = stack_cache(legacy)
    assert k.shape == (6, 2, 3, 5, 4)
    torch.testing.assert_close(k[4], legacy[4][0])
    torch.testing.assert_close(v[1], legacy[1][1])


def test_kvcache_rejects_bad_shapes():
    k = torch.zeros(2, 1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"\[L, B, H, T, D\]"):
        KVCache(k[0], k[0], torch.ones(1, 5))
    with pytest.raises(ValueError, match="attention_mask"):
        KVCache(k, k, torch.ones(1, 6))
