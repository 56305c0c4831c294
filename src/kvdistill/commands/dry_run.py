"""`kvdistill dry-run`: will a training config fit on a GPU? Every model is built on the meta device.

    kvdistill dry-run --config configs/qwen2.5-0.5b_from_qwen2-1.5b+7b.yaml [--key value ...] [--output_dir DIR]

Reads the training config as `kvdistill train` does (same YAML, same overrides, same checks), builds
the student and every teacher from its `config.json` with `AutoModelForCausalLM.from_config` under
`torch.device("meta")` (shapes only: no weights, no memory, no download) and each teacher's aligner as
training does (`KVAligner(...)` with the run's options), sized from the models' KV dims instead of a
probe batch. Prints parameters, KV shapes, aligner sizes and a memory estimate per GPU; with
`--output_dir` on the command line it also writes them to `output_dir/dry_run.json`.

Model configs: a model path that is a local directory with a `config.json` is read from there (the
model training would load); otherwise `configs/models/<last part of the path>/config.json`, shipped
for the GPU recipe's models (Qwen2.5-0.5B, Qwen2-1.5B, Qwen2-7B, Llama-3.2-1B, Llama-3.2-3B). For any
other Hub id, copy its config.json there. `layer_map: cka` reads each teacher's layer-map JSON, which
the dry run does not need: a proportional map of the same shape [L_s, L_t] stands in. It maps every
student layer, as a CKA top-k map does, so the aligners get the same parameters.

Memory per GPU, in GiB (2**30 bytes). P: parameters; b(dtype): 4 bytes for fp32, 2 for bf16/fp16,
dtype auto = the dtype in the model's config.json; B = per_device_train_batch_size (+ transfer_batch_size
with transfer_data); T = max_length (every sequence padded to it: the worst case); L layers,
H_kv KV heads, D head dim, h hidden size, H*D query width, I MLP width, V vocabulary.

    student weights      P_s * b(student_dtype)          fp32: the master weights, bf16/fp16 autocast on top
    student grads        P_s * b(student_dtype)          gradients keep the parameter dtype
    student AdamW        P_s * b(student_dtype) * 2      torch AdamW: exp_avg and exp_avg_sq, parameter dtype
    autocast copy        P_s * 2                         fp32 weights under bf16/fp16 only: torch.autocast
                                                         caches a 16-bit copy of each weight for the step
    student activations  B*T * (L*(4h + 2*H*D + 4*H_kv*D + 4*I)*a + V*(a + 8))      rough, expect +-50 %
        a = 2 bytes under bf16/fp16 or with a 16-bit student, else 4. Per layer and token: both RMSNorms'
        inputs and outputs (4h), query and attention output (2*H*D), key and value in the layer and in the
        stacked cache the KV loss reads (4*H_kv*D), gate, up, SiLU(gate) and their product (4*I); per
        token the logits plus the cross-entropy's fp32 upcast and log-softmax (V*(a + 8)). Not counted:
        attention scores (SDPA / flash attention store none), RMSNorm's fp32 temporaries, fragmentation.
    teacher weights      none: P_t * b(dtype)
                         4bit: P_lin * 0.5625 + (P_t - P_lin) * b(dtype)   NF4: 4 bits + an fp32 absmax per 64
                         8bit: P_lin * 1 + (P_t - P_lin) * b(dtype)        LLM.int8 row scales not counted
        P_lin: weights of the nn.Linear layers bitsandbytes replaces (all but lm_head); embeddings, lm_head,
        norms and biases keep the teacher's dtype (bf16 for the shipped models).
        teacher_offload: true keeps teachers in CPU RAM and moves one at a time to the GPU, so of the
        unquantized teachers only the largest counts; quantized teachers are never moved: each counts.
        teacher_capture: no teacher weights are loaded.
    teacher outputs      2 * L * H_kv * D * B * T * b(dtype) (the KV cache of one micro-batch; every
                         teacher's, they live until the loss), + B*T*V*b(dtype) logits with
                         logit_kd_weight > 0, + (L+1)*B*T*h*b(dtype) hidden states with codi_weight > 0
    aligners             P_a * 4 + P_a_trainable * 12        fp32 weights; grads and two AdamW states
                                                         (CODI projectors included)

Not counted: the CUDA context (about 1 GiB, added before comparing with a card), NCCL buffers under
DDP (which keeps all of the above on every GPU), the teachers' forward activations (no grad: one layer
at a time), the aligners' activations (aligned K and V in fp32: megabytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from kvdistill.align.aligner import KVAligner
from kvdistill.align.layer_map import build_layer_map
from kvdistill.config import ConfigError, check_output_dir
from kvdistill.io import REPO_ROOT, write_json_atomic
from kvdistill.models import model_dir, num_layers, resolve_dtype
from kvdistill.report import markdown_table, param_count
from kvdistill.train.build import check_relation_heads, make_aligner
from kvdistill.train.config import KVDistillConfig, TeacherConfig, parse_config

MODEL_CONFIGS = REPO_ROOT / "configs" / "models"
GIB = 2**30
QUANT_BYTES = {"4bit": 0.5625, "8bit": 1.0}  # bytes per quantized Linear weight (NF4: 0.5 + 4 / 64)
CARDS_GIB = (24, 40, 48, 80)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
CUDA_CONTEXT_GIB = 1.0


@dataclass
class Component:
    """One model of the run, built on the meta device."""

    role: str  # "student" | "teacher"
    name: str
    source: Path  # the config.json it was built from
    model: nn.Module
    dtype: torch.dtype  # weights dtype (quantized teachers: of the modules bitsandbytes leaves alone)
    quantization: str | None = None


# ----------------------------------------------------------------------------- the config


def _cli_value(argv: list[str], key: str) -> str | None:
    """The last `--key value` / `--key=value` on the command line (a bare `--key` is "true")."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{key}":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            value = "true" if nxt is None or nxt.startswith("--") else nxt
        elif arg.startswith(f"--{key}="):
            value = arg.split("=", 1)[1]
    return value


def _option(argv: list[str], key: str) -> Any:
    """An option as the user set it: the command line, else the `--config` YAML, else None."""
    value = _cli_value(argv, key)
    path = Path(_cli_value(argv, "config") or "")
    if value is None and path.is_file():
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            return None  # `parse_config` reports it
        value = doc.get(key) if isinstance(doc, dict) else None
    return value


def _true(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "t", "yes", "y", "1")


def parse_dry_run(argv: list[str]) -> tuple[KVDistillConfig, dict[str, Any]]:
    """The training config, with what only a real run needs swapped out; returns it and what was swapped.

    `use_cpu` lets `bf16: true` parse on a machine without a GPU (nothing runs here); `fp16` is read
    from the arguments and turned off for parsing (transformers refuses it without CUDA);
    `layer_map: cka` becomes proportional (the JSON files are not needed).
    """
    planned = {"layer_map": _option(argv, "layer_map") or "proportional", "fp16": _true(_option(argv, "fp16"))}
    extra = ["--use_cpu", "true"]
    if planned["fp16"]:
        extra += ["--fp16", "false"]
    if planned["layer_map"] == "cka":
        extra += ["--layer_map", "proportional"]
    cfg = parse_config([*argv, *extra], prog="kvdistill dry-run", description=__doc__)
    planned.update(output_dir=_cli_value(argv, "output_dir"), config=_cli_value(argv, "config"))
    return cfg, planned


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


def build_components(cfg: KVDistillConfig, specs: list[TeacherConfig]) -> list[Component]:
    """Student and teachers on the meta device, with the dtype and quantization each would load with."""
    model, source = meta_model(cfg.student)
    out = [Component("student", Path(cfg.student.rstrip("/")).name, source, model,
                     weight_dtype(cfg.student_dtype, model))]
    for s in specs:
        model, source = meta_model(s.path)
        out.append(Component("teacher", s.name, source, model, weight_dtype(s.dtype, model), s.quantization))
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


def build_aligner(cfg: KVDistillConfig, spec: TeacherConfig, dims: dict[str, int]) -> KVAligner:
    """One teacher's aligner as `kvdistill train` builds it, parameters on the meta device.

    `layer_map: cka` gets a proportional map of the same shape (see the module docstring).
    """
    from accelerate import init_empty_weights

    kind = "proportional" if cfg.layer_map == "cka" else cfg.layer_map
    layer_map = build_layer_map(kind, dims["student_layers"], dims["teacher_layers"], k=cfg.layer_map_k)  # [L_s, L_t]
    aligner = make_aligner(cfg, spec, layer_map)
    with init_empty_weights():  # parameters on meta; the layer-map buffers ([L_s, L_t]) stay on the CPU
        aligner.build(dims)
    return aligner


def codi_params(cfg: KVDistillConfig, teacher: Component, student: Component) -> int:
    """CODI's `nn.Linear(d_t, d_s)` per teacher (weights + bias), 0 without codi_weight."""
    if cfg.codi_weight <= 0:
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


def teacher_output_bytes(cfg: KVDistillConfig, c: Component, B: int, T: int) -> int:
    """One micro-batch of a teacher's outputs: K and V, + logits (logit KD), + hidden states (CODI)."""
    cfg_t, b = text_config(c.model), nbytes(c.dtype)
    d = kv_dims(c.model)
    total = 2 * d["L"] * d["H_kv"] * d["D"] * B * T * b  # K and V, [L, B, H_kv, T, D] each
    if cfg.logit_kd_weight > 0:
        total += B * T * cfg_t.vocab_size * b  # [B, T, V]
    if cfg.codi_weight > 0:
        total += (d["L"] + 1) * B * T * cfg_t.hidden_size * b  # [L+1, B, T, h]
    return total


def activation_bytes(c: Component, B: int, T: int, a: int) -> int:
    """The student's stored activations, rough (formula in the module docstring)."""
    cfg, d = text_config(c.model), kv_dims(c.model)
    h, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = cfg.num_attention_heads * d["D"]
    per_layer = 4 * h + 2 * q + 4 * d["H_kv"] * d["D"] + 4 * inter  # values per token and layer
    return B * T * (d["L"] * per_layer * a + V * (a + 8))


# ----------------------------------------------------------------------------- the estimate


def _item(item: str, formula: str, value: float, counted: bool = True) -> dict[str, Any]:
    return {"item": item, "formula": formula, "bytes": int(value), "gib": value / GIB, "counted": counted}


def student_items(c: Component, mixed: str | None, B: int, T: int) -> list[dict[str, Any]]:
    """Weights, grads, AdamW, the autocast copy and the activations of the student."""
    P, b = param_count(c.model), nbytes(c.dtype)
    a = 2 if mixed or b == 2 else 4
    items = [
        _item("student weights", f"P_s * {b} B", P * b),
        _item("student grads", f"P_s * {b} B", P * b),
        _item("student AdamW (2 states)", f"P_s * 2 * {b} B", 2 * P * b),
    ]
    if mixed and b == 4:
        items.append(_item(f"student {mixed} autocast copy", "P_s * 2 B", 2 * P))
    d = kv_dims(c.model)
    formula = f"B*T*(L*(4h + 2*H*D + 4*H_kv*D + 4*I)*{a} + V*{a + 8}) B, L={d['L']}"
    items.append(_item("student activations (rough)", formula, activation_bytes(c, B, T, a)))
    return items


def on_gpu(teachers: list[Component], offload: bool, captured: bool) -> set[str]:
    """Names of the teachers whose weights sit on the GPU (see teacher_offload in the module docstring)."""
    if captured:
        return set()
    if not offload:
        return {t.name for t in teachers}
    plain = [t for t in teachers if t.quantization is None]
    largest = {max(plain, key=weight_bytes).name} if plain else set()
    return largest | {t.name for t in teachers if t.quantization is not None}


def teacher_items(cfg: KVDistillConfig, teachers: list[Component], B: int, T: int) -> list[dict[str, Any]]:
    """Each teacher's weights (counted if on the GPU) and one micro-batch of its outputs."""
    gpu = on_gpu(teachers, cfg.teacher_offload, bool(cfg.teacher_capture))
    items = []
    for t in teachers:
        b = nbytes(t.dtype)
        formula = (f"P_t * {b} B" if t.quantization is None
                   else f"P_lin * {QUANT_BYTES[t.quantization]} B + (P_t - P_lin) * {b} B")
        where = "" if t.name in gpu else (" (captured: not loaded)" if cfg.teacher_capture else " (offloaded)")
        items.append(_item(f"teacher {t.name} weights{where}", formula, weight_bytes(t), t.name in gpu))
    for t in teachers:
        d, b = kv_dims(t.model), nbytes(t.dtype)
        formula = f"2*{d['L']}*{d['H_kv']}*{d['D']}*B*T * {b} B"
        formula += f" + B*T*V * {b} B" if cfg.logit_kd_weight > 0 else ""
        formula += f" + (L+1)*B*T*h * {b} B" if cfg.codi_weight > 0 else ""
        items.append(_item(f"teacher {t.name} outputs (1 micro-batch)", formula, teacher_output_bytes(cfg, t, B, T)))
    return items


def aligner_rows(cfg: KVDistillConfig, specs: list[TeacherConfig], comps: list[Component],
                 planned: dict[str, Any]) -> tuple[dict[str, KVAligner], list[dict[str, Any]]]:
    """Each teacher's aligner (meta device) and its table row: layer map, projector, parameter counts."""
    student, aligners, rows = comps[0], {}, []
    kind = "cka -> proportional" if planned["layer_map"] == "cka" else cfg.layer_map
    for t, spec in zip(comps[1:], specs):
        if spec.weight == 0:  # logits only: outside the fusion, no aligner (as build_trainer)
            continue
        dims = aligner_dims(kv_dims(t.model), kv_dims(student.model))
        if cfg.kv_loss == "relation":
            check_relation_heads(cfg, t.name, dims)
        aligners[t.name] = a = build_aligner(cfg, spec, dims)
        rows.append({"teacher": t.name, **a.param_counts(), "codi": codi_params(cfg, t, student),
                     "layer_map": f"{kind} [{dims['student_layers']}, {dims['teacher_layers']}]",
                     "projector": a.config["projector"], "mode": cfg.head_mode})
    return aligners, rows


def dry_run(cfg: KVDistillConfig, planned: dict[str, Any]) -> dict[str, Any]:
    """Build every model and aligner on the meta device; the JSON-able report (`_modules` holds the modules)."""
    specs = cfg.active_teachers
    comps = build_components(cfg, specs)
    B = cfg.per_device_train_batch_size + (cfg.transfer_batch_size if cfg.transfer_data and specs else 0)
    T = cfg.max_length
    aligners, rows = aligner_rows(cfg, specs, comps, planned)
    mixed = "bf16" if cfg.bf16 else ("fp16" if planned["fp16"] else None)
    P_a = sum(r["total"] + r["codi"] for r in rows)
    P_train = sum(r["trainable"] + r["codi"] for r in rows)
    items = [*student_items(comps[0], mixed, B, T), *teacher_items(cfg, comps[1:], B, T),
             _item("aligners (fp32 weights + grads + AdamW)", "P_a * 4 B + P_a_trainable * 12 B",
                   4 * P_a + 12 * P_train)]
    total = sum(i["bytes"] for i in items if i["counted"]) / GIB
    return {
        "config": planned["config"], "batch": {"B": B, "T": T}, "mixed_precision": mixed,
        "teacher_offload": cfg.teacher_offload, "models": [_model_row(c, B, T) for c in comps],
        "aligners": rows, "memory": items, "total_gib": total,
        "fits": {f"{g} GiB": total + CUDA_CONTEXT_GIB <= g for g in CARDS_GIB},
        "notes": _notes(cfg, planned), "_modules": [*(c.model for c in comps), *aligners.values()],
    }  # fmt: skip


def _model_row(c: Component, B: int, T: int) -> dict[str, Any]:
    """A model's table row: parameters, dtype and KV shape per axis."""
    d = kv_dims(c.model)
    return {"role": c.role, "name": c.name, "config": _display(c.source), "params": param_count(c.model),
            "dtype": DTYPE_NAMES.get(c.dtype, str(c.dtype)), "quantization": c.quantization,
            "kv": {"L": d["L"], "B": B, "H_kv": d["H_kv"], "T": T, "D": d["D"]}, "kv_shape": kv_shape(d, B, T)}


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _notes(cfg: KVDistillConfig, planned: dict[str, Any]) -> list[str]:
    """What the dry run did differently from training, in words."""
    notes = []
    if planned["layer_map"] == "cka":
        notes.append("layer_map cka: the teachers' layer-map JSON files are not read; a proportional map of "
                     "the same shape [L_s, L_t] stands in (every student layer mapped: same aligner parameters)")
    if cfg.teacher_capture:
        notes.append("teacher_capture: teacher weights are not loaded; their outputs come from the capture")
    return notes


# ----------------------------------------------------------------------------- output


def format_report(report: dict[str, Any]) -> str:
    """The report as Markdown tables (what `main` prints)."""
    b = report["batch"]
    head = (f"config {report['config'] or '(command line)'}: micro-batch B={b['B']} x T={b['T']} tokens, "
            f"mixed precision {report['mixed_precision'] or 'off'}, "
            f"teacher_offload {str(report['teacher_offload']).lower()}; every model built on the meta device\n")
    models = markdown_table(
        ["model", "config", "params", "KV [L, H_kv, T, D]", "dtype"],
        [[f"{m['role']} {m['name']}", m["config"], f"{m['params']:,}", str([m['kv'][k] for k in ('L', 'H_kv', 'T', 'D')]),
          m["dtype"] + (f" + {m['quantization']}" if m["quantization"] else "")] for m in report["models"]],
    )  # fmt: skip
    aligners = markdown_table(
        ["aligner", "layer map [L_s, L_t]", "projector", "params", "trainable", "CODI"],
        [[r["teacher"], r["layer_map"], f"{r['projector']} ({r['mode']})", f"{r['total']:,}", f"{r['trainable']:,}",
          f"{r['codi']:,}"] for r in report["aligners"]],
    )  # fmt: skip
    memory = markdown_table(
        ["memory per GPU", "formula", "GiB"],
        [[i["item"], i["formula"], f"{i['gib']:.2f}" if i["counted"] else f"({i['gib']:.2f})"] for i in report["memory"]]
        + [["**total**", "counted items", f"**{report['total_gib']:.2f}**"]],
    )  # fmt: skip
    fits = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in report["fits"].items())
    tail = f"fits (total + {CUDA_CONTEXT_GIB:.0f} GiB CUDA context): {fits}\n"
    notes = "".join(f"\nnote: {n}\n" for n in report["notes"])  # one paragraph each (Markdown)
    return "\n".join([head, models, aligners, memory + "\n" + tail + notes])


def main(argv: list[str]) -> int:
    cfg, planned = parse_dry_run(argv)
    report = dry_run(cfg, planned)
    if planned["output_dir"]:  # before the tables: a report printed, then a failed write, reads as a success
        check_output_dir(planned["output_dir"])
    print(format_report(report), end="")
    if planned["output_dir"]:
        path = write_json_atomic(Path(planned["output_dir"]) / "dry_run.json",
                                 {k: v for k, v in report.items() if not k.startswith("_")})
        print(f"report written to {path}")
    return 0

