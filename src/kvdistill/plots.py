"""Plots (matplotlib, Agg backend: files only, no display needed).

Each function takes plain numbers / nested lists, writes one PNG and returns its path. Several
commands append their own functions here.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: CI, SLURM nodes, servers

import matplotlib.pyplot as plt
import numpy as np

from kvdistill.io import write_bytes_atomic

TICK_WRAP = 18  # characters per line of a bar's label: at 8 pt, narrower than its 1.4-inch slot


def save_figure(fig, path: str | Path) -> Path:
    """Lay out (tight, unless the figure has its own layout engine), write a PNG atomically (parent
    dirs created; a full disk leaves no partial image and raises `io.WriteError`), close the
    figure; returns the path."""
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    png = io.BytesIO()  # rendered first, so the write knows its size and is one atomic file
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return write_bytes_atomic(path, png.getvalue())


def legend(ax, **kwargs) -> None:
    """`ax.legend(**kwargs)` when something is labelled (an empty panel gets none, not a warning)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


# --------------------------------------------------------------------------- ab-projector


def plot_ab_curves(
    curves: dict[str, dict[str, tuple[list[int], list[list[float]]]]],
    path: str | Path,
    *,
    title: str = "",
    logy: bool = True,
) -> Path:
    """Loss curves of several projectors, mean ± std over seeds, one panel per curve kind.

    Args:
        curves: `{projector: {panel: (steps [P], per-seed values [S][P])}}`, e.g.
            `{"linear": {"train": ([1, 2, 3], [[...], ...]), "held-out": (...)}, "elastic": {...}}`.
        path: PNG to write.
        title: figure title.
        logy: log-scale loss axis (losses span decades).

    Returns:
        `path` as a `Path`.
    """
    panels = list(dict.fromkeys(p for per in curves.values() for p in per))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.2 * max(1, len(panels)), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for name, per in curves.items():
            steps, runs = per.get(panel) or ([], [])
            if not runs or not runs[0]:
                continue
            arr = np.asarray(runs, dtype=float)  # [S, P]
            mean, std = arr.mean(0), arr.std(0)
            steps = np.asarray(steps)
            (line,) = ax.plot(steps, mean, label=f"{name} (n={arr.shape[0]})")
            lo = np.maximum(mean - std, mean * 1e-3) if logy else mean - std  # keep the band on a log axis
            ax.fill_between(steps, lo, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.set_ylabel("MSE")
        if logy:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        legend(ax)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


# --------------------------------------------------------------------------- layer-map


def plot_cka_heatmap(
    similarity,
    matrix,
    path: str | Path,
    *,
    title: str = "",
    student_label: str = "student layer",
    teacher_label: str = "teacher layer",
) -> Path:
    """CKA similarity `S [L_s, L_t]` as a heatmap, with the chosen layer pairs of `M` marked.

    Each non-zero `M[s, t]` is drawn as a circle on cell `(s, t)`, its area proportional to the
    weight, so a top-k map shows both which teacher layers a student layer reads and how much.

    Args:
        similarity: `[L_s, L_t]` CKA values (tensor, array or nested lists).
        matrix: `[L_s, L_t]` mapping weights (rows sum to 1; zeros are not drawn), or None.
        path: PNG to write.
        title: figure title.

    Returns:
        `path` as a `Path`.
    """
    S = np.asarray(similarity.tolist() if hasattr(similarity, "tolist") else similarity, dtype=float)
    L_s, L_t = S.shape
    fig, ax = plt.subplots(figsize=(min(max(5.5, 2.5 + 0.32 * L_t), 16), min(max(4.0, 2.0 + 0.3 * L_s), 14)))
    vmin = min(0.0, float(np.nanmin(S))) if S.size else 0.0
    im = ax.imshow(
        S, origin="lower", aspect="auto", cmap="viridis", vmin=vmin, vmax=1.0, interpolation="nearest"
    )
    fig.colorbar(im, ax=ax, label="linear CKA")
    if L_s * L_t <= 144:  # small maps: print the values
        for (r, c), v in np.ndenumerate(S):
            ax.text(
                c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black"
            )
    marked = ""
    if matrix is not None:
        M = np.asarray(matrix.tolist() if hasattr(matrix, "tolist") else matrix, dtype=float)
        rows, cols = np.nonzero(M > 0)
        ax.scatter(
            cols, rows, s=60 + 240 * M[rows, cols], facecolors="none", edgecolors="red", linewidths=1.5
        )
        marked = "\n(red circles: chosen pairs, area ~ weight)"
    step_t, step_s = max(1, L_t // 16), max(1, L_s // 16)  # readable ticks for deep models
    ax.set_xticks(range(0, L_t, step_t))
    ax.set_yticks(range(0, L_s, step_s))
    ax.set_xlabel(teacher_label + marked)
    ax.set_ylabel(student_label)
    if title:
        ax.set_title(title, fontsize="medium", wrap=True)
    return save_figure(fig, path)


# --------------------------------------------------------------------------- ablate


def plot_bars_with_errors(
    labels: list[str],
    means: list[float],
    errors: list[float] | list[list[float]],
    path: str | Path,
    *,
    error_label: str,
    points: list[list[float]] | None = None,
    ylabel: str = "",
    title: str = "",
) -> Path:
    """Bar chart of per-variant means with error bars (named in the legend) and, optionally, each seed
    as a dot.

    Args:
        labels: `[V]` bar labels.
        means: `[V]` bar heights (NaN: no bar).
        errors: `[V]` symmetric half widths (± std), or `[2, V]` distances below and above the mean (an
            asymmetric interval such as Wilson's); NaN: none.
        path: PNG to write.
        error_label: what the bars are, in the legend (e.g. "95 % Wilson CI", "± 1 sd over seeds").
        points: `[V][S_v]` per-seed values drawn over the bars.
        ylabel, title: axis label and title.

    Returns:
        `path` as a `Path`.
    """
    x = np.arange(len(labels))
    m = np.nan_to_num(np.asarray(means, dtype=float), nan=0.0)
    e = np.nan_to_num(np.asarray(errors, dtype=float), nan=0.0)  # [V] or [2, V]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(labels) + 2.5), 4.5))
    ax.bar(x, m, color="#4c72b0", alpha=0.8)
    ax.errorbar(x, m, yerr=e, fmt="none", ecolor="black", capsize=4, label=error_label)
    dots = "one seed"  # one legend entry for the dots
    for i, pts in enumerate(points or []):
        vals = [v for v in pts if v is not None]
        if vals:  # small horizontal jitter so equal values stay visible
            ax.scatter(i + np.linspace(-0.15, 0.15, len(vals)), vals, color="black", s=12, zorder=3, label=dots)
            dots = None
    ax.set_xticks(x)
    # long variant labels wrap under their bar instead of squeezing the axes; the legend sits outside the bars
    ax.set_xticklabels([textwrap.fill(str(s), TICK_WRAP) for s in labels], fontsize=8)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, path)


def plot_run_curves(
    panels: dict[str, dict[str, list[tuple[list[float], list[float]]]]],
    path: str | Path,
    *,
    title: str = "",
) -> Path:
    """Training curves, one panel per metric, one colour per variant: each run a thin line and, where a
    variant has several runs logged at the same steps, their mean a thick one. One legend for the figure,
    below the panels (inside a panel it hides the curves of a sweep of many variants).

    Args:
        panels: `{metric: {variant label: [(steps [P], values [P]) per run]}}`.
        path: PNG to write.
        title: figure title.

    Returns:
        `path` as a `Path`.
    """
    names = list(panels)
    labels = list(dict.fromkeys(lab for per in panels.values() for lab in per))
    colors = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4.8 * max(1, len(names)), 3.6 + 0.22 * len(labels)),
                             squeeze=False, layout="constrained")
    handles = {}
    for ax, metric in zip(axes[0], names):
        for lab, runs in panels[metric].items():
            many = len(runs) > 1
            for steps, values in runs:
                (line,) = ax.plot(steps, values, color=colors[lab], alpha=0.35 if many else 0.8,
                                  linewidth=0.8 if many else 1.4)
                handles.setdefault(lab, line)
            if many and len({tuple(steps) for steps, _ in runs}) == 1:  # same steps: a mean over runs is defined
                (line,) = ax.plot(runs[0][0], np.mean([v for _, v in runs], axis=0), color=colors[lab], linewidth=2.2)
                handles[lab] = line
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)  # the panel's metric: a lone panel (the demo's SFT curve) needs it on its axis
        ax.grid(True, alpha=0.3)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", fontsize=8,
                   ncol=min(3, len(handles)))
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def plot_survival(
    curves: dict[str, tuple[list[float], list[float]]],
    path: str | Path,
    *,
    budget: float,
    threshold: float,
    title: str = "",
) -> Path:
    """Steps-to-threshold survival curves: per variant, the share of its runs whose dev accuracy has not yet
    reached the threshold, a falling step function (Kaplan–Meier; a curve that stays above 0 at the budget
    has runs that never reached it).

    Args:
        curves: `{variant label: (times [k], share [k])}` as `evaluate.stats.survival_curve` gives them.
        path: PNG to write.
        budget: the last step (each curve is drawn on to it).
        threshold: the dev accuracy, for the axis label.
        title: figure title.
    """
    # a legend row holds as many labels as fit the figure's ~100 characters at 8 pt
    ncol = max(1, min(3, 100 // (max(map(len, curves), default=1) + 6)))
    fig, ax = plt.subplots(figsize=(7.0, 3.6 + 0.22 * -(-len(curves) // ncol)), layout="constrained")
    for i, (lab, (times, share)) in enumerate(curves.items()):
        # curves that never fall lie on top of each other at 1.0: the line style tells them apart
        ax.step([*times, budget], [*share, share[-1]], where="post", color=plt.get_cmap("tab10")(i % 10),
                linestyle=("-", "--", ":", "-.")[i % 4], linewidth=1.8, label=lab)
    ax.set_xlabel("step")
    ax.set_ylabel(f"runs not yet at dev accuracy ≥ {threshold:g}")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower center", fontsize=8, ncol=ncol)
    if title:
        ax.set_title(title)
    return save_figure(fig, path)
