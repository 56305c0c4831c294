"""Per-run metrics beyond accuracy, and the tests that compare two variants on them (`kvdistill ablate`).

- steps to a threshold: the first logged step whose dev accuracy (`eval_accuracy` rows of a run's
  `metrics.jsonl`) reaches the threshold; a run that never reaches it is *censored* at its budget
  (the steps it trained), so "did not get there in 3000 steps" is not read as "took 3000 steps".
- `compare_values`: one metric per seed (accuracy, answer NLL) — paired t over the common seeds,
  Welch over all seeds, Mann–Whitney, and TOST when a margin is given.
- `compare_steps`: steps to the threshold — log-rank with censoring and Mann–Whitney.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvdistill.evaluate.stats import logrank, mann_whitney, paired_ttest, tost, welch_ttest
from kvdistill.report import MISSING, fmt_mean_std, fmt_p, fmt_signed


def accuracy_curve(metrics: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """`(step, dev accuracy)` of a run's accuracy curve (the `eval_accuracy` rows of its metrics.jsonl), by step."""
    return sorted((int(r["step"]), float(r["eval_accuracy"])) for r in metrics
                  if r.get("eval_accuracy") is not None and "step" in r)


def steps_to_threshold(metrics: Sequence[Mapping[str, Any]], threshold: float,
                       budget: int | None) -> tuple[int, bool] | None:
    """`(step, True)` at the first `eval_accuracy >= threshold`, else `(budget, False)` (censored).

    Args:
        metrics: the rows of a run's `metrics.jsonl`.
        threshold: the dev accuracy to reach.
        budget: the steps the run trained (None: its last logged step).

    Returns None when the run logged no dev-accuracy curve (`accuracy_eval_steps` was 0).
    """
    curve = accuracy_curve(metrics)
    if not curve:
        return None
    hit = next((step for step, acc in curve if acc >= threshold), None)
    if hit is not None:
        return hit, True
    last = max(int(r["step"]) for r in metrics if "step" in r)
    return (int(budget) if budget is not None else last), False


def median_steps(steps: Sequence[int], reached: Sequence[bool]) -> float:
    """Median steps to the threshold; `inf` when half or more of the runs never reached it.

    Censored runs sit at their budget, after every step a run could reach the threshold at, so they
    count as later than all of them: with one budget this is the Kaplan–Meier median.
    """
    times = sorted(s if r else math.inf for s, r in zip(steps, reached))
    if not times:
        return math.nan
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def compare_values(a: Mapping[int, float], b: Mapping[int, float], *, margin: float | None = None,
                   alpha: float = 0.05) -> dict[str, Any]:
    """Variant `a` vs reference `b`, one value per seed (`{seed: value}`).

    `paired_t` pairs the seeds both have; `welch` and `mann_whitney` use every seed of each; `tost`
    (Welch, when `margin` is given) tests equivalence within ±margin at `alpha`.
    """
    common = sorted(set(a) & set(b))
    xa, xb = [a[s] for s in sorted(a)], [b[s] for s in sorted(b)]
    out: dict[str, Any] = {
        "mean_diff": (sum(xa) / len(xa) - sum(xb) / len(xb)) if xa and xb else math.nan,
        "paired_t": paired_ttest([a[s] for s in common], [b[s] for s in common]).to_dict(),
        "welch": welch_ttest(xa, xb).to_dict(),
        "mann_whitney": mann_whitney(xa, xb).to_dict(),
    }
    if margin is not None:
        out["tost"] = tost(xa, xb, margin, alpha=alpha).to_dict() if xa and xb else None
    return out


def compare_steps(a: Mapping[int, tuple[int, bool]], b: Mapping[int, tuple[int, bool]]) -> dict[str, Any]:
    """Steps to the threshold of `a` vs `b` (`{seed: (steps, reached)}`): log-rank and Mann–Whitney."""
    (sa, ra), (sb, rb) = _split(a), _split(b)
    return {"median_a": median_steps(sa, ra), "median_b": median_steps(sb, rb),
            "logrank": logrank(sa, ra, sb, rb).to_dict(), "mann_whitney": mann_whitney(sa, sb).to_dict()}


def _split(runs: Mapping[int, tuple[int, bool]]) -> tuple[list[int], list[bool]]:
    pairs = [runs[s] for s in sorted(runs)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def run_test(metric: str, test: str, a: Mapping[int, Any], b: Mapping[int, Any], *, margin: float | None = None,
             alpha: float = 0.05, paired: bool = False) -> dict[str, Any]:
    """One named test of `a` vs `b`: `{seed: value}`, or `{seed: (steps, reached)}` for steps_to_threshold.

    The dict of the `stats` result; TOST is Welch's unless `paired` (then over the common seeds).
    """
    if metric == "steps_to_threshold":
        return compare_steps(a, b)[test]
    if test == "tost" and paired:
        common = sorted(set(a) & set(b))
        return tost([a[s] for s in common], [b[s] for s in common], margin, paired=True, alpha=alpha).to_dict()
    return compare_values(a, b, margin=margin, alpha=alpha)[test]


# ----------------------------------------------------------------------------- report


def fmt_steps(steps: Any) -> str:
    """A step count to the threshold; `inf`/None (not reached by half the runs or more) as "never"."""
    if steps is None or (isinstance(steps, float) and math.isnan(steps)):
        return MISSING
    return "never" if math.isinf(steps) else f"{steps:.0f}"


def render_continuous(report: Mapping[str, Any]) -> list[str]:
    """The report section on answer NLL, steps to the threshold and equivalence: each variant against its
    reference (empty when the ablation has none of them)."""
    rows, thr, margin = report["variants"], report.get("threshold"), report.get("margin")
    has_nll = any(r.get("answer_nll", {}).get("n") for r in rows.values())
    if not (has_nll or thr or margin):
        return []
    label = {name: row["label"] for name, row in rows.items()}
    lines = ["", "## Answer NLL, steps to the threshold, equivalence", "",
             "Answer NLL: the gold answer's NLL (nats) after the model's own rationale, mean over items, then "
             "mean ± std over seeds." + (f" Steps to dev accuracy {thr:g}: first logged step at or above it; a "
                                         "run that never got there is censored at its budget." if thr else "")
             + (f" TOST: Welch, equivalence of accuracy within ±{margin:g} at alpha 0.05 (90 % CI)." if margin else ""),
             "",
             "| variant | answer NLL | reached threshold | median steps | reference | Δ answer NLL | NLL paired t p "
             "| NLL Welch p | TOST accuracy | steps log-rank p | steps Mann–Whitney p |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows.values():
        st = row.get("steps_to_threshold") or {}
        nll = row.get("answer_nll") or {}
        cmp_ = row.get("vs_baseline") or {}
        nc, sc, tc = cmp_.get("answer_nll") or {}, cmp_.get("steps") or {}, cmp_.get("tost")
        cells = [
            row["label"],
            fmt_mean_std(nll.get("mean"), nll.get("std")) if nll.get("n") else MISSING,
            f"{st['reached']}/{st['n']}" if st.get("n") else MISSING,
            fmt_steps(st.get("median")) if st.get("n") else MISSING,
            label.get(row.get("reference"), MISSING) if cmp_ else MISSING,
            fmt_signed(nc.get("mean_diff")),
            fmt_p((nc.get("paired_t") or {}).get("p_value")),
            fmt_p((nc.get("welch") or {}).get("p_value")),
            f"{tc['verdict']} (p {fmt_p(tc['p_value'])})" if tc else MISSING,
            fmt_p((sc.get("logrank") or {}).get("p_value")),
            fmt_p((sc.get("mann_whitney") or {}).get("p_value")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def fmt_reached(steps: Sequence[Any] | None) -> str:
    """One run's `(steps, reached)`: `"1500"`, or `"> 3000"` when censored at its budget."""
    if not steps:
        return MISSING
    return f"{steps[0]}" if steps[1] else f"> {steps[0]}"
