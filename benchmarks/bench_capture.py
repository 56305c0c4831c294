"""Benchmark: a training epoch reading the teachers' KV from a `kvdistill capture` vs running them live.

Each case is a real `KVDistillTrainer.train()` epoch built by `build_trainer` from one config
(flat linear aligners, segment time alignment, Mercator KV loss, batch 2, one optimizer step per
batch, no checkpoints), on the large pair of `bench_step` (random-init student Qwen2 8 x 256,
7 M params; teachers Qwen2 and Llama 12 x 512, 36 M each; the fixtures' tokenizer and data):

- live: the teachers run their forward every step (`teacher_capture` unset);
- capture: `kvdistill capture` (`run_capture`) stores the teachers' KV once, then the same
  config with `teacher_capture: DIR` trains from it exactly as `kvdistill train` does: no
  teacher weights are loaded and every step reads the stored cache;
- student only: the same student and data without teachers (plain CE): no distillation step can
  be cheaper, so `live / student only` bounds any capture's speed-up; `share_of_bound = student only /
  capture` (= speed-up / bound) says how much of that bound a capture reaches.
- real pair (models/real, which `scripts/real_pair.sh` installs; otherwise a row that says so):
  Gemma-3-270m teaching SmolLM2-135M-Instruct (teacher 2.0x the student), CPU fp32, short sequences
  (`bench_step.REAL_MAX_LENGTH`), the same three epochs; its target is `share_of_bound >= 0.85`
  (`real_pair_share_of_bound`; at 2x its bound is small, so a speed-up target would say little), and
  `passed` needs it when measured. Then the bytes per teacher input token of its captures, each made by
  `run_capture` and measured on disk (shards' bytes / the manifest's token count): fp32 (the one trained
  from), bf16, `capture_layers: mapped` with the proportional map (30 student layers read all 18 teacher
  layers: no saving) and with `layer_map: last_k` 6, and `capture_keep: 0.5`.

`speedup = live / capture` per epoch (hence per step), the median of paired ratios of
interleaved epochs. Target: >= 3 when the teachers are >= 5x the student; the headline is the
two-teacher row (teachers 10.6x the student); the one-teacher row (5.2x) is reported beside it.
The capture's one-off cost (teacher forwards over the records, writing the shards) is a column,
not part of the epoch.

Threads: `torch.set_num_threads(1)` for the run (restored after), as `bench_step`; `cpu_speedup`
is the same ratio in process CPU time. `--quick` swaps in the half-size pair, 8 records (the real pair: 4) and one
repeat without warm-up (a smoke run, not a measurement).

    python benchmarks/bench_capture.py [--quick]
    kvdistill bench --only capture
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvdistill.capture import MANIFEST
from kvdistill.commands.bench import interleaved_times, load_benchmark, run_standalone, torch_threads
from kvdistill.commands.capture import run_capture
from kvdistill.real_pair import STUDENT, TEACHER
from kvdistill.tiny import build_tiny_world
from kvdistill.train.build import build_trainer
from kvdistill.train.config import KVDistillConfig, parse_config

TARGET = 3.0
SHARE_TARGET = 0.85  # of the bound, on the real pair
REAL_SAMPLES, REAL_SAMPLES_QUICK = 16, 4
# the real pair's capture settings whose bytes per token are measured, each against fp32's
BYTES_VARIANTS = {
    "fp32": {},
    "bf16": {"capture_dtype": "bf16"},
    "capture_layers mapped, proportional map": {"capture_layers": "mapped"},
    "capture_layers mapped, layer_map last_k 6": {"capture_layers": "mapped", "layer_map": "last_k", "layer_map_k": 6},
    "capture_keep 0.5": {"capture_keep": 0.5},
}


def trainer_argv(student: Path, teachers: list[Path], data: Path, out: Path, samples: int, batch: int,
                 device: torch.device, **extra: Any) -> list[str]:
    """CLI arguments of one training run: one epoch over `samples` records, no checkpoints, no logging."""
    args = {
        "student": student,
        "teachers": "[" + ", ".join(f"{{path: {p}}}" for p in teachers) + "]",
        "data": data,
        "output_dir": out,
        "max_samples": samples,
        "max_length": 256,
        "kv_weight": 0.1 if teachers else 0.0,
        "kv_warmup_steps": 0,
        "kv_loss": "mercator",
        "fusion": "loss_sum",
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "max_steps": samples // batch,
        "save_strategy": "no",
        "logging_steps": samples,
        "report_to": "none",
        "use_cpu": str(device.type == "cpu").lower(),
        "disable_tqdm": "true",
        **extra,
    }
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def run(quick: bool = False) -> dict[str, Any]:
    """Live vs captured teachers, one epoch each, interleaved; a JSON-able dict for `kvdistill bench`."""
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="kvdistill_bench_capture_") as tmp:
        return _run(quick, Path(tmp))


def capture(cfg: KVDistillConfig) -> dict[str, float]:
    """`run_capture(cfg)`: its time, and its size on disk over the teacher input tokens its manifests count."""
    t0 = time.perf_counter()
    run_capture(cfg, log=lambda _: None)
    seconds = time.perf_counter() - t0
    root = Path(cfg.teacher_capture)
    size = sum(f.stat().st_size for f in root.rglob("*.safetensors"))
    tokens = sum(json.loads(m.read_text())["tokens"] for m in root.glob(f"*/{MANIFEST}"))
    return {"capture_s": seconds, "capture_mib": size / 2**20, "bytes_per_token": size / tokens}


def capture_bytes(where: Path, **common: Any) -> list[dict[str, Any]]:
    """Rows: bytes per teacher input token of a capture made with each `BYTES_VARIANTS` setting (`common`: the
    run's `trainer_argv` arguments), and its share of the fp32 capture's."""
    sizes = {name: capture(parse_config(trainer_argv(out=where / f"run{v}", teacher_capture=where / f"capture{v}",
                                                     **common, **opts)))
             for v, (name, opts) in enumerate(BYTES_VARIANTS.items())}
    fp32 = sizes["fp32"]["bytes_per_token"]
    return [{"case": f"real pair capture, {name}", **size, "of_fp32": size["bytes_per_token"] / fp32}
            for name, size in sizes.items()]


def _run(quick: bool, root: Path) -> dict[str, Any]:
    step = load_benchmark(Path(__file__).with_name("bench_step.py"))  # the pairs and their batch size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    samples, repeats, warmup = (8, 1, 0) if quick else (32, 5, 1)  # 3 repeats swung the headline by ±0.2
    world = build_tiny_world(root / "tiny", n_train=64, n_test=8)
    pair = step.make_pair(root / "pair", world.tokenizers["bpe"], step.QUICK if quick else step.LARGE)
    # (one student's `trainer_argv` arguments, {case: teachers}): its cases share its student-only epoch
    large = {"student": pair["student"], "data": world.data_dir, "samples": samples, "batch": step.BATCH,
             "device": device}
    groups = [(large, {"1 teacher": [pair["teacher_qwen2"]],
                       "2 teachers": [pair["teacher_qwen2"], pair["teacher_llama"]]})]
    real, bytes_rows = step.real_pair_dirs(), []
    if real is not None:
        common = {**large, "student": real[STUDENT], "samples": REAL_SAMPLES_QUICK if quick else REAL_SAMPLES,
                  "max_length": step.REAL_MAX_LENGTH}
        groups.append((common, {step.REAL_CASE: [real[TEACHER]]}))
        # before any trainer is built: every config parsed resets accelerate's shared state, which a Trainer built
        # earlier reads in train()
        bytes_rows = capture_bytes(root / "bytes", teachers=[real[TEACHER]], **common)
    trainers, costs = [], {}  # per group, {name: trainer}
    for g, (common, cases) in enumerate(groups):
        where = root / f"g{g}"
        sft_argv = trainer_argv(teachers=[], out=where / "sft", **common)
        trainers.append({"student only": build_trainer(parse_config(sft_argv))})
        for c, (case, teachers) in enumerate(cases.items()):
            live = trainer_argv(teachers=teachers, out=where / f"live{c}", **common)
            trainers[g][f"live {case}"] = build_trainer(parse_config(live))
            cfg = parse_config(trainer_argv(teachers=teachers, out=where / f"cap{c}",
                                            teacher_capture=where / f"capture{c}", **common))
            costs[case] = capture(cfg)
            trainers[g][f"capture {case}"] = build_trainer(cfg)
    rows = []
    for (_, cases), group in zip(groups, trainers):
        # one timing loop per student: the real pair's long epochs would sit between the large pair's
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its metrics after each epoch
            t = interleaved_times({name: tr.train for name, tr in group.items()}, repeats, warmup=warmup, device=device)
        sft = "student only"
        steps = group[sft].state.global_step
        student_m = _params(group[sft].distill_model.student) / 1e6
        for case in cases:
            teachers_m = sum(_params(x.model) for x in group[f"live {case}"].teachers) / 1e6
            live, cap = f"live {case}", f"capture {case}"
            rows.append({
                "case": case,
                "student_M": student_m,
                "teachers_M": teachers_m,
                "teachers_x": teachers_m / student_m,
                "steps": steps,
                "live_step_ms": t.ms(live) / steps,
                "capture_step_ms": t.ms(cap) / steps,
                "student_only_step_ms": t.ms(sft) / steps,
                "speedup": t.ratio(live, cap),
                "cpu_speedup": t.ratio(live, cap, "cpu"),
                "bound": t.ratio(live, sft),
                "share_of_bound": t.ratio(sft, cap),
                "capture_s": costs[case]["capture_s"],
                "capture_mib": costs[case]["capture_mib"],
            })
    if real is None:
        rows.append({"case": step.REAL_CASE, "skipped": step.REAL_SKIPPED})
    speedup = rows[1]["speedup"]  # the two-teacher row: teachers >= 5x the student by a margin
    real_share = rows[2].get("share_of_bound")
    return {
        "name": "capture",
        "title": "Training epoch: teachers' KV from a capture vs live teachers",
        "description": f"`KVDistillTrainer.train()` for one epoch of {samples} records ({rows[0]['steps']} steps of "
        f"batch {step.BATCH}; the real pair: {REAL_SAMPLES_QUICK if quick else REAL_SAMPLES} records, max_length "
        f"{step.REAL_MAX_LENGTH}), built by `build_trainer`; capture = `run_capture` then `teacher_capture: DIR`, "
        f"read the way training reads it. speedup = live / capture epoch time, median of {repeats} interleaved "
        f"repeats (paired) after {warmup} warm-up; bound = live / student-only (no teachers): no capture can beat "
        "it; share_of_bound = student-only / capture. capture_s, capture_mib: the capture's one-off time and size "
        "on disk; bytes_per_token: its shards' bytes over the teacher input tokens. 1 torch thread, "
        f"{device.type}.",
        "results": rows + bytes_rows,
        "ratio": speedup,
        "target": TARGET,
        "passed": speedup >= TARGET and (real_share is None or real_share >= SHARE_TARGET),
        "speedup": speedup,
        "one_teacher_speedup": rows[0]["speedup"],
        "real_pair_speedup": rows[2].get("speedup"),
        "real_pair_share_of_bound": real_share,
        "share_of_bound_target": SHARE_TARGET,
        "real_pair_fp32_bytes_per_token": bytes_rows[0]["bytes_per_token"] if bytes_rows else None,
        "device": device.type,
        "torch_threads": 1,
        "quick": quick,
    }


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    run_standalone(run, __doc__, "half-size pair, 8 records, one repeat")
