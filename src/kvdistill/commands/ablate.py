"""`kvdistill ablate`: train + evaluate every variant x seed, then compare with paired tests.

One YAML file says what to run:

```yaml
base_config: configs/distill.yaml   # a `kvdistill train` config (looked up next to this file too)
output_dir: runs/ablation
seeds: [0, 1, 2, 3, 4]
variants: [core, {name: kv_w1, base: kv, overrides: {kv_weight: 1.0}}]
overrides: {max_steps: 600}         # applied to every run, before the variant's own
baseline: baseline                  # the reference of every comparison
eval: {split: test, limit: 1000, batch_size: 16, max_new_tokens: 256}
hypothesis: KV matching beats SFT   # pre-registered with `primary` (evaluate/prereg.py)
primary: {comparison: [kv, baseline], metric: accuracy, test: welch, alpha: 0.05}
threshold: 0.5                      # dev accuracy for steps-to-threshold (runs log eval_accuracy)
margin: 0.05                        # TOST equivalence margin (accuracy) of every comparison
```

Runs go to `out_dir/runs/<variant>/seed_<s>/` (the trainer's output_dir; its evaluation in
`eval/`). A run whose `eval/summary.json` exists is skipped, one whose `train_summary.json`
exists is only evaluated, so an interrupted ablation resumes where it stopped.

`capture: true` runs each variant's teachers once (`kvdistill capture` into
`out_dir/captures/<variant>`) and trains every seed from that capture, so seeds do not recompute
the teachers; the untrained control gets one capture per seed (its weights depend on the seed). A
capture equal to an earlier one (same teachers, records and settings, e.g. a signal's shuffled
control) is a link to it. A run starts once its capture is made; runs without teachers do not wait.

The report compares each variant with the baseline twice: across seeds (paired t-test on
the per-seed accuracies, paired by seed) and across items (per-item correctness pooled over
the common seeds, paired by (seed, item): sign-flip permutation p-value and a bootstrap CI of
the accuracy difference). Seeds carry the training variance, items the test-set variance;
with few seeds the item-level test alone overstates certainty, so both are reported. Beside them
(`kvdistill.evaluate.comparisons`): Welch and Mann–Whitney over seeds, TOST within ±`margin`, the
answer NLL's tests, and log-rank / Mann–Whitney for steps to `threshold`. `hypothesis` and
`primary` are written with a config hash to `preregistration.json` before the first run
(`kvdistill.evaluate.prereg`); the report opens with the primary result in words. The hash covers
the YAML's full design, so `--variants a,b` (a YAML variant by its name) and `--seeds` run part of
it first and the rest later under the same record.

`from_report: PATH` (or `--from_report`) continues such a sweep on a machine without the earlier runs: a run
of the plan with no finished run under `output_dir` but recorded in PATH (an ablation.json of the same
config hash) counts as finished with its recorded numbers, per-item correctness included, so the
comparisons equal those from its run dir; a run dir present always wins. Recorded runs have no
per-step metrics: the training curves leave them out.
"""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import re
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml

from kvdistill.commands.eval import EvalConfig
from kvdistill.config import (
    ConfigError,
    check_output_dir,
    option,
    parse_config,
    read_yaml,
    teacher_controls,
    to_plain,
)
from kvdistill.controls import MEANING_KEPT
from kvdistill.evaluate.comparisons import (
    compare_steps,
    compare_values,
    fmt_reached,
    median_steps,
    render_continuous,
    run_test,
    steps_to_threshold,
)
from kvdistill.evaluate.prereg import (
    METRIC_NAMES,
    Primary,
    beats,
    make_record,
    parse_primary,
    preregister,
    primary_verdict,
    render_lead,
)
from kvdistill.evaluate.stats import (
    mean_std,
    paired_bootstrap,
    paired_permutation_test,
    paired_ttest,
    survival_curve,
)
from kvdistill.io import read_json, write_json_atomic, write_text_atomic
from kvdistill.malloc import keep_freed_memory
from kvdistill.report import fmt_mean_std, fmt_num, fmt_p, fmt_signed, format_environment
from kvdistill.runs import (
    ASKED_CONFIG,
    EVAL_DIR,
    EVAL_SUMMARY,
    TRAIN_SUMMARY,
    check_reuse,
    evaluated,
    read_run,
    trained,
)
from kvdistill.train.config import BOOKKEEPING, TEACHER_CONTROLS, TEACHER_SIGNALS, KVDistillConfig
from kvdistill.train.config import parse_config as parse_train_config

# ----------------------------------------------------------------------------- variants

# The KV defaults every built-in KV variant starts from: a small weight and a direction-type
# loss (the pilot in SPEC §7: kv_weight 1.0 and MSE hurt), the plainest alignment otherwise.
_KV = {
    "kv_weight": 0.1,
    "kv_loss": "cosine",
    "time_mode": "global",
    "layer_map": "proportional",
    "head_mode": "flat",
    "projector": "linear",
}
_CKA = {**_KV, "layer_map": "cka"}
_SEGMENT = {**_CKA, "time_mode": "segment"}
_FULL = {**_SEGMENT, "kv_loss": "mercator"}
_RELATION = {**_KV, "kv_loss": "relation", "time_mode": "segment"}
_PRIVILEGED = {**_KV, "time_mode": "segment", "student_input": "no_rationale", "teacher_compression": "rkv"}
_LATENT = {**_PRIVILEGED, "student_input": "latent:6"}

# name -> (label in the report, overrides on the train config). The core rows are cumulative
# (+CKA keeps +KV's settings, +Segment keeps +CKA's); the factor rows change one setting of Full.
BUILTIN_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("Baseline (SFT)", {"kv_weight": 0.0}),
    "kv": ("+KV", dict(_KV)),
    "cka": ("+CKA", dict(_CKA)),
    "segment": ("+Segment", dict(_SEGMENT)),
    "full": ("Full", dict(_FULL)),
    "untrained_teacher": ("Full, untrained teacher", {**_FULL, "teacher_control": "untrained"}),
    # KV signals and their controls: a gain counts only if it beats SFT *and* both controls
    "kv_untrained": ("+KV, untrained teacher", {**_KV, "teacher_control": "untrained"}),
    "kv_shuffled": ("+KV, shuffled teacher", {**_KV, "teacher_control": "shuffled"}),
    "relation": ("+Relation", dict(_RELATION)),
    "relation_untrained": ("+Relation, untrained teacher", {**_RELATION, "teacher_control": "untrained"}),
    "relation_shuffled": ("+Relation, shuffled teacher", {**_RELATION, "teacher_control": "shuffled"}),
    # positive control of the relation channel: the data's `class` field as target (oracle_field to change)
    "relation_oracle": ("+Relation, oracle target", {**_RELATION, "teacher_control": "oracle"}),
    "logit_kd": ("Logit KD (positive control)", {"kv_weight": 0.0, "logit_kd_weight": 1.0}),
    "logit_kd_kv": ("Logit KD + KV", {**_KV, "logit_kd_weight": 1.0}),
    "logit_kd_relation": ("Logit KD + Relation", {**_RELATION, "logit_kd_weight": 1.0}),
    # privileged teacher (KaVa): the student reads no rationale, the teachers the whole one
    "sft_no_rationale": ("SFT, no rationale", {"kv_weight": 0.0, "student_input": "no_rationale"}),
    "privileged_kv": ("Privileged KV, no rationale", dict(_PRIVILEGED)),
    "privileged_kv_untrained": ("Privileged KV, untrained teacher", {**_PRIVILEGED, "teacher_control": "untrained"}),
    "privileged_kv_shuffled": ("Privileged KV, shuffled teacher", {**_PRIVILEGED, "teacher_control": "shuffled"}),
    # KaVa's latent slots: 6 slot tokens where the rationale was, the teachers' rationale compressed onto them
    "sft_latent": ("SFT, 6 latent slots", {"kv_weight": 0.0, "student_input": "latent:6"}),
    "latent_kv": ("Privileged KV, 6 latent slots", dict(_LATENT)),
    "latent_kv_untrained": ("Privileged KV, latent, untrained teacher", {**_LATENT, "teacher_control": "untrained"}),
    "latent_kv_shuffled": ("Privileged KV, latent, shuffled teacher", {**_LATENT, "teacher_control": "shuffled"}),
    # head alignment
    "flat": ("Full, flat heads", {**_FULL, "head_mode": "flat"}),
    "structured": ("Full, structured heads", {**_FULL, "head_mode": "structured"}),
    # dim projector
    "linear": ("Full, linear projector", {**_FULL, "projector": "linear"}),
    "elastic": ("Full, elastic projector", {**_FULL, "projector": "elastic"}),
    # time alignment alone
    "time_index": ("Full, index time", {**_FULL, "time_mode": "index"}),
    "time_global": ("Full, global time", {**_FULL, "time_mode": "global"}),
    # KV loss kinds
    "loss_mse": ("Full, MSE loss", {**_FULL, "kv_loss": "mse"}),
    "loss_smooth_l1": ("Full, smooth-L1 loss", {**_FULL, "kv_loss": "smooth_l1"}),
    "loss_cosine": ("Full, cosine loss", {**_FULL, "kv_loss": "cosine"}),
    "loss_mercator": ("Full, Mercator loss", {**_FULL, "kv_loss": "mercator"}),
    "loss_hybrid": ("Full, hybrid loss", {**_FULL, "kv_loss": "hybrid"}),
    "loss_structural": (
        "Full, structural loss",
        {**_FULL, "kv_loss": "structural", "head_mode": "structured"},
    ),
}
# names that expand to several variants in `variants:`
VARIANT_SETS: dict[str, list[str]] = {
    "core": ["baseline", "kv", "cka", "segment", "full", "untrained_teacher"],
    "signals": ["baseline", "kv", "kv_untrained", "kv_shuffled", "relation", "relation_untrained",
                "relation_shuffled", "logit_kd", "logit_kd_kv", "logit_kd_relation"],
    "privileged": ["sft_no_rationale", "privileged_kv", "privileged_kv_untrained", "privileged_kv_shuffled",
                   "sft_latent", "latent_kv", "latent_kv_untrained", "latent_kv_shuffled"],
    "heads": ["baseline", "flat", "structured"],
    "projectors": ["baseline", "linear", "elastic"],
    "time": ["baseline", "time_index", "time_global", "full"],
    "losses": [
        "baseline",
        "loss_mse",
        "loss_smooth_l1",
        "loss_cosine",
        "loss_mercator",
        "loss_hybrid",
        "loss_structural",
    ],
}
_NAME_OK = re.compile(r"^[A-Za-z0-9_.+-]+$")


class AblationError(ConfigError):
    """A bad ablation config; the message names the fix."""


@dataclass
class Variant:
    """One row of the ablation: a name (its run dir), a report label and train-config overrides.

    `reference`: the variant it is compared with (None: the ablation's baseline); `controls`: the
    control variants it must also beat (compared when they are part of the ablation).
    """

    name: str
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None
    controls: list[str] = field(default_factory=list)


# the controls of each built-in KV signal, and the reference of variants on another task
# (the privileged student reads no rationale: its SFT reference reads none either)
_CONTROLS = {
    "full": ["untrained_teacher"],
    "kv": ["kv_untrained", "kv_shuffled"],
    "relation": ["relation_untrained", "relation_shuffled"],
    "privileged_kv": ["privileged_kv_untrained", "privileged_kv_shuffled"],
    "latent_kv": ["latent_kv_untrained", "latent_kv_shuffled"],
    "logit_kd_kv": ["logit_kd"],
    "logit_kd_relation": ["logit_kd"],
}
_REFERENCES = {
    **{name: "sft_no_rationale" for name in ("privileged_kv", "privileged_kv_untrained", "privileged_kv_shuffled")},
    **{name: "sft_latent" for name in ("latent_kv", "latent_kv_untrained", "latent_kv_shuffled")},
}


def resolve_variants(spec: Any) -> list[Variant]:
    """Turn the YAML `variants:` entry into `Variant`s.

    Accepted entries: a built-in name (`"kv"`), a set name (`"core"`), or a mapping
    `{name, overrides, base?, label?}` where `base` names a built-in to start from. A mapping
    `{name: overrides}` for the whole entry also works. Duplicates keep the first.
    """
    if spec is None:
        spec = ["core"]
    if isinstance(spec, str):
        spec = [spec]
    if isinstance(spec, Mapping):
        spec = [{"name": k, "overrides": v or {}} for k, v in spec.items()]
    out: dict[str, Variant] = {}
    for entry in spec:
        if isinstance(entry, str):
            if entry in VARIANT_SETS:
                for name in VARIANT_SETS[entry]:
                    out.setdefault(name, _builtin(name))
                continue
            out.setdefault(entry, _builtin(entry))
            continue
        if not isinstance(entry, Mapping) or "name" not in entry:
            raise AblationError(f"a variant must be a name or a mapping with `name:`, got {entry!r}")
        unknown = set(entry) - {"name", "overrides", "base", "label", "reference", "controls"}
        if unknown:
            raise AblationError(
                f"variant {entry['name']!r}: unknown keys {sorted(unknown)} "
                "(use name, overrides, base, label, reference, controls)"
            )
        name = str(entry["name"])
        start = Variant(name, name)
        if entry.get("base") is not None:  # same name: the built-in with other settings, controls kept
            base = _builtin(str(entry["base"]))
            same = base.name == name
            start = Variant(name, base.label if same else f"{base.label} + {name}", dict(base.overrides),
                            base.reference, base.controls if same else [])
        elif name in BUILTIN_VARIANTS and not entry.get("overrides"):
            start = _builtin(name)
        start.overrides.update(entry.get("overrides") or {})
        start.label = str(entry.get("label") or start.label)
        start.reference = entry.get("reference", start.reference)
        start.controls = list(entry.get("controls", start.controls))
        out.setdefault(name, start)
    for name in out:
        if not _NAME_OK.match(name):
            raise AblationError(
                f"variant name {name!r} is used as a directory name; use letters, digits, _ . + -"
            )
    if not out:
        raise AblationError("no variants given")
    return list(out.values())


def _builtin(name: str) -> Variant:
    if name not in BUILTIN_VARIANTS:
        known = sorted([*BUILTIN_VARIANTS, *VARIANT_SETS])
        raise AblationError(
            f"unknown variant {name!r}; built-ins and sets: {known}, or give "
            "{name: ..., overrides: {...}}"
        )
    label, overrides = BUILTIN_VARIANTS[name]
    return Variant(name, label, copy.deepcopy(overrides), _REFERENCES.get(name), list(_CONTROLS.get(name, [])))


# ----------------------------------------------------------------------------- config


@dataclass
class AblationConfig:
    """Options of `kvdistill ablate`: one YAML file (`--config`) plus command-line overrides."""

    base_config: str | None = option(None, "A `kvdistill train` YAML every run starts from (looked up next to "
                                     "the ablation YAML too). Required.")
    output_dir: str = option("runs/ablation", "Where runs/<variant>/seed_<s>/ and the report go.")
    seeds: None | str | list = option([0, 1, 2], "Seeds: a list, or comma separated on the command line.")
    variants: None | str | list = option(["core"], "Variants: built-in names, set names or {name, base, overrides, "
                                         "label} mappings; comma separated on the command line. "
                                         "`--list_variants` shows the built-ins.")
    overrides: None | str | dict = option({}, "Train-config overrides applied to every run, before the variant's. "
                                          "`{seed}` in a string value (here or a variant's) reads the run's seed, "
                                          "e.g. `student: runs/baseline/seed_{seed}/checkpoint-1500`.")
    baseline: str | None = option(None, "The variant every other is compared with (default: baseline, or the first).")
    primary: None | str | list | dict = option(None, "The primary comparison, named before the run: [variant, "
                                               "reference], or {comparison: [a, b], metric: accuracy|answer_nll|"
                                               "steps_to_threshold, test: paired_t|welch|mann_whitney|logrank|tost, "
                                               "alpha, margin, paired} (docs/evaluation.md).")
    hypothesis: str | None = option(None, "The hypothesis, in words; written with the primary test and a config hash "
                                    "to preregistration.json before the first run.")
    threshold: float | None = option(None, "Dev accuracy for steps-to-threshold (from each run's eval_accuracy curve; "
                                     "runs need accuracy_eval_steps > 0).")
    margin: float | None = option(None, "Equivalence margin (accuracy) for the TOST of every comparison.")
    eval: None | str | dict = option({}, "`kvdistill eval` settings for every run (keys of EvalConfig: split, limit, "
                                     "batch_size, max_new_tokens, ...).")
    n_resamples: int = option(10_000, "Permutation / bootstrap resamples.")
    workers: int = option(1, "Runs trained at once, each in its own process (CPU: one per core).")
    threads: int = option(1, "torch threads per run (fixed, so the same command and seed give the same numbers; "
                          "recorded with every result).")
    capture: bool = option(False, "Capture each variant's teachers once (`kvdistill capture`, in out_dir/captures) "
                           "and train every seed from it; fp32 captures give the live runs' losses.")
    keep_going: bool = option(False, "Log a failed run and go on with the others.")
    report_only: bool = option(False, "Train nothing; rebuild the report from finished runs.")
    register_only: bool = option(False, "Write the pre-registration record and exit, running nothing: a design "
                                 "registered first can then take runs made elsewhere with the same settings (a "
                                 "copied run dir whose config matches is reused, not rerun).")
    from_report: str | None = option(None, "The ablation.json of an earlier run of this YAML (same config hash): a "
                                     "run of the plan with no finished run in output_dir counts as finished with the "
                                     "numbers recorded there instead of being run (a fresh machine continues a sweep).")
    list_variants: bool = option(False, "Print the built-in variants and sets, and exit.")
    config_file: str | None = option(None, "The ablation YAML (set by --config).")

    def __post_init__(self) -> None:
        if self.list_variants:
            return
        self.seeds = _seeds(self.seeds)
        spec = to_plain(self.variants)
        if isinstance(spec, str):
            spec = [v.strip() for v in spec.split(",") if v.strip()]
        # the YAML's full design, which the pre-registration records: --variants / --seeds on the command line
        # pick runs of it (a name of a YAML variant picks that variant); what they add outside it joins it
        doc = read_yaml(self.config_file, "config") if self.config_file else None
        default = {f.name: f.default_factory() for f in fields(self) if f.name in ("variants", "seeds")}
        design = {v.name: v for v in resolve_variants(to_plain(doc.get("variants", default["variants"])))
                  } if doc is not None else {}
        self.variants = _pick_variants(spec, design)
        self.design_variants = list({**design, **{v.name: v for v in self.variants}}.values())
        design_seeds = _seeds(to_plain(doc.get("seeds", default["seeds"]))) if doc is not None else []
        self.design_seeds = design_seeds + [s for s in self.seeds if s not in design_seeds]
        self.overrides, self.eval = to_plain(self.overrides) or {}, to_plain(self.eval) or {}
        names = [v.name for v in self.variants]
        design_names = [v.name for v in self.design_variants]
        self.design_baseline = self.baseline or ("baseline" if "baseline" in design_names else design_names[0])
        if self.baseline is None:
            self.baseline = "baseline" if "baseline" in names else names[0]
        if self.baseline not in names:
            raise AblationError(f"baseline {self.baseline!r} is not among the variants {names}")
        for v in self.variants:
            if v.reference is not None and v.reference not in names:
                raise AblationError(f"variant {v.name!r} is compared with {v.reference!r}: add it to the variants")
        if self.workers < 1 or self.threads < 1:
            raise AblationError("workers and threads must be >= 1")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise AblationError(f"threshold is a dev accuracy in (0, 1], got {self.threshold}")
        if self.margin is not None and not 0 < self.margin < 1:
            raise AblationError(f"margin is an accuracy difference in (0, 1), got {self.margin}")
        try:
            self.primary = parse_primary(to_plain(self.primary), design_names, self.threshold)
        except ConfigError as err:
            raise AblationError(str(err)) from None
        eval_keys = {f.name for f in fields(EvalConfig)} - {"model", "output_dir", "no_progress", "stop",
                                                            "no_perplexity", "no_answer_nll"} | {
            "stop_strings", "perplexity", "answer_nll"}
        unknown = set(self.eval) - eval_keys
        if unknown:
            raise AblationError(f"eval: unknown keys {sorted(unknown)}; allowed {sorted(eval_keys)}")
        self.base_config = self._find_base_config()
        self.earlier_report = read_earlier_report(self.from_report, preregistration(self)["config_hash"]
                                                  ) if self.from_report else None

    def _find_base_config(self) -> str:
        if not self.base_config:
            raise AblationError("`base_config:` (a kvdistill train YAML) is required")
        base = Path(self.base_config)
        here = Path(self.config_file).parent if self.config_file else Path(".")
        if not base.exists() and (here / base).exists():
            base = here / base
        if not base.exists():
            raise AblationError(f"base_config {self.base_config} not found (tried the CWD and {here})")
        read_yaml(base, "base_config")  # a broken base config fails now, not at the first run
        return str(base)

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def references(self, v: Variant) -> list[str]:
        """What `v` is compared with: its reference (or the baseline), then its controls that are run."""
        names = {x.name for x in self.variants}
        ref = v.reference or self.baseline
        return [r for r in [ref, *v.controls] if r in names and r != v.name]


def _seeds(value: str | list) -> list[int]:
    seeds = [int(s) for s in (value.split(",") if isinstance(value, str) else value)]
    if not seeds or len(set(seeds)) != len(seeds):
        raise AblationError(f"seeds must be a non-empty list of distinct ints, got {seeds}")
    return seeds


def _pick_variants(spec: Any, design: Mapping[str, Variant]) -> list[Variant]:
    """`resolve_variants(spec)`, where a name of a variant of the YAML's design (`{name: Variant}`) picks it."""
    if not isinstance(spec, list):
        return resolve_variants(spec)
    out: dict[str, Variant] = {}
    for entry in spec:
        for v in [design[entry]] if isinstance(entry, str) and entry in design else resolve_variants([entry]):
            out.setdefault(v.name, v)
    return list(out.values())


def load_ablation_config(path: str | Path, **overrides: Any) -> AblationConfig:
    """Read an ablation YAML (+ overrides, as the command line would give them)."""
    argv = ["--config", str(path)]
    for key, value in overrides.items():
        if value is not None:
            argv += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return parse_config(AblationConfig, argv, "kvdistill ablate", __doc__)


# ----------------------------------------------------------------------------- running


def run_dir(cfg: AblationConfig, variant: str, seed: int) -> Path:
    return Path(cfg.output_dir) / "runs" / variant / f"seed_{seed}"


def train_config_for(cfg: AblationConfig, variant: Variant, seed: int) -> dict[str, Any]:
    """The full train YAML of one run: base config < common overrides < variant < (output_dir, seed)."""
    merged = read_yaml(cfg.base_config, "base_config")
    merged.update(copy.deepcopy(cfg.overrides))
    merged.update(copy.deepcopy(variant.overrides))
    merged["output_dir"] = str(run_dir(cfg, variant.name, seed))
    merged["seed"] = int(seed)
    return _with_seed(merged, int(seed))


def _with_seed(value: Any, seed: int) -> Any:
    """`value` with `{seed}` in every string replaced by `seed`: a run can start from its seed's own
    checkpoint of an earlier sweep (on-policy from each seed's SFT model)."""
    if isinstance(value, str):
        return value.replace("{seed}", str(seed))
    if isinstance(value, dict):
        return {k: _with_seed(v, seed) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_seed(v, seed) for v in value]
    return value


def eval_settings_for(cfg: AblationConfig, train_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Eval settings of one run; data, template and chat mode default to what the run trained with."""
    settings: dict[str, Any] = {
        "data": train_cfg.get("data", "synthetic"),
        "split": "test",
        "field_map": train_cfg.get("field_map"),
        "template": train_cfg.get("prompt_template") or None,
        # training falls back to the plain template when the tokenizer has none: so does "auto"
        "chat_template": "auto" if train_cfg.get("use_chat_template") else "off",
        "batch_size": 8,
        "max_new_tokens": 256,
    }
    settings.update(cfg.eval)
    return {k: v for k, v in settings.items() if v is not None}


def capture_dir_for(cfg: AblationConfig, variant: Variant, train_cfg: Mapping[str, Any]) -> Path | None:
    """Where `capture: true` stores a run's teachers: one capture per variant, shared by its seeds,
    and per seed for the untrained and permuted controls (run-wide or of one teacher); None for a run
    without teachers, without a teacher signal or on-policy (`lmbda > 0` or `seq_kd`)."""
    if not cfg.capture or not train_cfg.get("teachers"):
        return None
    # `KVDistillConfig.teacher_signal` on the unparsed YAML (class attributes hold the defaults)
    if not any(float(train_cfg.get(k, getattr(KVDistillConfig, k))) > 0 for k in TEACHER_SIGNALS):
        return None
    if train_cfg.get("teacher_control") == "oracle":  # no teacher runs: nothing to capture
        return None
    # on-policy / seq_kd runs teach on text generated during training: they read live teachers (and refuse a capture)
    if float(train_cfg.get("lmbda", KVDistillConfig.lmbda)) > 0 or train_cfg.get("seq_kd", KVDistillConfig.seq_kd):
        return None
    controls = teacher_controls(to_plain(train_cfg["teachers"]), train_cfg.get("teacher_control", "none"))
    # weights / map drawn from the seed, for every teacher or one (its own `control`)
    per_seed = bool(set(controls.values()) & {"untrained", "permuted"})
    return Path(cfg.output_dir) / "captures" / (f"{variant.name}_seed{train_cfg['seed']}" if per_seed else variant.name)


def make_capture(rdir: str, made: dict[str, dict]) -> tuple[dict[str, dict], list[str]]:
    """Make (or finish) the capture the run in `rdir` reads; one equal to a capture in `made` (same
    teachers, records and settings: a signal and its shuffled control, say) is linked to it, not
    computed and stored again. Returns `made` with this capture added, and the lines it logged
    (a worker process hands them back to the parent's log)."""
    from kvdistill.commands.capture import run_capture

    train_cfg = parse_train_config(["--config", str(Path(rdir) / ASKED_CONFIG)])
    lines = [f"capture: {train_cfg.teacher_capture}"]
    run_capture(train_cfg, log=lambda msg: lines.append(f"    {msg}"), made=made)
    return made, lines


def check_variants(cfg: AblationConfig) -> None:
    """Parse every variant's full train config (at its first seed) as `kvdistill train` will: a typo or a
    bad value in one variant's overrides fails before the first run, not after the variants before it
    trained."""
    with tempfile.TemporaryDirectory() as tmp:
        for v in cfg.variants:
            path = Path(tmp) / f"{v.name}.yaml"
            write_text_atomic(path, yaml.safe_dump(train_config_for(cfg, v, cfg.seeds[0]), sort_keys=False,
                                                   allow_unicode=True))
            try:
                parse_train_config(["--config", str(path)])
            except ConfigError as err:
                raise AblationError(f"variant {v.name}: {str(err).replace(f'{path}: ', '')}") from None


def _default_train(argv: list[str]) -> int:
    from kvdistill.commands.train import main as train_main

    return int(train_main(argv) or 0)


def _default_eval(model_dir: str, out_dir: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    from kvdistill.commands.eval import run_eval

    s = dict(settings)
    data = s.pop("data")
    return run_eval(model_dir, data=data, out=out_dir, progress=False, **s)


TrainFn = Callable[[list[str]], int]
EvalFn = Callable[[str, str, Mapping[str, Any]], Any]


def _init_worker(threads: int, parent: int) -> None:
    """A spawned worker is a fresh interpreter: give it what `kvdistill` gives every process, and make it
    exit with `parent` (the ablation's pid)."""
    keep_freed_memory()
    torch.set_num_threads(threads)
    threading.Thread(target=_exit_with, args=(parent,), name="exit-with-parent", daemon=True).start()


def _exit_with(parent: int, every_s: float = 0.5) -> None:
    """Exit when `parent` dies: a killed ablation (SIGKILL, pkill) would otherwise leave its workers training for
    half an hour as orphans, writing into the run dirs its restart reuses. An orphan is re-parented, so its
    parent pid changes. (Not prctl PR_SET_PDEATHSIG: it fires when the *thread* that spawned the worker exits,
    and it is Linux only.)"""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


def _pool(workers: int, threads: int) -> ProcessPoolExecutor:
    """The worker processes: spawned (no state forked from the parent), each with `threads` threads, each
    exiting with this process."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                               initargs=(threads, os.getpid()))


def train_and_evaluate(rdir: str, settings: Mapping[str, Any], train_fn: TrainFn | None = None,
                       eval_fn: EvalFn | None = None) -> None:
    """Train one run from its `train_config.yaml` (unless finished) and evaluate it into `eval/`."""
    train_fn, eval_fn, path = train_fn or _default_train, eval_fn or _default_eval, Path(rdir)
    if not trained(path):
        # a run killed mid-training goes on from its newest complete checkpoint (none: from the start)
        rc = train_fn(["--config", str(path / ASKED_CONFIG), "--resume_from_checkpoint", "last"])
        if rc:
            raise RuntimeError(f"training exited with code {rc}")
        if not trained(path):
            raise RuntimeError(f"training finished but wrote no {path / TRAIN_SUMMARY}")
    eval_fn(str(path), str(path / EVAL_DIR), settings)
    if not evaluated(path / EVAL_DIR):
        raise RuntimeError(f"evaluation wrote no {path / EVAL_DIR / EVAL_SUMMARY}")


@dataclass
class _Job:
    """One pending run: its log tag, run dir, eval settings and the capture it trains from (None: no
    capture, or it is trained already)."""

    tag: str
    rdir: str
    settings: dict[str, Any]
    capture: str | None


class _Plan:
    """An ablation's pending work: its captures, made one after another (a capture may link to an
    earlier one), each by the first run that reads it; and its runs, each free to start once its
    capture is made."""

    def __init__(self, runs: list[_Job], keep_going: bool, log: Callable[[str], None]):
        self.runs, self.keep_going, self.log = runs, keep_going, log
        self.captures = list(dict.fromkeys(j.capture for j in runs if j.capture is not None))
        self.reader = {c: next(j.rdir for j in runs if j.capture == c) for c in self.captures}
        self.made: dict[str, dict] = {}  # capture dir -> its settings (what a later capture links by)
        self.ready: set[str] = set()
        self.failures: list[str] = []

    def next_run(self) -> _Job | None:
        """The first run whose capture is made (taken off the plan), or None."""
        job = next((j for j in self.runs if j.capture is None or j.capture in self.ready), None)
        if job is not None:
            self.runs.remove(job)
        return job

    def done(self, tag: str, err: BaseException | None, tb: str = "") -> None:
        if err is None:
            self.log(f"{tag}: done")
            return
        if not self.keep_going:
            raise err
        self.failures.append(f"{tag.split('] ', 1)[1]}: {type(err).__name__}: {err}")
        self.log(f"{tag}: FAILED\n{tb}")

    def captured(self, capture: str, result: tuple[dict, list[str]] | None, err: BaseException | None = None,
                 tb: str = "") -> None:
        """A capture is made (its runs may start) or failed (its runs cannot)."""
        if err is None:
            self.made.update(result[0])
            for line in result[1]:
                self.log(line)
            self.ready.add(capture)
            return
        self.done(f"[capture] {capture}", err, tb)
        for job in [j for j in self.runs if j.capture == capture]:
            self.runs.remove(job)
            self.failures.append(f"{job.tag.split('] ', 1)[1]}: its capture failed")


def _run_here(plan: _Plan, threads: int, train_fn: TrainFn, eval_fn: EvalFn) -> None:
    """Every capture, then every run, one after another in this process."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for capture in plan.captures:
            try:
                plan.captured(capture, make_capture(plan.reader[capture], plan.made))
            except Exception as err:
                plan.captured(capture, None, err, traceback.format_exc())
        while (job := plan.next_run()) is not None:
            plan.log(f"{job.tag}: training + evaluating -> {job.rdir}")
            try:
                train_and_evaluate(job.rdir, job.settings, train_fn, eval_fn)
                plan.done(job.tag, None)
            except Exception as err:
                plan.done(job.tag, err, traceback.format_exc())
    finally:
        torch.set_num_threads(before)


def _run_pool(plan: _Plan, workers: int, threads: int) -> None:
    """One process per job: jobs share no state, each keeps its fixed thread count. A free worker
    takes the next capture (one at a time), else the first run whose capture is made, so runs
    without teachers train while the captures are made."""
    plan.log(f"{len(plan.runs)} runs and {len(plan.captures)} captures on {workers} workers x {threads} thread(s)")
    captures = list(plan.captures)
    running: dict[Future, tuple[str, Any]] = {}
    with _pool(workers, threads) as pool:
        while True:
            while len(running) < workers:
                if captures and all(kind != "capture" for kind, _ in running.values()):
                    capture = captures.pop(0)  # `made` copied now: the pool pickles it later
                    running[pool.submit(make_capture, plan.reader[capture], dict(plan.made))] = ("capture", capture)
                elif (job := plan.next_run()) is not None:
                    running[pool.submit(train_and_evaluate, job.rdir, job.settings)] = ("run", job)
                else:
                    break
            if not running:
                return
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                kind, item = running.pop(fut)
                err = fut.exception()
                tb = "".join(traceback.format_exception(err)) if err else ""
                if kind == "capture":
                    plan.captured(item, None if err else fut.result(), err, tb)
                else:
                    plan.done(item.tag, err, tb)


def register(cfg: AblationConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Before any run: fix the hypothesis and primary test in `output_dir/preregistration.json`, or refuse
    an output dir whose runs were made under another (`prereg.preregister`)."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return preregister(out, preregistration(cfg), any((out / "runs").glob(f"*/seed_*/{ASKED_CONFIG}")), log)


def run_ablation(
    cfg: AblationConfig,
    *,
    train_fn: TrainFn | None = None,
    eval_fn: EvalFn | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every variant x seed that is not finished yet, then write the report.

    Args:
        cfg: the ablation.
        train_fn: `argv -> exit code`; default `kvdistill.commands.train.main` (in-process).
        eval_fn: `(model_dir, out_dir, settings) -> Any`, must write `out_dir/summary.json` and
            `items.jsonl`; default `kvdistill.commands.eval.run_eval`.

    Returns:
        the report dict (also written to `out_dir/ablation.json`).
    """
    train_fn = train_fn or _default_train
    eval_fn = eval_fn or _default_eval
    register(cfg, log)
    check_variants(cfg)
    # seed-major order: a partial ablation already holds complete seeds for every variant
    jobs = [(v, s) for s in cfg.seeds for v in cfg.variants]
    todo: list[_Job] = []
    for k, (variant, seed) in enumerate(jobs, 1):
        rdir = run_dir(cfg, variant.name, seed)
        tag = f"[{k}/{len(jobs)}] {variant.name} seed {seed}"
        train_cfg = train_config_for(cfg, variant, seed)
        capture = capture_dir_for(cfg, variant, train_cfg)
        if capture is not None:
            train_cfg["teacher_capture"] = str(capture)
        # a run dir left by an earlier ablation is reused only if it was made with these settings
        check_reuse(rdir, ASKED_CONFIG, train_cfg, BOOKKEEPING, asker="this ablation", error=AblationError,
                    fix="delete it or set another output_dir, so old and new runs are never mixed")
        if evaluated(rdir / EVAL_DIR):
            log(f"{tag}: finished, skipped")
            continue
        if recorded_run(cfg, variant.name, seed) is not None:
            log(f"{tag}: from report {cfg.from_report}")
            continue
        rdir.mkdir(parents=True, exist_ok=True)
        done = trained(rdir)  # only its evaluation is left: no capture needed
        if not done:
            write_text_atomic(rdir / ASKED_CONFIG, yaml.safe_dump(train_cfg, sort_keys=False, allow_unicode=True))
        todo.append(_Job(tag, str(rdir), eval_settings_for(cfg, train_cfg),
                         None if done or capture is None else str(capture)))

    plan = _Plan(todo, cfg.keep_going, log)
    if cfg.workers == 1 or len(todo) <= 1:
        _run_here(plan, cfg.threads, train_fn, eval_fn)
    else:
        _run_pool(plan, cfg.workers, cfg.threads)
    report = summarize(cfg)
    report["failures"] = plan.failures
    write_report(report, cfg)
    return report


# ----------------------------------------------------------------------------- reading runs

# what the report records of each run (`variants[v].runs[seed]`), besides its per-item correctness
_RUN_KEYS = ("accuracy", "ci_low", "ci_high", "n", "perplexity", "ce", "kv_loss", "cos_sim", "relation_kl",
             "global_step", "answer_nll", "steps", "agreement", "train_runtime")


def read_earlier_report(path: str, config_hash: str) -> dict[str, Any]:
    """The ablation report at `path` (`from_report`), refused unless its runs are of the design that hashes
    to `config_hash` (`preregistration`)."""
    fix = "pass the ablation.json that `kvdistill ablate` wrote for this YAML"
    if not Path(path).is_file():
        raise AblationError(f"from_report {path}: no such file; {fix}")
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        report = None
    rows = report.get("variants") if isinstance(report, dict) else None
    saved = (report.get("preregistration") or {}).get("config_hash") if isinstance(report, dict) else None
    if not (isinstance(rows, dict) and saved and all(
            isinstance(row, dict) and isinstance(row.get("runs"), dict) and all(
                isinstance(r, dict) and isinstance(r.get("accuracy"), (int, float)) for r in row["runs"].values())
            for row in rows.values())):
        raise AblationError(f"from_report {path} is not an ablation report (no per-variant runs with an accuracy and "
                            f"a preregistration config_hash); {fix}")
    if saved != config_hash:
        raise AblationError(f"from_report {path}: its runs were made under config hash {saved}, this YAML's is "
                            f"{config_hash} (another design); restore the YAML that report was made with, or run "
                            "those seeds here")
    return report


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


# ----------------------------------------------------------------------------- statistics


def preregistration(cfg: AblationConfig) -> dict[str, Any]:
    """The pre-registration record of `cfg`: hypothesis, primary and the hash of what defines the runs and
    the analysis (the base config's content, every variant's settings, seeds, eval, threshold, margin).
    Variants, seeds and baseline are the YAML's full design, so runs of a `--variants` / `--seeds` subset
    of it, then of the rest, are one pre-registered ablation."""
    definition = {
        "base_config": read_yaml(cfg.base_config, "base_config"),
        "overrides": cfg.overrides,
        "variants": [{"name": v.name, "overrides": v.overrides, "reference": v.reference, "controls": v.controls}
                     for v in cfg.design_variants],
        "seeds": cfg.design_seeds, "baseline": cfg.design_baseline, "eval": cfg.eval,
        "threshold": cfg.threshold, "margin": cfg.margin,
    }
    return make_record(cfg.hypothesis, cfg.primary, definition)


def _values(runs: Mapping[int, Mapping[str, Any]], key: str) -> dict[int, Any]:
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
    every seed of each: Welch and Mann–Whitney on accuracy, TOST within ±`margin`, the answer-NLL
    tests and, for steps to the threshold, log-rank and Mann–Whitney."""
    seeds = sorted(set(runs) & set(base_runs))
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
    acc = compare_values(_values(runs, "accuracy"), _values(base_runs, "accuracy"), margin=margin)
    nll_a, nll_b = _values(runs, "answer_nll"), _values(base_runs, "answer_nll")
    steps_a, steps_b = _values(runs, "steps"), _values(base_runs, "steps")
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
    """The pre-registered metric and test (`p`) of runs `a` against runs `b` (`{seed: run}`)."""
    key = "steps" if p.metric == "steps_to_threshold" else p.metric
    return run_test(p.metric, p.test, _values(a, key), _values(b, key), margin=p.margin, alpha=p.alpha,
                    paired=p.paired)


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
        for key in ("accuracy", "answer_nll", "cos_sim", "relation_kl", "perplexity", "ce", "kv_loss"):
            mean, std, n = mean_std([r[key] for r in per_seed.values()])
            row[key] = {"mean": mean, "std": std, "n": n}
        # attention KL and the selected/other-row split, over teachers and per teacher, mean ± std over seeds
        row["agreement"] = {k: dict(zip(("mean", "std", "n"), mean_std([r["agreement"].get(k) for r in
                                                                         per_seed.values()])))
                            for k in sorted({k for r in per_seed.values() for k in r["agreement"]})}
        # the items too, so a later `from_report` gives the item-level tests their pairs
        row["runs"] = {str(s): {**{k: r[k] for k in _RUN_KEYS}, "items": _items_text(r["items"])}
                       for s, r in sorted(per_seed.items())}
        steps = list(_values(per_seed, "steps").values())
        row["steps_to_threshold"] = {"n": len(steps), "reached": sum(r for _, r in steps),
                                     "median": median_steps([s for s, _ in steps], [r for _, r in steps])}
        row["reference"] = v.reference or cfg.baseline
        row["controls"] = v.controls
        row["comparisons"] = {
            ref: compare(per_seed, runs[ref], cfg.n_resamples, cfg.margin)
            for ref in cfg.references(v) if per_seed and runs[ref]
        }
        if cfg.primary and cfg.primary.test != "tost":  # the reference and controls judged as the primary is
            for ref, cmp_ in row["comparisons"].items():
                cmp_["registered"] = registered_test(cfg.primary, per_seed, runs[ref])
        if row["reference"] in row["comparisons"]:
            row["vs_baseline"] = row["comparisons"][row["reference"]]
        variants[v.name] = row
    primary, p = None, cfg.primary
    if p and all(runs.get(name) for name in (p.a, *p.b)):  # a --variants subset may leave out a primary arm
        results = {b: registered_test(p, runs[p.a], runs[b]) for b in p.b}
        # the accuracy context is that of the first reference; each reference's registered test is in results
        primary = {"variant": p.a, "reference": p.b[0], **compare(runs[p.a], runs[p.b[0]], cfg.n_resamples,
                                                                   cfg.margin),
                   "spec": p.to_dict(), "results": results,
                   "verdict": primary_verdict(p, results, {v.name: v.label for v in cfg.variants})}
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


# ----------------------------------------------------------------------------- report


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
    if prim:
        delta, tp, wp, pp, ci = _cmp_cells(prim)
        verdict = ("**not significant**" if not _significant(prim) else "**significant**" if _beats(prim)
                   else "**significant, in the reference's favour**")
        metric = (prim.get("spec") or {}).get("metric", "accuracy")
        refs = list(prim.get("results") or [prim["reference"]])  # older reports: one reference
        pair = f"{label[prim['variant']]} vs {label[prim['reference']]} over seeds {prim['seeds']}"
        claim = f"{label[prim['variant']]} vs {'; '.join(label[r] for r in refs)} over seeds {prim['seeds']}"
        # a registered metric other than accuracy, or a claim against several arms, leads (its test is the
        # record); accuracy of the (first) pair follows as context
        registered = [] if metric == "accuracy" and len(refs) == 1 else [
            f"{claim}, the registered metric ({METRIC_NAMES[metric]}): {prim['verdict']}.", "",
            f"The {'first' if len(refs) > 1 else 'same'} pair on accuracy (not the registered test):"]
        lines += ["## Primary comparison (named in the config before the run)", "", *registered,
                  f"{pair}: Δ accuracy {delta}, paired t-test p {tp} (Welch p {wp}), permutation p {pp}, bootstrap "
                  f"95 % CI {ci} — {verdict} at p < 0.05 on both paired tests.", ""]
    lines += [
        "| variant | seeds | accuracy | cos-sim | relation / attention KL | perplexity | reference | Δ acc "
        "| t-test p (seeds) "
        "| Welch p (seeds) | permutation p (items) | bootstrap 95 % CI of Δ (items) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        cmp_ = row.get("vs_baseline")
        cells = _cmp_cells(cmp_) if cmp_ else ["–"] * 5
        ref = label.get(row.get("reference"), "–") if cmp_ else "–"
        lines.append(
            f"| {row['label']} | {len(row['seeds'])} | {_pm(row['accuracy'])} | {_pm(row['cos_sim'])} "
            f"| {_pm(_kl(row), 4)} | {_pm(row['perplexity'], 2)} | {ref} | " + " | ".join(cells) + " |"
        )
    lines += render_row_split(rows)
    controlled = {n: r for n, r in rows.items() if r.get("controls")}
    if controlled:
        # judged as the primary is, on its registered metric and test (older reports: on accuracy's paired tests)
        spec = (prim or {}).get("spec") if any("registered" in c for r in controlled.values()
                                               for c in r["comparisons"].values()) else None
        how = (f"on the registered {METRIC_NAMES[spec['metric']]} by its {spec['test'].replace('_', ' ')} test "
               f"at alpha {spec['alpha']:g}" if spec else "at p < 0.05 on both paired tests of accuracy")
        lines += ["", "## Against the controls", "",
                  "A KV signal counts as knowledge transfer only if it beats its reference **and** every "
                  f"control (untrained teacher, shuffled teacher) {how}; a control that keeps the meaning "
                  f"(permuted names) should instead equal it (TOST on accuracy within ±{report.get('margin')}).", "",
                  "| variant | compared with | Δ acc | t-test p | Welch p | permutation p | bootstrap 95 % CI "
                  "| registered test | as it should |",
                  "|---|---|---|---|---|---|---|---|---|"]

        def meets(ref: str, cmp_: Mapping[str, Any] | None) -> bool:
            if _invariance(report, ref):
                return _equals(cmp_)
            return beats(spec, cmp_.get("registered")) if spec and cmp_ else _beats(cmp_)

        for row in controlled.values():
            for ref in [row["reference"], *row["controls"]]:
                cmp_ = row["comparisons"].get(ref)
                if cmp_ is None:
                    lines.append(f"| {row['label']} | {label.get(ref, ref)} | not run | | | | | | |")
                    continue
                what = "equal" if _invariance(report, ref) else "beats it"
                lines.append(f"| {row['label']} | {label[ref]} | " + " | ".join(_cmp_cells(cmp_))
                             + f" | {_registered_cell(spec, cmp_.get('registered'))}"
                             + f" | {what}: {'yes' if meets(ref, cmp_) else 'no'} |")
        lines.append("")
        for row in controlled.values():
            refs = [row["reference"], *row["controls"]]
            ok = all(meets(r, row["comparisons"].get(r)) for r in refs)
            lines.append(f"- {row['label']}: {'**beats its reference and all controls**' if ok else 'does not beat its reference and all controls'}.")
    lines += render_continuous(report)
    n_seeds = min((len(r["seeds"]) for r in report["variants"].values()), default=0)
    lines += [
        "",
        "Accuracy and cos-sim are mean ± sample std over seeds (cos-sim: final value of the training "
        "log; – for runs without a KV loss). The t-test pairs the per-seed accuracies by seed; Welch's "
        "does not pair them (the better test when paired seeds are not correlated); the "
        "permutation (sign-flip) test and the bootstrap pool per-item correctness over the common "
        f"seeds, paired by (seed, item), with {report['n_resamples']} resamples. The seed-level test "
        "carries the training variance; the item-level tests only the test-set variance, so with few "
        "seeds they overstate certainty.",
    ]
    if n_seeds < 5:
        lines += [
            "",
            f"**Note:** only {n_seeds} seed(s) per variant; student accuracy swings widely "
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
    lines += [
        "",
        "## Runs",
        "",
        "| variant | seed | accuracy | 95 % CI | n | answer NLL | cos-sim | relation / attention KL | CE "
        "| perplexity | steps "
        "| threshold at | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["variants"].values():
        for seed, r in row["runs"].items():
            lines.append(
                f"| {row['label']} | {seed} | {fmt_num(r['accuracy'])} | [{fmt_num(r['ci_low'])}, {fmt_num(r['ci_high'])}] "
                f"| {r['n']} | {fmt_num(r.get('answer_nll'))} | {fmt_num(r['cos_sim'])} "
                f"| {fmt_num(_kl(r), 4)} | {fmt_num(r['ce'])} | {fmt_num(r['perplexity'], 2)} "
                f"| {r['global_step'] if r['global_step'] is not None else '–'} | {fmt_reached(r.get('steps'))} "
                f"| {fmt_num(r.get('train_runtime'), 0)} |"
            )
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


def _agreement(final: Mapping[str, Any]) -> dict[str, float]:
    """A run's final attention KL and its selected/other-row KL split (`<loss>_kl_selected` / `_other`),
    over teachers and per teacher (`/<teacher>`), from train_summary's `final` (`train.curves.final_metrics`)."""
    return {k: v for k, v in final.items() if v is not None and k.split("/")[0].startswith(("attention_kl",
                                                                                              "relation_kl_"))}


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
    """Write `ablation.md`, `ablation.json`, `ablation_accuracy.png`, `ablation_curves.png` and, with a
    `threshold`, `ablation_survival.png`."""
    from kvdistill.plots import plot_bars_with_errors, plot_run_curves, plot_survival

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves_raw = report.pop("_curves", {})
    rows = report["variants"]
    labels = [r["label"] for r in rows.values()]
    plots: dict[str, str] = {}
    acc_png = plot_bars_with_errors(
        labels,
        [r["accuracy"]["mean"] for r in rows.values()],
        [r["accuracy"]["std"] for r in rows.values()],
        out / "ablation_accuracy.png",
        points=[[r["runs"][s]["accuracy"] for s in r["runs"]] for r in rows.values()],
        error_label="± 1 sd over seeds",
        ylabel="accuracy (mean ± std over seeds)",
        title=f"Ablation {out.name}: accuracy",
    )
    plots["accuracy"] = acc_png.name
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
    paths = {"accuracy_png": acc_png}
    if panels:
        paths["curves_png"] = plot_run_curves(panels, out / "ablation_curves.png",
                                              title=f"Ablation {out.name}: training curves")
        plots["training curves"] = paths["curves_png"].name
    # steps to the threshold, per variant: (step, reached) of each run; censored runs sit at their budget
    steps = {r["label"]: list(_values(r["runs"], "steps").values()) for r in rows.values()}
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


# ----------------------------------------------------------------------------- command


def main(argv: list[str]) -> int:
    cfg = parse_config(AblationConfig, argv, "kvdistill ablate", __doc__)
    if cfg.list_variants:
        for name, (label, overrides) in BUILTIN_VARIANTS.items():
            print(f"{name:<18} {label:<28} {json.dumps(overrides, sort_keys=True)}")
        for name, members in VARIANT_SETS.items():
            print(f"set {name:<14} {', '.join(members)}")
        return 0
    if cfg.report_only and not any(evaluated(run_dir(cfg, v.name, s) / EVAL_DIR) or recorded_run(cfg, v.name, s)
                                   for v in cfg.variants for s in cfg.seeds):
        raise AblationError(f"--report_only: {cfg.output_dir} holds no finished run of this ablation's variants and "
                            "seeds (nor does --from_report); run the ablation first, or pass the --output_dir it ran "
                            "in")
    check_output_dir(cfg.output_dir)
    if cfg.register_only:
        record = register(cfg)
        print(f"registered {Path(cfg.output_dir) / 'preregistration.json'} ({record['registered']}); nothing run")
        return 0
    if cfg.report_only:
        report = summarize(cfg)
        report["failures"] = []
        write_report(report, cfg)
    else:
        report = run_ablation(cfg)
    print(f"wrote {Path(cfg.output_dir) / 'ablation.md'}")
    return 1 if report.get("failures") else 0


__all__ = [
    "BUILTIN_VARIANTS",
    "VARIANT_SETS",
    "AblationConfig",
    "AblationError",
    "Variant",
    "compare",
    "load_ablation_config",
    "main",
    "resolve_variants",
    "run_ablation",
    "summarize",
    "write_report",
]
