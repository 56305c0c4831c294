"""Training curves from `metrics.jsonl`: loss, cos-sim per teacher, per-layer cos-sim over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from kvdistill.io import read_jsonl
from kvdistill.plots import save_figure


def read_metrics(path: str | Path) -> list[dict]:
    """The training log records (those with a `loss`) of a `metrics.jsonl`."""
    return [r for r in read_jsonl(path) if "loss" in r]


# the teacher agreement logged per teacher (`<key>/<teacher>`): cos-sim (projected KV losses), relation /
# attention KL, and the KL on the rows `relation_rows` selects vs the other valid rows
AGREEMENT = ("cos_sim", "relation_kl", "attention_kl", "relation_kl_selected", "relation_kl_other",
             "attention_kl_selected", "attention_kl_other")


def final_metrics(path: str | Path) -> dict:
    """Last logged CE, KV loss and the teacher agreement (`AGREEMENT`), each averaged over teachers and
    per teacher (`<key>/<teacher>`); None where not logged."""
    rows = read_metrics(path)
    if not rows:
        return {"ce": None, "kv_loss": None, **dict.fromkeys(AGREEMENT)}
    last = rows[-1]

    def mean_of(prefix: str) -> float | None:
        vals = [v for k, v in last.items() if k.startswith(prefix)]
        return float(np.mean(vals)) if vals else None

    return {
        "ce": last.get("ce"),
        "kv_loss": last.get("kv_loss"),
        "logit_kd": last.get("logit_kd"),
        **{key: mean_of(f"{key}/") for key in AGREEMENT},
        **{k: v for k, v in last.items() if k.startswith(tuple(f"{key}/" for key in (*AGREEMENT, "norm_ratio")))},
    }


def plot_training_curves(path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write `curves_loss.png`, `curves_cos_sim.png` and `cos_sim_layers.png` (when KV was on)."""
    rows, out_dir, written = read_metrics(path), Path(out_dir), []
    if not rows:
        return written
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in ("loss", "ce", "kv_loss"):
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, np.nan) for r in rows], label=key)
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="training losses")
    ax.legend()
    written.append(save_figure(fig, out_dir / "curves_loss.png"))

    cos_keys = sorted({k for r in rows for k in r if k.startswith("cos_sim/")})
    if cos_keys:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in cos_keys:
            ax.plot(steps, [r.get(k, np.nan) for r in rows], label=k.split("/", 1)[1])
        ax.set(xlabel="step", ylabel="cos-sim (mean of K, V)", title="student vs aligned teacher KV", ylim=(-0.1, 1.0))
        ax.legend()
        written.append(save_figure(fig, out_dir / "curves_cos_sim.png"))

        teachers = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("cos_layer/")})
        if teachers:
            # constrained layout places the shared colorbar beside the panels (tight_layout cannot)
            fig, axes = plt.subplots(1, len(teachers), figsize=(4 * len(teachers) + 1, 3), squeeze=False,
                                     layout="constrained")
            # each logged step is one cell: half a logging interval either side (1 step when only one)
            half = (steps[-1] - steps[0]) / max(len(steps) - 1, 1) / 2 or 0.5
            for ax, t in zip(axes[0], teachers):
                layers = sorted({int(k.split("/")[2]) for r in rows for k in r if k.startswith(f"cos_layer/{t}/")})
                grid = np.array([[r.get(f"cos_layer/{t}/{layer}", np.nan) for r in rows] for layer in layers])  # [L, P]
                im = ax.imshow(grid, aspect="auto", origin="lower", vmin=-0.1, vmax=1.0, cmap="viridis",
                               extent=(steps[0] - half, steps[-1] + half, -0.5, len(layers) - 0.5))
                shown = range(0, len(layers), max(1, len(layers) // 12))  # row i of the grid is layers[i]
                ax.set_yticks(list(shown), [str(layers[i]) for i in shown])
                ax.set(xlabel="step", ylabel="student layer", title=f"per-layer cos-sim: {t}")
            fig.colorbar(im, ax=axes[0].tolist(), label="cos-sim (mean of K, V)")
            written.append(save_figure(fig, out_dir / "cos_sim_layers.png"))
    return written
