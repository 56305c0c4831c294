"""Benchmark: vectorised KV alignment + loss vs the prototype's loop-based way.

Forward + backward of `KVAligner` (flat, linear K/V projectors, segment time alignment,
proportional layer map) + the Mercator loss at real shapes — teacher 28 layers x 4 KV heads x
head dim 128 (Qwen2-1.5B-like), student 24 x 2 x 64, B=2, T_s=512, T_t=600, three segments with
per-sample lengths and padding — against `naive_reference`, written the prototype's way: Python
loops over student layers, samples and segments, one small projection and loss per iteration.
Both compute the same loss from the same projector weights (checked: `max_abs_diff`).

A third row, the *floor*, times only the K and V projection matmuls (forward + backward) on
already-aligned teacher tensors: work that every implementation has to do. `naive / floor`
bounds the speed-up any implementation could show over the naive reference on this device;
`vectorised / floor` says how much the vectorised path spends beyond the matmuls.

Not a test: run it alone on a quiet machine.

    python benchmarks/bench_align.py [--quick]
    kvdistill bench --only align
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvdistill.align.aligner import KVAligner
from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING, KVCache
from kvdistill.commands.profile import measure
from kvdistill.losses import aligned_kv_loss, build_kv_loss

FULL = {"L_t": 28, "H_t": 4, "D_t": 128, "L_s": 24, "H_s": 2, "D_s": 64, "B": 2, "T_s": 512, "T_t": 600}
QUICK = {"L_t": 6, "H_t": 4, "D_t": 32, "L_s": 4, "H_s": 2, "D_s": 16, "B": 2, "T_s": 64, "T_t": 80}
TARGET = 10.0


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


def _time(fn, device: torch.device, repeats: int, reset: Callable[[], None]) -> float:
    """Median wall seconds of `fn()` over `repeats` runs (after one warm-up run); `reset()` untimed."""
    reset()
    fn()
    times = []
    for _ in range(repeats):
        reset()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(quick: bool = False) -> dict[str, Any]:
    """Time forward+backward of both implementations; return a JSON-able dict (see `kvdistill bench`)."""
    cfg = QUICK if quick else FULL
    repeats = 2 if quick else 5
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    teacher, student = make_inputs(cfg, device)
    aligner = KVAligner(mode="flat", time_mode="segment", projector="linear").to(device)
    aligner.setup(teacher, student)
    loss_fn = build_kv_loss("mercator")
    layer_src = aligner.layer_map.argmax(1).tolist()  # proportional: one teacher layer per row
    w_k = (aligner.k_proj.proj.weight, aligner.k_proj.proj.bias)
    w_v = (aligner.v_proj.proj.weight, aligner.v_proj.proj.bias)
    params = [*aligner.parameters(), student.keys, student.values]

    def zero_grad() -> None:
        for p in params:
            p.grad = None

    # every case starts from freed grads (zero_grad outside the timed / measured call, so freeing
    # the previous grads does not offset the peak memory of this one)
    def vectorised() -> Tensor:
        loss, _ = aligned_kv_loss(loss_fn, aligner(teacher, student))
        loss.backward()
        return loss.detach()

    def naive() -> Tensor:
        loss = naive_reference(teacher, student, layer_src, w_k, w_v)
        loss.backward()
        return loss.detach()

    idx = aligner.time_index(teacher, student)
    pre_k, pre_v = aligner.teacher_time_layer(teacher.keys, idx), aligner.teacher_time_layer(teacher.values, idx)
    pre_k, pre_v = pre_k.flatten(-2), pre_v.flatten(-2)  # [L_s, B, T_s, H_t*D_t]

    def floor() -> Tensor:
        loss = F.linear(pre_k, *w_k).sum() + F.linear(pre_v, *w_v).sum()  # [L_s, B, T_s, F_s] each
        loss.backward()
        return loss.detach()

    diff = float((vectorised() - naive()).abs())
    t_vec, t_naive, t_floor = (_time(fn, device, repeats, zero_grad) for fn in (vectorised, naive, floor))
    peaks = []
    for fn in (vectorised, naive, floor):
        zero_grad()
        peaks.append(measure(fn, device)[2])
    mem_vec, mem_naive, mem_floor = peaks
    ratio = t_naive / t_vec
    shapes = (
        f"teacher {cfg['L_t']}x{cfg['B']}x{cfg['H_t']}x{cfg['T_t']}x{cfg['D_t']}, "
        f"student {cfg['L_s']}x{cfg['B']}x{cfg['H_s']}x{cfg['T_s']}x{cfg['D_s']}"
    )
    rows = [
        {"case": "vectorised (KVAligner + loss)", "ms": t_vec * 1000, "peak_mib": mem_vec / 2**20},
        {"case": "naive reference (loops)", "ms": t_naive * 1000, "peak_mib": mem_naive / 2**20},
        {"case": "floor (K/V projection matmuls only)", "ms": t_floor * 1000, "peak_mib": mem_floor / 2**20},
    ]
    return {
        "name": "align",
        "title": "KV alignment + loss, forward + backward",
        "description": f"{shapes}; flat mode, linear K/V projectors, segment time alignment, "
        f"Mercator loss; median of {repeats} runs on {device.type}.",
        "results": rows,
        "ratio": ratio,
        "target": TARGET,
        "passed": ratio >= TARGET,
        "max_abs_diff": diff,
        "vectorised_over_floor": t_vec / t_floor,
        "naive_over_floor": t_naive / t_floor,
        "device": device.type,
        "torch_threads": torch.get_num_threads(),
        "quick": quick,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    print(json.dumps(run(quick=parser.parse_args().quick), indent=1))
