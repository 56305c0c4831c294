"""The memory a training run needs, from the models' configs on the meta device; the host check on CPU.

`kvdistill dry-run` prints these items per GPU; `kvdistill train` on CPU adds them up (`estimate`) and
compares the sum with the memory the machine has available (`check_host_memory`) before any weight loads.
Every model is built from its `config.json` with `AutoModelForCausalLM.from_config` under
`torch.device("meta")`: shapes only, no weights, no memory, no download.

Memory in GiB (2**30 bytes). P: parameters; b(dtype): 4 bytes for fp32, 2 for bf16/fp16, dtype auto = the
dtype in the model's config.json; B = per_device_train_batch_size (+ transfer_batch_size with transfer_data);
T = max_length (every sequence padded to it: the worst case); L layers, H_kv KV heads, D head dim, h hidden
size, H*D query width, I MLP width, V vocabulary.

    student weights      P_s * b(student_dtype)          fp32: the master weights, bf16/fp16 autocast on top
    student grads        P_s * b(student_dtype)          gradients keep the parameter dtype
    student AdamW        P_s * b(student_dtype) * 2      torch AdamW: exp_avg and exp_avg_sq, parameter dtype
    autocast copy        P_s * 2                         fp32 weights under bf16/fp16 only: torch.autocast
                                                         caches a 16-bit copy of each weight for the step
    student activations  B*T * (L*(4h + 2*H*D + 4*H_kv*D + 4*I)*a + V*(a + 8))      rough, expect +-50 %
        a = 2 bytes under bf16/fp16 or with a 16-bit student, else 4. Per layer and token: both RMSNorms'
        inputs and outputs (4h), query and attention output (2*H*D), key and value in the layer and in the
        stacked cache the KV loss reads (4*H_kv*D), gate, up, SiLU(gate) and their product (4*I); per
        token the logits plus the cross-entropy's fp32 upcast and log-softmax (V*(a + 8)). key_space
        hidden: the stacked hidden states (h) in place of the stacked cache's 2*H_kv*D. Not counted:
        attention scores (SDPA / flash attention store none), RMSNorm's fp32 temporaries, fragmentation.
    teacher weights      none: P_t * b(dtype)
                         4bit: P_lin * 0.5625 + (P_t - P_lin) * b(dtype)   NF4: 4 bits + an fp32 absmax per 64
                         8bit: P_lin * 1 + (P_t - P_lin) * b(dtype)        LLM.int8 row scales not counted
        P_lin: weights of the nn.Linear layers bitsandbytes replaces (all but lm_head); embeddings, lm_head,
        norms and biases keep the teacher's dtype (bf16 for the shipped models).
        teacher_offload: true keeps teachers in CPU RAM and moves one at a time to the GPU, so of the
        unquantized teachers only the largest counts on a GPU; quantized teachers are never moved: each
        counts. On CPU (the host check) every teacher counts: offloading moves nothing.
        teacher_capture: no teacher weights are loaded.
    teacher outputs      2 * L * H_kv * D * B * T * b(dtype) (the KV cache of one micro-batch; every
                         teacher's, they live until the loss), + B*T*V*b(dtype) logits with
                         logit_kd_weight > 0, + (L+1)*B*T*h*b(dtype) hidden states with codi_weight > 0;
                         key_space hidden: (L+1)*B*T*h*b(dtype) in place of the cache (the hidden states
                         stand as keys and values, one tensor, shared with CODI's)
    aligners             P_a * 4 + P_a_trainable * 12        fp32 weights; grads and two AdamW states
                                                         (CODI projectors included)

Not counted: the CUDA context (about 1 GiB; dry-run adds it before comparing with a card), NCCL buffers
under DDP (which keeps all of the above on every GPU), the teachers' forward activations (no grad: one
layer at a time), the aligners' activations (aligned K and V in fp32: megabytes), the temporaries of
cross-vocabulary logit KD (about 25 B per teacher logit of each position where both tokenizers end a
token, `[M, V_t]`: fp32 copies, log-softmax, the sorted rest with its int64 indices; M depends on the data).

The host check (`kvdistill train` on CPU) compares the counted items with `MemAvailable` of
/proc/meminfo: what the kernel can hand out without swapping, page cache included. The process's own
resident memory at the check (Python, torch, transformers: about 0.46 GiB) is already outside it, so
it is not added. Above the available memory the run is refused; above `WARN_FRACTION` of it, a warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvdistill.align.aligner import KVAligner
from kvdistill.config import ConfigError
from kvdistill.io import REPO_ROOT
from kvdistill.models import model_dir, num_layers, resolve_dtype
from kvdistill.report import param_count

MODEL_CONFIGS = REPO_ROOT / "configs" / "models"
GIB = 2**30
QUANT_BYTES = {"4bit": 0.5625, "8bit": 1.0}  # bytes per quantized Linear weight (NF4: 0.5 + 4 / 64)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
WARN_FRACTION = 0.85  # the estimate is rough (activations +-50 %): warn when it leaves under 15 % headroom
MEMINFO = Path("/proc/meminfo")


@dataclass
class Component:
    """One model of the run, built on the meta device."""

    role: str  # "student" | "teacher"
    name: str
    source: Path  # the config.json it was built from
    model: nn.Module
    dtype: torch.dtype  # weights dtype (quantized teachers: of the modules bitsandbytes leaves alone)
    quantization: str | None = None


# ----------------------------------------------------------------------------- models on the meta device


def model_config_path(path: str) -> Path:
    """The config.json a model path is built from: its own local directory, else the shipped one."""
    local = Path(model_dir(path)) / "config.json"
    shipped = MODEL_CONFIGS / Path(str(path).rstrip("/")).name / "config.json"
    for candidate in (local, shipped):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"no config.json for model {path!r}: neither {shipped} nor {local} exists; copy the model's "
        f"config.json (from its Hub page) to {shipped}, or point the config at a local model directory"
    )


def meta_model(path: str) -> tuple[nn.Module, Path]:
    """`AutoModelForCausalLM.from_config` on the meta device: every parameter shaped, none allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = model_config_path(path)
    try:
        config = AutoConfig.from_pretrained(str(source.parent))
    except (OSError, ValueError) as err:  # not JSON, no or an unknown model_type
        raise ConfigError(f"{source} is not a model config transformers can read ({str(err).splitlines()[0]}); "
                          "copy the model's config.json again") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, source


def text_config(model: nn.Module) -> Any:
    """The decoder's config (the text config of a multimodal model)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def weight_dtype(dtype: str, model: nn.Module) -> torch.dtype:
    """A config dtype name as loaded: auto -> the checkpoint's dtype from config.json (fp32 if none)."""
    resolved = resolve_dtype(dtype)
    if isinstance(resolved, torch.dtype):
        return resolved
    stored = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    return getattr(torch, stored) if isinstance(stored, str) else (stored or torch.float32)


def kv_dims(model: nn.Module) -> dict[str, int]:
    """Layers, KV heads and head dim of a model's KV cache (GQA: num_key_value_heads)."""
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    return {
        "L": num_layers(model),
        "H_kv": getattr(cfg, "num_key_value_heads", None) or heads,
        "D": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    }


def build_components(student: str, student_dtype: str,
                     teachers: Sequence[tuple[str, str, str, str | None]]) -> list[Component]:
    """Student and teachers on the meta device, with the dtype and quantization each would load with.

    `teachers`: `(name, path, dtype, quantization)` of each teacher, in the run's order.
    """
    model, source = meta_model(student)
    out = [Component("student", Path(student.rstrip("/")).name, source, model, weight_dtype(student_dtype, model))]
    for name, path, dtype, quantization in teachers:
        model, source = meta_model(path)
        out.append(Component("teacher", name, source, model, weight_dtype(dtype, model), quantization))
    return out


# ----------------------------------------------------------------------------- aligners


def aligner_dims(teacher: dict[str, int], student: dict[str, int]) -> dict[str, int]:
    """`kv_dims` of both sides in the keys `KVAligner.build` reads (see `cache_dims`)."""
    return {
        "teacher_layers": teacher["L"], "student_layers": student["L"],
        "teacher_heads": teacher["H_kv"], "student_heads": student["H_kv"],
        "teacher_key_dim": teacher["D"], "teacher_value_dim": teacher["D"],
        "student_key_dim": student["D"], "student_value_dim": student["D"],
    }  # fmt: skip


def meta_aligner(aligner: KVAligner, dims: dict[str, int]) -> KVAligner:
    """`aligner` built for `dims` (`aligner_dims`) with its parameters on the meta device."""
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters on meta; the layer-map buffers ([L_s, L_t]) stay on the CPU
        aligner.build(dims)
    return aligner


def codi_params(teacher: Component, student: Component, codi: bool) -> int:
    """CODI's `nn.Linear(d_t, d_s)` per teacher (weights + bias), 0 without CODI."""
    if not codi:
        return 0
    d_t, d_s = text_config(teacher.model).hidden_size, text_config(student.model).hidden_size
    return d_t * d_s + d_s


# ----------------------------------------------------------------------------- bytes


def nbytes(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (b(dtype) in the module docstring)."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


def linear_weight_params(model: nn.Module) -> int:
    """Weights of the nn.Linear layers bitsandbytes quantizes: all but the output embedding (lm_head)."""
    head = model.get_output_embeddings()
    skip = {id(head.weight)} if head is not None else set()
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) not in skip)


def weight_bytes(c: Component) -> float:
    """Bytes of a model's weights: P * b(dtype), or quantized Linear weights + the rest in b(dtype)."""
    total = param_count(c.model)
    if c.quantization is None:
        return float(total * nbytes(c.dtype))
    quantized = linear_weight_params(c.model)
    return quantized * QUANT_BYTES[c.quantization] + (total - quantized) * nbytes(c.dtype)


def kv_shape(dims: dict[str, int], B: int, T: int) -> list[int]:
    """The KV cache shape as `KVCache` holds it: `[L, B, H_kv, T, D]`."""
    return [dims["L"], B, dims["H_kv"], T, dims["D"]]


def teacher_output_bytes(c: Component, B: int, T: int, logits: bool, hidden: bool, key_space: str = "post_rope"
                         ) -> int:
    """One micro-batch of a teacher's outputs: K and V (key_space hidden: the hidden states), + logits
    (logit KD), + hidden states (CODI; the same tensor under key_space hidden)."""
    cfg_t, b = text_config(c.model), nbytes(c.dtype)
    d = kv_dims(c.model)
    states = (d["L"] + 1) * B * T * cfg_t.hidden_size * b  # [L+1, B, T, h]
    total = states if key_space == "hidden" else 2 * d["L"] * d["H_kv"] * d["D"] * B * T * b  # K, V [L, B, H_kv, T, D]
    if logits:
        total += B * T * cfg_t.vocab_size * b  # [B, T, V]
    if hidden and key_space != "hidden":
        total += states
    return total


def activation_bytes(c: Component, B: int, T: int, a: int, key_space: str = "post_rope") -> int:
    """The student's stored activations, rough (formula in the module docstring)."""
    cfg, d = text_config(c.model), kv_dims(c.model)
    h, V = cfg.hidden_size, cfg.vocab_size
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * h  # GPT-2: n_inner or 4h
    q = cfg.num_attention_heads * d["D"]
    stacked = h if key_space == "hidden" else 2 * d["H_kv"] * d["D"]  # what the KV loss reads, stacked
    per_layer = 4 * h + 2 * q + 2 * d["H_kv"] * d["D"] + stacked + 4 * inter  # values per token and layer
    return B * T * (d["L"] * per_layer * a + V * (a + 8))


# ----------------------------------------------------------------------------- the estimate


def item(name: str, formula: str, value: float, counted: bool = True) -> dict[str, Any]:
    """One row of the estimate: what, its formula, bytes and GiB, and whether it is in the total."""
    return {"item": name, "formula": formula, "bytes": int(value), "gib": value / GIB, "counted": counted}


def student_items(c: Component, mixed: str | None, B: int, T: int, key_space: str = "post_rope"
                  ) -> list[dict[str, Any]]:
    """Weights, grads, AdamW, the autocast copy and the activations of the student."""
    P, b = param_count(c.model), nbytes(c.dtype)
    a = 2 if mixed or b == 2 else 4
    items = [
        item("student weights", f"P_s * {b} B", P * b),
        item("student grads", f"P_s * {b} B", P * b),
        item("student AdamW (2 states)", f"P_s * 2 * {b} B", 2 * P * b),
    ]
    if mixed and b == 4:
        items.append(item(f"student {mixed} autocast copy", "P_s * 2 B", 2 * P))
    d = kv_dims(c.model)
    stacked = "2*H_kv*D + h" if key_space == "hidden" else "4*H_kv*D"
    formula = f"B*T*(L*(4h + 2*H*D + {stacked} + 4*I)*{a} + V*{a + 8}) B, L={d['L']}"
    items.append(item("student activations (rough)", formula, activation_bytes(c, B, T, a, key_space)))
    return items


def resident_teachers(teachers: list[Component], offload: bool, captured: bool) -> set[str]:
    """Names of the teachers whose weights sit on the device (see teacher_offload in the module docstring);
    pass `offload=False` on CPU, where offloading moves nothing."""
    if captured:
        return set()
    if not offload:
        return {t.name for t in teachers}
    plain = [t for t in teachers if t.quantization is None]
    largest = {max(plain, key=weight_bytes).name} if plain else set()
    return largest | {t.name for t in teachers if t.quantization is not None}


def teacher_items(teachers: list[Component], B: int, T: int, *, logits: bool, hidden: bool, offload: bool,
                  captured: bool, key_space: str = "post_rope") -> list[dict[str, Any]]:
    """Each teacher's weights (counted if resident) and one micro-batch of its outputs."""
    resident = resident_teachers(teachers, offload, captured)
    items = []
    for t in teachers:
        b = nbytes(t.dtype)
        formula = (f"P_t * {b} B" if t.quantization is None
                   else f"P_lin * {QUANT_BYTES[t.quantization]} B + (P_t - P_lin) * {b} B")
        where = "" if t.name in resident else (" (captured: not loaded)" if captured else " (offloaded)")
        items.append(item(f"teacher {t.name} weights{where}", formula, weight_bytes(t), t.name in resident))
    for t in teachers:
        d, b = kv_dims(t.model), nbytes(t.dtype)
        states = f"(L+1)*B*T*h * {b} B"
        formula = states if key_space == "hidden" else f"2*{d['L']}*{d['H_kv']}*{d['D']}*B*T * {b} B"
        formula += f" + B*T*V * {b} B" if logits else ""
        formula += f" + {states}" if hidden and key_space != "hidden" else ""
        items.append(item(f"teacher {t.name} outputs (1 micro-batch)", formula,
                          teacher_output_bytes(t, B, T, logits, hidden, key_space)))
    return items


def estimate(student: Component, teachers: list[Component], *, B: int, T: int, mixed: str | None, logits: bool,
             hidden: bool, offload: bool, captured: bool, aligner_params: int,
             aligner_trainable: int, key_space: str = "post_rope") -> list[dict[str, Any]]:
    """Every item of the module docstring for one micro-batch of B x T tokens; `total_gib` adds them up.

    Args:
        mixed: "bf16" | "fp16" | None, the autocast dtype.
        logits, hidden: the teachers give logits (logit_kd_weight > 0) / hidden states (codi_weight > 0).
        offload, captured: teacher_offload, and teacher_capture set (no teacher weights load).
        aligner_params, aligner_trainable: parameters of every aligner and CODI projector, and how many train.
        key_space: what the KV loss reads (hidden: the hidden states, not the cache).
    """
    return [*student_items(student, mixed, B, T, key_space),
            *teacher_items(teachers, B, T, logits=logits, hidden=hidden, offload=offload, captured=captured,
                           key_space=key_space),
            item("aligners (fp32 weights + grads + AdamW)", "P_a * 4 B + P_a_trainable * 12 B",
                 4 * aligner_params + 12 * aligner_trainable)]


def total_gib(items: list[dict[str, Any]]) -> float:
    """The counted items, in GiB."""
    return sum(i["bytes"] for i in items if i["counted"]) / GIB


# ----------------------------------------------------------------------------- the host check


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes; None where there is none (not Linux, a kernel before 3.14)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def check_host_memory(need_gib: float, available: int | None) -> str | None:
    """The verdict on `need_gib` against the `available` bytes: "refuse" above them, "warn" above
    `WARN_FRACTION` of them, else None (also when the available memory is unknown)."""
    if available is None:
        return None
    if need_gib * GIB > available:
        return "refuse"
    return "warn" if need_gib * GIB > WARN_FRACTION * available else None
