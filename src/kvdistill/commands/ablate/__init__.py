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
hypothesis: KV matching beats SFT   # pre-registered with `primary` (lab/prereg.py)
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
(`kvdistill.lab.prereg`); the report opens with the primary result in words. The hash covers
the YAML's full design, so `--variants a,b` (a YAML variant by its name) and `--seeds` run part of
it first and the rest later under the same record.

`from_report: PATH` (or `--from_report`) continues such a sweep on a machine without the earlier runs: a run
of the plan with no finished run under `output_dir` but recorded in PATH (an ablation.json of the same
config hash) counts as finished with its recorded numbers, per-item correctness included, so the
comparisons equal those from its run dir; a run dir present always wins. Recorded runs have no
per-step metrics: the training curves leave them out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvdistill.commands.ablate.design import (
    BUILTIN_VARIANTS,
    VARIANT_SETS,
    AblationConfig,
    AblationError,
    Variant,
    resolve_variants,
    run_dir,
)
from kvdistill.commands.ablate.render import write_report
from kvdistill.commands.ablate.run import register, run_ablation
from kvdistill.commands.ablate.summary import compare, recorded_run, summarize
from kvdistill.config import check_output_dir, parse_config
from kvdistill.runs import EVAL_DIR, evaluated

# The command is a recipe over four modules: design (variants, the config, the pre-registration record),
# run (train + evaluate each variant x seed), summary (read the runs, compare them), render (the report).


def load_ablation_config(path: str | Path, **overrides: Any) -> AblationConfig:
    """Read an ablation YAML (+ overrides, as the command line would give them)."""
    argv = ["--config", str(path)]
    for key, value in overrides.items():
        if value is not None:
            argv += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return parse_config(AblationConfig, argv, "kvdistill ablate", __doc__)


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
