"""Benchmark: KV alignment + loss against its floor, the K/V projection matmuls.

Forward + backward of `KVAligner` (flat, linear K/V projectors, segment time alignment,
proportional layer map) + the Mercator loss at real shapes — teacher 28 layers x 4 KV heads x
head dim 128 (Qwen2-1.5B-like), student 24 x 2 x 64, B=2, T_s=512, T_t=600, three segments with
per-sample lengths and padding — and at the real pair's (Gemma-3-270m teaching SmolLM2-135M:
teacher 18 x 1 x 256, student 30 x 3 x 64, read from models/real/*/config.json when
`scripts/real_pair.sh` installed it; random tensors, so the models are not needed), B=2,
T_s=480, T_t=420: more student layers than teacher layers, one teacher KV head.

- floor: the K and V projection matmuls alone (forward + backward), work every implementation has to
  do, on the fewer rows of two: the already-aligned teacher tensors `[L_s*B*T_s, H_t*D_t]`, or the
  teacher's own rows `[L_t*B*T_t, H_t*D_t]` (the gather is linear, so it commutes with the projection:
  the aligner projects the teacher first when those are fewer, as at the real pair's 18 teacher layers
  for 30 student layers). Headline: `over_floor` = aligner / floor (median of paired ratios of
  interleaved repeats), target <= 1.3. The real pair's row on the aligned rows is kept for comparison
  with results before 2026-12-03, when that was its floor.
- fused: `KVAligner` as training runs it: one weighted gather (`kv_bags`) does time + layer
  alignment and feeds the projection chunk by chunk (`bag_linear`), so the aligned teacher is
  never stored; `_DotAndNorms` gives the loss a two-pass backward.
- plain stages: the same aligner with `fused = False`: gather (`resample_kv`), then the projector.
- naive reference: the prototype's way, Python loops over student layers, samples and segments,
  one small projection and loss per iteration.
- real pair: fused and floor at the real pair's shapes, `real_pair_over_floor`, the same target;
  `passed` needs both.
All compute the same loss from the same projector weights (checked: `max_abs_diff_*`, and the
fused and plain gradients: `max_abs_grad_diff`).

Stage rows time each step on its own (share = of the fused total), so the gap to the floor is
visible: the time index and the gather's row ids (`kv_bags`); the teacher gather one layer at a
time as the fused path reads it (its forward; the backward reads it again), with and without
interpolation, and whole as the plain path materialises it; the projections' forward; the
student's time-major copy; the loss forward, and forward + backward; the whole fused forward;
and the backward (fused total - fused forward).

Threads: `torch.set_num_threads(1)` for the run (restored after), as `bench_step`. `cpu_*`
numbers are this process's CPU time, which other jobs on a shared machine do not inflate.

    python benchmarks/bench_align.py [--quick]
    kvdistill bench --only align
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvdistill.align.aligner import KVAligner
from kvdistill.align.time import TimeIndex, kv_bags, resample_kv
from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING, KVCache
from kvdistill.commands.bench import interleaved_times, load_benchmark, run_standalone, torch_threads
from kvdistill.commands.profile import measure
from kvdistill.losses import aligned_kv_loss, build_kv_loss
from kvdistill.real_pair import STUDENT, TEACHER

FULL = {"L_t": 28, "H_t": 4, "D_t": 128, "L_s": 24, "H_s": 2, "D_s": 64, "B": 2, "T_s": 512, "T_t": 600}
QUICK = {"L_t": 6, "H_t": 4, "D_t": 32, "L_s": 4, "H_s": 2, "D_s": 16, "B": 2, "T_s": 64, "T_t": 80}
# the real pair's caches where models/real is absent (kvdistill.real_pair's docstring)
REAL_PAIR = {"L_t": 18, "H_t": 1, "D_t": 256, "L_s": 30, "H_s": 3, "D_s": 64}
# below Gemma's 512-token sliding window (max_length <= 511); its 262k vocabulary cuts text into fewer tokens
REAL_TIMES, REAL_TIMES_QUICK = {"B": 2, "T_s": 480, "T_t": 420}, {"B": 2, "T_s": 64, "T_t": 56}
TARGET = 1.3


def real_pair_shapes() -> tuple[dict[str, int], str]:
    """The real pair's cache shapes `{L_t, H_t, D_t, L_s, H_s, D_s}` and where they came from."""
    dirs = load_benchmark(Path(__file__).with_name("bench_step.py")).real_pair_dirs()
    if dirs is None:
        return REAL_PAIR, "kvdistill.real_pair (models/real absent)"
    shapes = {}
    for side, name in (("t", TEACHER), ("s", STUDENT)):
        c = json.loads((dirs[name] / "config.json").read_text())
        shapes |= {f"L_{side}": c["num_hidden_layers"], f"H_{side}": c["num_key_value_heads"],
                   f"D_{side}": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]}
    return shapes, "models/real/*/config.json"


def _segment_row(T: int, parts: tuple[float, float, float], valid: int, left_pad: bool) -> list[int]:
    """Segment ids for one sample: prompt / reasoning / answer in the given proportions, then padding."""
    n_p, n_r = int(valid * parts[0]), int(valid * parts[1])
    row = [PROMPT] * n_p + [REASONING] * n_r + [ANSWER] * (valid - n_p - n_r)
    pad = [PAD] * (T - valid)
    return pad + row if left_pad else row + pad


def make_inputs(cfg: dict[str, int], device: torch.device, seed: int = 0) -> tuple[KVCache, KVCache]:
    """Random teacher / student caches; per-sample segment lengths, right- and left-padding."""
    g = torch.Generator().manual_seed(seed)
    L_t, H_t, D_t, L_s, H_s, D_s = (cfg[k] for k in ("L_t", "H_t", "D_t", "L_s", "H_s", "D_s"))
    B, T_s, T_t = cfg["B"], cfg["T_s"], cfg["T_t"]
    t_rows = [
        _segment_row(T_t, (0.25, 0.65, 0.10), T_t if b % 2 == 0 else int(T_t * 0.85), False) for b in range(B)
    ]
    s_rows = [
        _segment_row(T_s, (0.22, 0.70, 0.08), T_s if b % 2 == 0 else int(T_s * 0.9), True) for b in range(B)
    ]
    t_seg, s_seg = torch.tensor(t_rows), torch.tensor(s_rows)

    def kv(L: int, H: int, T: int, D: int) -> tuple[Tensor, Tensor]:
        return tuple(torch.randn(L, B, H, T, D, generator=g).to(device) for _ in range(2))  # [L, B, H, T, D]

    tk, tv = kv(L_t, H_t, T_t, D_t)
    sk, sv = kv(L_s, H_s, T_s, D_s)
    teacher = KVCache(tk, tv, (t_seg >= 0).long().to(device), t_seg.to(device))
    student = KVCache(
        sk.requires_grad_(), sv.requires_grad_(), (s_seg >= 0).long().to(device), s_seg.to(device)
    )
    return teacher, student


# --------------------------------------------------------------------------------------------
# NAIVE REFERENCE — the prototype's way, kept only as the benchmark's baseline.
# Python loops over student layers, samples and segments; positions found per sample with
# nonzero(); one interpolation, one projection and one loss per (layer, sample, segment).
# --------------------------------------------------------------------------------------------
def naive_reference(
    teacher: KVCache,
    student: KVCache,
    layer_src: list[int],
    w_k: tuple[Tensor, Tensor],
    w_v: tuple[Tensor, Tensor],
) -> Tensor:
    """Mercator (beta=0) K+V loss, mean over valid tokens and layers, computed with loops."""
    L_s, B = student.keys.shape[0], student.keys.shape[1]
    total_k = total_v = student.keys.new_zeros(())
    n_tokens = 0
    for b in range(B):  # count the valid student tokens (those whose segment the teacher has)
        for seg in (PROMPT, REASONING, ANSWER):
            if (teacher.segment_ids[b] == seg).any():
                n_tokens += int((student.segment_ids[b] == seg).sum())
    for l in range(L_s):  # noqa: E741 - loop over layers
        tl = layer_src[l]
        for b in range(B):  # loop over samples
            for seg in (PROMPT, REASONING, ANSWER):  # loop over segments
                t_pos = (
                    ((teacher.attention_mask[b] > 0) & (teacher.segment_ids[b] == seg)).nonzero().flatten()
                )
                s_pos = (
                    ((student.attention_mask[b] > 0) & (student.segment_ids[b] == seg)).nonzero().flatten()
                )
                n_t, n_s = len(t_pos), len(s_pos)
                if n_t == 0 or n_s == 0:
                    continue
                if n_s > 1:
                    u = torch.arange(n_s, device=t_pos.device) * (n_t - 1) / (n_s - 1)
                else:
                    u = torch.full((1,), (n_t - 1) / 2, device=t_pos.device)
                lo = u.floor().long().clamp(max=n_t - 1)
                hi = (lo + 1).clamp(max=n_t - 1)
                lam = (u - lo).unsqueeze(-1)  # [n_s, 1]
                for which, (w, bias) in (("k", w_k), ("v", w_v)):
                    t_src = teacher.keys if which == "k" else teacher.values
                    s_src = student.keys if which == "k" else student.values
                    t = t_src[tl, b][:, t_pos].transpose(0, 1)  # [n_t, H_t, D_t]
                    t = t.reshape(n_t, -1)  # flatten heads
                    t = (1 - lam) * t[lo] + lam * t[hi]  # [n_s, H_t*D_t]
                    t = F.linear(t, w, bias)  # [n_s, F_s]
                    s = s_src[l, b][:, s_pos].transpose(0, 1).reshape(n_s, -1)  # [n_s, F_s]
                    loss = (1 - F.cosine_similarity(s, t, dim=-1, eps=1e-8)).sum()
                    if which == "k":
                        total_k = total_k + loss
                    else:
                        total_v = total_v + loss
    denom = max(n_tokens, 1) * L_s
    return (total_k / denom + total_v / denom) / 2


# --------------------------------------------------------------------------------------------


class Case:
    """One shape's caches, aligner and loss, and the calls timed on them: the aligner + loss and its floor."""

    def __init__(self, cfg: dict[str, int], device: torch.device):
        self.teacher, self.student = make_inputs(cfg, device)
        self.aligner = KVAligner(mode="flat", time_mode="segment", projector="linear").to(device)
        self.aligner.setup(self.teacher, self.student)
        self.loss_fn = build_kv_loss("mercator")
        self.w_k = (self.aligner.k_proj.proj.weight, self.aligner.k_proj.proj.bias)
        self.w_v = (self.aligner.v_proj.proj.weight, self.aligner.v_proj.proj.bias)
        self.params = [*self.aligner.parameters(), self.student.keys, self.student.values]
        self.idx = self.aligner.time_index(self.teacher, self.student)
        self.layers = (self.aligner._src_layers, self.aligner._src_weights)
        self.pre_k, self.pre_v = (x.flatten(-2) for x in self.gather(self.idx))  # [L_s, B, T_s, H_t*D_t]
        # the teacher's own rows, time-major [L_t*B*T_t, H_t*D_t]: where they are fewer, the aligner projects these
        self.rows_k, self.rows_v = (x.transpose(2, 3).flatten(3).flatten(0, 2) for x in (self.teacher.keys,
                                                                                         self.teacher.values))

    def zero_grad(self) -> None:  # every case starts from freed grads, outside the timed call
        for p in self.params:
            p.grad = None

    def aligned(self, fused: bool, backward: bool = True) -> Tensor:
        self.aligner.fused = fused
        loss, _ = aligned_kv_loss(self.loss_fn, self.aligner(self.teacher, self.student))
        if backward:
            loss.backward()
        return loss.detach()

    def gather(self, index: TimeIndex) -> tuple[Tensor, Tensor]:  # [L_s, B, T_s, H_t, D_t] each, materialised
        return resample_kv(self.teacher.keys, index, *self.layers), resample_kv(self.teacher.values, index, *self.layers)

    def floor(self, rows: str = "fewer") -> Tensor:
        """The K/V projections, forward + backward, on the aligned rows, the teacher's, or the fewer of the two."""
        aligned = rows == "aligned" or (rows == "fewer" and self.pre_k[..., 0].numel() <= self.rows_k.shape[0])
        k, v = (self.pre_k, self.pre_v) if aligned else (self.rows_k, self.rows_v)
        loss = F.linear(k, *self.w_k).sum() + F.linear(v, *self.w_v).sum()  # [..., F_s] each
        loss.backward()
        return loss.detach()


def _shapes(cfg: dict[str, int]) -> str:
    return (f"teacher {cfg['L_t']}x{cfg['B']}x{cfg['H_t']}x{cfg['T_t']}x{cfg['D_t']}, "
            f"student {cfg['L_s']}x{cfg['B']}x{cfg['H_s']}x{cfg['T_s']}x{cfg['D_s']}")


def run(quick: bool = False) -> dict[str, Any]:
    """Time the aligner + loss, its stages and its floor; a JSON-able dict for `kvdistill bench`."""
    with torch_threads(1):
        return _run(quick)


def _run(quick: bool) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    repeats = 3 if quick else 9
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    case = Case(cfg, device)
    real_shapes, shapes_from = real_pair_shapes()
    real_cfg = real_shapes | (REAL_TIMES_QUICK if quick else REAL_TIMES)
    real = Case(real_cfg, device)
    teacher, student, aligner, loss_fn = case.teacher, case.student, case.aligner, case.loss_fn
    layer_src = aligner.layer_map.argmax(1).tolist()  # proportional: one teacher layer per row

    def zero_grad() -> None:
        case.zero_grad()
        real.zero_grad()

    def naive() -> Tensor:
        loss = naive_reference(teacher, student, layer_src, case.w_k, case.w_v)
        loss.backward()
        return loss.detach()

    idx, layers = case.idx, case.layers
    lo_only = TimeIndex(idx.lo, idx.lo, torch.zeros_like(idx.lam), idx.valid, exact=True)

    def gather_by_layer(index: TimeIndex) -> None:  # the fused path's reads: one layer's bags at a time
        rows, weights = kv_bags(teacher.keys.shape, index, *layers)  # [L_s, B, T_s, H_t, K]
        for x in (teacher.keys, teacher.values):
            for r, w in zip(rows, weights):
                F.embedding_bag(r.flatten(0, -2), x.reshape(-1, x.shape[-1]), per_sample_weights=w.flatten(0, -2),
                                mode="sum")

    def projections() -> None:
        with torch.no_grad():
            F.linear(case.pre_k, *case.w_k), F.linear(case.pre_v, *case.w_v)

    def student_layout() -> None:
        aligner._layout(aligner.student_layers(student.keys)), aligner._layout(aligner.student_layers(student.values))

    with torch.no_grad():
        aligner.fused = True
        out = aligner(teacher, student)
    leaves = [x.clone().requires_grad_() for x in (out.student_keys, out.student_values, out.teacher_keys,
                                                   out.teacher_values)]
    loss_in = replace(out, **dict(zip(("student_keys", "student_values", "teacher_keys", "teacher_values"), leaves)))

    def loss_forward() -> None:
        with torch.no_grad():
            aligned_kv_loss(loss_fn, out)

    def loss_backward() -> None:
        for x in leaves:
            x.grad = None
        aligned_kv_loss(loss_fn, loss_in)[0].backward()

    # correctness: fused == plain (loss and every gradient) == naive loops (loss)
    diffs = {}
    for name, fn in (("fused", lambda: case.aligned(True)), ("plain", lambda: case.aligned(False)), ("naive", naive)):
        zero_grad()
        diffs[name] = (fn(), [p.grad.clone() for p in case.params])
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(diffs["fused"][1], diffs["plain"][1]))

    main = {
        "fused": lambda: case.aligned(True),
        "plain": lambda: case.aligned(False),
        "naive": naive,
        "floor": case.floor,
        "real fused": lambda: real.aligned(True),
        "real floor": real.floor,
        "real floor, aligned rows": lambda: real.floor("aligned"),
    }
    stages = {
        "time index + bags": lambda: kv_bags(teacher.keys.shape, aligner.time_index(teacher, student), *layers),
        "teacher gather by layer, no interpolation": lambda: gather_by_layer(lo_only),
        "teacher gather by layer (fused path's reads)": lambda: gather_by_layer(idx),
        "teacher gather whole (plain path)": lambda: case.gather(idx),
        "K/V projections, forward": projections,
        "student layout (time-major copy)": student_layout,
        "loss, forward": loss_forward,
        "loss, forward + backward": loss_backward,
        "fused forward (all)": lambda: case.aligned(True, backward=False),
    }
    t = interleaved_times({**main, **stages}, repeats, device=device, setup=zero_grad)
    peaks = {}
    for name in main:
        zero_grad()
        peaks[name] = measure(main[name], device)[2] / 2**20
    fused_ms = t.ms("fused")
    real_over_floor = t.ratio("real fused", "real floor")
    rows = [
        {"case": "KVAligner + loss (fused)", "ms": fused_ms, "over_floor": t.ratio("fused", "floor")},
        {"case": "plain stages (fused=False)", "ms": t.ms("plain"), "over_floor": t.ratio("plain", "floor")},
        {"case": "naive reference (loops)", "ms": t.ms("naive"), "over_floor": t.ratio("naive", "floor")},
        {"case": "floor (K/V projection matmuls)", "ms": t.ms("floor"), "over_floor": 1.0},
        {"case": "real pair shapes: KVAligner + loss (fused)", "ms": t.ms("real fused"), "over_floor": real_over_floor},
        {"case": "real pair shapes: floor", "ms": t.ms("real floor"), "over_floor": 1.0},
        {"case": "real pair shapes: projections on the aligned rows (the floor before project-first)",
         "ms": t.ms("real floor, aligned rows"), "over_floor": t.ratio("real floor, aligned rows", "real floor")},
    ]
    for row, name in zip(rows, main):
        base = "real floor" if name.startswith("real") else "floor"
        row.update(cpu_ms=t.ms(name, "cpu"), cpu_over_floor=t.ratio(name, base, "cpu"), peak_mib=peaks[name])
    for name in stages:
        rows.append({"case": f"stage: {name}", "ms": t.ms(name), "cpu_ms": t.ms(name, "cpu"),
                     "share": t.ms(name) / fused_ms})
    backward_ms = fused_ms - t.ms("fused forward (all)")
    rows.append({"case": "stage: backward (fused - fused forward)", "ms": backward_ms,
                 "cpu_ms": t.ms("fused", "cpu") - t.ms("fused forward (all)", "cpu"), "share": backward_ms / fused_ms})
    over_floor = t.ratio("fused", "floor")
    return {
        "name": "align",
        "title": "KV alignment + loss, forward + backward, against its floor",
        "description": f"{_shapes(cfg)}; real pair shapes ({shapes_from}): {_shapes(real_cfg)}; flat mode, linear "
        f"K/V projectors, segment time alignment, Mercator loss; median of {repeats} interleaved repeats (paired "
        f"ratios), 1 torch thread, {device.type}. Stage rows: each forward step of the first shapes timed alone, "
        "share = of the fused total. cpu_*: process CPU time. passed: both shapes within the target.",
        "results": rows,
        "ratio": over_floor,
        "target": TARGET,
        "passed": over_floor <= TARGET and real_over_floor <= TARGET,
        "over_floor": over_floor,
        "real_pair_over_floor": real_over_floor,
        "real_pair_over_aligned_rows_floor": t.ratio("real fused", "real floor, aligned rows"),
        "cpu_over_floor": t.ratio("fused", "floor", "cpu"),
        "speedup_vs_naive": t.ratio("naive", "fused"),
        "max_abs_diff_fused_vs_plain": float((diffs["fused"][0] - diffs["plain"][0]).abs()),
        "max_abs_diff_fused_vs_naive": float((diffs["fused"][0] - diffs["naive"][0]).abs()),
        "max_abs_grad_diff": grad_diff,
        "device": device.type,
        "torch_threads": 1,
        "quick": quick,
    }


if __name__ == "__main__":
    run_standalone(run, __doc__, "small shapes (seconds)")
