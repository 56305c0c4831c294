"""Benchmark: logit KD's memory and time against CE alone, at vocabulary 262,144 (and 151,936).

One loss forward + backward from the student's final hidden states `[N, d]` through its head
`[V, d]` (N = B·T = 2,048 tokens, fp32; gradients to the hidden states and the head) at two head
shapes: Gemma-3-270m's (d 640, V 262,144: the headline) and Qwen2.5-0.5B's (d 896, V 151,936).
The teacher has a head of the student's shapes; its hidden states and head are given, so its logits
are made inside the loss (one matmul more than CE), unless a variant says its logits are given.
Variants:

- ce plain: `token_ce_sum` on the full logits, the way an HF model computes its loss (N×V logits,
  their log-softmax and gradient all live at once);
- ce chunked: the same CE through `chunked_head_loss` with no teacher (what Liger's fused linear CE
  and torchtune's chunked CE do): one chunk's logits at a time;
- kd unchunked: CE + forward-KL logit KD from one teacher of the same vocabulary on full logits
  (`token_ce_sum` + `logit_kd_sum`): the path without chunking;
- kd chunked: the same loss through `chunked_head_loss`;
- kd chunked, teacher logits: the same, from the teacher's logits `[N, V]` given (a teacher cache or a
  capture of logits: its head's matmul done elsewhere; the logits are an input, not counted);
- cross-vocab unchunked / chunked: CE + cross-vocabulary KD (`cross_vocab_kd_sum`; chunked: the same
  teacher as a `KDTeacher`) from a teacher with another tokenizer of the same size, half of whose
  tokens are the student's (a fixed random pairing), every position a shared boundary.

The unchunked variants run at V 151,936 only: at 262,144 they need 11 to 16 GB, more than the
machine these numbers come from can give one process (their ratio to chunked is clear at 151,936).

Chunks are `auto_chunk_tokens(d)` = d / 4 tokens (the `logit_chunk_tokens` default's size: 160 at
d 640, 224 at d 896): one fp32 `[chunk, V]` buffer is a quarter of the head's gradient.

Memory: each variant runs in fresh processes (`--measure VARIANT`), so no earlier variant's
high-water mark or allocator cache counts: `peak_mib`, the peak bytes torch allocates during the
fwd + bwd above what its inputs hold (`torch.profiler` memory events:
`kvdistill.commands.profile.measure`; the headline), and, from another fresh process without the
profiler, `rss_peak_mib`, the process's RSS high-water mark (`ru_maxrss`) after the step minus the
same mark once the inputs are allocated (glibc defaults, freed memory given back). The parameters'
and hidden states' gradients count in every variant.

Time: the variants of one head shape interleaved in this process (`interleaved_times`, 1 torch thread).

Headline `mem_over_ce` = kd chunked / ce chunked peak extra memory at V 262,144, `cross_mem_over_ce`
the same for cross-vocab KD (target ≤ 1.3 each): the fair "CE alone" is CE computed the same
memory-aware way, so the ratio is what logit KD adds to a trainer that already avoids materialising
the logits. The 151,936 ratios carry a `_151936` suffix; the ratios against plain CE
(`mem_over_ce_plain`, `time_over_ce_plain`) stand beside them.

Floors, computed from the shapes beside the measured ratios: `time_floor_over_ce` = the head matmuls
of kd chunked over ce chunked's (CE: logits, grad_hidden, grad_weight = 3; KD adds the teacher's
logits: 4/3, above the 1.3 time target, so that target applies where the teacher's logits are given:
floor 1); `mem_floor_over_ce` = (gradients + two chunk buffers) / (gradients + one): CE makes its
gradient in its logits' buffer, KD holds the teacher's distribution beside it (6/5 at d / 4 tokens).

`--quick`: N 256, d 64, V 8,192 and 4,096, one repeat (a smoke test, not a measurement).

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
from kvdistill.losses import KDTeacher, chunked_head_loss, cross_vocab_kd_sum, logit_kd_sum, token_ce_sum
from kvdistill.losses.chunked import auto_chunk_tokens
from kvdistill.malloc import keep_freed_memory

# the headline's head first (Gemma-3-270m's), then Qwen2.5-0.5B's
FULL = ({"tokens": 2048, "hidden": 640, "vocab": 262_144}, {"tokens": 2048, "hidden": 896, "vocab": 151_936})
QUICK = ({"tokens": 256, "hidden": 64, "vocab": 8192}, {"tokens": 256, "hidden": 64, "vocab": 4096})
VARIANTS = ("ce plain", "ce chunked", "kd unchunked", "kd chunked", "kd chunked, teacher logits",
            "cross-vocab unchunked", "cross-vocab chunked")
UNCHUNKED = ("kd unchunked", "cross-vocab unchunked")  # the secondary head shape only (module docstring)
MATMULS = {"ce plain": 3, "ce chunked": 3, "kd unchunked": 4, "kd chunked": 4, "kd chunked, teacher logits": 3,
           "cross-vocab unchunked": 4, "cross-vocab chunked": 4}
TARGET = 1.3


def make_inputs(shape: dict[str, int], seed: int = 0, t_logits: bool = False) -> dict[str, torch.Tensor]:
    """Student hidden `[N+1, d]` + head `[V, d]` (with gradients), a teacher's hidden + head, labels `[N+1]`, the
    cross-vocab pairing (`si`, `ti` `[V/2]`: student id si[k] is teacher id ti[k]); with `t_logits`, the
    teacher's logits `[N+1, V]` too."""
    g = torch.Generator().manual_seed(seed)
    n, d, v = shape["tokens"] + 1, shape["hidden"], shape["vocab"]  # n positions predict n-1 = N targets
    x = {
        "hidden": torch.randn(n, d, generator=g).requires_grad_(),
        "weight": (torch.randn(v, d, generator=g) * d**-0.5).requires_grad_(),
        "t_hidden": torch.randn(n, d, generator=g),
        "t_weight": torch.randn(v, d, generator=g) * d**-0.5,
        "labels": torch.randint(0, v, (n,), generator=g),
        "si": torch.randperm(v, generator=g)[: v // 2].sort().values,
        "ti": torch.randperm(v, generator=g)[: v // 2],
    }
    if t_logits:
        x["t_logits"] = F.linear(x["t_hidden"], x["t_weight"])  # [N+1, V]
    return x


def step_fn(variant: str, x: dict[str, torch.Tensor], chunk: int):
    """The variant's loss forward + backward on inputs `x`, as a callable (gradients reset first)."""

    def plain() -> torch.Tensor:
        logits = F.linear(x["hidden"], x["weight"])[None]  # [1, N+1, V]
        loss = token_ce_sum(logits, x["labels"][None])
        if variant == "ce plain":
            return loss
        with torch.no_grad():
            t_logits = F.linear(x["t_hidden"], x["t_weight"])[None]  # [1, N+1, V]
        if variant == "kd unchunked":
            return loss + logit_kd_sum(logits, t_logits, x["labels"][None], "forward_kl", 1.0)
        ones = logits.new_ones(logits.shape[1] - 1)  # [N] every position a shared boundary
        return loss + cross_vocab_kd_sum(logits[0, :-1], t_logits[0, :-1], x["si"], x["ti"], ones)

    def chunked() -> torch.Tensor:
        targets = x["labels"][1:]  # [N]
        head = (x["t_hidden"][:-1], x["t_weight"], None)
        teachers = ([] if variant == "ce chunked" else [head] if variant == "kd chunked"
                    else [KDTeacher(head, None, x["si"], x["ti"])] if variant == "cross-vocab chunked"
                    else [(x["t_logits"][:-1], None, None)])  # kd chunked, teacher logits
        kd_w = torch.ones(len(teachers), targets.shape[0])  # [K, N]
        return chunked_head_loss(x["hidden"][:-1], x["weight"], None, targets, teachers, kd_w, chunk_tokens=chunk)[0]

    loss_fn = plain if variant in ("ce plain", *UNCHUNKED) else chunked

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
    fn = step_fn(variant, x, auto_chunk_tokens(shape["hidden"]))
    if how == "profiler":
        return measure(fn)[2] / 2**20
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux: the inputs are in it
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**10


def run_shape(shape: dict[str, int], variants: tuple[str, ...], repeats: int, warmup: int) -> dict[str, Any]:
    """One head shape: memory per variant in fresh processes, then the variants' times interleaved here."""
    mem: dict[str, dict[str, float]] = {v: {} for v in variants}
    for v in variants:
        for how, key in (("profiler", "peak_mib"), ("rss", "rss_peak_mib")):
            out = subprocess.run([sys.executable, __file__, "--measure", v, "--how", how, "--shape", json.dumps(shape)],
                                 check=True, capture_output=True, text=True)
            mem[v][key] = float(out.stdout.strip().splitlines()[-1])
    chunk = auto_chunk_tokens(shape["hidden"])
    x = make_inputs(shape, t_logits=True)
    with torch_threads(1):
        t = interleaved_times({v: step_fn(v, x, chunk) for v in variants}, repeats, warmup=warmup)
    rows = [{"case": v, "vocab": shape["vocab"], **mem[v], "head_matmuls": MATMULS[v], "ms": t.ms(v),
             "time_over_ce": t.ratio(v, "ce chunked"), "time_over_ce_plain": t.ratio(v, "ce plain")} for v in variants]
    peak = {v: mem[v]["peak_mib"] for v in variants}
    grads = (shape["vocab"] + shape["tokens"] + 1) * shape["hidden"] * 4  # bytes of grad_weight, grad_hidden
    chunk_bytes = chunk * shape["vocab"] * 4  # one [chunk, V] fp32 buffer
    keys = {
        "mem_over_ce": peak["kd chunked"] / peak["ce chunked"],
        "time_over_ce": t.ratio("kd chunked", "ce chunked"),
        "cross_mem_over_ce": peak["cross-vocab chunked"] / peak["ce chunked"],
        "cross_time_over_ce": t.ratio("cross-vocab chunked", "ce chunked"),
        "mem_over_ce_teacher_logits": peak["kd chunked, teacher logits"] / peak["ce chunked"],
        "time_over_ce_teacher_logits": t.ratio("kd chunked, teacher logits", "ce chunked"),
        "mem_over_ce_plain": peak["kd chunked"] / peak["ce plain"],
        "time_over_ce_plain": t.ratio("kd chunked", "ce plain"),
        "mem_floor_over_ce": (grads + 2 * chunk_bytes) / (grads + chunk_bytes),
    }
    if "kd unchunked" in variants:
        keys["mem_unchunked_over_chunked"] = peak["kd unchunked"] / peak["kd chunked"]
        keys["cross_mem_unchunked_over_chunked"] = peak["cross-vocab unchunked"] / peak["cross-vocab chunked"]
    return {"rows": rows, "keys": keys, "chunk": chunk}


def run(quick: bool = False) -> dict[str, Any]:
    """Both head shapes (`run_shape`); a dict for `kvdistill bench`."""
    head, second = QUICK if quick else FULL
    repeats, warmup = (1, 0) if quick else (3, 1)
    main = run_shape(head, tuple(v for v in VARIANTS if v not in UNCHUNKED), repeats, warmup)
    other = run_shape(second, VARIANTS, repeats, warmup)
    k = main["keys"]
    floor = MATMULS["kd chunked"] / MATMULS["ce chunked"]
    shapes = ", ".join(f"[{s['tokens']}, {s['hidden']}] through [{s['vocab']}, {s['hidden']}]" for s in (head, second))
    return {
        "name": "logits",
        "title": "Logit KD from hidden states, same and cross vocabulary: chunked vs unchunked vs CE alone (memory, time)",
        "description": f"One loss fwd + bwd from student hidden states through a head ({shapes}; fp32), CE + "
        "forward-KL KD from one teacher of the same head shapes (cross-vocab: another tokenizer sharing half the "
        "tokens, `cross_vocab_kd_sum`); chunked = `chunked_head_loss`, d / 4 tokens per chunk "
        f"({main['chunk']}, {other['chunk']}). peak_mib: peak bytes torch allocates during the step above its "
        "inputs (torch.profiler), each variant in a fresh process; rss_peak_mib: the max-RSS rise over the step in "
        f"another fresh process, without the profiler. ms: median of {repeats} interleaved repeats, 1 torch thread. "
        f"Headline keys at V {head['vocab']}, the same keys with suffix _{second['vocab']} at V {second['vocab']} "
        "(the unchunked variants there only). mem_over_ce, cross_mem_over_ce, time_over_ce: kd chunked / ce "
        "chunked (CE done the same memory-aware way); *_plain: against CE on full logits. Floors (computed): "
        "time_floor_over_ce = head matmuls of kd chunked / ce chunked (4/3: the teacher's logits from its hidden "
        "states are one matmul more than CE's three; above the time target 1.3, which applies to KD from given "
        "teacher logits, floor 1); mem_floor_over_ce = (grad_weight + grad_hidden + 2 chunk buffers) / (the same "
        "+ 1): KD holds the teacher's distribution beside the student's logits, CE only the logits.",
        "results": main["rows"] + other["rows"],
        "ratio": k["mem_over_ce"],
        **k,
        **{f"{key}_{second['vocab']}": value for key, value in other["keys"].items()},
        "time_floor_over_ce": floor,
        "time_floor_over_ce_teacher_logits": MATMULS["kd chunked, teacher logits"] / MATMULS["ce chunked"],
        "target": TARGET,
        "passed": max(k["mem_over_ce"], k["cross_mem_over_ce"], k["time_over_ce_teacher_logits"]) <= TARGET,
        "shapes": [[s["tokens"], s["hidden"], s["vocab"]] for s in (head, second)],
        "chunk_tokens": [main["chunk"], other["chunk"]],
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
