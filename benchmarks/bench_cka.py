"""CKA layer similarity: all layer pairs batched (`StreamingCKA`) vs a loop over layer pairs.

Setting of the issue: a 24-layer 896-dim student against a 28-layer 3584-dim teacher (Qwen2.5-0.5B
vs Qwen2-7B), 100 samples x 256 tokens of random features, token pooling, minibatches of 1024
rows (the `kvdistill layer-map` defaults), float32 Grams (`--cka-dtype float32`; the float64
default costs about twice the time and memory for both methods, so the ratio is the same).

- batched: `StreamingCKA.update` per batch of 4 samples: one Gram stack per model and minibatch,
  all 672 pairs from one matmul.
- pairwise: `linear_cka(x[i], y[j])` for every pair (each call builds both Grams again), the
  straightforward double loop. At full size it would take about an hour on a laptop CPU, so it
  is timed on a spread subset of 16 pairs of one minibatch and extrapolated (every pair and every
  minibatch costs the same), and checked against the batched values of those pairs.

The features are one random minibatch streamed repeatedly: timing does not depend on values.
Peak memory is the CUDA allocator peak, or on CPU the resident-set high-water mark above the
level before the run (sampled every 2 ms).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

import torch

from kvdistill.align.cka import StreamingCKA, linear_cka

TARGET = 20.0


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
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if quick:  # same layer counts and the same 1:4 width ratio, tiny widths and rows
        L_s, L_t, d_s, d_t, samples, tokens, per_update, minibatch = 24, 28, 56, 224, 8, 64, 4, 256
    else:
        L_s, L_t, d_s, d_t, samples, tokens, per_update, minibatch = 24, 28, 896, 3584, 100, 256, 4, 1024
    dtype = torch.float32
    rows_per_update = per_update * tokens
    updates = samples // per_update
    n_minibatches = samples * tokens // minibatch
    pairs = [(i, j) for i in range(L_s) for j in range(L_t)]

    g = torch.Generator().manual_seed(0)
    x = torch.randn(L_s, rows_per_update, d_s, generator=g).to(device)  # [L_s, n, d_s] one update's rows
    y = torch.randn(L_t, rows_per_update, d_t, generator=g).to(device)  # [L_t, n, d_t]
    y[:, :, :d_s] += x[torch.linspace(0, L_s - 1, L_t).round().long()]  # some structure

    # warm-up (first-call allocations, thread pools) on one minibatch, untimed
    warm = StreamingCKA(None, dtype=dtype)
    warm.update(x[:, :minibatch], y[:, :minibatch])
    warm.compute()
    linear_cka(x[0, :minibatch], y[0, :minibatch], dtype=dtype)

    # batched: the whole stream (best of 3 in quick mode, where a run takes well under a second)
    batched_s = float("inf")
    with peak_memory(device) as mem_b:
        for _ in range(3 if quick else 1):
            _sync(device)
            t0 = time.perf_counter()
            acc = StreamingCKA(minibatch, dtype=dtype)
            for _ in range(updates):
                acc.update(x, y)
            S = acc.compute()
            _sync(device)
            batched_s = min(batched_s, time.perf_counter() - t0)
    assert acc.num_minibatches == n_minibatches, (acc.num_minibatches, n_minibatches)

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
    ratio = pairwise_s / batched_s

    results = [
        {
            "case": "batched (StreamingCKA)",
            "pairs": len(pairs),
            "minibatches": n_minibatches,
            "s": round(batched_s, 4),
            "ms_per_minibatch": round(1e3 * batched_s / n_minibatches, 3),
            "peak_mb": None if mem_b["peak_mb"] is None else round(mem_b["peak_mb"], 1),
            "extrapolated": False,
        },
        {
            "case": "pairwise loop (linear_cka per pair)",
            "pairs": len(pairs),
            "minibatches": n_minibatches,
            "s": round(pairwise_s, 4),
            "ms_per_minibatch": round(1e3 * pair_s * len(pairs), 3),
            "peak_mb": None if mem_p["peak_mb"] is None else round(mem_p["peak_mb"], 1),
            "extrapolated": len(timed) < len(pairs),
        },
    ]
    cross_cov_gb = L_s * L_t * d_s * d_t * 8 / 2**30
    return {
        "name": "cka",
        "title": "CKA: all layer pairs batched vs pairwise loop",
        "description": (
            f"{L_s} x {L_t} layers, d {d_s} vs {d_t}, {samples} samples x {tokens} tokens "
            f"({samples * tokens} rows), minibatches of {minibatch} rows, {str(dtype).replace('torch.', '')} "
            f"Grams, device {device.type}. Pairwise timed on {len(timed)} of {len(pairs)} pairs of one "
            "minibatch and scaled to the whole stream. For scale: streaming exact cross-covariances "
            f"Σ XᵀY for every pair would hold {cross_cov_gb:.1f} GiB."
        ),
        "results": results,
        "ratio": round(ratio, 2),
        "target": TARGET,
        "passed": bool(ratio >= TARGET),
        "pairs_timed": len(timed),
        "max_abs_diff_pairwise_vs_batched": float(max_diff),
        "similarity_mean": round(float(S.mean()), 4),
    }


if __name__ == "__main__":
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv[1:]), indent=1))
