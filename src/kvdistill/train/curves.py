"""Training curves from `metrics.jsonl`: loss, cos-sim per teacher, per-layer cos-sim over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import yaml

from kvdistill.io import read_jsonl
from kvdistill.plots import save_figure
from kvdistill.runs import TRAIN_CONFIG


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


# logged term -> its weight option: the total loss is the sum of weight x term (kv_loss also x its warm-up)
LOSS_TERMS = {"ce": "ce_weight", "kv_loss": "kv_weight", "logit_kd": "logit_kd_weight", "codi": "codi_weight"}


def run_label(out_dir: str | Path) -> str:
    """A run's name in plot titles: its dir with the parent (`runs/student_kv`, `kv/seed_0`)."""
    return "/".join(Path(out_dir).absolute().parts[-2:])


def weighted_terms(rows: list[dict], weights: dict[str, float]) -> dict[str, list[float]]:
    """`{legend label: [P] values}` of each logged loss term times its weight (and the KV warm-up),
    as the total loss sums them; a term logged without a known weight is drawn as logged."""
    terms = {}
    for key, option in LOSS_TERMS.items():
        if not any(key in r for r in rows) or weights.get(option) == 0:
            continue
        w = weights.get(option)
        warm = key == "kv_loss" and any("kv_warmup" in r for r in rows)
        label = key if w is None else f"{w:g} × {key}" + (" × warm-up" if warm else "")
        terms[label] = [(1.0 if w is None else w) * r.get(key, np.nan) * (r.get("kv_warmup", 1.0) if warm else 1.0)
                        for r in rows]
    return terms


def plot_training_curves(path: str | Path, out_dir: str | Path, weights: dict[str, float] | None = None
                         ) -> list[Path]:
    """Write `curves_loss.png` (the total loss and every weighted term it sums), `curves_cos_sim.png` and
    `cos_sim_layers.png` (when KV was on); titles name the run (`run_label`). `weights`: the loss
    weights (`ce_weight`, ...), by default read from the run's `kvdistill_config.yaml` in `out_dir`."""
    rows, out_dir, written = read_metrics(path), Path(out_dir), []
    if not rows:
        return written
    if weights is None:
        config = out_dir / TRAIN_CONFIG
        weights = yaml.safe_load(config.read_text(encoding="utf-8")) if config.is_file() else {}
    run, steps = run_label(out_dir), [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    # the total drawn wide and pale underneath, so a term equal to it (SFT: the CE) stays visible on top
    ax.plot(steps, [r["loss"] for r in rows], color="black", linewidth=4, alpha=0.3, label="total loss")
    for (label, values), style in zip(weighted_terms(rows, weights).items(), ("--", "-.", ":", (0, (5, 1)))):
        ax.plot(steps, np.where(np.asarray(values) > 0, values, np.nan), linestyle=style, marker=".", label=label)
    ax.set(xlabel="step", ylabel="loss (log scale)", yscale="log", title=f"{run}: total loss and its weighted terms")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: covers no curve
    written.append(save_figure(fig, out_dir / "curves_loss.png"))

    cos_keys = sorted({k for r in rows for k in r if k.startswith("cos_sim/")})
    if cos_keys:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in cos_keys:
            ax.plot(steps, [r.get(k, np.nan) for r in rows], label=k.split("/", 1)[1])
        ax.set(xlabel="step", ylabel="cos-sim (mean of K, V)", title=f"{run}: student vs aligned teacher KV",
               ylim=(-0.1, 1.0))
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
                ax.set(xlabel="step", ylabel="student layer", title=t)
            fig.colorbar(im, ax=axes[0].tolist(), label="cos-sim (mean of K, V)")
            fig.suptitle(f"{run}: per-layer cos-sim with each teacher")  # the figure's width, not a panel's
            written.append(save_figure(fig, out_dir / "cos_sim_layers.png"))
    return written
