"""`kvdistill ab-projector`: scenario statistics, fitting, reproducibility, outputs, parameter counts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from kvdistill.align.projectors import build_projector
from kvdistill.cli import main as cli_main
from kvdistill.commands import ab_projector as ab
from kvdistill.lab import projector_study as study
from kvdistill.report import param_count

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_simple_and_nonlinear_statistics() -> None:
    d = study.make_scenario("simple", 0, d_in=256, d_out=128, n_train=4000, n_test=100)
    assert d.x_train.shape == (4000, 256) and d.y_train.shape == (4000, 128) and d.x_test.shape == (100, 256)
    assert abs(d.x_train.mean().item()) < 0.01 and abs(d.x_train.std().item() - 1) < 0.01
    assert abs(d.y_train.std().item() - 1) < 0.1  # W ~ N(0, 1/d_in): unit-variance targets
    torch.testing.assert_close(d.y_test, d.x_test @ d.W)

    nl = study.make_scenario("nonlinear", 0, d_in=256, d_out=128, n_train=500, n_test=100)
    torch.testing.assert_close(nl.y_train, torch.tanh(nl.x_train @ nl.W))
    assert nl.y_train.abs().max() < 1


@pytest.mark.parametrize("rate", [0.02, 0.05])
def test_outlier_channel_statistics(rate: float) -> None:
    d = study.make_scenario("outliers", 1, d_in=1024, d_out=64, n_train=2000, n_test=300, outlier_rate=rate)
    x = d.x_train  # [N, d_in]
    # the whole tensor, outliers included, has the seed's statistics
    assert abs(x.mean().item() - 2.4) < 0.05 and abs(x.std().item() - 5.6) < 0.05
    # outliers: whole channels at exactly ±20, at the requested rate, the same channels held-out
    const = (x == x[:1]).all(0) & (x[0].abs() == 20)
    assert const.sum().item() == round(rate * 1024) == d.outlier_channels.numel()
    assert torch.equal(const.nonzero().squeeze(1), d.outlier_channels)
    assert (d.x_test[:, d.outlier_channels].abs() == 20).all()
    signs = x[0, d.outlier_channels].sign()
    assert (signs > 0).any() and (signs < 0).any()  # "±20"
    torch.testing.assert_close(d.y_train, x @ d.W)


def test_outlier_entry_mode_and_bad_rate() -> None:
    g = torch.Generator().manual_seed(0)
    x, mask = study.shifted_inputs(1000, 512, g, outlier_rate=0.03, mode="entry")
    assert abs(mask.float().mean().item() - 0.03) < 0.003
    assert (x[mask].abs() == 20).all() and x[mask].min() < 0 < x[mask].max()
    assert abs(x.mean().item() - 2.4) < 0.05 and abs(x.std().item() - 5.6) < 0.05
    with pytest.raises(ValueError, match="exceed"):
        study.shifted_inputs(10, 512, g, outlier_rate=0.2, mode="entry")  # 0.2·400 > 5.6²


def test_both_projectors_fit_simple_linear_with_more_steps() -> None:
    # well-posed small case: more tokens than input dims
    data = study.make_scenario("simple", 0, d_in=32, d_out=16, n_train=256, n_test=256)
    cfg = study.RunConfig(steps=300, lr=1e-2, mlp_ratio=2.0, dropout=0.0)
    for kind in study.PROJECTORS:
        r = study.train_one(kind, data, cfg, seed=0)
        assert r["train_curve"][-1] < 0.05 * r["train_curve"][0], kind
        assert r["train_mse"] < 0.05 and r["train_cos"] > 0.97, (kind, r["train_mse"])
    lin = study.train_one("linear", data, cfg, seed=0)
    assert lin["test_mse"] < 0.01  # the linear map is exactly learnable and generalises


def test_variants_reach_the_real_modules() -> None:
    base = study.TABLE_CONFIG["outliers"]
    no_ln = study.build("elastic", 16, 8, study.VARIANTS["no-layernorm"].apply("outliers", base, 200))
    no_act = study.build("elastic", 16, 8, study.VARIANTS["no-silu"].apply("outliers", base, 200))
    assert not any("LayerNorm" in type(m).__name__ for m in no_ln.modules())
    assert any(isinstance(m, nn.SiLU) for m in no_ln.modules())
    assert param_count(no_ln) == study.expected_params("elastic", 16, 8, 1.0, layernorm=False)
    assert not any(isinstance(m, nn.SiLU) for m in no_act.modules())
    assert study.VARIANTS["more-steps"].apply("simple", base, 123).steps == 123
    assert study.VARIANTS["no-dropout"].apply("simple", base, 200).dropout == 0.0
    assert study.VARIANTS["prototype"].apply("outliers", base, 200).linear_lr == 1e-4
    assert study.VARIANTS["table-steps"].apply("nonlinear", study.TABLE_CONFIG["nonlinear"], 200).steps == 100


def test_param_counts_equal_formula() -> None:
    rows = {r["projector"]: r for r in study.param_check()}
    assert all(r["matches_formula"] for r in rows.values())
    assert rows["linear"]["one_projector"] == 5120 * 1536 + 1536  # seed 001's 7.87 M is ONE projector
    assert rows["elastic r=1"]["k_plus_v"] == 2 * (2 * 5120 + 5120 * 5120 + 5120 + 5120 * 1536 + 1536)
    assert round(rows["elastic r=1"]["k_plus_v"] / 1e6, 2) == 68.19
    assert round(rows["linear"]["one_projector"] / 1e6, 2) == 7.87
    # the meta-device count agrees with a real (small) module
    assert param_count(build_projector("elastic", 48, 24, mlp_ratio=0.5)) == study.expected_params(
        "elastic", 48, 24, 0.5
    )


def _small_run(seed0: int) -> dict:
    kw = {"d_in": 48, "d_out": 24, "n_train": 16, "n_test": 32}
    return study.run_ab(
        ("simple", "outliers"), ("base", "no-silu"), seeds=2, seed0=seed0, steps=3, data_kwargs=kw
    )


def _numbers(result: dict) -> str:
    return json.dumps([{k: v for k, v in r.items() if k != "wall_s"} for r in result["runs"]])


def test_same_seed_same_results() -> None:
    a, b, c = _small_run(0), _small_run(0), _small_run(7)
    assert _numbers(a) == _numbers(b)  # bit-identical curves and metrics
    assert _numbers(a) != _numbers(c)
    run = a["runs"][0]
    assert (
        run["projectors"]["linear"]["per_seed"]["train_mse"][0]
        != run["projectors"]["linear"]["per_seed"]["train_mse"][1]
    )  # seeds draw different data / inits


def test_command_writes_table_json_and_pngs(tmp_path: Path, capsys) -> None:
    out = tmp_path / "abproj"
    assert ab.main(["--steps", "5", "--seeds", "2", "--out", str(out)]) == 0
    md = (out / "ab_projector.md").read_text()
    assert "linear train MSE" in md and "elastic train MSE" in md
    assert "19.67 / 5.37 | +72.7 %" in md and "68.19 M" in md
    for s in study.SCENARIOS:
        assert (out / f"curves_{s}.png").read_bytes()[:8] == PNG_MAGIC
    res = json.loads((out / "ab_projector.json").read_text())
    assert [r["scenario"] for r in res["runs"]] == list(study.SCENARIOS)
    assert len(res["runs"][0]["projectors"]["elastic"]["train_curves"][0]) == 5
    printed = capsys.readouterr().out
    assert "| simple | base |" in printed and "elastic r=1" in printed


def test_command_rejects_unknown_variant(capsys) -> None:
    assert cli_main(["ab-projector", "--variants", "nope", "--seeds", "1", "--steps", "1"]) == 2


def test_improvement_matches_seed_definition() -> None:
    assert study.improvement_pct(19.67, 5.37) == pytest.approx(72.7, abs=0.05)
    assert study.SEED_IMPROVEMENT_PCT["outliers"] == pytest.approx(72.7, abs=0.05)
    assert replace(study.RunConfig(lr=5e-4), lr_linear=None).linear_lr == 5e-4
