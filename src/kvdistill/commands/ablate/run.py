"""Running an ablation: each variant x seed's train config, its capture, and the workers that train
and evaluate the runs (resumable: a finished run is skipped)."""

from __future__ import annotations

import copy
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from kvdistill.commands.ablate.design import AblationConfig, AblationError, Variant, preregistration, run_dir
from kvdistill.commands.ablate.render import write_report
from kvdistill.commands.ablate.summary import recorded_run, summarize
from kvdistill.config import ConfigError, read_yaml, teacher_controls, to_plain
from kvdistill.io import write_text_atomic
from kvdistill.lab.prereg import preregister
from kvdistill.malloc import keep_freed_memory
from kvdistill.runs import (
    ASKED_CONFIG,
    EVAL_DIR,
    EVAL_SUMMARY,
    TRAIN_SUMMARY,
    check_reuse,
    checkpoints,
    evaluated,
    trained,
)
from kvdistill.train.config import BOOKKEEPING, TEACHER_SIGNALS, KVDistillConfig
from kvdistill.train.config import parse_config as parse_train_config


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
                       eval_fn: EvalFn | None = None, keep_checkpoints: bool = True) -> None:
    """Train one run from its `train_config.yaml` (unless finished) and evaluate it into `eval/`; then,
    unless `keep_checkpoints`, remove its checkpoint dirs (a finished run is never resumed)."""
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
    for ckpt in [] if keep_checkpoints else checkpoints(path):
        shutil.rmtree(ckpt)


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

    def __init__(self, runs: list[_Job], keep_going: bool, keep_checkpoints: bool, log: Callable[[str], None]):
        self.runs, self.keep_going, self.keep_checkpoints, self.log = runs, keep_going, keep_checkpoints, log
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
                train_and_evaluate(job.rdir, job.settings, train_fn, eval_fn, plan.keep_checkpoints)
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
                    running[pool.submit(train_and_evaluate, job.rdir, job.settings, None, None,
                                        plan.keep_checkpoints)] = ("run", job)
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

    plan = _Plan(todo, cfg.keep_going, cfg.keep_checkpoints, log)
    if cfg.workers == 1 or len(todo) <= 1:
        _run_here(plan, cfg.threads, train_fn, eval_fn)
    else:
        _run_pool(plan, cfg.workers, cfg.threads)
    report = summarize(cfg)
    report["failures"] = plan.failures
    write_report(report, cfg)
    return report
