"""The ablation report: `ablation.md` (tables, the primary in words, the controls), `ablation.json` and
the plots."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvdistill.commands.ablate.design import AblationConfig
from kvdistill.commands.ablate.summary import seed_values
from kvdistill.controls import MEANING_KEPT
from kvdistill.evaluate.comparisons import fmt_reached, render_continuous
from kvdistill.evaluate.stats import survival_curve
from kvdistill.io import write_json_atomic, write_text_atomic
from kvdistill.lab.prereg import METRIC_NAMES, beats, controls_spec, render_lead, verdict_lines
from kvdistill.report import fmt_mean_std, fmt_num, fmt_p, fmt_signed, format_environment


def _pm(stat: Mapping[str, float], digits: int = 3) -> str:
    """`mean ± std` of a `{"mean", "std", "n"}` stat (– when no run has it)."""
    return fmt_mean_std(stat["mean"], stat["std"], digits) if stat and stat.get("n", 0) else fmt_num(None)


def _cmp_cells(cmp_: Mapping[str, Any]) -> list[str]:
    """Δ, t-test p, Welch p, permutation p, bootstrap CI of one comparison."""
    b = cmp_["bootstrap"]
    ci = "–" if b["ci_low"] is None or math.isnan(b["ci_low"]) else f"[{b['ci_low']:+.3f}, {b['ci_high']:+.3f}]"
    return [fmt_signed(cmp_["delta_accuracy"]), fmt_p(cmp_["ttest"]["p_value"]),
            fmt_p((cmp_.get("welch") or {}).get("p_value")), fmt_p(cmp_["permutation_p"]), ci]


def _significant(cmp_: Mapping[str, Any] | None, alpha: float = 0.05) -> bool:
    """Paired p < alpha on both the seed-level and the item-level test, either direction (a test with no
    p-value, e.g. the t-test of one seed, shows nothing)."""
    if not cmp_ or cmp_["ttest"]["p_value"] is None or cmp_["permutation_p"] is None:
        return False
    return cmp_["ttest"]["p_value"] < alpha and cmp_["permutation_p"] < alpha


def _beats(cmp_: Mapping[str, Any] | None, alpha: float = 0.05) -> bool:
    """Higher accuracy, significant on both paired tests."""
    return _significant(cmp_, alpha) and cmp_["delta_accuracy"] > 0


def _equals(cmp_: Mapping[str, Any] | None) -> bool:
    """Accuracy equivalent within the margin (TOST)."""
    return bool(cmp_ and (cmp_.get("tost") or {}).get("equivalent"))


def _table(header: list[str], body: list[list[str]], keep: int = 1) -> list[str]:
    """A Markdown table without the columns no row has a value in (past the first `keep`): a sweep on the
    held-out LM loss has no accuracy, one without a KV loss no cos-sim."""
    cols = [j for j in range(len(header)) if j < keep or any(r[j] not in ("–", "") for r in body)]
    return ["| " + " | ".join(header[j] for j in cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(r[j] for j in cols) + " |" for r in body)]


def _lm_loss_cells(cmp_: Mapping[str, Any] | None) -> list[str]:
    """Δ held-out LM loss vs the reference, its paired-t 95 % CI and p (– for a sweep without it)."""
    t = ((cmp_ or {}).get("nll") or {}).get("paired_t") or {}
    ci = "–" if t.get("ci_low") is None else f"[{t['ci_low']:+.3f}, {t['ci_high']:+.3f}]"
    return [fmt_signed(t.get("mean_diff")), ci, fmt_p(t.get("p_value"))]


def _registered_cell(spec: Mapping[str, Any] | None, result: Mapping[str, Any] | None) -> str:
    """The registered test of one comparison: `Δ answer NLL -0.948, p 3.6e-16` (– where none was run)."""
    if not spec or not result:
        return fmt_num(None)
    delta = "" if result.get("mean_diff") is None else f"Δ {METRIC_NAMES[spec['metric']]} {fmt_signed(result['mean_diff'])}, "
    return f"{delta}p {fmt_p(result.get('p_value'))}"


def _invariance(report: Mapping[str, Any], name: str) -> bool:
    """A control that keeps the meaning (a permutation in `controls.MEANING_KEPT`, e.g. renamed variables):
    the signal should equal it, not beat it. A variant the report lacks (not run) is none."""
    row = report["variants"].get(name) or {}
    permute = {**(report.get("common_overrides") or {}), **(row.get("overrides") or {})}.get("permute")
    return row.get("teacher_control") == "permuted" and permute in MEANING_KEPT  # older reports lack the key


def render_markdown(report: Mapping[str, Any], plots: Mapping[str, str] | None = None) -> str:
    """`ablation.md`: primary comparison, variant table, controls, per-run table, method, plots."""
    rows = report["variants"]
    label = {name: row["label"] for name, row in rows.items()}
    base_label = label[report["baseline"]]
    lines = ["# Ablation", "", *render_lead(report),
             f"Base config `{report['base_config']}`; seeds {report['seeds']}; baseline "
             f"**{base_label}**; {report.get('threads', 1)} torch thread(s) per run.", ""]
    prim = report.get("primary")
    has_acc = any((r.get("accuracy") or {}).get("n") for r in rows.values())
    if prim:
        delta, tp, wp, pp, ci = _cmp_cells(prim)
        verdict = ("**not significant**" if not _significant(prim) else "**significant**" if _beats(prim)
                   else "**significant, in the reference's favour**")
        metric = (prim.get("spec") or {}).get("metric", "accuracy")
        # older reports: one reference; several tests: each test's results name the references
        results = prim.get("results") or next(iter((prim.get("tests") or {}).values()), {}).get("results")
        refs = list(results or [prim["reference"]])
        pair = f"{label[prim['variant']]} vs {label[prim['reference']]} over seeds {prim['seeds']}"
        claim = f"{label[prim['variant']]} vs {'; '.join(label[r] for r in refs)} over seeds {prim['seeds']}"
        # a registered metric other than accuracy, a claim against several arms or several tests lead (their
        # tests are the record), one line per test; accuracy of the (first) pair follows as context
        stated = verdict_lines(prim)
        registered = [] if metric == "accuracy" and len(refs) == 1 and len(stated) <= 1 else [
            *(line for _, v in stated for line in (f"{claim}, the registered metric ({METRIC_NAMES[metric]}): {v}.",
                                                   "")),
            f"The {'first' if len(refs) > 1 else 'same'} pair on accuracy (not the registered test):"]
        accuracy = [f"{pair}: Δ accuracy {delta}, paired t-test p {tp} (Welch p {wp}), permutation p {pp}, bootstrap "
                    f"95 % CI {ci} — {verdict} at p < 0.05 on both paired tests.", ""]
        lines += ["## Primary comparison (named in the config before the run)", "",
                  *(registered + accuracy if has_acc else registered[:-1])]
    body = []
    for row in rows.values():
        cmp_ = row.get("vs_baseline")
        ref = label.get(row.get("reference"), "–") if cmp_ else "–"
        body.append([row["label"], str(len(row["seeds"])), _pm(row["accuracy"]), _pm(row["cos_sim"]),
                     _pm(_kl(row), 4), _pm(row["perplexity"], 2), _pm(row.get("nll"), 4), ref,
                     *(_cmp_cells(cmp_) if cmp_ else ["–"] * 5), *_lm_loss_cells(cmp_)])
    lines += _table(["variant", "seeds", "accuracy", "cos-sim", "relation / attention KL", "perplexity",
                     "held-out LM loss", "reference", "Δ acc", "t-test p (seeds)", "Welch p (seeds)",
                     "permutation p (items)", "bootstrap 95 % CI of Δ (items)", "Δ held-out LM loss",
                     "its 95 % CI (paired t)", "its paired t p"], body, keep=2)
    lines += render_row_split(rows)
    controlled = {n: r for n, r in rows.items() if r.get("controls")}
    if controlled:
        # judged as the primary is, on its registered metric and test (older reports: on accuracy's paired tests)
        spec = controls_spec((prim or {}).get("spec")) if any("registered" in c for r in controlled.values()
                                                              for c in r["comparisons"].values()) else None
        how = (f"on the registered {METRIC_NAMES[spec['metric']]} by its {spec['test'].replace('_', ' ')} test "
               f"at alpha {spec['alpha']:g}" if spec else "at p < 0.05 on both paired tests of accuracy")
        kept = any(_invariance(report, c) for r in controlled.values() for c in r["controls"])
        lines += ["", "## Against the controls", "",
                  "A KV signal counts as knowledge transfer only if it beats its reference **and** every "
                  f"control (untrained teacher, shuffled teacher) {how}"
                  + (f"; a control that keeps the meaning (permuted names) should instead equal it (TOST on "
                     f"accuracy within ±{report.get('margin')})." if kept else "."), ""]
        body = []

        def meets(ref: str, cmp_: Mapping[str, Any] | None) -> bool:
            if _invariance(report, ref):
                return _equals(cmp_)
            return beats(spec, cmp_.get("registered")) if spec and cmp_ else _beats(cmp_)

        for row in controlled.values():
            for ref in [row["reference"], *row["controls"]]:
                cmp_ = row["comparisons"].get(ref)
                if cmp_ is None:
                    body.append([row["label"], label.get(ref, ref), *["–"] * 6, "not run"])
                    continue
                what = "equal" if _invariance(report, ref) else "beats it"
                body.append([row["label"], label[ref], *_cmp_cells(cmp_), _registered_cell(spec, cmp_.get("registered")),
                             f"{what}: {'yes' if meets(ref, cmp_) else 'no'}"])
        lines += _table(["variant", "compared with", "Δ acc", "t-test p", "Welch p", "permutation p",
                         "bootstrap 95 % CI", "registered test", "as it should"], body, keep=2)
        lines.append("")
        for row in controlled.values():
            refs = [row["reference"], *row["controls"]]
            # a control this ablation did not run is no verdict either way: say which, and what the run ones show
            missing = [label.get(r, r) for r in refs if r not in row["comparisons"]]
            ok = all(meets(r, row["comparisons"][r]) for r in refs if r in row["comparisons"])
            if missing:
                verdict = (f"not judged against all controls ({', '.join(missing)}: not run in this ablation); "
                           f"{'beats' if ok else 'does not beat'} every one that was run")
            else:
                verdict = "**beats its reference and all controls**" if ok else \
                    "does not beat its reference and all controls"
            lines.append(f"- {row['label']}: {verdict}.")
    lines += render_continuous(report)
    n_seeds = min((len(r["seeds"]) for r in report["variants"].values()), default=0)
    lines += ["", (
        "Accuracy and cos-sim are mean ± sample std over seeds (cos-sim: final value of the training "
        "log; – for runs without a KV loss). The t-test pairs the per-seed accuracies by seed; Welch's "
        "does not pair them (the better test when paired seeds are not correlated); the "
        "permutation (sign-flip) test and the bootstrap pool per-item correctness over the common "
        f"seeds, paired by (seed, item), with {report['n_resamples']} resamples. The seed-level test "
        "carries the training variance; the item-level tests only the test-set variance, so with few "
        "seeds they overstate certainty." if has_acc else
        "Held-out LM loss (nats per target token of the test split), perplexity and cos-sim are mean ± sample std "
        "over seeds (cos-sim: final value of the training log). Δ is each variant minus its reference, paired by "
        "seed (same init and data order), with the paired t test's 95 % CI and p.")]
    if n_seeds < 5:
        lines += [
            "",
            f"**Note:** only {n_seeds} seed(s) per variant; a student's results swing widely "
            "between seeds (SPEC §7), use ≥ 5 seeds before drawing conclusions.",
        ]
    if report.get("failures"):
        lines += ["", "**Failed runs:**", *[f"- {f}" for f in report["failures"]]]
    earlier = report.get("from_report")
    if earlier:
        listed = "; ".join(f"{label.get(name, name)} seed(s) {', '.join(map(str, seeds))}"
                           for name, seeds in earlier["runs"].items())
        no_items = sum(len(seeds) for seeds in earlier["without_items"].values())
        lines += ["", f"**Runs from an earlier report:** not run here but read from `{earlier['path']}` (same config "
                  f"hash): {listed}. They have no per-step metrics, so the training curves leave them out"
                  + (f"; {no_items} of them have no per-item record, so the item-level tests (permutation, bootstrap) "
                     "pool only the seeds whose runs have one" if no_items else "") + "."]
    body = [[row["label"], str(seed), fmt_num(r["accuracy"]),
             "–" if r["accuracy"] is None else f"[{fmt_num(r['ci_low'])}, {fmt_num(r['ci_high'])}]", str(r["n"]),
             fmt_num(r.get("answer_nll")), fmt_num(r["cos_sim"]), fmt_num(_kl(r), 4), fmt_num(r["ce"]),
             fmt_num(r["perplexity"], 2), fmt_num(r.get("nll"), 4),
             str(r["global_step"]) if r["global_step"] is not None else "–", fmt_reached(r.get("steps")),
             fmt_num(r.get("train_runtime"), 0)]
            for row in report["variants"].values() for seed, r in row["runs"].items()]
    lines += ["", "## Runs", "", *_table(["variant", "seed", "accuracy", "95 % CI", "n", "answer NLL", "cos-sim",
                                          "relation / attention KL", "CE", "perplexity", "held-out LM loss", "steps",
                                          "threshold at", "train s"], body, keep=2)]
    lines += ["", "## Variants", ""]
    for name, row in report["variants"].items():
        lines.append(f"- **{row['label']}** (`{name}`): `{json.dumps(row['overrides'], sort_keys=True)}`")
    if report.get("environments"):
        lines += ["", "Environment of the runs: " + "; ".join(
            f"`{format_environment(e)}`" for e in report["environments"])]
    if plots:
        lines += ["", "## Plots", ""]
        for title, fname in plots.items():
            lines.append(f"![{title}]({fname})")
    return "\n".join(lines) + "\n"


def _kl(row: Mapping[str, Any]) -> Any:
    """A variant's (or run's) final relation KL, else its attention KL (a run has one kv_loss)."""
    rel = row.get("relation_kl")
    has = rel.get("n", 0) if isinstance(rel, Mapping) else rel is not None
    return rel if has else (row.get("agreement") or {}).get("attention_kl")


def render_row_split(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The KL on the rows `relation_rows` selects vs the other valid rows, per variant and teacher: the right
    teacher and each control compared on the rows that can carry the knowledge. Empty when none logged it."""
    lines = []
    for row in rows.values():
        agree = row.get("agreement") or {}
        for key in sorted(k for k in agree if "_kl_selected/" in k):
            loss, _, teacher = key.partition("_kl_selected/")
            lines.append(f"| {row['label']} | {teacher} | {loss} | {_pm(agree[key], 4)} "
                         f"| {_pm(agree.get(key.replace('_selected/', '_other/')), 4)} |")
    if not lines:
        return []
    return ["", "## KL on the selected rows vs the other rows", "",
            "Final KL to each teacher (mean ± std over seeds) on the rows `relation_rows` selects and on the other "
            "valid rows: a teacher that carries the knowledge should be matched better where it matters than its "
            "controls are.", "",
            "| variant | teacher | loss | KL selected rows | KL other rows |", "|---|---|---|---|---|", *lines]


def _metric(row: Mapping[str, Any], key: str) -> float | None:
    """`row[key]`; cos_sim and relation_kl are logged per teacher (`cos_sim/<name>`): their mean."""
    if row.get(key) is not None:
        return float(row[key])
    if key in ("cos_sim", "relation_kl"):
        per_teacher = [float(v) for k, v in row.items() if k.startswith(f"{key}/") and v is not None]
        return sum(per_teacher) / len(per_teacher) if per_teacher else None
    return None


def write_report(report: dict[str, Any], cfg: AblationConfig) -> dict[str, Path]:
    """Write `ablation.md`, `ablation.json`, `ablation_accuracy.png` (`ablation_nll.png` for a sweep on the
    held-out LM loss), `ablation_curves.png` and, with a `threshold`, `ablation_survival.png`."""
    from kvdistill.plots import plot_bars_with_errors, plot_run_curves, plot_survival

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves_raw = report.pop("_curves", {})
    rows = report["variants"]
    labels = [r["label"] for r in rows.values()]
    plots: dict[str, str] = {}
    # the bars show accuracy, or the held-out LM loss of a sweep that has no accuracy (text data)
    key = "accuracy" if any((r.get("accuracy") or {}).get("n") for r in rows.values()) or \
        not any((r.get("nll") or {}).get("n") for r in rows.values()) else "nll"
    name = METRIC_NAMES[key]
    bars_png = plot_bars_with_errors(
        labels,
        [r[key]["mean"] for r in rows.values()],
        [r[key]["std"] for r in rows.values()],
        out / f"ablation_{key}.png",
        points=[[r["runs"][s][key] for s in r["runs"]] for r in rows.values()],
        error_label="± 1 sd over seeds",
        ylabel=f"{name} (mean ± std over seeds)",
        title=f"Ablation {out.name}: {name}",
    )
    plots[name] = bars_png.name
    panels: dict[str, dict[str, list[tuple[list[float], list[float]]]]] = {}
    for name, per_seed in curves_raw.items():
        for metrics in per_seed.values():
            for key in ("eval_accuracy", "loss", "ce", "kv_loss", "cos_sim", "relation_kl"):
                pts = [(m["step"], v) for m in metrics if (v := _metric(m, key)) is not None and "step" in m]
                if pts:
                    steps, vals = zip(*pts)
                    panels.setdefault(key, {}).setdefault(rows[name]["label"], []).append(
                        (list(steps), list(vals))
                    )
    paths = {"bars_png": bars_png}
    if panels:
        paths["curves_png"] = plot_run_curves(panels, out / "ablation_curves.png",
                                              title=f"Ablation {out.name}: training curves")
        plots["training curves"] = paths["curves_png"].name
    # steps to the threshold, per variant: (step, reached) of each run; censored runs sit at their budget
    steps = {r["label"]: list(seed_values(r["runs"], "steps").values()) for r in rows.values()}
    if report.get("threshold") and any(steps.values()):
        paths["survival_png"] = plot_survival(
            {lab: survival_curve(*zip(*st)) for lab, st in steps.items() if st},
            out / "ablation_survival.png", budget=max(s for st in steps.values() for s, _ in st),
            threshold=report["threshold"], title=f"Ablation {out.name}: steps to the threshold")
        plots["steps to the threshold"] = paths["survival_png"].name
    paths["md"] = out / "ablation.md"
    write_text_atomic(paths["md"], render_markdown(report, plots))
    paths["json"] = out / "ablation.json"
    write_json_atomic(paths["json"], report, indent=2)
    return paths
