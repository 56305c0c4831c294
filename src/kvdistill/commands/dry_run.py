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

Memory per GPU, in GiB (2**30 bytes): the items and formulas of `kvdistill.memory` (its module docstring
lists them, and what they leave out), for one micro-batch of B = per_device_train_batch_size
(+ transfer_batch_size with transfer_data) sequences of T = max_length tokens. `kvdistill train` on CPU adds
up the same items and compares them with the memory the machine has available before any weight loads.
Before comparing with a card, the CUDA context (about 1 GiB) is added.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvdistill.align.aligner import KVAligner
from kvdistill.config import check_output_dir
from kvdistill.io import REPO_ROOT, write_json_atomic
from kvdistill.memory import (
    DTYPE_NAMES,
    Component,
    build_components,
    kv_dims,
    kv_shape,
    total_gib,
)
from kvdistill.report import markdown_table, param_count
from kvdistill.train.build import meta_aligners, micro_batch, planned_memory
from kvdistill.train.config import KVDistillConfig, TeacherConfig, parse_config

CARDS_GIB = (24, 40, 48, 80)
CUDA_CONTEXT_GIB = 1.0


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


# ----------------------------------------------------------------------------- aligners


def aligner_rows(cfg: KVDistillConfig, specs: list[TeacherConfig], comps: list[Component],
                 planned: dict[str, Any]) -> tuple[dict[str, tuple[KVAligner, dict[str, int], int]], list[dict[str, Any]]]:
    """Each teacher's aligner (`train.build.meta_aligners`) and its table row: layer map, projector, parameter
    counts."""
    aligners = meta_aligners(cfg, specs, comps)
    kind = "cka -> proportional" if planned["layer_map"] == "cka" else cfg.layer_map
    rows = [{"teacher": name, **a.param_counts(), "codi": codi,
             "layer_map": f"{kind} [{dims['student_layers']}, {dims['teacher_layers']}]",
             "projector": a.config["projector"], "mode": cfg.head_mode} for name, (a, dims, codi) in aligners.items()]
    return aligners, rows


def dry_run(cfg: KVDistillConfig, planned: dict[str, Any]) -> dict[str, Any]:
    """Build every model and aligner on the meta device; the JSON-able report (`_modules` holds the modules)."""
    specs = cfg.active_teachers
    comps = build_components(cfg.student, cfg.student_dtype, [(s.name, s.path, s.dtype, s.quantization) for s in specs])
    B, T = micro_batch(cfg), cfg.max_length
    aligners, rows = aligner_rows(cfg, specs, comps, planned)
    mixed = "bf16" if cfg.bf16 else ("fp16" if planned["fp16"] else None)
    items = planned_memory(cfg, comps, aligners, mixed=mixed, offload=cfg.teacher_offload)
    total = total_gib(items)
    return {
        "config": planned["config"], "batch": {"B": B, "T": T}, "mixed_precision": mixed,
        "teacher_offload": cfg.teacher_offload, "models": [_model_row(c, B, T) for c in comps],
        "aligners": rows, "memory": items, "total_gib": total,
        "fits": {f"{g} GiB": total + CUDA_CONTEXT_GIB <= g for g in CARDS_GIB},
        "notes": _notes(cfg, planned), "_modules": [*(c.model for c in comps), *(a for a, _, _ in aligners.values())],
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

