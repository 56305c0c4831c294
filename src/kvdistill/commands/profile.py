"""`kvdistill profile`: shapes, time and memory of every alignment stage for a model pair.

One batch goes through teacher KV extraction, the student forward, then each stage of a
`KVAligner` (time + layer, then head + dim, as `KVAligner.forward` runs them), the KV loss and
the backward pass; a table shows each
stage's output shape, wall time and peak memory (after one unmeasured warm-up pass of the aligner),
followed by the aligner's parameter counts.

Memory: on CUDA, `torch.cuda.max_memory_allocated` above the stage's starting point; on CPU,
the peak of the bytes the PyTorch allocator handed out during the stage, read from
`torch.profiler` memory events (`tracemalloc` cannot see tensor storage, which is allocated
outside Python's allocator). CPU times include the profiler's small per-op overhead.

Example:
    kvdistill profile --teacher Qwen/Qwen2-1.5B --student Qwen/Qwen2.5-0.5B --mode structured
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvdistill.config import ConfigError, check_choice, check_output_dir, option, parse_config
from kvdistill.io import write_json_atomic

MiB = 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, float, int]:
    """Run `fn()` once: `(result, seconds, peak bytes allocated above the starting point)`.

    CUDA: `max_memory_allocated`; CPU: the running sum of `torch.profiler` memory events.
    """
    device = torch.device(device)
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        seconds = time.perf_counter() - t0
        return out, seconds, max(0, torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return out, seconds, peak


def _shape(x: Any) -> str:
    if isinstance(x, Tensor):
        return "x".join(str(s) for s in x.shape) if x.dim() else "scalar"
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], Tensor):
        return " / ".join(_shape(t) for t in x)
    return "-"


@dataclass
class ProfileConfig:
    """Options of `kvdistill profile`."""

    teacher: str | None = option(None, "Teacher model: Hub id or local directory. Required.")
    student: str | None = option(None, "Student model: Hub id or local directory. Required.")
    mode: str = option("flat", "Head alignment mode: flat | structured.")
    projector: str = option("linear", "Dim projector kind: linear | elastic.")
    mlp_ratio: float = option(1.0, "Elastic Bottleneck width ratio.")
    time_mode: str = option("segment", "Time alignment: segment | global | index.")
    direction: str = option("teacher_to_student", "Which side the projectors map: teacher_to_student | "
                            "student_to_teacher.")
    layer_map: str | None = option(None, "Layer-map JSON (default: proportional).")
    loss: str = option("mercator", "KV loss for the loss/backward stages.")
    batch_size: int = option(2, "Examples in the batch.")
    max_length: int = option(128, "Token limit per example.")
    data: str | None = option(None, "GSM8K-format data (jsonl/json/parquet file, directory or Hub id); "
                              "default: synthetic problems.")
    split: str = option("train", "Split of --data.")
    device: str = option("auto", "cpu, cuda, cuda:1 ... (auto: cuda if available).")
    dtype: str = option("fp32", "Model dtype: fp32 | bf16 | fp16 | auto.")
    key_space: str = option("post_rope", "Which keys: post_rope | pre_rope.")
    seed: int = option(0, "Seed for synthetic data and projector init.")
    json: str | None = option(None, "Also write the table as JSON to this path.")

    def __post_init__(self) -> None:
        from kvdistill.losses import LOSSES

        if not self.teacher or not self.student:
            raise ConfigError("pass both --teacher and --student (Hub ids or local model directories)")
        if self.batch_size < 1 or self.max_length < 8 or self.mlp_ratio <= 0:
            raise ConfigError(f"need --batch_size >= 1, --max_length >= 8 and --mlp_ratio > 0, got {self.batch_size}, "
                              f"{self.max_length} and {self.mlp_ratio}")
        check_choice("loss", self.loss, tuple(LOSSES))
        for name, allowed in (("mode", ("flat", "structured")), ("projector", ("linear", "elastic")),
                              ("time_mode", ("segment", "global", "index")),
                              ("direction", ("teacher_to_student", "student_to_teacher")),
                              ("key_space", ("post_rope", "pre_rope"))):
            check_choice(name, getattr(self, name), allowed)


def profile_pair(args: ProfileConfig) -> dict[str, Any]:
    """Run the profile and return `{"stages": [...], "aligner": {...}, ...}` (also used by tests)."""
    from kvdistill.align.aligner import KVAligner
    from kvdistill.align.layer_map import load_layer_map
    from kvdistill.cache import extract_kv, forward_with_kv
    from kvdistill.data import DistillCollator, TeacherView, load_records
    from kvdistill.losses import aligned_kv_loss, build_kv_loss
    from kvdistill.models import (
        check_length,
        check_vocab,
        config_hash,
        load_model,
        load_tokenizer,
        max_positions,
        num_layers,
        resolve_device,
    )
    from kvdistill.synthetic import generate_problems

    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    s_tok, t_tok = load_tokenizer(args.student), load_tokenizer(args.teacher)
    student = load_model(args.student, dtype=args.dtype, device=device)
    teacher = load_model(args.teacher, dtype=args.dtype, device=device).eval()
    for name, model, tok in ((f"student {args.student}", student, s_tok), (f"teacher {args.teacher}", teacher, t_tok)):
        check_vocab(model, tok, name)
        check_length(model, args.max_length, name, f"--max_length {args.max_length}",
                     f"set --max_length <= {max_positions(model)}")
    if args.data:
        records = load_records(args.data, split=args.split, limit=args.batch_size)
    else:
        records = generate_problems(args.batch_size, seed=args.seed)
    # the teacher always reads the text through its own tokenizer (identical ids if shared)
    collate = DistillCollator(s_tok, args.max_length, teachers={"teacher": TeacherView(t_tok)})
    batch = collate(records)
    s_in = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "segment_ids")}
    t_in = {k: batch["teacher_inputs"]["teacher"][k].to(device) for k in ("input_ids", "attention_mask", "segment_ids")}

    rows: list[dict[str, Any]] = []

    def stage(name: str, fn: Callable[[], Any], shape_of: Callable[[Any], Any] | None = None) -> Any:
        out, seconds, peak = measure(fn, device)
        rows.append(
            {
                "stage": name,
                "shape": _shape(shape_of(out) if shape_of else out),
                "ms": round(seconds * 1000, 3),
                "peak_mib": round(peak / MiB, 3),
            }
        )
        return out

    tkv = stage(
        "teacher KV (no_grad)",
        lambda: extract_kv(teacher, **t_in, key_space=args.key_space),
        lambda kv: kv.keys,
    )
    _, skv = stage(
        "student forward + KV",
        lambda: forward_with_kv(student, **s_in, key_space=args.key_space),
        lambda o: o[1].keys,
    )
    layer_map = None
    if args.layer_map:
        try:
            layer_map = load_layer_map(
                args.layer_map,
                num_layers(student),
                num_layers(teacher),
                student_hash=config_hash(student),
                teacher_hash=config_hash(teacher),
            )
        except (OSError, ValueError) as err:  # names the file and the fix
            raise ConfigError(f"--layer_map: {err}") from None
    aligner = KVAligner(
        mode=args.mode,
        time_mode=args.time_mode,
        layer_map=layer_map,
        projector=args.projector,
        mlp_ratio=args.mlp_ratio,
        direction=args.direction,
    )
    stage("aligner setup (build params)", lambda: aligner.setup(tkv, skv))
    loss_fn = build_kv_loss(args.loss)
    with torch.no_grad():  # one unmeasured warm-up pass: first-call costs are not a stage's
        aligned_kv_loss(loss_fn, aligner(tkv, skv))

    # the stages one by one, as KVAligner.forward runs them
    idx = stage("time: index", lambda: aligner.time_index(tkv, skv), lambda i: i.lo)
    t_tl = stage(
        "time+layer: gather",  # one weighted gather, one-hot or soft (CKA) map alike
        lambda: (aligner.teacher_time_layer(tkv.keys, idx), aligner.teacher_time_layer(tkv.values, idx)),
    )
    s_l = stage(
        "student: layers, time-major",
        lambda: (aligner.student_layers(skv.keys), aligner.student_layers(skv.values)),
    )
    src = t_tl if args.direction == "teacher_to_student" else s_l
    stage(
        "head+dim: " + ("flatten, projectors" if args.mode == "flat" else "mix heads, projectors"),
        lambda: (aligner.head_dim(src[0], "key"), aligner.head_dim(src[1], "value")),
    )
    aligned = stage(
        "aligner forward (all)",
        lambda: aligner(tkv, skv),
        lambda a: (a.teacher_keys, a.student_keys),
    )
    loss, metrics = stage("loss (K+V)", lambda: aligned_kv_loss(loss_fn, aligned), lambda o: o[0])
    stage("backward", lambda: loss.backward())
    counts = aligner.param_counts()
    return {
        "teacher": str(args.teacher),
        "student": str(args.student),
        "device": str(device),
        "teacher_kv": tkv.shape_summary(),
        "student_kv": skv.shape_summary(),
        "stages": rows,
        "aligner": {"dims": aligner.dims, "params": counts, "summary": aligner.summary()},
        "cos_sim": float(metrics["cos_sim"]),
        "loss": float(loss.detach()),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    w_stage = max(len("stage"), *(len(r["stage"]) for r in rows)) + 2
    w_shape = max(len("output shape"), *(len(r["shape"]) for r in rows)) + 2
    header = f"{'stage':<{w_stage}}{'output shape':<{w_shape}}{'ms':>10}{'peak MiB':>12}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['stage']:<{w_stage}}{r['shape']:<{w_shape}}{r['ms']:>10.2f}{r['peak_mib']:>12.2f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_config(ProfileConfig, argv, "kvdistill profile", __doc__)
    if args.json:
        check_output_dir(Path(args.json).parent, "--json's directory")
    report = profile_pair(args)
    print(f"teacher {report['teacher']}: {report['teacher_kv']}")
    print(f"student {report['student']}: {report['student_kv']}   device {report['device']}")
    print(format_table(report["stages"]))
    print(report["aligner"]["summary"])
    print(
        f"aligner parameters: {report['aligner']['params']['total']:,}   initial cos-sim {report['cos_sim']:.3f}"
    )
    if args.json:
        write_json_atomic(args.json, report)
    return 0
