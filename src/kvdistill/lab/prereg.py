"""Pre-registration of an ablation: the hypothesis and the primary test, fixed before the first run.

An ablation YAML may name

```yaml
hypothesis: relation KV transfers what the teachers know beyond its shuffled control
threshold: 0.5            # dev accuracy for steps-to-threshold
primary: {comparison: [relation, relation_shuffled], metric: accuracy, test: welch, alpha: 0.05}
```

A claim against several arms names them in a list, `comparison: [kv, [baseline, kv_shuffled, kv_untrained]]`:
"kv beats every one of them". It is met only if each pair's test is significant at `alpha` in kv's favour
(an intersection-union test, which holds its level without a multiplicity correction: the claim needs all
of them). Registering SFT beside the controls keeps a control that *hurts* from meeting the claim alone.

Several tests of one comparison name them in a list, `test: [paired_t, tost]` (with `margin: 0.1`,
`paired: true` for TOST): each runs on the same per-seed values and each gets its verdict, one line each, in the
words its single-test primary would get. The claims are stated side by side, not combined: "A beats B" by
paired t and "A and B are not shown equivalent within ±0.1" by TOST can both hold. A single test is recorded
as before (`test: paired_t`), so earlier sweeps' records keep their hash.

`kvdistill ablate` writes them, with a hash of everything that defines the runs and the analysis,
to `<output_dir>/preregistration.json` before the first run starts, and refuses to go on in an
output dir whose runs were made under another hypothesis, primary test or config. The report leads
with the primary result in words (`primary_verdict`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvdistill.config import ConfigError
from kvdistill.io import read_json, write_json_atomic

METRICS = ("accuracy", "answer_nll", "nll", "steps_to_threshold")  # nll: held-out LM loss per token
TESTS = ("paired_t", "welch", "mann_whitney", "logrank", "tost")
LOWER_IS_BETTER = {"accuracy": False, "answer_nll": True, "nll": True, "steps_to_threshold": True}
# t-tests and TOST need a value per run; a censored step count has none, so its tests are rank/survival ones
TESTS_FOR = {"accuracy": ("paired_t", "welch", "mann_whitney", "tost"),
             "answer_nll": ("paired_t", "welch", "mann_whitney", "tost"),
             "nll": ("paired_t", "welch", "mann_whitney", "tost"),
             "steps_to_threshold": ("logrank", "mann_whitney")}
RECORD = "preregistration.json"
METRIC_NAMES = {"accuracy": "accuracy", "answer_nll": "answer NLL", "nll": "held-out LM loss",
                "steps_to_threshold": "steps to threshold"}


@dataclass
class Primary:
    """The primary comparison: variant `a` against every one of `b` on `metric` by `test` at `alpha`; `margin`
    (TOST) in the metric's units; `paired` picks the paired TOST (default Welch). `test` is one name or
    several (each run on the same values, each with its own verdict)."""

    a: str
    b: tuple[str, ...]  # one reference, or several: a claim against all of them (intersection-union)
    metric: str = "accuracy"
    test: str | tuple[str, ...] = "paired_t"  # one test, or several, in the registered order
    alpha: float = 0.05
    margin: float | None = None
    paired: bool = False

    @property
    def tests(self) -> tuple[str, ...]:
        """The registered tests, in order (one for a single-test primary)."""
        return (self.test,) if isinstance(self.test, str) else self.test

    def single(self, test: str) -> Primary:
        """The single-test primary of one of the listed `test`s: what `test: <test>` alone registers."""
        return replace(self, test=test)

    @property
    def controls_test(self) -> str | None:
        """The test the reference and controls are judged by: the first listed one that is not TOST (a control
        is to be beaten, not equalled); None when TOST is all there is."""
        return next((t for t in self.tests if t != "tost"), None)

    def to_dict(self) -> dict[str, Any]:
        # one reference and one test are written as before, so the records of earlier sweeps keep their hash
        refs = self.b[0] if len(self.b) == 1 else list(self.b)
        test = self.test if isinstance(self.test, str) else list(self.test)
        return {"comparison": [self.a, refs],
                **{k: test if k == "test" else v for k, v in asdict(self).items() if k not in ("a", "b")}}


def parse_primary(spec: Any, names: Sequence[str], threshold: float | None) -> Primary | None:
    """The YAML `primary:`: `[a, b]` (accuracy, paired t) or `{comparison: [a, b], metric, test,
    alpha, margin, paired}`; `b` may be a list of variants (a beats every one), `test` a list of tests (each
    run and stated; a list of one is that test). Raises `ConfigError` naming the fix."""
    if spec is None:
        return None
    if isinstance(spec, list):
        spec = {"comparison": spec}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"primary must be [variant, reference] or a mapping with comparison:, got {spec!r}")
    unknown = set(spec) - {"comparison", "metric", "test", "alpha", "margin", "paired"}
    if unknown:
        raise ConfigError(f"primary: unknown keys {sorted(unknown)} (use comparison, metric, test, alpha, margin, "
                          "paired)")
    pair = spec.get("comparison")
    refs = (pair[1] if isinstance(pair[1], list) else [pair[1]]) if isinstance(pair, list) and len(pair) == 2 else []
    if (not refs or not all(isinstance(x, str) for x in [pair[0], *refs]) or not {pair[0], *refs} <= set(names)
            or pair[0] in refs or len(set(refs)) != len(refs)):
        raise ConfigError(f"primary comparison must name two of the variants {list(names)} as [variant, reference] "
                          "(or [variant, [reference, control, ...]]: beats every one)")
    fields = {k: spec[k] for k in ("metric", "test", "alpha", "margin", "paired") if spec.get(k) is not None}
    if isinstance(fields.get("test"), list):
        tests = fields["test"]
        if not tests or not all(isinstance(t, str) for t in tests) or len(set(tests)) != len(tests):
            raise ConfigError(f"primary test must be one test or a list of different tests, got {tests!r}")
        fields["test"] = tests[0] if len(tests) == 1 else tuple(tests)  # a list of one registers that test
    p = Primary(str(pair[0]), tuple(map(str, refs)), **fields)
    if p.metric not in METRICS:
        raise ConfigError(f"primary metric {p.metric!r} is not one of {list(METRICS)}")
    for test in p.tests:
        if test not in TESTS_FOR[p.metric]:
            raise ConfigError(f"primary test {test!r} does not fit metric {p.metric}; use one of "
                              f"{list(TESTS_FOR[p.metric])}")
    if not (isinstance(p.alpha, (int, float)) and 0 < p.alpha < 0.5):
        raise ConfigError(f"primary alpha must be in (0, 0.5), got {p.alpha!r}")
    has_tost = "tost" in p.tests
    if has_tost and not (isinstance(p.margin, (int, float)) and math.isfinite(p.margin) and p.margin > 0):
        raise ConfigError(f"primary test tost needs margin: > 0 (the equivalence bound, in {p.metric} units), "
                          f"got {p.margin!r}")
    if has_tost and len(p.b) > 1:
        raise ConfigError("primary test tost names one reference; a list of references is a claim to beat each")
    if p.metric == "steps_to_threshold" and threshold is None:
        raise ConfigError("primary metric steps_to_threshold needs `threshold:` (the dev accuracy to reach)")
    return p


# ----------------------------------------------------------------------------- the record


def config_hash(definition: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of `definition` (sorted keys), 16 hex digits."""
    text = json.dumps(definition, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_record(hypothesis: str | None, primary: Primary | None, definition: Mapping[str, Any]) -> dict[str, Any]:
    """What `preregistration.json` holds: hypothesis, primary, config hash and what was hashed."""
    return {"hypothesis": hypothesis, "primary": primary.to_dict() if primary else None,
            "config_hash": config_hash(definition), "config": dict(definition)}


def preregister(out_dir: str | Path, record: Mapping[str, Any], has_runs: bool,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Write `record` to `out_dir/preregistration.json` before any run, or refuse.

    Refused (a `ConfigError`) when the dir already holds runs and a hypothesis is involved: runs
    recorded under another hypothesis, primary or config hash, or runs made before any record (a
    hypothesis named after the runs is not pre-registered). Ablations without a hypothesis are
    recorded (for provenance) but never refused. Returns the record in force (its first date kept).
    """
    path = Path(out_dir) / RECORD
    saved = read_json(path)
    keys = ("hypothesis", "primary", "config_hash")
    if saved is not None and all(saved.get(k) == record[k] for k in keys):
        return saved
    if has_runs and (record["hypothesis"] or (saved or {}).get("hypothesis")):
        if saved is None:
            raise ConfigError(f"{out_dir} holds runs made before any pre-registration; a hypothesis named now is "
                              "not pre-registered: set another output_dir")
        differ = [k.replace("_", " ") for k in keys if saved.get(k) != record[k]]
        raise ConfigError(f"{out_dir} holds runs pre-registered under another {', '.join(differ)} ({path}); "
                          "restore the ablation YAML or set another output_dir")
    now = {**record, "registered": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_json_atomic(path, now, indent=2)
    if record["hypothesis"]:
        log(f"pre-registered in {path}: hypothesis, primary and config hash {record['config_hash']}")
    return now


# ----------------------------------------------------------------------------- the verdict


def primary_verdicts(p: Primary, results: Mapping[str, Mapping[str, Mapping[str, Any]]],
                     labels: Mapping[str, str]) -> dict[str, str]:
    """`{test: verdict}` of every registered test, in order: each `primary_verdict` of `p.single(test)` on
    `results[test]` (each reference's result of that test)."""
    return {t: primary_verdict(p.single(t), results[t], labels) for t in p.tests}


def primary_verdict(p: Primary, results: Mapping[str, Mapping[str, Any]], labels: Mapping[str, str]) -> str:
    """The primary result in words: "A beats B on M at alpha 0.05 (...)", "A and B are equivalent
    within ±m on M ...", or "neither shown ...". `results` holds each reference's test (`stats` results);
    against several, "A beats every one of B; C on M ..." or "not shown: A does not beat C ...". One test:
    a primary of several is stated test by test (`primary_verdicts`)."""
    if not isinstance(p.test, str):
        raise ValueError(f"primary_verdict states one test; {list(p.tests)} are stated by primary_verdicts")
    if len(p.b) > 1:
        return _claim_verdict(p, results, labels)
    result = results[p.b[0]]
    a, b, metric = labels.get(p.a, p.a), labels.get(p.b[0], p.b[0]), METRIC_NAMES[p.metric]
    pv = result.get("p_value", math.nan) if result else math.nan
    if pv is None or math.isnan(pv):
        return f"not testable: {a} vs {b} on {metric} has too few runs for {p.test}"
    if p.test == "tost":
        ci = f"{result['confidence']:.0%} CI of Δ [{result['ci_low']:+.4g}, {result['ci_high']:+.4g}]"
        if result["equivalent"]:
            return f"{a} and {b} are equivalent within ±{p.margin:g} on {metric} at alpha {p.alpha:g} (TOST p {pv:.4g}, {ci})"
        return (f"{a} and {b} are not shown equivalent within ±{p.margin:g} on {metric} at alpha {p.alpha:g} "
                f"(TOST p {pv:.4g}, {ci})")
    detail = f"{p.test.replace('_', ' ')} p {pv:.4g}"
    if pv >= p.alpha:
        return f"neither shown: {a} vs {b} on {metric}, {detail} ≥ alpha {p.alpha:g}"
    win, lose = (a, b) if favours_a(p.metric, p.test, result) else (b, a)
    return f"{win} beats {lose} on {metric} at alpha {p.alpha:g} ({detail})"


def _claim_verdict(p: Primary, results: Mapping[str, Mapping[str, Any]], labels: Mapping[str, str]) -> str:
    """"A beats every one of B; C" (each test at alpha, A's way), or which of them A does not beat. Arms are
    separated by "; " since labels hold commas."""
    spec, a, metric = p.to_dict(), labels.get(p.a, p.a), METRIC_NAMES[p.metric]
    ps = {b: (results.get(b) or {}).get("p_value") for b in p.b}
    detail = "; ".join(f"{labels.get(b, b)} p {ps[b]:.4g}" if ps[b] is not None else f"{labels.get(b, b)} p –"
                       for b in p.b)
    test = p.test.replace("_", " ")
    missed = [labels.get(b, b) for b in p.b if not beats(spec, results.get(b))]
    if not missed:
        return (f"{a} beats every one of {'; '.join(labels.get(b, b) for b in p.b)} on {metric} at alpha "
                f"{p.alpha:g} ({test}: {detail})")
    return f"not shown: {a} does not beat {'; '.join(missed)} on {metric} at alpha {p.alpha:g} ({test}: {detail})"


def favours_a(metric: str, test: str, result: Mapping[str, Any]) -> bool:
    """Whether `result` (`test` of a vs b on `metric`) points a's way: higher accuracy, lower answer NLL,
    fewer steps to the threshold."""
    if test == "logrank":
        a_higher = result["statistic"] < 0  # > 0: a reaches the threshold sooner (fewer steps)
    elif test == "mann_whitney":
        a_higher = result["prob_a_greater"] > 0.5
    else:
        a_higher = result["mean_diff"] > 0
    return a_higher != LOWER_IS_BETTER[metric]


def beats(spec: Mapping[str, Any], result: Mapping[str, Any] | None) -> bool:
    """a beats b by the registered single-test `spec` (`Primary.to_dict()`, or `controls_spec` of several): its
    test significant at its alpha, a's way."""
    pv = (result or {}).get("p_value")
    return pv is not None and not math.isnan(pv) and pv < spec["alpha"] and favours_a(spec["metric"], spec["test"],
                                                                                      result)


def verdict_lines(primary: Mapping[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """`(single-test spec, verdict)` of each registered test of a report's `primary` (`summarize`'s): one for a
    single-test primary, one per listed test (`primary["tests"]`) for several, none in a report older than
    verdicts."""
    spec = dict(primary.get("spec") or {})
    if "tests" not in primary:
        return [(spec, primary["verdict"])] if primary.get("verdict") else []
    return [({**spec, "test": t}, entry["verdict"]) for t, entry in primary["tests"].items()]


def controls_spec(spec: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The single-test spec the reference and controls are judged by (`Primary.controls_test`) of a registered
    `spec` (`Primary.to_dict()`); None without a spec or when TOST is its only test."""
    if not spec:
        return None
    tests = [spec["test"]] if isinstance(spec["test"], str) else spec["test"]
    test = next((t for t in tests if t != "tost"), None)
    return None if test is None else {**spec, "test": test}


def render_lead(report: Mapping[str, Any]) -> list[str]:
    """The lines an ablation report opens with: the hypothesis (with its registration) and the primary
    result in words."""
    lines: list[str] = []
    reg = report.get("preregistration") or {}
    if report.get("hypothesis"):
        when = (f"pre-registered {reg['registered']}" if reg.get("registered")
                else f"no {RECORD} of this config was found")
        lines += [f"**Hypothesis** ({when}; config hash `{reg.get('config_hash')}`): {report['hypothesis']}", ""]
    prim = report.get("primary")
    if prim and prim.get("verdict"):
        for spec, verdict in verdict_lines(prim):  # one line per registered test
            how = f"{METRIC_NAMES[spec['metric']]}, {spec['test'].replace('_', ' ')}, alpha {spec['alpha']:g}"
            lines += [f"**Primary result** ({how}): {verdict}.", ""]
    return lines
