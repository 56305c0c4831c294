"""Benchmark: logit KD's memory and time against CE alone, at Qwen2.5-0.5B head shapes.

One loss forward + backward from the student's final hidden states `[N, d]` through its head
`[V, d]` (N = B·T = 2,048 tokens, d = 896, V = 151,936; fp32; gradients to the hidden states and
the head), four variants:

- ce plain: `token_ce_sum` on the full logits, the way an HF model computes its loss (N×V logits,
  their log-softmax and gradient all live at once);
- ce chunked: the same CE through `chunked_head_loss` with no teacher (what Liger's fused linear CE
  and torchtune's chunked CE do): one chunk's logits at a time;
- kd unchunked: CE + forward-KL logit KD from one teacher of the same head shapes (its hidden states
  and head given, so its logits are made inside the loss: one matmul more than CE, in both KD
  variants), on full logits (`token_ce_sum` + `logit_kd_sum`): the path without chunking;
- kd chunked: the same loss through `chunked_head_loss` (`AUTO_CHUNK_TOKENS` tokens per chunk);
- kd chunked, teacher logits: the same, from the teacher's logits `[N, V]` given (a teacher cache or a
  capture of logits: its head's matmul done elsewhere; the logits are an input, not counted).

Memory: each variant runs in fresh processes (`--measure VARIANT`), so no earlier variant's
high-water mark or allocator cache counts: `peak_mib`, the peak bytes torch allocates during the
fwd + bwd above what its inputs hold (`torch.profiler` memory events:
`kvdistill.commands.profile.measure`; the headline), and, from another fresh process without the
profiler, `rss_peak_mib`, the process's RSS high-water mark (`ru_maxrss`) after the step minus the
same mark once the inputs are allocated (glibc defaults, freed memory given back). The parameters'
and hidden states' gradients count in every variant.

Time: the four variants interleaved in this process (`interleaved_times`, 1 torch thread).

Headline `mem_over_ce` = kd chunked / ce chunked peak extra memory, and `time_over_ce` likewise
(target ≤ 1.3 each): the fair "CE alone" is CE computed the same memory-aware way, so the ratio is
what logit KD adds to a trainer that already avoids materialising the logits. The ratios against
plain CE (`mem_over_ce_plain`, `time_over_ce_plain`) are reported beside them; plain CE's memory is
dominated by its own N×V logits, so against it chunked KD looks cheaper than it is.

Floors, computed from the shapes beside the measured ratios: `time_floor_over_ce` = the head matmuls of
kd chunked over ce chunked's (CE: logits, grad_hidden, grad_weight = 3; KD adds the teacher's logits
= 4/3 for the matmuls alone, 1 with the teacher's logits given); `mem_floor_over_ce` = (gradients +
two chunk buffers) / (gradients + one): CE makes its gradient in its logits' buffer, KD holds the
teachers' (summed) distribution beside it. Both floors are above the 1.3 target at this chunk size.

`--quick`: N 256, d 64, V 8,192, chunk 64, one repeat (a smoke test, not a measurement).

    python benchmarks/bench_logits.py [--quick]
    kvdistill bench --only logits
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from typing import Any

import torch
import torch.nn.functional as F

from kvdistill.commands.bench import interleaved_times, torch_threads
from kvdistill.commands.profile import measure
from kvdistill.losses import chunked_head_loss, logit_kd_sum, token_ce_sum
from kvdistill.losses.chunked import AUTO_CHUNK_TOKENS
from kvdistill.malloc import keep_freed_memory

FULL = {"tokens": 2048, "hidden": 896, "vocab": 151_936, "chunk": AUTO_CHUNK_TOKENS}  # Qwen2.5-0.5B's head
QUICK = {"tokens": 256, "hidden": 64, "vocab": 8192, "chunk": 64}
VARIANTS = ("ce plain", "ce chunked", "kd unchunked", "kd chunked", "kd chunked, teacher logits")
MATMULS = {"ce plain": 3, "ce chunked": 3, "kd unchunked": 4, "kd chunked": 4, "kd chunked, teacher logits": 3}
TARGET = 1.3


def make_inputs(shape: dict[str, int], seed: int = 0, t_logits: bool = False) -> dict[str, torch.Tensor]:
    """Student hidden `[N+1, d]` + head `[V, d]` (with gradients), a teacher's hidden + head, labels `[N+1]`;
    with `t_logits`, the teacher's logits `[N+1, V]` too."""
    g = torch.Generator().manual_seed(seed)
    n, d, v = shape["tokens"] + 1, shape["hidden"], shape["vocab"]  # n positions predict n-1 = N targets
    x = {
        "hidden": torch.randn(n, d, generator=g).requires_grad_(),
        "weight": (torch.randn(v, d, generator=g) * d**-0.5).requires_grad_(),
        "t_hidden": torch.randn(n, d, generator=g),
        "t_weight": torch.randn(v, d, generator=g) * d**-0.5,
        "labels": torch.randint(0, v, (n,), generator=g),
    }
    if t_logits:
        x["t_logits"] = F.linear(x["t_hidden"], x["t_weight"])  # [N+1, V]
    return x


def step_fn(variant: str, x: dict[str, torch.Tensor], chunk: int):
    """The variant's loss forward + backward on inputs `x`, as a callable (gradients reset first)."""

    def plain() -> torch.Tensor:
        logits = F.linear(x["hidden"], x["weight"])[None]  # [1, N+1, V]
        loss = token_ce_sum(logits, x["labels"][None])
        if variant == "kd unchunked":
            with torch.no_grad():
                t_logits = F.linear(x["t_hidden"], x["t_weight"])[None]  # [1, N+1, V]
            loss = loss + logit_kd_sum(logits, t_logits, x["labels"][None], "forward_kl", 1.0)
        return loss

    def chunked() -> torch.Tensor:
        targets = x["labels"][1:]  # [N]
        teachers = ([(x["t_hidden"][:-1], x["t_weight"], None)] if variant == "kd chunked"
                    else [(x["t_logits"][:-1], None, None)] if variant == "kd chunked, teacher logits" else [])
        kd_w = torch.ones(len(teachers), targets.shape[0])  # [K, N]
        return chunked_head_loss(x["hidden"][:-1], x["weight"], None, targets, teachers, kd_w, chunk_tokens=chunk)[0]

    loss_fn = plain if variant in ("ce plain", "kd unchunked") else chunked

    def fn() -> None:
        x["hidden"].grad = x["weight"].grad = None
        loss_fn().backward()

    return fn


def measure_variant(variant: str, shape: dict[str, int], how: str = "profiler") -> float:
    """In this (fresh) process: MiB of peak extra memory of one fwd + bwd, by the profiler's memory events
    (`how="profiler"`) or by the rise of the max RSS over its value once the inputs are allocated ("rss",
    without the profiler, whose own buffers would count)."""
    torch.set_num_threads(1)
    x = make_inputs(shape, t_logits=variant == "kd chunked, teacher logits")
    fn = step_fn(variant, x, shape["chunk"])
    if how == "profiler":
        return measure(fn)[2] / 2**20
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux: the inputs are in it
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**10


def run(quick: bool = False) -> dict[str, Any]:
    """Memory per variant in fresh processes, then time interleaved here; a dict for `kvdistill bench`."""
    shape = QUICK if quick else FULL
    mem: dict[str, dict[str, float]] = {v: {} for v in VARIANTS}
    for v in VARIANTS:
        for how, key in (("profiler", "peak_mib"), ("rss", "rss_peak_mib")):
            out = subprocess.run([sys.executable, __file__, "--measure", v, "--how", how, "--shape", json.dumps(shape)],
                                 check=True, capture_output=True, text=True)
            mem[v][key] = float(out.stdout.strip().splitlines()[-1])
    repeats, warmup = (1, 0) if quick else (3, 1)
    x = make_inputs(shape, t_logits=True)
    with torch_threads(1):
        t = interleaved_times({v: step_fn(v, x, shape["chunk"]) for v in VARIANTS}, repeats, warmup=warmup)
    rows = [{"case": v, **mem[v], "head_matmuls": MATMULS[v], "ms": t.ms(v), "time_over_ce": t.ratio(v, "ce chunked"),
             "time_over_ce_plain": t.ratio(v, "ce plain")} for v in VARIANTS]
    kd, ce, ce_plain = mem["kd chunked"]["peak_mib"], mem["ce chunked"]["peak_mib"], mem["ce plain"]["peak_mib"]
    mem_over_ce, time_over_ce = kd / ce, t.ratio("kd chunked", "ce chunked")
    grads = (shape["vocab"] + shape["tokens"] + 1) * shape["hidden"] * 4  # bytes of grad_weight, grad_hidden
    chunk_bytes = shape["chunk"] * shape["vocab"] * 4  # one [chunk, V] fp32 buffer
    return {
        "name": "logits",
        "title": "Logit KD from hidden states: chunked vs unchunked vs CE alone (memory and time)",
        "description": f"One loss fwd + bwd from student hidden states [{shape['tokens']}, {shape['hidden']}] through "
        f"a [{shape['vocab']}, {shape['hidden']}] head (fp32), CE + forward-KL KD from one teacher of the same shapes; "
        f"chunked = `chunked_head_loss`, {shape['chunk']} tokens per chunk. peak_mib: peak bytes torch allocates during "
        "the step above its inputs (torch.profiler), each variant in a fresh process; rss_peak_mib: the max-RSS rise "
        f"over the step in another fresh process, without the profiler. ms: median of {repeats} interleaved repeats, 1 torch thread. mem_over_ce, "
        "time_over_ce: kd chunked / ce chunked (the headline: CE done the same memory-aware way); *_plain: against "
        "CE on full logits. Floors (computed): time_floor_over_ce = head matmuls of kd chunked / ce chunked (4/3: "
        "the teacher's logits from its hidden states are one matmul more than CE's three; the time target 1.3 is "
        "below it); mem_floor_over_ce = (grad_weight + grad_hidden + 2 chunk buffers) / (the same + 1): KD holds "
        "the teachers' distribution beside the student's logits, CE only the logits (its gradient made in them).",
        "results": rows,
        "ratio": mem_over_ce,
        "mem_over_ce": mem_over_ce,
        "time_over_ce": time_over_ce,
        "mem_over_ce_plain": kd / ce_plain,
        "time_over_ce_plain": t.ratio("kd chunked", "ce plain"),
        "time_floor_over_ce": MATMULS["kd chunked"] / MATMULS["ce chunked"],
        "mem_floor_over_ce": (grads + 2 * chunk_bytes) / (grads + chunk_bytes),
        "time_over_ce_teacher_logits": t.ratio("kd chunked, teacher logits", "ce chunked"),
        "mem_over_ce_teacher_logits": mem["kd chunked, teacher logits"]["peak_mib"] / ce,
        "mem_unchunked_over_chunked": mem["kd unchunked"]["peak_mib"] / kd,
        "target": TARGET,
        "passed": mem_over_ce <= TARGET and time_over_ce <= TARGET,
        "shape": [shape["tokens"], shape["hidden"], shape["vocab"]],
        "chunk_tokens": shape["chunk"],
        "torch_threads": 1,
        "quick": quick,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, one repeat")
    parser.add_argument("--measure", choices=VARIANTS, help="(internal) measure one variant's memory in this process")
    parser.add_argument("--how", choices=("profiler", "rss"), default="profiler", help="(internal) with --measure")
    parser.add_argument("--shape", help="(internal) the shape dict, JSON")
    args = parser.parse_args()
    if args.measure:  # glibc defaults here: RSS follows what is really held
        print(measure_variant(args.measure, json.loads(args.shape), args.how))
    else:
        keep_freed_memory()  # as every `kvdistill` process does (`kvdistill bench` runs this module too)
        json.dump(run(quick=args.quick), sys.stdout, indent=1)
        print()
