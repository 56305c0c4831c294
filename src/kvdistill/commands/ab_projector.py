"""`kvdistill ab-projector`: the Linear vs Elastic Bottleneck A/B test of seed 000, with seeds.

Each scenario is a teacher -> student feature map `x [N, d_in] -> y [N, d_out]` that a projector
from `kvdistill.align.projectors` learns by full-batch AdamW on an MSE loss:

    simple     x ~ N(0, 1)                                  y = x W
    outliers   x: mean 2.4, std 5.6, ±20 outlier channels   y = x W
    nonlinear  x ~ N(0, 1)                                  y = tanh(x W)

with `W ~ N(0, 1/d_in)` (so `x W` has unit variance for standard `x`). Sizes follow the prototype
script behind seed 000: `d_in=1024 -> d_out=512`, 64 training tokens (B=2 x T=32), 40 steps.
Unlike the prototype we also draw a held-out set from the same teacher, report the mean ± std
over seeds, and run the ablations the seed planned (no dropout, more steps, mlp_ratio 2, no
LayerNorm, no SiLU).

The study itself (scenarios, variants, training, summaries) is `kvdistill/projector_study.py`;
this command parses its options, runs it and writes the tables, plots and JSON.

Example:
    kvdistill ab-projector --out runs/abproj --seeds 5 --all-variants
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvdistill.config import ConfigError, check_choice, option, parse_config
from kvdistill.io import write_json_atomic, write_text_atomic
from kvdistill.lab.projector_study import SCENARIOS, VARIANTS, improvement_pct, param_check, run_ab
from kvdistill.report import environment, fmt_mean_std, fmt_pct, fmt_sig

# --------------------------------------------------------------------------- reporting


def _pm(s: dict[str, float], digits: int = 3) -> str:
    return fmt_mean_std(s["mean"], s["std"], digits, sig=True)


def _one_line(run: dict[str, Any]) -> str:
    p, c = run["projectors"], run["comparison"]
    return (
        f"{run['scenario']:<9} {run['variant']:<12} train MSE lin {_pm(p['linear']['train_mse'])} | "
        f"ela {_pm(p['elastic']['train_mse'])}  held-out lin {_pm(p['linear']['test_mse'])} | "
        f"ela {_pm(p['elastic']['test_mse'])}  Δheld-out {fmt_pct(c['test_mse']['improvement_pct'])} "
        f"({run['wall_s']:.1f} s)"
    )


def results_table(result: dict[str, Any]) -> str:
    """Markdown: one row per scenario x variant, linear vs elastic, eval-mode MSE and cos-sim."""
    n = len(result["settings"]["seeds"])
    lines = [
        f"| scenario | variant | linear train MSE | elastic train MSE | Δ train | linear held-out MSE "
        f"| elastic held-out MSE | Δ held-out | mean-predictor held-out MSE | held-out cos lin / ela "
        f"| elastic wins (train, held-out; of {n}) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lin, el, c = r["projectors"]["linear"], r["projectors"]["elastic"], r["comparison"]
        lines.append(
            f"| {r['scenario']} | {r['variant']} | {_pm(lin['train_mse'])} | {_pm(el['train_mse'])} "
            f"| {fmt_pct(c['train_mse']['improvement_pct'])} | {_pm(lin['test_mse'])} | {_pm(el['test_mse'])} "
            f"| {fmt_pct(c['test_mse']['improvement_pct'])} | {fmt_sig(r['mean_predictor_test_mse']['mean'])} "
            f"| {lin['test_cos']['mean']:.3f} / {el['test_cos']['mean']:.3f} "
            f"| {c['train_mse']['elastic_wins']}, {c['test_mse']['elastic_wins']} |"
        )
    return "\n".join(lines) + "\n"


def seed_table(result: dict[str, Any]) -> str:
    """Markdown: seed 000's own metric (lowest train-mode loss over the steps) next to its numbers."""
    lines = [
        "| scenario | variant | linear best train loss | elastic best train loss | Δ | seed 000 linear / elastic "
        "| seed Δ | same winner |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if r["variant"] not in ("base", "prototype"):
            continue
        lin, el, sd = r["projectors"]["linear"], r["projectors"]["elastic"], r["seed_000"]
        ours = improvement_pct(lin["train_loss_best"]["mean"], el["train_loss_best"]["mean"])
        same = (ours > 0) == (sd["improvement_pct"] > 0)
        lines.append(
            f"| {r['scenario']} | {r['variant']} | {_pm(lin['train_loss_best'])} | {_pm(el['train_loss_best'])} "
            f"| {fmt_pct(ours)} | {sd['linear']:g} / {sd['elastic']:g} | {fmt_pct(sd['improvement_pct'])} "
            f"| {'yes' if same else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def config_table(result: dict[str, Any]) -> str:
    n_default = result["settings"]["data"]["n_train"]
    lines = [
        "| scenario | variant | steps | lr elastic / linear | mlp_ratio | dropout | LayerNorm | SiLU | train tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        c = r["config"]
        lin_lr = c["lr"] if c["lr_linear"] is None else c["lr_linear"]
        lines.append(
            f"| {r['scenario']} | {r['variant']} | {c['steps']} | {c['lr']:g} / {lin_lr:g} | {c['mlp_ratio']:g} "
            f"| {c['dropout']:g} | {'yes' if c['layernorm'] else 'no'} | {'yes' if c['activation'] else 'no'} "
            f"| {c['n_train'] or n_default} |"
        )
    return "\n".join(lines) + "\n"


def params_table(rows: list[dict]) -> str:
    lines = [
        "| projector (5120 → 1536) | one projector | K + V | formula K + V | matches | seed 001 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['projector']} | {r['one_projector'] / 1e6:.2f} M | {r['k_plus_v'] / 1e6:.2f} M "
            f"| {r['formula_k_plus_v'] / 1e6:.2f} M | {'yes' if r['matches_formula'] else '**no**'} "
            f"| {r['seed_001']} |"
        )
    return "\n".join(lines) + "\n"


def render_markdown(result: dict[str, Any], params: list[dict], plots: list[str]) -> str:
    st = result["settings"]
    d = st["data"]
    stats = "; ".join(
        f"{s}: x mean {v['x_mean']:.2f}, std {v['x_std']:.2f}, range [{v['x_min']:.1f}, {v['x_max']:.1f}]"
        + (f", {v['outlier_channels']} outlier channels" if v["outlier_channels"] else "")
        for s, v in result["data_stats"].items()
    )
    out = [
        "# Projector A/B test: linear vs Elastic Bottleneck (seed 000)\n",
        f"`kvdistill ab-projector`, {len(st['seeds'])} seeds ({st['seeds'][0]}..{st['seeds'][-1]}), "
        f"d_in {d['d_in']} → d_out {d['d_out']}, {d['n_train']} training / {d['n_test']} held-out tokens, "
        f"full-batch AdamW on MSE. Mean ± std over seeds; Δ = (linear − elastic) / linear, positive = "
        f'elastic better (seed 000\'s "advantage"). MSEs are eval-mode (no dropout) after the last step; '
        f"seed 000's numbers are its lowest training loss over 40 steps of one run.\n",
        f"Data (seed {st['seeds'][0]}): {stats}.\n",
        "## Results\n",
        results_table(result),
        "\n## Against seed 000 (its metric: lowest train-mode loss over the steps)\n",
        seed_table(result),
        "\n## Settings per row\n",
        config_table(result),
        "\n## Parameter check (seed 001), built on the meta device\n",
        params_table(params),
    ]
    if plots:
        out.append("\n## Loss curves (mean ± std over seeds)\n")
        out += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    m = result.get("machine", {})
    if m:
        out.append(
            f"\n<sub>torch {m.get('torch')} · {m.get('threads')} thread(s) · {m.get('wall_s')} s · {m.get('date')}</sub>"
        )
    return "\n".join(out) + "\n"


def write_outputs(
    result: dict[str, Any], params: list[dict], out_dir: Path, plots: bool = True
) -> list[Path]:
    """`ab_projector.json`, `ab_projector.md` and `curves_<scenario>[_<variant>].png` in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []
    if plots:
        from kvdistill.plots import plot_ab_curves

        for r in result["runs"]:
            suffix = "" if r["variant"] == "base" else f"_{r['variant']}"
            path = out_dir / f"curves_{r['scenario']}{suffix}.png"
            curves = {
                k: {
                    "train (train mode)": (list(range(1, r["config"]["steps"] + 1)), p["train_curves"]),
                    "held-out (eval mode)": (p["test_steps"], p["test_curves"]),
                }
                for k, p in r["projectors"].items()
            }
            plot_ab_curves(curves, path, title=f"{r['scenario']} · {r['variant']} · {len(r['seeds'])} seeds")
            pngs.append(path)
    md = out_dir / "ab_projector.md"
    write_text_atomic(md, render_markdown(result, params, [str(p) for p in pngs]))
    js = out_dir / "ab_projector.json"
    write_json_atomic(js, {**result, "param_check": params})
    return [md, js, *pngs]


# --------------------------------------------------------------------------- command


@dataclass
class ABProjectorConfig:
    """Options of `kvdistill ab-projector`."""

    output_dir: str | None = option(None, "Write ab_projector.md/.json and curves_*.png here.", aliases=["--out"])
    scenarios: str = option(",".join(SCENARIOS), f"Comma-separated subset of {SCENARIOS}.")
    variants: str = option("base", f"Comma-separated subset of {list(VARIANTS)}.")
    all_variants: bool = option(False, "Run every variant.")
    seeds: int = option(5, "Number of seeds.")
    seed0: int = option(0, "First seed.")
    steps: int | None = option(None, "Override every scenario's base steps (default 40).")
    long_steps: int = option(200, "Steps of the more-steps variant.")
    d_in: int = option(1024, "Teacher feature size.")
    d_out: int = option(512, "Student feature size.")
    n_train: int = option(64, "Training tokens (prototype: B=2 x T=32).")
    n_test: int = option(512, "Held-out tokens from the same teacher.")
    outlier_rate: float = option(0.02, "Fraction of outlier channels (or entries).")
    outlier_value: float = option(20.0, "Outlier magnitude (random sign).")
    outlier_mode: str = option("channel", "Where outliers sit: channel | entry.")
    threads: int = option(1, "torch.set_num_threads (fixed for reproducibility).")
    no_plots: bool = option(False, "Skip the PNG curves.")
    no_param_check: bool = option(False, "Skip the seed-001 parameter check.")

    def __post_init__(self) -> None:
        self.scenario_list = tuple(s.strip() for s in self.scenarios.split(",") if s.strip())
        self.variant_list = tuple(VARIANTS) if self.all_variants else tuple(
            v.strip() for v in self.variants.split(",") if v.strip())
        bad = [s for s in self.scenario_list if s not in SCENARIOS] + [v for v in self.variant_list if v not in VARIANTS]
        if bad or not self.scenario_list or not self.variant_list or self.seeds < 1:
            raise ConfigError(f"unknown or empty scenarios/variants {bad} (or seeds < 1); scenarios {SCENARIOS}, "
                              f"variants {list(VARIANTS)}")
        check_choice("outlier_mode", self.outlier_mode, ("channel", "entry"))


def main(argv: list[str] | None = None) -> int:
    args = parse_config(ABProjectorConfig, argv, "kvdistill ab-projector", __doc__)
    torch.set_num_threads(max(1, args.threads))
    scenarios, variants = args.scenario_list, args.variant_list
    data_kwargs = {
        "d_in": args.d_in,
        "d_out": args.d_out,
        "n_train": args.n_train,
        "n_test": args.n_test,
        "outlier_rate": args.outlier_rate,
        "outlier_value": args.outlier_value,
        "outlier_mode": args.outlier_mode,
    }
    t0 = time.perf_counter()
    result = run_ab(
        scenarios,
        variants,
        args.seeds,
        args.seed0,
        steps=args.steps,
        long_steps=args.long_steps,
        data_kwargs=data_kwargs,
        log=lambda run: print(_one_line(run)),
    )
    result["machine"] = {**environment(), "threads": torch.get_num_threads(),
                         "wall_s": round(time.perf_counter() - t0, 1)}
    params = [] if args.no_param_check else param_check()
    print()
    print(results_table(result))
    print(seed_table(result))
    if params:
        print(params_table(params))
        print(
            "note: seed 001 compares one linear projector (7.87 M) with the elastic K+V pair (68.19 M); "
            f"like for like, K+V is {params[0]['k_plus_v'] / 1e6:.2f} M vs "
            f"{next(r['k_plus_v'] for r in params if r['projector'] == 'elastic r=1') / 1e6:.2f} M."
        )
    if args.output_dir:
        files = write_outputs(result, params, Path(args.output_dir), plots=not args.no_plots)
        print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
