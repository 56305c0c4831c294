"""KV-cache extraction: any HF causal LM's cache as one `[L, B, H_kv, T, D]` stack.

`transformers` has changed its cache object several times (legacy tuples, `DynamicCache`
with `key_cache` lists, `DynamicCache.layers[i].keys` in 5.x). Everything downstream of this
module sees only the `KVCache` value below, so those differences stop here.
"""

from __future__ import annotations

import inspect
import math
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn

KeySpace = Literal["post_rope", "pre_rope", "hidden"]  # hidden: the residual stream as keys and values
KEY_SPACES = ("post_rope", "pre_rope", "hidden")

# segment ids, shared by data, time alignment and the losses
PAD, PROMPT, REASONING, ANSWER = -1, 0, 1, 2
SEGMENT_NAMES = {PROMPT: "prompt", REASONING: "reasoning", ANSWER: "answer"}


@dataclass
class KVCache:
    """A model's key/value cache for one batch, stacked over layers.

    Attributes:
        keys: `[L, B, H, T, D]` keys per layer (post-RoPE as cached, or pre-RoPE).
        values: `[L, B, H, T, D]` values per layer.
        attention_mask: `[B, T]` 1 for real tokens, 0 for padding.
        segment_ids: `[B, T]` 0 prompt, 1 reasoning, 2 answer, -1 padding (optional).
        hidden_states: `[L+1, B, T, d_model]` embeddings + every layer's output (optional).
        queries: `[L, B, H_q, T, D]` post-RoPE queries, carrying the model's logit scale over `1/sqrt(D)`
            (optional; `forward_with_kv(queries=True)`, `capture_queries`).
        char_ends: `[B, T]` each token's last character in the text both sides read (`data.tokenize_example`;
            -1 none): with both sides', the time alignment pairs tokens by the text they cover (optional).
    """

    keys: Tensor
    values: Tensor
    attention_mask: Tensor
    segment_ids: Tensor | None = None
    hidden_states: Tensor | None = None
    queries: Tensor | None = None
    char_ends: Tensor | None = None

    def __post_init__(self) -> None:
        if self.keys.dim() != 5 or self.values.dim() != 5:
            raise ValueError(
                f"KVCache keys/values must be [L, B, H, T, D]; got keys {tuple(self.keys.shape)}, "
                f"values {tuple(self.values.shape)}"
            )
        if self.keys.shape[:4] != self.values.shape[:4]:
            raise ValueError(
                f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} disagree on [L, B, H, T]"
            )
        B, T = self.keys.shape[1], self.keys.shape[3]
        if tuple(self.attention_mask.shape) != (B, T):
            raise ValueError(
                f"attention_mask must be [B, T] = [{B}, {T}] to match the cache; got {tuple(self.attention_mask.shape)}"
            )
        if self.segment_ids is not None and tuple(self.segment_ids.shape) != (B, T):
            raise ValueError(f"segment_ids must be [B, T] = [{B}, {T}]; got {tuple(self.segment_ids.shape)}")
        q = self.queries
        if q is not None and (q.dim() != 5 or q.shape[:2] != self.keys.shape[:2] or q.shape[3] != T):
            raise ValueError(f"queries must be [L, B, H_q, T, D] beside keys {tuple(self.keys.shape)}; got "
                             f"{tuple(q.shape)}")

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_heads(self) -> int:
        return self.keys.shape[2]

    @property
    def seq_len(self) -> int:
        return self.keys.shape[3]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[4]

    def shape_summary(self) -> str:
        L, B, H, T, D = self.keys.shape
        return f"L={L} B={B} H_kv={H} T={T} D={D}"

    def detach(self) -> KVCache:
        return replace(
            self,
            keys=self.keys.detach(),
            values=self.values.detach(),
            hidden_states=None if self.hidden_states is None else self.hidden_states.detach(),
            queries=None if self.queries is None else self.queries.detach(),
        )


def stack_cache(past_key_values: Any) -> tuple[Tensor, Tensor]:
    """Stack whatever cache object a model returned into keys, values `[L, B, H, T, D]`.

    Handles transformers 5.x `Cache` objects (`.layers[i].keys/.values`), 4.x `DynamicCache`
    (`.key_cache/.value_cache` lists) and legacy tuples `((k, v), ...)`.
    """
    if past_key_values is None:
        raise ValueError("the model returned no cache: call it with use_cache=True")
    if hasattr(past_key_values, "layers"):  # transformers >= 4.56 / 5.x
        ks = [layer.keys for layer in past_key_values.layers]
        vs = [layer.values for layer in past_key_values.layers]
    elif hasattr(past_key_values, "key_cache"):  # transformers 4.3x-4.5x DynamicCache
        ks, vs = list(past_key_values.key_cache), list(past_key_values.value_cache)
    elif isinstance(past_key_values, (tuple, list)):  # legacy format
        ks = [layer[0] for layer in past_key_values]
        vs = [layer[1] for layer in past_key_values]
    else:
        raise TypeError(f"unsupported cache type {type(past_key_values).__name__}")
    if any(k is None for k in ks):
        raise ValueError("the cache has uninitialised layers (a hybrid/linear-attention model?)")
    lengths = {k.shape[-2] for k in ks}
    if len(lengths) != 1:
        raise ValueError(
            f"cache layers hold different lengths {sorted(lengths)} (sliding-window layers keep only their last "
            f"{min(lengths)} tokens); use a max_length of at most {min(lengths)}"
        )
    return torch.stack(ks), torch.stack(vs)  # [L, B, H, T, D] each


def _attentions(model: nn.Module) -> list[nn.Module]:
    """The per-layer attention modules with a key projection (Llama/Qwen/Gemma-style `self_attn.k_proj`)."""
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "k_proj")]


def _heads(attn: nn.Module, x: Tensor, norm: str) -> Tensor:
    """A query/key projection's output `[B, T, H*D]` as it enters the rotary embedding, `[B, H, T, D]`.

    The layer's `q_norm`/`k_norm` (where it has one) is applied here rather than hooked, since models
    apply it at different layouts: Qwen3 on `[B, T, H, D]`, Gemma3 on `[B, H, T, D]` (both an RMSNorm
    over the head dim, so the layout does not change it), OLMo2 on `[B, T, H*D]` (over all heads at once).
    """
    B, T = x.shape[:2]
    norm_fn = getattr(attn, norm, None)
    whole = norm_fn is not None and norm_fn.weight.shape[-1] == x.shape[-1]  # OLMo2: one norm over all heads
    x = (norm_fn(x) if whole else x).reshape(B, T, -1, attn.head_dim)  # [B, T, H, D]
    if norm_fn is not None and not whole:
        x = norm_fn(x)
    return x.transpose(1, 2)  # [B, H, T, D]


@contextmanager
def capture_pre_rope_keys(model: nn.Module):
    """Record each layer's key before the rotary embedding via forward hooks on `k_proj`.

    Yields a list that fills with `[B, H, T, D]` tensors, one per layer, in layer order: the key
    projection's output through the layer's `k_norm` where it has one (`_heads`). Models without
    rotary embeddings (GPT-2) have no `k_proj`: their cached keys already are "pre-RoPE", and the
    caller falls back to them. A caller can wrap `forward_with_kv` and get pre- and post-RoPE keys
    from one pass.
    """
    captured: list[Tensor] = []

    def key_hook(attn: nn.Module):
        def hook(_module: nn.Module, _inputs: Any, output: Tensor) -> None:
            captured.append(_heads(attn, output, "k_norm"))  # [B, H, T, D]
        return hook

    handles = [m.k_proj.register_forward_hook(key_hook(m)) for m in _attentions(model)]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def query_modules(model: nn.Module, seq_len: int | None = None) -> tuple[list[nn.Module], Any]:
    """The per-layer attention modules with a query projection (Llama/Qwen/Gemma-style `self_attn.q_proj`)
    and their modeling module's `apply_rotary_pos_emb`, for attention maps `softmax(scaling · q kᵀ)`
    over all earlier tokens, `scaling` the module's own. ValueError (one line) for a model without
    them (GPT-2), whose attention is not causal or soft-caps its logits, or, given `seq_len`, whose
    sliding window would cut a sequence that long (`_check_windows`)."""
    attns = [m for m in _attentions(model) if hasattr(m, "q_proj")]
    name = type(model).__name__
    rotate = getattr(sys.modules[type(attns[0]).__module__], "apply_rotary_pos_emb", None) if attns else None
    if not attns or rotate is None:
        raise ValueError(f"{name} has no Llama/Qwen2-style attention (self_attn.q_proj and apply_rotary_pos_emb): "
                         "kv_loss attention needs its post-RoPE queries; use kv_loss relation for this model")
    for reason, bad in [("soft-capped logits (attn_logit_softcapping)",
                         [i for i, m in enumerate(attns) if getattr(m, "attn_logit_softcapping", None)]),
                        ("non-causal attention", [i for i, m in enumerate(attns) if not getattr(m, "is_causal", True)])]:
        if bad:
            raise ValueError(f"{name}: layers {_spans(bad)} have {reason}; kv_loss attention cannot reproduce "
                             "their maps")
    if seq_len is not None:
        _check_windows(name, attns, seq_len)
    return attns, rotate


def _check_windows(name: str, attns: list[nn.Module], seq_len: int) -> None:
    """ValueError (one line) where a layer's sliding window W would cut a `seq_len`-token map: a query
    sees its last W keys itself included (`masking_utils.sliding_window_overlay`), so `seq_len <= W` is
    exactly the causal map the attention loss computes."""
    windows = {i: m.sliding_window for i, m in enumerate(attns) if getattr(m, "sliding_window", None)}
    cut = [i for i, w in windows.items() if seq_len > w]
    if cut:
        raise ValueError(f"{name}: layers {_spans(cut)} attend within a sliding window of "
                         f"{min(windows[i] for i in cut)} tokens, and kv_loss attention reads causal maps over "
                         f"{seq_len}; use sequences of at most {min(windows.values())} tokens")


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 4] -> "0-2, 4"."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@contextmanager
def capture_queries(model: nn.Module):
    """Record each layer's post-RoPE queries via forward hooks, as its attention computes them.

    Yields a list that fills with `[B, H_q, T, D]` tensors, one per layer, in layer order: the query
    projection's output (through `q_norm` where the model has one, `_heads`) rotated by the
    `position_embeddings` (cos, sin) the attention module receives, with its modeling module's own
    `apply_rotary_pos_emb` (`query_modules`; ValueError for a model without them). Each is scaled by
    `scaling · sqrt(D)` (1 where the module's scaling is the usual `D**-0.5`; Gemma3's is
    `query_pre_attn_scalar**-0.5`), so that `softmax(q kᵀ / sqrt(D))`, the attention loss's map, is the
    model's own. A sequence longer than a layer's sliding window raises ValueError (`_check_windows`).
    """
    attns, rotate = query_modules(model)
    captured: list[Tensor] = []
    pending: dict[int, Tensor] = {}

    def project_hook(attn: nn.Module):
        def hook(_module: nn.Module, _inputs: Any, output: Tensor) -> None:
            pending[id(attn)] = output
        return hook

    def attn_hook(module: nn.Module, args: tuple, kwargs: dict, _output: Any) -> None:
        D = module.head_dim
        q = _heads(module, pending.pop(id(module)), "q_norm")  # [B, H_q, T, D]
        if not captured:  # one check a forward: every layer sees the same length
            _check_windows(type(model).__name__, attns, q.shape[2])
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        scale = getattr(module, "scaling", D**-0.5) * math.sqrt(D)  # the model's logit scale over the loss's 1/sqrt(D)
        captured.append(rotate(q, q, cos, sin)[0] * scale)

    handles = []
    for m in attns:
        handles.append(m.q_proj.register_forward_hook(project_hook(m)))
        handles.append(m.register_forward_hook(attn_hook, with_kwargs=True))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def forward_with_kv(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    segment_ids: Tensor | None = None,
    *,
    labels: Tensor | None = None,
    key_space: KeySpace = "post_rope",
    output_hidden_states: bool = False,
    queries: bool = False,
    logits: bool = True,
    **model_kwargs: Any,
) -> tuple[Any, KVCache]:
    """One forward pass returning the model output *and* its stacked cache.

    The cache keeps the autograd graph: use this for the student, whose KV loss must reach its
    weights through the same pass that produces its LM loss. Wrap in `torch.no_grad()` (or use
    `extract_kv`) for teachers.

    Args:
        model: any HF causal LM (possibly wrapped by DDP/FSDP: call the wrapper so gradients sync).
        input_ids: `[B, T]` token ids.
        attention_mask: `[B, T]` 1 real / 0 pad.
        segment_ids: `[B, T]` optional segment ids, carried into the returned `KVCache`.
        labels: `[B, T]` optional LM labels (-100 ignored), passed to the model.
        key_space: "post_rope" (as cached), "pre_rope" (key projection output) or "hidden": the hidden
            state after each layer `[L, B, 1, T, d]` as both keys and values, one "head" of the model's
            width (an intermediate-state loss, as Minitron's, through the same aligners and losses); the
            last is after the final norm, as HF's `hidden_states` give it.
        output_hidden_states: also return hidden states `[L+1, B, T, d_model]`.
        queries: also return post-RoPE queries `[L, B, H_q, T, D]` (`capture_queries`; kv_loss attention).
        logits: False runs the LM head on the last position only (where the model takes `logits_to_keep`),
            for a caller that reads the cache or hidden states alone: `[B, T, V]` logits of a 262k
            vocabulary are GBs and most of a small model's forward.

    Returns:
        (model output, KVCache)
    """
    if key_space not in KEY_SPACES:
        raise ValueError(f"key_space must be one of {KEY_SPACES}, got {key_space!r}")
    if not logits and takes_logits_to_keep(model):
        model_kwargs = {**model_kwargs, "logits_to_keep": 1}
    if key_space == "hidden":
        if queries:
            raise ValueError("key_space hidden gives hidden states, which have no queries (kv_loss attention)")
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False,
                    output_hidden_states=True, **model_kwargs)
        hidden = torch.stack(out.hidden_states)  # [L+1, B, T, d]: the embeddings, then each layer's output
        h = hidden[1:].unsqueeze(2)  # [L, B, 1, T, d]
        return out, KVCache(h, h, attention_mask, segment_ids, hidden if output_hidden_states else None)
    inner = getattr(model, "module", model)  # DDP/FSDP wrapper -> the HF model, for hooks/config
    ctx = capture_pre_rope_keys(inner) if key_space == "pre_rope" else nullcontext([])
    with ctx as pre_keys, (capture_queries(inner) if queries else nullcontext([])) as qs:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            use_cache=True,
            output_hidden_states=output_hidden_states,
            **model_kwargs,
        )
    keys, values = stack_cache(out.past_key_values)  # [L, B, H, T, D]
    if key_space == "pre_rope" and pre_keys:
        if len(pre_keys) != keys.shape[0]:
            raise RuntimeError(f"captured {len(pre_keys)} pre-RoPE keys for {keys.shape[0]} layers")
        keys = torch.stack(pre_keys)  # [L, B, H, T, D]
    hidden = torch.stack(out.hidden_states) if output_hidden_states else None  # [L+1, B, T, d]
    kv = KVCache(keys, values, attention_mask, segment_ids, hidden, torch.stack(qs) if queries else None)
    return out, kv


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether `model.forward` takes `logits_to_keep` (HF causal LMs do; older or remote-code models may not)."""
    return "logits_to_keep" in inspect.signature(getattr(model, "module", model).forward).parameters


def extract_kv(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    segment_ids: Tensor | None = None,
    *,
    grad: bool = False,
    key_space: KeySpace = "post_rope",
    output_hidden_states: bool = False,
    queries: bool = False,
) -> KVCache:
    """The stacked KV cache of `model` on a batch; teacher use by default (`grad=False`).

    Example:
        >>> kv = extract_kv(teacher, batch["input_ids"], batch["attention_mask"])
        >>> kv.keys.shape  # [L, B, H_kv, T, D]
    """
    with torch.set_grad_enabled(grad):
        _, kv = forward_with_kv(
            model,
            input_ids,
            attention_mask,
            segment_ids,
            key_space=key_space,
            output_hidden_states=output_hidden_states,
            queries=queries,
            logits=False,  # the cache is all that is read
        )
    return kv if grad else kv.detach()
