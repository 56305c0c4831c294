"""`kvdistill demo`: distillation in a regime where it can matter, end to end on a laptop CPU, offline.

The default (`--task binding`, issue 51) is the regime where a teacher's K/V measurably beats its controls:
one-hop variable binding, from the teachers shipped in assets/binding/ (copied, gated and probed), then
the students of `configs/demo/binding/students.yaml` (SFT, logit KD on the answer rows and on the line and
query rows, KV on those rows, KV from a shuffled teacher) through `kvdistill ablate`, in a few minutes on 2
cores. `--task modular` builds the modular regime's assets; `--task arithmetic` runs the original demo:

1. data: a pool of generated 2-step arithmetic word problems for the teachers; the student's
   small labelled subset of it; a dev split (teacher gate, learning curve, settings) and a
   test split (the only one reported)
2. models: one BPE tokenizer (digits split) for the student and teacher_qwen2, another BPE
   (whole numbers as tokens) for teacher_llama, so time alignment is exercised for real;
   random-init models of three shapes
3. teachers trained on the whole pool, one process each; the quality gate stops the demo when
   a teacher is below `gate` accuracy on dev
4. the transfer set: the best teacher answers pool questions the student has no labels for
   (`kvdistill eval` on them; its items.jsonl is the transfer set)
5. the student's SFT learning curve on its labelled subset (dev accuracy vs steps) ->
   `sft_curve.png`; the student budget is the first step on the curve's plateau
6. students at that budget: SFT, logit KD (the positive control) and the KV signal
   (`configs/demo/student_kv.yaml`), all from the same init and data order; the distilling ones
   also get the transfer set, with teacher signals only
7. test evaluation -> `report.md`

Every step is a public command with a config from `configs/demo/`, exactly what a GPU user runs
with real model names, in a subprocess with one torch thread; `--workers` of them run at once
where nothing orders them (the two teachers, then the transfer set beside the SFT curve, then the
students, the KV one first, each evaluated as soon as it is trained, beside the teachers' test
evaluations). Finished steps are skipped on a second run (teachers are cached); a finished
training made with other settings than the demo now asks for (a config changed since) stops it
with the options that differ, never reported as this demo's.
`kvdistill ablate --config configs/demo/evidence.yaml` runs the full evidence ablation on the
assets this writes.

`--task binding|modular` builds what the evidence ablation of that regime needs (issue 31,
docs/tasks.md), from `configs/demo/<task>/` (`run_regime`): the task's splits, the tokenizers and
random-init models of its `models.json`, the teachers (teacher_other on other_task) gated on their
held-out splits, the probe audit of each teacher on dev, the student's SFT curve and budget (no
transfer set), the students of demo.yaml's `students:` (binding) and `report.md` with the assets
`configs/demo/evidence_<task>.yaml` reads.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvdistill.config import ConfigError, check_output_dir, option, parse_config, read_yaml
from kvdistill.evaluate.comparisons import accuracy_curve
from kvdistill.io import REPO_ROOT, read_json, read_jsonl, write_json_atomic, write_text_atomic
from kvdistill.lab import regimes
from kvdistill.report import environment, format_environment
from kvdistill.runs import (
    EVAL_ITEMS,
    EVAL_SUMMARY,
    METRICS,
    TRAIN_CONFIG,
    TRAIN_SUMMARY,
    check_reuse,
    evaluated,
    trained,
)
from kvdistill.synthetic import generate_problems, write_jsonl
from kvdistill.train.config import BOOKKEEPING
from kvdistill.train.config import parse_config as parse_train_config

CONFIG_DIR = REPO_ROOT / "configs" / "demo"
TASKS = ("arithmetic", *regimes.SPLIT_MAKERS)
TASK = {"min_steps": 2, "max_steps": 2, "max_value": 20, "ops": ("add", "sub")}
MODELS = CONFIG_DIR / "models.json"  # tokenizers and shapes: the teachers differ from the student on L, H_kv, D, tokenizer
TEACHERS = ("teacher_qwen2", "teacher_llama")
TRANSFER_TEACHER = "teacher_qwen2"  # answers the transfer questions (the best teacher on dev)
SPLITS = ("teacher_pool", "train", "transfer_questions", "dev", "test")
# an eval's items.jsonl read as a transfer set: the teacher's completion is the text
TRANSFER_FIELDS = "{question: question, answer: prediction}"
STUDENTS = {  # name -> (config in configs/demo/, extra flags)
    "student_sft": ("student.yaml", []),
    "student_logit_kd": ("student.yaml", ["--logit_kd_weight", "1.0"]),
    "student_kv": ("student_kv.yaml", []),
}
CAPTURED = ("student_logit_kd", "student_kv")  # the students with a teacher signal read it from a capture


@dataclass(frozen=True)
class Sizes:
    pool: int  # teacher training problems
    labelled: int  # the student's labelled subset of the pool
    transfer: int  # pool questions after the labelled ones, answered by a teacher: the transfer set
    dev: int
    test: int
    teacher_steps: int
    curve_steps: int  # length of the SFT learning curve
    curve_every: int  # dev accuracy every N steps
    curve_items: int  # dev items per curve point
    gate: float  # teachers' minimum dev accuracy


SIZES = {
    "full": Sizes(pool=20000, labelled=500, transfer=2000, dev=500, test=1000, teacher_steps=2500, curve_steps=1500,
                  curve_every=250, curve_items=300, gate=0.90),
    "quick": Sizes(pool=400, labelled=64, transfer=32, dev=40, test=60, teacher_steps=30, curve_steps=30, curve_every=15,
                   curve_items=20, gate=0.0),
}


@dataclass
class DemoConfig:
    """Options of `kvdistill demo`."""

    output_dir: str | None = option(None, "Output directory (default outputs/demo_<task>; outputs/demo for "
                                    "arithmetic).", aliases=["--out"])
    task: str = option("binding", f"The regime, one of {TASKS}: binding (the default: shipped teachers, then "
                       "students with and without their K/V) and modular build the data, gated teachers, probe "
                       "audit and SFT curve of configs/demo/<task>/ (docs/tasks.md); arithmetic is the first demo.")
    quick: bool = option(False, "~2-minute smoke version (tiny data and steps, no quality gate).")
    seed: int = option(0, "Seed of data, inits and training.")
    workers: int = option(2, "Trainings run at once, one process each (one per CPU core).")
    gate: float | None = option(None, "Teachers' minimum dev accuracy (default 0.90; quick: none).")
    fresh: bool = option(False, "Delete the output directory first.")
    retrain_teachers: bool = option(False, "binding/modular: train the teachers here (an hour and more on CPU) "
                                    "instead of copying the ones shipped in assets/<task>/.")
    ship_teachers: bool = option(False, "binding/modular: write the teachers this demo trained to assets/<task>/ "
                                 "with their manifest (for maintainers; implies --retrain_teachers).")

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"task {self.task!r} is not one of {TASKS}")
        self.output_dir = self.output_dir or ("outputs/demo" if self.task == "arithmetic" else f"outputs/demo_{self.task}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if (self.retrain_teachers or self.ship_teachers) and self.task == "arithmetic":
            raise ConfigError("--retrain_teachers and --ship_teachers are for --task binding|modular (the arithmetic "
                              "demo always trains its teachers, a few minutes)")
        if self.ship_teachers and self.quick:
            raise ConfigError("--ship_teachers with --quick would ship the smoke run's tiny teachers; drop --quick")
        if self.gate is not None and not 0 <= self.gate <= 1:
            raise ConfigError(f"gate {self.gate} is not an accuracy; set --gate between 0 and 1 (default 0.90)")


def _log(msg: str) -> None:
    print(f"\n=== {msg}", flush=True)


def config_path(name: str) -> Path:
    path = CONFIG_DIR / name
    if not path.exists():
        raise ConfigError(f"demo config {path} is missing (the demo runs from a source checkout)")
    return path


PROGRESS_S = 30  # the console hears from every running job at least this often


ABLATE_DONE = re.compile(r"^\[(\d+)/(\d+)\] .*: (done|finished, skipped|from report .*)$", re.M)  # ablate's log


def progress_line(name: str, argv: list[str], elapsed: float, log: Path | None = None) -> str:
    """`name: kvdistill train, step 40/300, 52 s, ETA 338 s` for a running `kvdistill` command: a
    training's steps are read from its `metrics.jsonl` (the total from `--max_steps`, else its
    `--config`), an ablation's finished runs from its `log`; the ETA extrapolated from those done so far."""
    flags = dict(zip(argv[1::2], argv[2::2]))
    line = f"    {name}: kvdistill {argv[0]}, {elapsed:.0f} s"
    if argv[0] == "ablate" and log is not None and log.exists():
        done = ABLATE_DONE.findall(log.read_text(errors="replace"))
        if done:
            total = int(done[0][1])
            eta = f", ETA {elapsed / len(done) * (total - len(done)):.0f} s" if len(done) < total else ""
            return f"    {name}: kvdistill ablate, {len(done)}/{total} runs done, {elapsed:.0f} s{eta}"
    if argv[0] != "train" or "--output_dir" not in flags:
        return line
    total = flags.get("--max_steps")
    if total is None and "--config" in flags:
        total = read_yaml(flags["--config"], "--config").get("max_steps")
    done = max((int(r["step"]) for r in read_jsonl(Path(flags["--output_dir"]) / METRICS) if "step" in r), default=0)
    if not total:
        return f"{line}, step {done}"
    eta = f", ETA {elapsed / done * (int(total) - done):.0f} s" if done else ""
    return f"    {name}: kvdistill train, step {done}/{total}, {elapsed:.0f} s{eta}"


def run_parallel(jobs: dict[str, list[list[str]]], workers: int, logs: Path) -> None:
    """Run jobs `{name: [argv, ...]}` of `kvdistill ...` commands, `workers` jobs at a time.

    A job's commands run one after another (a training, then its evaluation), each a subprocess
    with one torch thread (so a run's numbers do not depend on how many run beside it); a job's
    output goes to `logs/<name>.log`, and every `PROGRESS_S` seconds a line per running job to the
    console (`progress_line`). Jobs start in the order given: list the longest first.
    """
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    pending = [(name, list(commands)) for name, commands in jobs.items() if commands]
    running: dict[str, tuple[subprocess.Popen, Any, list[list[str]], list[str], float]] = {}

    def start(name: str, commands: list[list[str]], fh: Any) -> None:
        argv = commands.pop(0)
        print(f"$ kvdistill {' '.join(argv)}   (log: {logs / name}.log)", flush=True)
        proc = subprocess.Popen([sys.executable, "-m", "kvdistill.cli", *argv], stdout=fh, stderr=subprocess.STDOUT,
                                env=env)
        running[name] = (proc, fh, commands, argv, time.time())

    said = time.time()
    while pending or running:
        while pending and len(running) < workers:
            name, commands = pending.pop(0)
            start(name, commands, (logs / f"{name}.log").open("w"))
        time.sleep(0.5)
        if time.time() - said >= PROGRESS_S:
            said = time.time()
            for name, (_, _, _, argv, t0) in running.items():
                print(progress_line(name, argv, said - t0, logs / f"{name}.log"), flush=True)
        for name, (proc, fh, rest, _, _) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            if proc.returncode:
                for other, other_fh, *_ in running.values():  # nothing keeps running behind the error
                    other.kill()
                    other_fh.close()
                fh.close()
                tail = (logs / f"{name}.log").read_text().splitlines()[-15:]
                raise SystemExit(f"{name} failed (exit {proc.returncode}); last lines of its log:\n" + "\n".join(tail))
            if rest:
                start(name, rest, fh)
            else:
                fh.close()
                print(f"    {name}: done", flush=True)


def prepare_data(data: Path, sizes: Sizes, seed: int) -> None:
    """teacher_pool / train (the student's labelled subset of the pool) / dev / test jsonl, disjoint
    questions between the pool and the held-out splits."""
    if all((data / f"{split}.jsonl").exists() for split in SPLITS):
        return
    pool = generate_problems(sizes.pool, seed, **TASK)
    held = generate_problems(sizes.dev + sizes.test, seed + 1_000_003, exclude=[r["question"] for r in pool], **TASK)
    write_jsonl(pool, data / "teacher_pool.jsonl")
    write_jsonl(pool[: sizes.labelled], data / "train.jsonl")
    write_jsonl(pool[sizes.labelled : sizes.labelled + sizes.transfer], data / "transfer_questions.jsonl")
    write_jsonl(held[: sizes.dev], data / "dev.jsonl")
    write_jsonl(held[sizes.dev :], data / "test.jsonl")


def _trained(path: Path, argv: list[str], stale: Path) -> bool:
    """A finished training in `path`, made with the settings `argv` (a `kvdistill train` command line)
    asks. One made otherwise (a config changed since) stops the demo, naming what to delete: `stale`,
    the run and what was made from it."""
    if not trained(path):
        return False
    check_reuse(path, TRAIN_CONFIG, parse_train_config(argv[1:]).to_yaml_dict(), BOOKKEEPING, common_only=True,
                asker="this demo", fix=f"delete {stale} or give another --output_dir")
    return True


def flags(options: dict[str, Any]) -> list[str]:
    """`{key: value}` as command-line flags: `--key value` (a list: `--key v1 v2`)."""
    return [x for k, v in options.items() for x in (f"--{k}", *map(str, v if isinstance(v, list) else [v]))]


def _eval_argv(model: Path, data: Path, split: str, limit: int, out: Path) -> list[str]:
    return ["eval", "--model", str(model), "--data", str(data), "--split", split, "--limit", str(limit),
            "--batch_size", "100", "--max_new_tokens", "48", "--max_length", "256", "--output_dir", str(out),
            "--no_progress"]


def curve_points(metrics: Path) -> list[tuple[int, float]]:
    """`(step, dev accuracy)` of a run's accuracy curve (`eval_accuracy` rows of metrics.jsonl)."""
    return accuracy_curve(read_jsonl(metrics))


def plateau_step(points: list[tuple[int, float]], share: float = 0.95) -> int:
    """The first step whose dev accuracy reaches `share` of the curve's best: the student budget."""
    best = max(a for _, a in points)
    return next(s for s, a in points if a >= share * best)


def write_report(out: Path, rows: list[dict], curve: dict, transfer: int) -> Path:
    """`report.md`: the results table, where SFT stands on its curve, the plots."""
    from kvdistill.plots import plot_bars_with_errors

    plot_bars_with_errors(  # the 95 % Wilson interval, asymmetric about the accuracy
        [r["model"] for r in rows], [r["accuracy"] for r in rows],
        [[r["accuracy"] - r["ci_low"] for r in rows], [r["ci_high"] - r["accuracy"] for r in rows]],
        out / "accuracy.png", error_label="95 % Wilson CI", ylabel="test accuracy (exact match)",
        title=f"teachers vs students (demo run {out.name})",
    )
    lines = [
        "# kvdistill demo report", "",
        "Test accuracy on generated 2-step arithmetic problems (greedy decoding, exact match of the final",
        "number), 95 % Wilson interval. Teachers learned from the whole pool; every student from the same",
        f"{curve['labelled']} labelled problems, the same init and data order, for {curve['budget']} steps; the "
        f"distilling students (logit KD, KV) also read a transfer set of {transfer} pool questions answered by "
        f"{TRANSFER_TEACHER}, with teacher signals only (no LM loss). All numbers are read from the eval files.", "",
        "| model | params | accuracy | 95 % CI | final agreement |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        agree = r.get("agreement") or ""
        lines.append(f"| {r['model']} | {r['params']:,} | {r['accuracy']:.3f} | [{r['ci_low']:.3f}, "
                     f"{r['ci_high']:.3f}] | {agree} |")
    last = [f"{a:.3f}" for _, a in curve["points"][-3:]]
    where = ("the curve's last point, so SFT may still be rising (a longer curve would tell)"
             if curve["budget"] == curve["points"][-1][0] else "on the curve's plateau, so a gain is not a speed-up")
    lines += [
        "", f"**SFT learning curve** (dev accuracy, `sft_curve.png`): best {curve['best']:.3f} at step "
        f"{curve['best_step']}, last points {', '.join(last)}; the budget {curve['budget']} is the first step at "
        f"≥ 95 % of the best ({curve['at_budget']:.3f}): {where}.", "",
        "![accuracy](accuracy.png)", "![SFT curve](sft_curve.png)", "",
    ]
    env = read_json(out / "runs" / "student_sft" / TRAIN_SUMMARY, {}).get("environment")
    if env:  # what a rerun must match to give these numbers (README: what is reproducible)
        lines += [f"Environment of the student runs: `{format_environment(env)}`.", ""]
    for run in STUDENTS:
        for png in ("curves_loss.png", "curves_cos_sim.png"):
            if (out / "runs" / run / png).exists():
                lines.append(f"![{run} {png}](runs/{run}/{png})")
    return write_text_atomic(out / "report.md", "\n".join(lines) + "\n")


def train_teachers(out: Path, data: Path, init: dict[str, Path], teachers: dict[str, tuple[str, str, int]],
                   config: Path, steps: int, seed: int, workers: int, gate: float,
                   beside: dict[str, list[list[str]]] | None = None,
                   overrides: dict[str, dict[str, Any]] | None = None,
                   shipped: frozenset[str] = frozenset()) -> tuple[dict[str, bool], dict[str, list[str]]]:
    """Train each teacher `name: (training split, gate split, gate items)` from `init[name]` into
    `out/teachers/<name>` (`workers` at once, each evaluated on its gate split right after its training,
    into `out/eval_<gate split>/<name>`); stop the demo at the first one below `gate`. `beside`: jobs that
    read no teacher, run in the same pool (a core a lone teacher leaves idle); `overrides`: a teacher's own
    train options over `config` (demo.yaml's teacher_overrides); `shipped`: teachers already copied from
    assets/ (evaluated, never trained). Returns which teachers were trained now (the others were reused)
    and the `kvdistill train` argv of each."""
    paths = {name: out / "teachers" / name for name in teachers}
    argvs = {name: ["train", "--config", str(config), "--student", str(init[name]), "--data", str(data),
                    "--data_split", split, "--output_dir", str(paths[name]), "--max_steps", str(steps),
                    "--seed", str(seed), "--resume_from_checkpoint", "last", *flags((overrides or {}).get(name, {}))]
             for name, (split, _, _) in teachers.items()}
    # everything after this stage reads the teachers: one trained otherwise asks for a fresh output dir
    jobs = {name: [] if name in shipped or _trained(paths[name], argv, stale=out) else [argv]
            for name, argv in argvs.items()}
    fresh = {name: bool(commands) for name, commands in jobs.items()}
    for name, (_, split, items) in teachers.items():  # each teacher's gate accuracy right after its training
        if jobs[name] or not evaluated(out / f"eval_{split}" / name):
            jobs[name].append(_eval_argv(paths[name], data, split, items, out / f"eval_{split}" / name))
    run_parallel({**jobs, **(beside or {})}, workers, out / "logs")
    for name, (_, split, _) in teachers.items():
        acc = read_json(out / f"eval_{split}" / name / EVAL_SUMMARY, {})["accuracy"]
        if acc < gate:
            raise SystemExit(f"quality gate: teacher {name} reached {acc:.3f} on {split}, {gate - acc:.3f} below the "
                             f"{gate:.2f} gate; train it longer (delete {paths[name]} and raise its steps) or "
                             "lower --gate")
        print(f"    {name}: {split} accuracy {acc:.3f} (gate {gate:.2f})" + (" (shipped)" if name in shipped else ""))
    return fresh, argvs


def record_curve(out: Path, curve_run: Path, labelled: int) -> dict:
    """The SFT curve of `curve_run` and its budget (`plateau_step`) -> `sft_curve.json`, `sft_curve.png`."""
    from kvdistill.plots import plot_run_curves

    points = curve_points(curve_run / METRICS)
    budget = plateau_step(points)
    best_step, best = max(points, key=lambda p: p[1])
    steps, accs = zip(*points)
    plot_run_curves({"dev accuracy": {"SFT": [(list(steps), list(accs))]}}, out / "sft_curve.png",
                    title=f"run {curve_run.name}: SFT on {labelled} labelled problems; budget {budget}")
    curve = {"labelled": labelled, "budget": budget, "best": best, "best_step": best_step,
             "at_budget": dict(points)[budget], "points": points}
    write_json_atomic(out / "sft_curve.json", curve)
    print(f"    budget: {budget} steps (dev {dict(points)[budget]:.3f}; best {best:.3f} at step {best_step})")
    return curve


def run_demo(out: Path, quick: bool = False, seed: int = 0, workers: int = 2, gate: float | None = None) -> Path:
    """Run every stage (skipping finished ones) and return the report path."""
    sizes = SIZES["quick" if quick else "full"]
    gate = sizes.gate if gate is None else gate
    t0 = time.time()
    data = out / "data"
    _log(f"[1/7] data: pool {sizes.pool}, labelled {sizes.labelled}, dev {sizes.dev}, test {sizes.test} -> {data}")
    prepare_data(data, sizes, seed)
    _log(f"[2/7] tokenizers and random-init models of {MODELS.relative_to(REPO_ROOT)} -> {out / 'init'}")
    init = regimes.build_models(MODELS, data, out / "init", seed)

    teachers = {name: out / "teachers" / name for name in TEACHERS}
    _log(f"[3/7] teachers on the pool ({sizes.teacher_steps} steps each), quality gate {gate:.2f} on dev")
    train_teachers(out, data, init, {name: ("teacher_pool", "dev", sizes.dev) for name in TEACHERS},
                   config_path("teacher.yaml"), sizes.teacher_steps, seed, workers, gate)

    # the transfer set needs a teacher, the SFT curve does not: they run side by side
    _log(f"[4/7] transfer set: {TRANSFER_TEACHER} answers {sizes.transfer} pool questions the student has no "
         "labels for (teacher signals only, no LM loss)")
    _log(f"[5/7] SFT learning curve of the student on its {sizes.labelled} labelled problems")
    transfer = out / "transfer" / TRANSFER_TEACHER
    curve_run = out / "runs" / "sft_curve"
    common = ["--student", str(init["student"]), "--data", str(data), "--seed", str(seed)]
    jobs = {}
    curve_argv = ["train", "--config", str(config_path("student.yaml")), *common, "--output_dir", str(curve_run),
                  "--max_steps", str(sizes.curve_steps), "--accuracy_eval_steps", str(sizes.curve_every),
                  "--accuracy_eval_limit", str(sizes.curve_items)]
    if not _trained(curve_run, curve_argv, stale=curve_run):
        jobs["sft_curve"] = [curve_argv]
    if not evaluated(transfer):
        jobs["transfer"] = [_eval_argv(teachers[TRANSFER_TEACHER], data, "transfer_questions", sizes.transfer,
                                       transfer)]
    run_parallel(jobs, workers, out / "logs")
    curve = record_curve(out, curve_run, sizes.labelled)
    budget = curve["budget"]

    _log(f"[6/7] students at {budget} steps: SFT, logit KD, KV")
    _log(f"[7/7] test evaluation on {sizes.test} held-out problems, each model's as soon as it is trained")
    # the logit-KD student reads teacher_qwen2's logits only, as in every committed result; cross-vocab KD
    # from teacher_llama (another tokenizer) is an arm of its own (docs/training.md, the logit channel)
    teacher_list = "[" + ", ".join(f"{{path: {p}}}" if n == TRANSFER_TEACHER else f"{{path: {p}, logit_kd: off}}"
                                   for n, p in teachers.items()) + "]"
    runs = {name: out / "runs" / name for name in STUDENTS}
    train = {name: ["--config", str(config_path(cfg_name)), *common, "--teachers", teacher_list,
                    "--transfer_data", str(transfer / EVAL_ITEMS), "--transfer_field_map", TRANSFER_FIELDS,
                    "--output_dir", str(runs[name]), "--max_steps", str(budget), *extra]
             for name, (cfg_name, extra) in STUDENTS.items()}
    train = {name: argv for name, argv in train.items() if not _trained(runs[name], ["train", *argv], stale=runs[name])}
    # each teacher runs once over the records (`kvdistill capture`), not in the first epochs of every student
    captured = [name for name in CAPTURED if name in train]
    for name in captured:
        train[name] += ["--teacher_capture", str(out / "captures" / name)]
    run_parallel({f"capture_{name}": [["capture", *train[name]]] for name in captured}, workers, out / "logs")
    models = {**teachers, **runs}
    tests = {name: [_eval_argv(path, data, "test", sizes.test, out / "eval" / name)]
             if name in train or not evaluated(out / "eval" / name) else [] for name, path in models.items()}
    # the longest jobs first (STUDENTS lists the cheapest first); the teachers' evaluations fill the gaps
    jobs = {name: ([["train", *train[name]]] if name in train else []) + tests[name] for name in reversed(STUDENTS)}
    run_parallel({**jobs, **{f"eval_{name}": tests[name] for name in teachers}}, workers, out / "logs")
    rows = []
    for name, path in models.items():
        s = read_json(out / "eval" / name / EVAL_SUMMARY, {})
        final = read_json(path / TRAIN_SUMMARY, {}).get("final", {})
        agree = (f"cos {final['cos_sim']:.3f}" if final.get("cos_sim") is not None else
                 f"relation KL {final['relation_kl']:.4f}" if final.get("relation_kl") is not None else None)
        rows.append({"model": name, "params": _params(path), "accuracy": s["accuracy"], "ci_low": s["ci_low"],
                     "ci_high": s["ci_high"], "agreement": agree if name == "student_kv" else None})
    report = write_report(out, rows, curve, sizes.transfer)
    print("\n" + report.read_text().split("\n\n![")[0])
    print(f"\nreport: {report}  ({time.time() - t0:.0f} s)")
    return report


@dataclass(frozen=True)
class Regime:
    """What `--task binding|modular` runs from, all of `configs/demo/<task>/`, read before anything is written."""

    task: str
    settings: regimes.DemoSettings  # demo.yaml
    models: regimes.Models  # models.json
    teachers: dict[str, tuple[str, str]]  # name -> (training split, gate split)

    @staticmethod
    def load(task: str, quick: bool) -> Regime:
        for name in ("teacher.yaml", "student.yaml"):
            config_path(f"{task}/{name}")
        models = regimes.read_models(CONFIG_DIR / task / "models.json")
        settings = regimes.read_settings(config_path(f"{task}/demo.yaml"), quick)
        regimes.check_data(task, settings.data)
        teachers = regimes.teachers_of(models, settings.teachers)
        for key in regimes.PER_TEACHER:
            if unknown := sorted(set(getattr(settings, key) or {}) - set(teachers)):
                raise ConfigError(f"configs/demo/{task}/demo.yaml {key}: {unknown} are not teachers this demo trains "
                                  f"({sorted(teachers)}); name one of them or add it to teachers:")
        return Regime(task, settings, models, teachers)


def evidence_assets(out: Path, regime: Regime, budget: int) -> str:
    """The `overrides:` of `configs/demo/evidence_<task>.yaml` that point at what this demo wrote."""
    right = [n for n, (split, _) in regime.teachers.items() if split == "teacher_pool"]
    other = [n for n in regime.teachers if n not in right]
    return "\n".join([
        "overrides:", f"  student: {out / 'init' / 'student'}", f"  data: {out / 'data'}",
        f"  max_steps: {budget}   # the SFT curve's budget ({out / 'sft_curve.json'})", "  teachers:",
        *[f"    - {{path: {out / 'teachers' / n}}}" for n in right],
        *[f"# other_task control: {{teacher_control: other_task, teachers: [{{path: {out / 'teachers' / n}}}]}}"
          for n in other],
    ])


def run_regime(out: Path, regime: Regime, seed: int = 0, workers: int = 2, gate: float | None = None,
               retrain: bool = False, ship: bool = False, quick: bool = False) -> Path:
    """`--task binding|modular`: every stage (skipping finished ones); returns the report path. The teachers
    shipped in assets/<task>/ are copied, not trained, unless `retrain` (`ship`: retrain and write them there;
    `quick`'s tiny data has its own tokenizer: it always trains its tiny teachers)."""
    task, s = regime.task, regime.settings
    gate = s.gate if gate is None else gate
    t0, data, stages = time.time(), out / "data", 7 if s.students else 6
    _log(f"[1/{stages}] {task} data -> {data}")
    sizes = regimes.write_data(task, s.data, data, seed)
    print("    " + ", ".join(f"{split} {n}" for split, n in sizes.items()))
    _log(f"[2/{stages}] tokenizers and random-init models of configs/demo/{task}/models.json -> {out / 'init'}")
    init = regimes.build_models(CONFIG_DIR / task / "models.json", data, out / "init", seed)

    student_split = regime.models.models["student"].data
    curve_run = out / "runs" / "sft_curve"
    curve_argv = ["train", "--config", str(config_path(f"{task}/student.yaml")), "--student", str(init["student"]),
                  "--data", str(data), "--data_split", student_split, "--seed", str(seed), "--output_dir",
                  str(curve_run), "--max_steps", str(s.curve_steps), "--accuracy_eval_steps", str(s.curve_every),
                  "--accuracy_eval_limit", str(s.curve_items)]
    curve_job = {} if _trained(curve_run, curve_argv, stale=curve_run) else {"sft_curve": [curve_argv]}
    manifest = {} if retrain or ship or quick else regimes.shipped(task)
    shipped = frozenset(regime.teachers) & set(manifest.get("teachers", {}))
    for name in sorted(shipped):
        regimes.install_teacher(task, name, out / "init", out / "teachers" / name)
    # a teacher trained by an earlier run of this output dir is reused (train_teachers checks its settings)
    reused = sorted(n for n in regime.teachers if n not in shipped and trained(out / "teachers" / n))
    steps = ", ".join(f"{n} {(s.teacher_overrides or {}).get(n, {}).get('max_steps', s.teacher_steps)} steps"
                      for n in regime.teachers if n not in shipped and n not in reused)
    copied = f"{', '.join(sorted(shipped))} copied from {regimes.ASSETS / task} (--retrain_teachers trains them)"
    kept = f"{', '.join(reused)} already trained in {out / 'teachers'}"
    parts = (copied if shipped else "", kept if reused else "", steps)
    _log(f"[3/{stages}] teachers ({'; '.join(x for x in parts if x)}), quality gate {gate:.2f} on "
         f"their held-out splits; beside them [5/{stages}] the SFT learning curve of the student on its "
         f"{sizes[student_split]} labelled records")
    fresh, argvs = train_teachers(out, data, init, {n: (split, gate_split, sizes[gate_split]) for n, (split, gate_split)
                                                    in regime.teachers.items()},
                                  config_path(f"{task}/teacher.yaml"), s.teacher_steps, seed, workers, gate, curve_job,
                                  s.teacher_overrides, shipped)
    gates = {n: (split, read_json(out / f"eval_{split}" / n / EVAL_SUMMARY)["accuracy"])
             for n, (_, split) in regime.teachers.items()}
    if ship:
        path = regimes.ship_teachers(task, out, list(regime.teachers), gates, argvs, environment())
        print(f"    shipped {', '.join(regime.teachers)} -> {path.parent}")

    _log(f"[4/{stages}] probe audit: {s.probe.get('target')} at {s.probe.get('rows')} rows of dev, each teacher beside its "
         "untrained copy")
    jobs = {}
    probes = {name: out / "probe" / name for name in regime.teachers}
    for name, path in probes.items():  # a retrained teacher is probed again
        if fresh[name] or not (path / "probe.json").exists():
            jobs[f"probe_{name}"] = [["probe", "--model", str(out / "teachers" / name), "--untrained", "--data",
                                      str(data), "--split", "dev", *flags(s.probe), "--seed", str(seed), "--output_dir",
                                      str(path), "--no_progress"]]
    layouts = {name: out / "layout" / name for name in s.layout or {}}
    for name, path in layouts.items():  # the layout of a retrained teacher is read again
        if fresh[name] or not (path / "layout.json").exists():
            jobs[f"layout_{name}"] = [["layout", "--model", str(out / "teachers" / name), "--untrained",
                                       *flags(s.layout[name]), "--seed", str(seed), "--output_dir", str(path)]]
    run_parallel(jobs, workers, out / "logs")
    curve = record_curve(out, curve_run, sizes[student_split])

    students, students_plot = None, None
    if s.students:
        config, ablation = write_students(out, task, s.students)
        _log(f"[6/{stages}] students: {', '.join(v if isinstance(v, str) else v['name'] for v in ablation['variants'])}, "
             f"seeds {', '.join(map(str, ablation['seeds']))}, {ablation['workers']} at once: kvdistill ablate --config "
             f"{config}")
        run_parallel({"students": [["ablate", "--config", str(config)]]}, 1, out / "logs")
        where = Path(ablation["output_dir"])  # the ablation's own output dir, as students.yaml names it
        students = regimes.students_section(read_json(where / "ablation.json"), f"{where}/")
        students_plot = os.path.relpath(where / "ablation_accuracy.png", out)

    _log(f"[{stages}/{stages}] report")
    assets = evidence_assets(out, regime, curve["budget"])
    text = regimes.regime_report(task, out, gates, gate, {n: read_json(p / "probe.json") for n, p in probes.items()}, curve,
                                 assets, {n: read_json(p / "layout.json") for n, p in layouts.items()}, students,
                                 students_plot)
    report = write_text_atomic(out / "report.md", text)
    print("\n" + text.split("\n![")[0])
    print(f"\nreport: {report}  ({time.time() - t0:.0f} s)")
    return report


def write_students(out: Path, task: str, students: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """`<out>/students.yaml` and what it holds: the ablation `students['config']` of configs/demo/<task>/ with
    demo.yaml's other `students:` keys over it (quick's steps, say) and every `{out}` in it this demo's output
    dir."""
    template = config_path(f"{task}/{students['config']}")
    spec = regimes.merged(read_yaml(template, "students"), {k: v for k, v in students.items() if k != "config"})

    def fill(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        return x.replace("{out}", str(out)) if isinstance(x, str) else x

    spec = fill(spec)
    spec["base_config"] = str(template.parent / spec["base_config"])  # the written copy is not beside it
    path = write_text_atomic(out / "students.yaml", yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))
    return path, spec


def _params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)


def main(argv: list[str]) -> int:
    cfg = parse_config(DemoConfig, argv, "kvdistill demo", __doc__)
    out = Path(cfg.output_dir)
    regime = None if cfg.task == "arithmetic" else Regime.load(cfg.task, cfg.quick)  # refused before any write
    if cfg.fresh and out.is_dir():
        shutil.rmtree(out)
    check_output_dir(out)
    if regime is None:
        run_demo(out, quick=cfg.quick, seed=cfg.seed, workers=cfg.workers, gate=cfg.gate)
    else:
        run_regime(out, regime, seed=cfg.seed, workers=cfg.workers, gate=cfg.gate, retrain=cfg.retrain_teachers,
                   ship=cfg.ship_teachers, quick=cfg.quick)
    return 0
