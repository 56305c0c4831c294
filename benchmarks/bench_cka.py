"""CKA layer similarity: all layer pairs batched (`StreamingCKA`) against its floor, the Gram matmuls.

Setting of the issue: a 24-layer 896-dim student against a 28-layer 3584-dim teacher (Qwen2.5-0.5B
vs Qwen2-7B), 100 samples x 256 tokens of random features, token pooling, minibatches of 1024
rows (the `kvdistill layer-map` defaults), float32 Grams (`--cka-dtype float32`; float64 costs
about twice the time and memory of both the batched path and its floor).

- batched: `StreamingCKA.update` per batch of 4 samples (one minibatch): a Gram of centred
  features per layer, all 672 pair products from one matmul accumulated in float64.
- floor: one Gram matmul per layer and minibatch (`X_l X_lᵀ` for the 24 + 28 layers), nothing
  else: what any minibatch-CKA has to compute. It runs after every batched update (interleaved);
  headline `over_floor` = batched / floor, the median of the per-minibatch ratios, target <= 1.3.
- pairwise: `linear_cka(x[i], y[j])` for every pair (each call builds both Grams again), the
  straightforward double loop, kept as a secondary row. At full size it would take about an hour,
  so it is timed on a spread subset of 16 pairs of one minibatch and extrapolated (every pair and
  every minibatch costs the same), and checked against the batched values of those pairs.

The features are one random minibatch streamed repeatedly: timing does not depend on values.
Threads: `torch.set_num_threads(1)` for the run (restored after); `cpu_*` is process CPU time.
Peak memory of one update is the CUDA allocator peak, or on CPU the resident-set high-water mark
above the level before it (sampled every 2 ms).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

import torch

from kvdistill.align.cka import StreamingCKA, linear_cka
from kvdistill.commands.bench import interleaved_times, torch_threads
from kvdistill.malloc import keep_freed_memory

TARGET = 1.3


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextmanager
def peak_memory(device: torch.device):
    """Yields a dict whose "peak_mb" is set on exit: memory above the starting level."""
    out: dict[str, float | None] = {"peak_mb": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        out["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        return
    base = _rss_bytes()
    if base is None:
        yield out
        return
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes() or 0)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], _rss_bytes() or 0)
        out["peak_mb"] = (peak[0] - base) / 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(quick: bool = False) -> dict:
    """Batched CKA, its floor and the pairwise loop; a JSON-able dict for `kvdistill bench`."""
    with torch_threads(1):
        return _run(quick)


def _run(quick: bool) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if quick:  # same layer counts and the same 1:4 width ratio, tiny widths and rows; the stream 3 times
        L_s, L_t, d_s, d_t, samples, tokens, per_update, minibatch, rounds = 24, 28, 56, 224, 8, 64, 4, 256, 3
    else:
        L_s, L_t, d_s, d_t, samples, tokens, per_update, minibatch, rounds = 24, 28, 896, 3584, 100, 256, 4, 1024, 1
    dtype = torch.float32
    rows_per_update = per_update * tokens  # == minibatch: one update reduces one minibatch
    updates = samples // per_update
    n_minibatches = samples * tokens // minibatch
    pairs = [(i, j) for i in range(L_s) for j in range(L_t)]

    g = torch.Generator().manual_seed(0)
    x = torch.randn(L_s, rows_per_update, d_s, generator=g).to(device)  # [L_s, n, d_s] one update's rows
    y = torch.randn(L_t, rows_per_update, d_t, generator=g).to(device)  # [L_t, n, d_t]
    y[:, :, :d_s] += x[torch.linspace(0, L_s - 1, L_t).round().long()]  # some structure

    def floor() -> None:  # one Gram matmul per layer, nothing else
        x @ x.transpose(1, 2), y @ y.transpose(1, 2)  # [L_s, n, n], [L_t, n, n]

    # warm-up (first-call allocations, thread pools) on one minibatch, untimed; peak memory of one update
    linear_cka(x[0, :minibatch], y[0, :minibatch], dtype=dtype)
    with peak_memory(device) as mem_b:
        StreamingCKA(minibatch, dtype=dtype).update(x, y)
    with peak_memory(device) as mem_f:
        floor()

    acc = StreamingCKA(minibatch, dtype=dtype)
    t = interleaved_times({"batched": lambda: acc.update(x, y), "floor": floor}, updates * rounds, warmup=0,
                          device=device)
    _sync(device)
    t0 = time.perf_counter()
    S = acc.compute()
    _sync(device)
    batched_s = (sum(t.wall["batched"]) + time.perf_counter() - t0) / rounds
    floor_s = sum(t.wall["floor"]) / rounds
    assert acc.num_minibatches == n_minibatches * rounds, (acc.num_minibatches, n_minibatches)

    # pairwise: one minibatch, a spread subset of pairs, extrapolated to all pairs and minibatches
    timed = pairs[:: max(1, len(pairs) // 16)]
    xb, yb = x[:, :minibatch], y[:, :minibatch]
    ref = StreamingCKA(None, dtype=dtype)
    ref.update(xb, yb)
    S_mb = ref.compute()
    pair_s = float("inf")
    with peak_memory(device) as mem_p:
        for _ in range(3):  # best of 3: the loop is short
            _sync(device)
            t0 = time.perf_counter()
            vals = [linear_cka(xb[i], yb[j], dtype=dtype) for i, j in timed]
            _sync(device)
            pair_s = min(pair_s, (time.perf_counter() - t0) / len(timed))  # one pair, one minibatch
    max_diff = max(abs(float(v) - float(S_mb[i, j])) for v, (i, j) in zip(vals, timed))
    pairwise_s = pair_s * len(pairs) * n_minibatches

    def mb(m: dict) -> float | None:
        return None if m["peak_mb"] is None else round(m["peak_mb"], 1)

    floor_mb_ms = t.ms("floor")
    results = [
        {
            "case": "batched (StreamingCKA)",
            "pairs": len(pairs),
            "minibatches": n_minibatches,
            "s": round(batched_s, 4),
            "ms_per_minibatch": round(t.ms("batched"), 3),
            "cpu_ms_per_minibatch": round(t.ms("batched", "cpu"), 3),
            "over_floor": t.ratio("batched", "floor"),
            "peak_mb": mb(mem_b),
            "extrapolated": False,
        },
        {
            "case": "floor (one Gram matmul per layer)",
            "pairs": len(pairs),
            "minibatches": n_minibatches,
            "s": round(floor_s, 4),
            "ms_per_minibatch": round(floor_mb_ms, 3),
            "cpu_ms_per_minibatch": round(t.ms("floor", "cpu"), 3),
            "over_floor": 1.0,
            "peak_mb": mb(mem_f),
            "extrapolated": False,
        },
        {
            "case": "pairwise loop (linear_cka per pair)",
            "pairs": len(pairs),
            "minibatches": n_minibatches,
            "s": round(pairwise_s, 4),
            "ms_per_minibatch": round(1e3 * pair_s * len(pairs), 3),
            "over_floor": 1e3 * pair_s * len(pairs) / floor_mb_ms,
            "peak_mb": mb(mem_p),
            "extrapolated": len(timed) < len(pairs),
        },
    ]
    over_floor = t.ratio("batched", "floor")
    cross_cov_gb = L_s * L_t * d_s * d_t * 8 / 2**30
    return {
        "name": "cka",
        "title": "CKA: all layer pairs batched, against its floor (the Gram matmuls) and a pairwise loop",
        "description": (
            f"{L_s} x {L_t} layers, d {d_s} vs {d_t}, {samples} samples x {tokens} tokens "
            f"({samples * tokens} rows), minibatches of {minibatch} rows, {str(dtype).replace('torch.', '')} "
            f"Grams, device {device.type}, 1 torch thread. The floor runs after every batched update; "
            f"over_floor = median of the {updates * rounds} per-minibatch ratios. Pairwise timed on "
            f"{len(timed)} of {len(pairs)} pairs of one minibatch and scaled to the whole stream. For scale: "
            f"streaming exact cross-covariances Σ XᵀY for every pair would hold {cross_cov_gb:.1f} GiB."
        ),
        "results": results,
        "ratio": over_floor,
        "target": TARGET,
        "passed": bool(over_floor <= TARGET),
        "over_floor": over_floor,
        "cpu_over_floor": t.ratio("batched", "floor", "cpu"),
        "pairwise_over_batched": pairwise_s / batched_s,
        "pairs_timed": len(timed),
        "max_abs_diff_pairwise_vs_batched": float(max_diff),
        "similarity_mean": round(float(S.mean()), 4),
        "torch_threads": 1,
    }


if __name__ == "__main__":
    keep_freed_memory()  # as every `kvdistill` process does (`kvdistill bench` runs this module too)
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv[1:]), indent=1))
