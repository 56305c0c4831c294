"""Benchmark: a training epoch reading the teachers' KV from a `kvdistill capture` vs running them live.

Each case is a real `KVDistillTrainer.train()` epoch built by `build_trainer` from one config
(flat linear aligners, segment time alignment, Mercator KV loss, batch 2, one optimizer step per
batch, no checkpoints), on the large pair of `bench_step` (random-init student Qwen2 8 x 256,
7 M params; teachers Qwen2 and Llama 12 x 512, 36 M each; the fixtures' tokenizer and data):

- live: the teachers run their forward every step (`teacher_capture` unset);
- capture: `kvdistill capture` (`run_capture`) stores the teachers' KV once, then the same
  config with `teacher_capture: DIR` trains from it exactly as `kvdistill train` does: no
  teacher weights are loaded and every step reads the stored cache (`load_capture`);
- student only: the same student and data without teachers (plain CE): no distillation step can
  be cheaper, so `live / student only` bounds any capture's speed-up.

`speedup = live / capture` per epoch (hence per step), the median of paired ratios of
interleaved epochs. Target: >= 3 when the teachers are >= 5x the student; the headline is the
two-teacher row (teachers 10.6x the student); the one-teacher row (5.2x) is reported beside it.
The capture's one-off cost (teacher forwards over the records, writing the shards) is a column,
not part of the epoch.

Threads: `torch.set_num_threads(1)` for the run (restored after), as `bench_step`; `cpu_speedup`
is the same ratio in process CPU time. `--quick` swaps in the half-size pair, 8 records and one
repeat without warm-up (a smoke run, not a measurement).

    python benchmarks/bench_capture.py [--quick]
    kvdistill bench --only capture
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvdistill.commands.bench import interleaved_times, load_benchmark, run_standalone, torch_threads
from kvdistill.commands.capture import run_capture
from kvdistill.tiny import build_tiny_world
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

TARGET = 3.0


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


def _run(quick: bool, root: Path) -> dict[str, Any]:
    step = load_benchmark(Path(__file__).with_name("bench_step.py"))  # the large pair and its batch size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    samples, repeats, warmup = (8, 1, 0) if quick else (32, 5, 1)  # 3 repeats swung the headline by ±0.2
    world = build_tiny_world(root / "tiny", n_train=64, n_test=8)
    pair = step.make_pair(root / "pair", world.tokenizers["bpe"], step.QUICK if quick else step.LARGE)
    student, teacher_sets = pair["student"], {1: [pair["teacher_qwen2"]], 2: [pair["teacher_qwen2"], pair["teacher_llama"]]}

    def argv(name: str, teachers: list[Path], **extra: Any) -> list[str]:
        return trainer_argv(student, teachers, world.data_dir, root / name, samples, step.BATCH, device, **extra)

    trainers, capture_cost = {"student only": build_trainer(parse_config(argv("sft", [])))}, {}
    for n, teachers in teacher_sets.items():
        trainers[f"live {n}"] = build_trainer(parse_config(argv(f"live{n}", teachers)))
        cfg = parse_config(argv(f"cap{n}", teachers, teacher_capture=root / f"capture{n}"))
        t0 = time.perf_counter()
        run_capture(cfg, log=lambda _: None)
        seconds = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (root / f"capture{n}").rglob("*.safetensors"))
        capture_cost[n] = (seconds, size / 2**20)
        trainers[f"capture {n}"] = build_trainer(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its metrics after each epoch
        t = interleaved_times({name: tr.train for name, tr in trainers.items()}, repeats, warmup=warmup, device=device)
    steps = trainers["student only"].state.global_step
    student_m = _params(trainers["student only"].distill_model.student) / 1e6
    rows = []
    for n in teacher_sets:
        teachers_m = sum(_params(t.model) for t in trainers[f"live {n}"].teachers) / 1e6
        rows.append({
            "case": f"{n} teacher{'s' if n > 1 else ''}",
            "student_M": student_m,
            "teachers_M": teachers_m,
            "teachers_x": teachers_m / student_m,
            "steps": steps,
            "live_step_ms": t.ms(f"live {n}") / steps,
            "capture_step_ms": t.ms(f"capture {n}") / steps,
            "student_only_step_ms": t.ms("student only") / steps,
            "speedup": t.ratio(f"live {n}", f"capture {n}"),
            "cpu_speedup": t.ratio(f"live {n}", f"capture {n}", "cpu"),
            "bound": t.ratio(f"live {n}", "student only"),
            "capture_s": capture_cost[n][0],
            "capture_mib": capture_cost[n][1],
        })
    speedup = rows[-1]["speedup"]  # the two-teacher row: teachers >= 5x the student by a margin
    return {
        "name": "capture",
        "title": "Training epoch: teachers' KV from a capture vs live teachers",
        "description": f"`KVDistillTrainer.train()` for one epoch of {samples} records ({steps} steps of batch "
        f"{step.BATCH}), built by `build_trainer`; capture = `run_capture` then `teacher_capture: DIR`, read the "
        f"way training reads it. speedup = live / capture epoch time, median of {repeats} interleaved repeats "
        f"(paired) after {warmup} warm-up; bound = live / student-only (no teachers): no capture can beat it. capture_s, "
        f"capture_mib: the capture's one-off time and size on disk. 1 torch thread, {device.type}.",
        "results": rows,
        "ratio": speedup,
        "target": TARGET,
        "passed": speedup >= TARGET,
        "speedup": speedup,
        "one_teacher_speedup": rows[0]["speedup"],
        "device": device.type,
        "torch_threads": 1,
        "quick": quick,
    }


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    run_standalone(run, __doc__, "half-size pair, 8 records, one repeat")
