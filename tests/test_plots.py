"""Plots (`kvdistill.plots`, `kvdistill.train.curves`): no matplotlib warning, readable axes.

Every plotting function runs with warnings turned into errors, on typical inputs and on the edge
cases training produces (one logged step, one teacher, one layer, a panel without data).
"""

import itertools
import json
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from kvdistill import plots
from kvdistill.train import curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(path, steps, teachers=("qwen2", "llama"), layers=3):
    """A `metrics.jsonl` like the trainer writes: losses, cos-sim per teacher and per layer."""
    rows = []
    for i, step in enumerate(steps):
        row = {"step": step, "loss": 2.0 / (i + 1), "ce": 1.5 / (i + 1), "kv_loss": 0.5 / (i + 1)}
        for t in teachers:
            row[f"cos_sim/{t}"] = 0.1 * i
            row.update({f"cos_layer/{t}/{layer}": 0.1 * i + 0.01 * layer for layer in range(layers)})
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def strict():
    """Any warning (tight_layout, singular limits, empty legend ...) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.mark.parametrize(
    ("steps", "teachers", "layers"),
    [([2, 4, 6, 8], ("qwen2", "llama"), 3), ([2], ("qwen2", "llama"), 3), ([5, 10], ("qwen2",), 1)],
    ids=["typical", "one-logged-step", "one-teacher-one-layer"],
)
def test_training_curves_emit_no_warning(tmp_path, strict, steps, teachers, layers):
    written = curves.plot_training_curves(_metrics(tmp_path / "metrics.jsonl", steps, teachers, layers), tmp_path)
    assert [p.name for p in written] == ["curves_loss.png", "curves_cos_sim.png", "cos_sim_layers.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in written)


def test_cos_sim_layers_has_integer_layer_ticks_and_its_colorbar_beside_the_panels(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(curves, "save_figure", lambda fig, path: figs.append(fig) or path)
    curves.plot_training_curves(_metrics(tmp_path / "metrics.jsonl", [2, 4, 6, 8], layers=3), tmp_path)
    fig = figs[-1]  # cos_sim_layers
    fig.canvas.draw()
    *panels, cbar = fig.axes
    assert len(panels) == 2 and cbar.get_label() == "<colorbar>"
    for ax in panels:
        assert list(ax.get_yticks()) == [0, 1, 2]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
        assert ax.get_xlim()[0] < 2 and ax.get_xlim()[1] > 8  # every logged step is a whole cell
        grid = np.asarray(ax.images[0].get_array())  # [layers, steps]: row l is layer l
        np.testing.assert_allclose(grid[:, 1], [0.1, 0.11, 0.12])
    right = max(ax.get_position().x1 for ax in panels)
    assert cbar.get_position().x0 >= right, "the colorbar overlaps a panel"
    for f in figs:
        plt.close(f)


def test_component_plots_emit_no_warning(tmp_path, strict):
    S = np.random.default_rng(0).uniform(size=(3, 5))
    M = np.zeros((3, 5))
    M[[0, 1, 2], [0, 2, 4]] = 1.0
    paths = [
        plots.plot_cka_heatmap(S, M, tmp_path / "cka.png", title="t"),
        plots.plot_cka_heatmap(S[:1, :1], None, tmp_path / "cka_1x1.png"),
        plots.plot_bars_with_errors(["a", "b"], [0.5, float("nan")], [0.1, float("nan")], tmp_path / "bars.png",
                                    error_label="± 1 sd", points=[[0.4, 0.6], []], ylabel="acc", title="t"),
        plots.plot_bars_with_errors(["a"], [0.5], [[0.1], [0.2]], tmp_path / "bars_ci.png", error_label="95 % CI"),
        plots.plot_run_curves({"loss": {"sft": [([1, 2], [2.0, 1.0])]}, "cos_sim": {}}, tmp_path / "runs.png",
                              title="t"),
        plots.plot_run_curves({"loss": {"sft": [([3], [2.0])]}}, tmp_path / "runs_1.png"),
        plots.plot_ab_curves({"linear": {"train": ([1, 2, 3], [[3.0, 2.0, 1.0], [3.0, 2.5, 1.5]]),
                                         "held-out": ([1], [[]])}}, tmp_path / "ab.png", title="t"),
    ]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)


# ---------------------------------------------------------------------------- what the plots say
# Checked on the drawn artists (line labels and data, titles, axis labels), not on pixels.


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plotting functions made, instead of writing them (module -> figures)."""
    figs = []
    for module in (plots, curves):
        monkeypatch.setattr(module, "save_figure", lambda fig, path: figs.append(fig) or Path(path))
    yield figs
    for f in figs:
        plt.close(f)


def _loss_rows(path, terms, steps=(1, 2, 3, 4)):
    """A `metrics.jsonl` whose total is the sum of the weighted `terms` {name: weight} (kv with warm-up)."""
    rows = []
    for i, step in enumerate(steps):
        row = {"step": step, "kv_warmup": min(1.0, 0.25 * (i + 1))}
        row.update({k: 2.0 / (i + 1) + j for j, k in enumerate(terms)})
        row["loss"] = sum(w * row[k] * (row["kv_warmup"] if k == "kv_loss" else 1.0) for k, w in terms.items())
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.parametrize("terms", [
    {"ce": 1.0},
    {"ce": 1.0, "logit_kd": 0.5},
    {"ce": 1.0, "kv_loss": 0.1},
    {"ce": 0.5, "kv_loss": 0.1, "logit_kd": 2.0, "codi": 0.3},
], ids=["sft", "logit_kd", "kv", "every_term"])
def test_the_loss_plot_draws_the_total_and_every_weighted_term_it_optimises(tmp_path, drawn, terms):
    run = tmp_path / "runs" / "student_x"
    run.mkdir(parents=True)
    rows = _loss_rows(run / "metrics.jsonl", terms)
    weights = {f"{k}_weight" if k != "kv_loss" else "kv_weight": w for k, w in terms.items()}
    curves.plot_training_curves(run / "metrics.jsonl", run, weights=weights)
    ax = drawn[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    expected = {k: f"{w:g} × {k}" + (" × warm-up" if k == "kv_loss" else "") for k, w in terms.items()}
    assert sorted(legend) == sorted(["total loss", *expected.values()])
    np.testing.assert_allclose(lines["total loss"].get_ydata(), [r["loss"] for r in rows])
    drawn_sum = sum(np.asarray(lines[label].get_ydata(), dtype=float) for label in expected.values())
    np.testing.assert_allclose(drawn_sum, [r["loss"] for r in rows])  # the terms drawn add up to the total
    styles = {(line.get_color(), line.get_linestyle(), line.get_linewidth()) for line in lines.values()}
    assert len(styles) == len(lines)  # each distinguishable from the others (and from the total under it)
    assert "runs/student_x" in ax.get_title()
    assert ax.get_xlabel() and ax.get_ylabel()


def test_the_loss_plot_reads_the_weights_from_the_run_config(tmp_path, drawn):
    (tmp_path / "kvdistill_config.yaml").write_text("ce_weight: 1.0\nkv_weight: 0.0\nlogit_kd_weight: 0.25\n")
    _loss_rows(tmp_path / "metrics.jsonl", {"ce": 1.0, "logit_kd": 0.25})
    curves.plot_training_curves(tmp_path / "metrics.jsonl", tmp_path)
    assert {line.get_label() for line in drawn[0].axes[0].get_lines()} == {"total loss", "1 × ce", "0.25 × logit_kd"}


def test_every_training_plot_names_the_run_and_labels_its_axes(tmp_path, drawn):
    run = tmp_path / "abl" / "seed_3"
    run.mkdir(parents=True)
    curves.plot_training_curves(_metrics(run / "metrics.jsonl", [2, 4, 6]), run)
    assert len(drawn) == 3  # loss, cos-sim, per-layer cos-sim (a panel per teacher)
    for fig in drawn:
        title = fig.get_suptitle() or fig.axes[0].get_title()
        assert "abl/seed_3" in title, title
        for ax in fig.axes:
            assert ax.get_label() == "<colorbar>" or (ax.get_title() and ax.get_xlabel() and ax.get_ylabel())


def test_run_curves_label_each_panel_s_y_axis(tmp_path, drawn):
    plots.plot_run_curves({"dev accuracy": {"SFT": [([10, 20], [0.2, 0.4])]}}, tmp_path / "sft.png",
                          title="run sft_curve: SFT")
    ax = drawn[0].axes[0]
    assert ax.get_ylabel() == "dev accuracy" and ax.get_xlabel() == "step"


def test_run_curves_draw_a_variant_s_mean_over_runs_and_one_legend_outside_the_panels(tmp_path, drawn):
    plots.plot_run_curves({"acc": {"a": [([1, 2], [0.0, 1.0]), ([1, 2], [1.0, 1.0])], "b": [([1, 2], [0.5, 0.5])]}},
                          tmp_path / "x.png")
    fig = drawn[0]
    ax = fig.axes[0]
    assert ax.get_legend() is None and [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b"]
    thick = [line for line in ax.lines if line.get_linewidth() > 2]  # a's mean; b has one run, no mean
    assert len(ax.lines) == 4 and len(thick) == 1 and list(thick[0].get_ydata()) == [0.5, 1.0]


def test_error_bars_say_what_they_are_and_keep_an_asymmetric_interval(tmp_path, drawn):
    plots.plot_bars_with_errors(["sft", "kv"], [0.5, 0.7], [[0.1, 0.2], [0.3, 0.05]], tmp_path / "acc.png",
                                error_label="95 % Wilson CI", points=[[0.4, 0.6], [0.7]])
    ax = drawn[0].axes[0]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["95 % Wilson CI", "one seed"]
    (bars,) = ax.containers[1].lines[2]  # the vertical error segments, one per bar
    np.testing.assert_allclose([seg[:, 1] for seg in bars.get_segments()], [[0.4, 0.8], [0.5, 0.75]])


def test_long_bar_labels_wrap_and_the_legend_sits_beside_the_bars(tmp_path, monkeypatch):
    figs = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figs.append(fig) or Path(path))
    long = "+Relation, permuted numbers (teacher reads a+b with 0..16 relabelled)"
    plots.plot_bars_with_errors(["SFT", long], [0.5, 0.6], [0.1, 0.1], tmp_path / "b.png", error_label="± 1 sd",
                                points=[[0.4, 0.6], [0.5, 0.7]])
    (fig,) = figs
    fig.canvas.draw()
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.get_xticklabels()]
    assert texts[0] == "SFT" and texts[1].replace("\n", " ") == long and texts[1].count("\n") >= 2
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1  # never over a bar
    # five long labels side by side: each stays within its own slot (the 24-character wrap ran them together)
    labels = ["Logit KD (positive control)", "Logit KD + Relation from the permuted-number copy",
              "Logit KD + Relation from the untrained copy", "Logit KD, T = 4", "Logit KD + Relation"]
    plots.plot_bars_with_errors(labels, [0.1] * 5, [0.01] * 5, tmp_path / "c.png", error_label="± 1 sd")
    fig = figs[-1]
    fig.canvas.draw()
    boxes = sorted((t.get_window_extent() for t in fig.axes[0].get_xticklabels()), key=lambda b: b.x0)
    assert all(a.x1 < b.x0 for a, b in itertools.pairwise(boxes))
