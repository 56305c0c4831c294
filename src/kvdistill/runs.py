"""A run directory: the names of its files, how to read one, and when a finished one is reused.

    runs/student/                      `kvdistill train --output_dir runs/student`
        kvdistill_config.yaml          TRAIN_CONFIG: the resolved options (also in every checkpoint)
        teachers.json                  TEACHERS_FILE: the teacher manifest (also in every checkpoint)
        metrics.jsonl                  METRICS: one row per logging step
        train_summary.json             TRAIN_SUMMARY: written last; its presence means "finished"
        train_config.yaml              ASKED_CONFIG: what `kvdistill ablate` asked the run to train with
        eval/                          EVAL_DIR: ablate's evaluation of the run
            summary.json, items.jsonl  EVAL_SUMMARY, EVAL_ITEMS: `kvdistill eval --output_dir ...`
        checkpoint-N/                  a checkpoint (a model dir + trainer state), complete once it holds
            checkpoint_complete.json   COMPLETE_FILE, written last

The final model is the run dir itself: config.json, weights, tokenizer, teachers.json, and last
kvdistill_config.yaml (the trainer's `_save` writes that file after the weights).

Everything here reads plain files; which options may differ between a finished run and a new
request (`ignore`) is the caller's (`train.config.BOOKKEEPING`, derived from the options' roles).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvdistill.config import ConfigError
from kvdistill.io import read_json, read_jsonl

TRAIN_CONFIG = "kvdistill_config.yaml"
TEACHERS_FILE = "teachers.json"
METRICS = "metrics.jsonl"
TRAIN_SUMMARY = "train_summary.json"
ASKED_CONFIG = "train_config.yaml"
EVAL_DIR = "eval"
EVAL_SUMMARY = "summary.json"
EVAL_ITEMS = "items.jsonl"
CHECKPOINT = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR: checkpoint-<global step>
COMPLETE_FILE = "checkpoint_complete.json"  # written last: a checkpoint without it was cut short


def trained(rdir: str | Path) -> bool:
    """`rdir` holds a finished training (its `train_summary.json`)."""
    return (Path(rdir) / TRAIN_SUMMARY).exists()


def evaluated(eval_dir: str | Path) -> bool:
    """`eval_dir` holds a finished evaluation (its `summary.json`)."""
    return (Path(eval_dir) / EVAL_SUMMARY).exists()


def checkpoint_step(path: str | Path) -> int | None:
    """N of a `checkpoint-N` dir's name (the global step it was saved at); None for any other name."""
    step = Path(path).name.removeprefix(f"{CHECKPOINT}-")
    return int(step) if step != Path(path).name and step.isascii() and step.isdigit() else None


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The `checkpoint-N` dirs of a run, complete or not, oldest first."""
    steps = {step: p for p in Path(run_dir).glob(f"{CHECKPOINT}-*")
             if (step := checkpoint_step(p)) is not None and p.is_dir()}
    return [steps[k] for k in sorted(steps)]


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """`checkpoint-N` dirs of a run that were saved to the end (they hold `COMPLETE_FILE`), oldest first."""
    return [p for p in checkpoints(run_dir) if (p / COMPLETE_FILE).is_file()]


def resolve_model(path: str | Path, doing: str, log: Callable[[str], None] = print) -> str:
    """The model dir that `path` names; when `path` is a run, one line (`log`) says which model
    `doing` (e.g. "evaluating") takes and why.

    A run dir (it holds kvdistill_config.yaml, metrics.jsonl or checkpoint-N dirs) gives its final
    model when the final save went to its end (config.json and kvdistill_config.yaml, written last),
    else its newest complete checkpoint; a checkpoint dir gives itself when complete. An incomplete
    checkpoint is never picked: a run with no final model and no complete checkpoint, or an
    incomplete checkpoint named directly, is a ConfigError. Hub ids and plain model dirs pass unchanged."""
    p = Path(path)
    if not p.is_dir():
        return str(path)
    if checkpoint_step(p) is not None and (p / TRAIN_CONFIG).exists():
        if not (p / COMPLETE_FILE).is_file():
            done = complete_checkpoints(p.parent)
            raise ConfigError(f"checkpoint {p} is incomplete (no {COMPLETE_FILE}: the run stopped while saving it); "
                              f"pass {done[-1] if done else 'a complete checkpoint or the finished run dir'} instead")
        return str(path)
    saved = checkpoints(p)
    if not saved and not (p / TRAIN_CONFIG).exists() and not (p / METRICS).exists():
        return str(path)  # a plain model dir (or not a model: the loader says so)
    if (p / TRAIN_CONFIG).exists() and (p / "config.json").exists():
        log(f"{doing} {p} (the run's final model)")
        return str(path)
    done = complete_checkpoints(p)
    if done:
        log(f"{doing} {done[-1]} (newest complete checkpoint; the run has no final model)")
        return str(done[-1])
    cut = f" ({', '.join(c.name for c in saved)} incomplete: no {COMPLETE_FILE})" if saved else ""
    raise ConfigError(f"run {p} has no final model and no complete checkpoint{cut}; train it to the end "
                      f"(kvdistill train --output_dir {p} ...) or pass another model dir")


def differing(saved: Mapping[str, Any], now: Mapping[str, Any], ignore: Collection[str] = (),
              common_only: bool = False) -> list[str]:
    """The options (those in `ignore` aside) in which two configs, as YAML data, differ. `common_only`
    compares only the options both hold: two full configs written by different versions, where an
    option added since the run is no change of its settings."""
    keys = saved.keys() & now.keys() if common_only else saved.keys() | now.keys()
    return sorted(k for k in keys - set(ignore) if saved.get(k) != now.get(k))


def check_reuse(rdir: str | Path, config_file: str, now: Mapping[str, Any], ignore: Collection[str], *,
                common_only: bool = False, asker: str = "this command", fix: str = "delete it or give another "
                "--output_dir", error: type[ConfigError] = ConfigError) -> None:
    """Refuse, in one line naming the differing options and `fix`, a run in `rdir` whose `config_file`
    (YAML) holds other settings than `now`: a finished run is reused, and a partial one continued,
    only with the settings it was made with. Nothing to compare (no such file) passes."""
    path = Path(rdir) / config_file
    if not path.exists():
        return
    saved = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    plain = yaml.safe_load(yaml.safe_dump(dict(now), sort_keys=False, allow_unicode=True))
    changed = differing(saved, plain, ignore, common_only)
    if changed:
        raise error(f"{rdir} was trained with other settings ({', '.join(changed)} differ) than {asker} asks; {fix}")


def read_run(rdir: str | Path) -> dict[str, Any] | None:
    """One finished and evaluated run (ablate's layout): eval summary, per-item correctness by index,
    train summary, curves; None when it has no evaluation yet."""
    rdir = Path(rdir)
    summary = read_json(rdir / EVAL_DIR / EVAL_SUMMARY)
    if summary is None:
        return None
    items = {int(row["index"]): bool(row["correct"]) for row in read_jsonl(rdir / EVAL_DIR / EVAL_ITEMS)}
    train = read_json(rdir / TRAIN_SUMMARY, {})
    final = train.get("final") or {}
    metrics = read_jsonl(rdir / METRICS)
    # each `train()` call that finishes logs its own wall time; a resumed run sums its calls (a killed
    # segment logs none, so its time is not counted)
    runtimes = [float(r["train_runtime"]) for r in metrics if "train_runtime" in r]
    return {
        "accuracy": summary.get("accuracy"),
        "ci_low": summary.get("ci_low"),
        "ci_high": summary.get("ci_high"),
        "n": summary.get("n"),
        "perplexity": summary.get("perplexity"),
        "nll": summary.get("nll"),  # held-out LM loss per target token
        "ce": final.get("ce"),
        "kv_loss": final.get("kv_loss"),
        "cos_sim": final.get("cos_sim"),
        "relation_kl": final.get("relation_kl"),
        "global_step": train.get("global_step"),
        "teacher_control": train.get("teacher_control"),
        "teacher_controls": train.get("teacher_controls"),  # per teacher (absent from runs made before them)
        "environment": train.get("environment"),
        "items": items,
        "metrics": metrics,
        "train_runtime": sum(runtimes) if runtimes else None,
    }
