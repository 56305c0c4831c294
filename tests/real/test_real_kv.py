"""K/V and query extraction on the real pair (Gemma-3-270m, SmolLM2-135M): what `cache` returns is what
the model computes, recomputed here from each layer's input with the model's own modules."""

from contextlib import contextmanager

import pytest
import torch

from kvdistill.cache import extract_kv, forward_with_kv, query_modules
from kvdistill.models import load_model

pytestmark = pytest.mark.real

ROLES = ["teacher", "student"]  # Gemma3 (k_norm/q_norm, sliding + full layers, one KV head), Llama (GQA 3:1)
TEXTS = ["The quick brown fox jumps over the lazy dog, then runs far into the woods.", "2 + 3 = 5"]
# the recomputation runs the model's own modules on the same inputs (bit-exact on one CPU thread);
# the slack is for other kernels' summation order
TOL = {"rtol": 1e-5, "atol": 1e-4}


def _close(actual, expected, what, **tol):
    torch.testing.assert_close(actual, expected, **(tol or TOL), msg=lambda m: f"{what}: {m}")


def _batch(tokenizer, n=20):
    """`(ids, mask)` `[2, T]`: the texts cut to `n` tokens, the short one right-padded (a padded row)."""
    rows = [tokenizer(t)["input_ids"][:n] for t in TEXTS]
    T = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    assert mask.sum(1).min() < T
    return ids, mask


def _rotate(x, cos, sin):
    """RoPE as the HF models apply it (rotate_half convention), `x [B, H, T, D]`, `cos, sin [B, T, D]`."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


def _recompute(model, hidden, T):
    """Per layer `(pre-RoPE key, post-RoPE key, value)`, each `[B, H, T, D]`, from the layer's input
    `hidden[l]`: input_layernorm, k_proj / v_proj, k_norm where present, and the rotary embedding
    for that layer's type (Gemma3: another base on sliding and full layers)."""
    out, pos = [], torch.arange(T)[None]
    for layer, h in zip(model.model.layers, hidden):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        k = attn.k_proj(x).unflatten(-1, (-1, attn.head_dim))  # [B, T, H, D]
        k = (attn.k_norm(k) if hasattr(attn, "k_norm") else k).transpose(1, 2)  # [B, H, T, D]
        v = attn.v_proj(x).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)  # [B, H, T, D]
        kind = getattr(attn, "layer_type", None)
        cos, sin = model.model.rotary_emb(x, pos, *([kind] if kind else []))  # [1, T, D]
        out.append((k, _rotate(k, cos, sin), v))
    return out


@pytest.mark.parametrize("role", ROLES)
def test_cached_keys_and_values_are_the_models(real_models, role):
    """extract_kv's post-RoPE keys and values equal the recomputation from each layer's input."""
    model, tok = real_models[role]
    ids, mask = _batch(tok)
    kv = extract_kv(model, ids, mask, output_hidden_states=True)
    with torch.no_grad():
        ref = _recompute(model, kv.hidden_states, ids.shape[1])
    assert kv.num_layers == len(ref) == model.config.num_hidden_layers
    for layer, (_, k, v) in enumerate(ref):
        _close(kv.keys[layer], k, f"layer {layer} keys")
        _close(kv.values[layer], v, f"layer {layer} values")


@pytest.mark.parametrize("role", ROLES)
def test_pre_rope_keys_are_the_models_and_rotate_to_the_cache(real_models, role):
    """key_space pre_rope: the recomputation before RoPE (k_norm applied), and rotated by the layer's own
    rotary embedding they are the cached keys."""
    model, tok = real_models[role]
    ids, mask = _batch(tok)
    post = extract_kv(model, ids, mask, output_hidden_states=True)
    pre = extract_kv(model, ids, mask, key_space="pre_rope")
    assert pre.keys.shape == post.keys.shape
    with torch.no_grad():
        ref = _recompute(model, post.hidden_states, ids.shape[1])
    pos = torch.arange(ids.shape[1])[None]
    for layer, (k, _, _) in enumerate(ref):
        _close(pre.keys[layer], k, f"layer {layer}")
        kind = getattr(model.model.layers[layer].self_attn, "layer_type", None)
        cos, sin = model.model.rotary_emb(k, pos, *([kind] if kind else []))
        _close(_rotate(pre.keys[layer], cos, sin), post.keys[layer], f"layer {layer} rotated")
    torch.testing.assert_close(pre.values, post.values)


# ------------------------------------------------------------------ queries: the attention-map signal
@pytest.fixture(scope="module")
def eager(real_pair):
    """Eager-attention copies (output_attentions gives the probabilities), each test's edits undone."""
    return {role: load_model(path, dtype="fp32", attn_implementation="eager").eval() for role, path in real_pair.items()}


@contextmanager
def _set(objects, name, value):
    """`obj.name = value` on each of `objects`, restored afterwards."""
    old = [getattr(o, name) for o in objects]
    for o in objects:
        setattr(o, name, value)
    try:
        yield
    finally:
        for o, v in zip(objects, old):
            setattr(o, name, v)


def _assert_own_attention(model, ids, mask):
    """softmax(q kᵀ / sqrt(D)) of the hooked queries and cached keys (the attention loss's map: causal,
    padded keys masked) equals the eager attention's probabilities, every layer, on real rows and keys."""
    with torch.no_grad():
        out, kv = forward_with_kv(model, ids, mask, queries=True, output_attentions=True)
    q, k = kv.queries.double(), kv.keys.double()  # [L, B, H_q, T, D], [L, B, H_kv, T, D]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    T = ids.shape[1]
    hidden = torch.ones(T, T, dtype=torch.bool).triu(1) | ~mask.bool()[:, None, None, :]  # [B, 1, T, T]
    probs = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(hidden, -torch.inf).softmax(-1)
    real = mask.bool()[:, None, :, None] & mask.bool()[:, None, None, :]  # [B, 1, T, T]
    assert len(out.attentions) == kv.num_layers
    for layer, att in enumerate(out.attentions):  # [B, H_q, T, T]
        _close(probs[layer].float().masked_fill(~real, 0), att.masked_fill(~real, 0), f"layer {layer}",
               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("role", ROLES)
def test_hooked_queries_give_the_models_own_attention(real_models, eager, role):
    _assert_own_attention(eager[role], *_batch(real_models[role][1]))


def test_queries_carry_the_models_own_scaling(real_models, eager):
    """Gemma3 scales logits by query_pre_attn_scalar**-0.5, which is head_dim**-0.5 for the 270m only:
    with another scaling on every layer, the maps are still the model's."""
    model = eager["teacher"]
    attns, _ = query_modules(model)
    with _set(attns, "scaling", 64**-0.5):
        _assert_own_attention(model, *_batch(real_models["teacher"][1]))


def test_sliding_window_shorter_than_the_sequence_is_refused_in_one_line(real_models, eager):
    """A window of W leaves maps over <= W tokens causal; a longer sequence is refused naming the
    sliding layers and the length that works (the cache itself holds only W - 1 of them)."""
    model = eager["teacher"]
    ids, mask = _batch(real_models["teacher"][1])
    T = ids.shape[1]
    windowed = [m for m in query_modules(model)[0] if m.sliding_window]
    with _set([model.config, *windowed], "sliding_window", T - 1):
        with pytest.raises(ValueError, match=rf"^Gemma3ForCausalLM: layers 0-4, 6-10, 12-16 attend within a sliding "
                                             rf"window of {T - 1} tokens.* at most {T - 1} tokens$"):
            forward_with_kv(model, ids, mask, queries=True)
        with pytest.raises(ValueError, match=r"^Gemma3ForCausalLM: layers 0-4"):
            query_modules(model, seq_len=T)
    with (_set([model.config, *windowed], "sliding_window", T),  # the maps pass; the cache drops a token
          pytest.raises(ValueError, match=rf"keep only their last {T - 1} tokens\); use a max_length of at most {T - 1}$")):
        forward_with_kv(model, ids, mask, queries=True)
    query_modules(model, seq_len=512)  # the real window


def test_a_max_length_beyond_the_teachers_sliding_window_is_refused_from_its_config(real_pair):
    """The cache of Gemma's 512-token sliding layers keeps 511 tokens: max_length 1024 is refused from config.json
    before any model loads (it failed at step 1, "cache layers hold different lengths"); without a KV signal
    the teacher's cache is not read."""
    from kvdistill.train.config import ConfigError, parse_config

    argv = ["--student", real_pair["student"], "--teachers", f"[{{path: {real_pair['teacher']}}}]", "--max_length"]
    with pytest.raises(ConfigError, match=r"^max_length 1024: teacher \S+ \(.*\) has layers with a sliding window of "
                                          r"512 tokens, whose KV cache keeps only the last 511; set max_length <= 511$"):
        parse_config([*argv, "1024", "--kv_weight", "0.1"])
    assert parse_config([*argv, "511", "--kv_weight", "0.1"]).max_length == 511
    assert parse_config([*argv, "1024", "--kv_weight", "0", "--logit_kd_weight", "1"]).max_length == 1024
