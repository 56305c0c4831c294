"""Reading an ablation's finished runs (or an earlier report's records) and comparing them: per variant
mean ± std over seeds, paired tests against its reference and controls, the registered primary."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvdistill.commands.ablate.design import AblationConfig, Variant, preregistration, run_dir
from kvdistill.config import teacher_controls, to_plain
from kvdistill.evaluate.comparisons import (
    compare_steps,
    compare_values,
    median_steps,
    run_test,
    steps_to_threshold,
)
from kvdistill.evaluate.stats import mean_std, paired_bootstrap, paired_permutation_test, paired_ttest
from kvdistill.io import read_json
from kvdistill.lab.prereg import Primary, primary_verdict, primary_verdicts
from kvdistill.runs import EVAL_DIR, EVAL_SUMMARY, TRAIN_SUMMARY, read_run
from kvdistill.train.config import TEACHER_CONTROLS

# what the report records of each run (`variants[v].runs[seed]`), besides its per-item correctness
_RUN_KEYS = ("accuracy", "ci_low", "ci_high", "n", "perplexity", "nll", "ce", "kv_loss", "cos_sim", "relation_kl",
             "global_step", "answer_nll", "steps", "agreement", "train_runtime")


def recorded_run(cfg: AblationConfig, variant: str, seed: int) -> dict[str, Any] | None:
    """Run `seed` of `variant` as `cfg.from_report` recorded it, in `read_run`'s shape plus answer_nll, agreement and
    steps; None when it is not recorded (or there is no earlier report). It has no per-step metrics (the curves)
    and no environment, and per-item correctness only where the report recorded it."""
    row = ((cfg.earlier_report or {}).get("variants") or {}).get(variant) or {}
    rec = row.get("runs", {}).get(str(seed))
    if rec is None:
        return None
    steps = rec.get("steps")
    return {**{k: rec.get(k) for k in _RUN_KEYS}, "agreement": rec.get("agreement") or {},
            "steps": None if steps is None else tuple(steps),  # JSON made the (steps, reached) pair a list
            "teacher_control": row.get("teacher_control"), "environment": None, "metrics": [],
            "items": {i: c == "1" for i, c in enumerate(rec.get("items") or "") if c != "-"}}


def _items_text(items: Mapping[int, bool]) -> str:
    """Per-item correctness by index as the report stores it: character i is "1" (correct), "0" or "-" (no item i)."""
    return "".join("-" if i not in items else "1" if items[i] else "0" for i in range(max(items, default=-1) + 1))


def seed_values(runs: Mapping[int, Mapping[str, Any]], key: str) -> dict[int, Any]:
    """`{seed: run[key]}` of the runs that have it."""
    return {s: r[key] for s, r in runs.items() if r.get(key) is not None}


def compare(
    runs: Mapping[int, Mapping[str, Any]],
    base_runs: Mapping[int, Mapping[str, Any]],
    n_resamples: int = 10_000,
    margin: float | None = None,
) -> dict[str, Any]:
    """Variant vs baseline on the seeds both have: paired t-test over seeds, permutation and
    bootstrap over items pooled across those seeds (paired by (seed, item index)); beside them, over
    every seed of each: Welch and Mann–Whitney on accuracy, TOST within ±`margin`, the answer-NLL and
    held-out LM loss (`nll`) tests and, for steps to the threshold, log-rank and Mann–Whitney. Runs on
    records without final answers (text) have no accuracy: its tests are then None."""
    seeds = sorted(set(runs) & set(base_runs))
    lm_a, lm_b = seed_values(runs, "nll"), seed_values(base_runs, "nll")  # held-out LM loss
    lm = {"nll": compare_values(lm_a, lm_b) if lm_a and lm_b else None}
    if any(r[s].get("accuracy") is None for r in (runs, base_runs) for s in seeds):
        return {"seeds": seeds, "delta_accuracy": None, "ttest": {"p_value": None}, "items": 0, "item_delta": None,
                "permutation_p": None, "bootstrap": {"ci_low": None, "ci_high": None}, "welch": None,
                "mann_whitney": None, "tost": None, "answer_nll": None, "steps": None, **lm}
    acc = [float(runs[s]["accuracy"]) for s in seeds]
    base = [float(base_runs[s]["accuracy"]) for s in seeds]
    ttest = paired_ttest(acc, base)
    a_items: list[float] = []
    b_items: list[float] = []
    for s in seeds:
        common = sorted(set(runs[s]["items"]) & set(base_runs[s]["items"]))
        a_items += [float(runs[s]["items"][i]) for i in common]
        b_items += [float(base_runs[s]["items"][i]) for i in common]
    boot = paired_bootstrap(a_items, b_items, n_resamples=n_resamples, seed=0)
    perm = paired_permutation_test(a_items, b_items, n_resamples=n_resamples, seed=0) if a_items else math.nan
    acc = compare_values(seed_values(runs, "accuracy"), seed_values(base_runs, "accuracy"), margin=margin)
    nll_a, nll_b = seed_values(runs, "answer_nll"), seed_values(base_runs, "answer_nll")
    steps_a, steps_b = seed_values(runs, "steps"), seed_values(base_runs, "steps")
    return {
        "seeds": seeds,
        "delta_accuracy": ttest.mean_diff,
        "ttest": ttest.to_dict(),
        "items": len(a_items),
        "item_delta": boot.mean_diff,
        "permutation_p": perm,
        "bootstrap": boot.to_dict(),
        "welch": acc["welch"],
        "mann_whitney": acc["mann_whitney"],
        "tost": acc.get("tost"),
        "answer_nll": compare_values(nll_a, nll_b) if nll_a and nll_b else None,
        "steps": compare_steps(steps_a, steps_b) if steps_a and steps_b else None,
        **lm,
    }


# controls a report names beside the variant's label (the built-in untrained/shuffled labels say it already)
CONTROL_TAGS = {"oracle": "positive control: oracle target", "permuted": "control: permuted teacher input",
                "other_task": "control: other-task teacher"}


def control_label(label: str, control: str | None) -> str:
    """`label` with its run's control named, e.g. `+Relation [control: other-task teacher]`; a text that is no
    one control (`_control`'s `untrained (a), permuted (b)` of several teachers' controls) as it is."""
    tag = CONTROL_TAGS.get(str(control)) or (None if control in (None, *TEACHER_CONTROLS) else f"controls: {control}")
    return label if tag is None or tag in label else f"{label} [{tag}]"


def _control(cfg: AblationConfig, v: Variant, per_seed: Mapping[int, Mapping[str, Any]]) -> str:
    """A variant's control, as its runs recorded it (train_summary.json: the run's `teacher_control` and each
    teacher's), else as the ablation's overrides set it: the one control its teachers have besides none
    (`permuted` for a run-wide `teacher_control: permuted` and for one permuted teacher beside a real one
    alike), the run's `teacher_control` where no teacher has one, or, where teachers have different ones,
    each with its teacher's name (`untrained (a), permuted (b)`)."""
    for r in per_seed.values():
        if r.get("teacher_control"):  # an earlier report's record holds this text, and no per-teacher controls
            return _controls_text(r.get("teacher_controls") or {}, r["teacher_control"])
    overrides = {**(cfg.overrides or {}), **v.overrides}
    run_control = str(overrides.get("teacher_control", "none"))
    return _controls_text(teacher_controls(to_plain(overrides.get("teachers")), run_control), run_control)


def _controls_text(controls: Mapping[str, str], run_control: str) -> str:
    """`_control`'s text of `{teacher name: its control}` (`teacher_controls`) in a run of `run_control`."""
    if not controls:  # no teachers (or recorded before per-teacher controls)
        return run_control
    own = {name: c for name, c in controls.items() if c != "none"}
    if len(set(own.values())) > 1:
        return ", ".join(f"{c} ({name})" for name, c in own.items())
    return next(iter(own.values()), "none")


def registered_test(p: Primary, a: Mapping[int, Mapping[str, Any]], b: Mapping[int, Mapping[str, Any]]) -> dict:
    """The pre-registered metric and test (`p`, of one test) of runs `a` against runs `b` (`{seed: run}`)."""
    key = "steps" if p.metric == "steps_to_threshold" else p.metric
    return run_test(p.metric, p.test, seed_values(a, key), seed_values(b, key), margin=p.margin, alpha=p.alpha,
                    paired=p.paired)


def primary_result(p: Primary, runs: Mapping[str, Mapping[int, Mapping[str, Any]]],
                   labels: Mapping[str, str]) -> dict[str, Any]:
    """The registered tests of `p` on `runs` (`{variant: {seed: run}}`) and their verdicts. One test: `results`
    (`{reference: result}`) and `verdict`, as before; several: `tests` (`{test: {"results", "verdict"}}`, each
    what that test alone gives, on the same per-seed values) and `verdict`, their lines joined by newlines."""
    if isinstance(p.test, str):
        results = {b: registered_test(p, runs[p.a], runs[b]) for b in p.b}
        return {"results": results, "verdict": primary_verdict(p, results, labels)}
    by_test = {t: {b: registered_test(p.single(t), runs[p.a], runs[b]) for b in p.b} for t in p.tests}
    verdicts = primary_verdicts(p, by_test, labels)
    return {"tests": {t: {"results": by_test[t], "verdict": verdicts[t]} for t in p.tests},
            "verdict": "\n".join(verdicts.values())}


def summarize(cfg: AblationConfig) -> dict[str, Any]:
    """Read every finished run and compute the per-variant numbers and the comparisons."""
    runs: dict[str, dict[int, dict[str, Any]]] = {v.name: {} for v in cfg.variants}
    from_report: dict[str, list[int]] = {}
    for name, per_seed in runs.items():
        for s in cfg.seeds:
            rdir = run_dir(cfg, name, s)
            if (r := read_run(rdir)) is not None:  # a run made here wins over the earlier report's record
                r["answer_nll"] = read_json(rdir / EVAL_DIR / EVAL_SUMMARY, {}).get("answer_nll")
                r["agreement"] = _agreement(read_json(rdir / TRAIN_SUMMARY, {}).get("final") or {})
                r["steps"] = steps_to_threshold(r["metrics"], cfg.threshold, r["global_step"]) if cfg.threshold else None
            elif (r := recorded_run(cfg, name, s)) is not None:
                from_report.setdefault(name, []).append(s)
            else:
                continue
            per_seed[s] = r
    variants: dict[str, Any] = {}
    for v in cfg.variants:
        per_seed = runs[v.name]
        control = _control(cfg, v, per_seed)
        row: dict[str, Any] = {"label": control_label(v.label, control), "teacher_control": control,
                               "overrides": v.overrides, "seeds": sorted(per_seed)}
        for key in ("accuracy", "answer_nll", "nll", "cos_sim", "relation_kl", "perplexity", "ce", "kv_loss"):
            mean, std, n = mean_std([r[key] for r in per_seed.values()])
            row[key] = {"mean": mean, "std": std, "n": n}
        # attention KL and the selected/other-row split, over teachers and per teacher, mean ± std over seeds
        row["agreement"] = {k: dict(zip(("mean", "std", "n"), mean_std([r["agreement"].get(k) for r in
                                                                         per_seed.values()])))
                            for k in sorted({k for r in per_seed.values() for k in r["agreement"]})}
        # the items too, so a later `from_report` gives the item-level tests their pairs
        row["runs"] = {str(s): {**{k: r[k] for k in _RUN_KEYS}, "items": _items_text(r["items"])}
                       for s, r in sorted(per_seed.items())}
        steps = list(seed_values(per_seed, "steps").values())
        row["steps_to_threshold"] = {"n": len(steps), "reached": sum(r for _, r in steps),
                                     "median": median_steps([s for s, _ in steps], [r for _, r in steps])}
        row["reference"] = v.reference or cfg.baseline
        row["controls"] = v.controls
        row["comparisons"] = {
            ref: compare(per_seed, runs[ref], cfg.n_resamples, cfg.margin)
            for ref in cfg.references(v) if per_seed and runs[ref]
        }
        if cfg.primary and cfg.primary.controls_test:  # the reference and controls judged as the primary is
            judge = cfg.primary.single(cfg.primary.controls_test)
            for ref, cmp_ in row["comparisons"].items():
                cmp_["registered"] = registered_test(judge, per_seed, runs[ref])
        if row["reference"] in row["comparisons"]:
            row["vs_baseline"] = row["comparisons"][row["reference"]]
        variants[v.name] = row
    primary, p = None, cfg.primary
    if p and all(runs.get(name) for name in (p.a, *p.b)):  # a --variants subset may leave out a primary arm
        # the accuracy context is that of the first reference; each reference's registered test is in results
        primary = {"variant": p.a, "reference": p.b[0], **compare(runs[p.a], runs[p.b[0]], cfg.n_resamples,
                                                                   cfg.margin),
                   "spec": p.to_dict(), **primary_result(p, runs, {v.name: v.label for v in cfg.variants})}
    record = preregistration(cfg)
    saved = read_json(Path(cfg.output_dir) / "preregistration.json", {})
    # one entry per distinct software/hardware setup (the run dates differ, the setup rarely does)
    environments = {json.dumps({k: v for k, v in r["environment"].items() if k != "date"}, sort_keys=True)
                    for per_seed in runs.values() for r in per_seed.values() if r.get("environment")}
    return {
        "baseline": cfg.baseline,
        "seeds": cfg.seeds,
        "base_config": cfg.base_config,
        "common_overrides": cfg.overrides,
        "eval": cfg.eval,
        "n_resamples": cfg.n_resamples,
        "hypothesis": cfg.hypothesis,
        "threshold": cfg.threshold,
        "margin": cfg.margin,
        # the date it was registered, when the record on disk is this config's
        "preregistration": {"config_hash": record["config_hash"], "registered": saved.get("registered")
                            if saved.get("config_hash") == record["config_hash"] else None},
        "primary": primary,
        "threads": cfg.threads,
        "environments": [json.loads(e) for e in sorted(environments)],
        "variants": variants,
        # the runs not made here but read from the earlier report, and those of them it has no items of
        "from_report": {"path": cfg.from_report, "runs": from_report, "without_items": {
            name: [s for s in seeds if not runs[name][s]["items"]] for name, seeds in from_report.items()
            if any(not runs[name][s]["items"] for s in seeds)}} if from_report else None,
        "_curves": {name: {s: r["metrics"] for s, r in per_seed.items()} for name, per_seed in runs.items()},
    }


def _agreement(final: Mapping[str, Any]) -> dict[str, float]:
    """A run's final attention KL and its selected/other-row KL split (`<loss>_kl_selected` / `_other`),
    over teachers and per teacher (`/<teacher>`), from train_summary's `final` (`train.curves.final_metrics`)."""
    return {k: v for k, v in final.items() if v is not None and k.split("/")[0].startswith(("attention_kl",
                                                                                              "relation_kl_"))}
