"""Plots (`kvdistill.plots`, `kvdistill.train.curves`): no matplotlib warning, readable axes.

Every plotting function runs with warnings turned into errors, on typical inputs and on the edge
cases training produces (one logged step, one teacher, one layer, a panel without data).
"""

import json
import warnings

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
                                    points=[[0.4, 0.6], []], ylabel="acc", title="t"),
        plots.plot_run_curves({"loss": {"sft": [([1, 2], [2.0, 1.0])]}, "cos_sim": {}}, tmp_path / "runs.png",
                              title="t"),
        plots.plot_run_curves({"loss": {"sft": [([3], [2.0])]}}, tmp_path / "runs_1.png"),
        plots.plot_ab_curves({"linear": {"train": ([1, 2, 3], [[3.0, 2.0, 1.0], [3.0, 2.5, 1.5]]),
                                         "held-out": ([1], [[]])}}, tmp_path / "ab.png", title="t"),
    ]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)
