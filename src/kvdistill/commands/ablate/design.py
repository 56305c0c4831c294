"""The design of an ablation: its variants (built-ins, sets, YAML mappings), the `AblationConfig` that
reads the YAML, where each run lives, and the pre-registration record that fixes the design."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvdistill.commands.eval import EvalConfig
from kvdistill.config import ConfigError, option, read_yaml, to_plain
from kvdistill.lab.prereg import make_record, parse_primary

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
                                               "steps_to_threshold, test: paired_t|welch|mann_whitney|logrank|tost or a list of them, "
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
    keep_checkpoints: bool = option(True, "Keep a finished run's checkpoint-N dirs (its resume state; a later "
                                    "sweep may start from one). false: removed once the run is evaluated, its "
                                    "final model kept (each checkpoint of a 135M student holds ~0.9 GB).")
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


def run_dir(cfg: AblationConfig, variant: str, seed: int) -> Path:
    return Path(cfg.output_dir) / "runs" / variant / f"seed_{seed}"


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
