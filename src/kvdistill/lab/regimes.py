"""The evidence regimes' assets (issue 31, docs/tasks.md): a task's data splits, and the tokenizers and
random-init models a `models.json` names (`configs/demo/binding/`, `configs/demo/modular/`).

`models.json` holds `tokenizers` (`name -> keyword arguments of models.build_tokenizer`, e.g.
`{"vocab_size": 384, "numbers_whole": 59}`) and `models` (`name -> {model_type, tokenizer,
tie_word_embeddings, data, sizes[, init]}`: `data` is the split the model trains on, `sizes` go to
`AutoConfig.for_model` beside `vocab_size` and `max_position_embeddings`, `init` names an embedding
init of `EMBED_INITS`, random when absent). `build_models` trains each
tokenizer once on the texts of `teacher_pool` and saves every model, seeded, with its tokenizer: the
same files whoever builds them (the demo, an ablation, a scratch script).

`demo.yaml` beside it holds what `kvdistill demo --task <task>` needs besides shapes and training
recipes (`read_settings`): the data knobs, teacher steps and gate, the SFT curve and the probe audit,
with a `quick:` block of overrides for the smoke run; `regime_report` writes the demo's report.

`assets/<task>/` ships the regime's trained teachers (an hour and more of CPU each, and a teacher's
time to its gate differs by >10,000 steps across CPU models): each teacher's model files and its
training's summary and config, and `manifest.json` with every file's SHA-256, the init record they were
trained from (`SAVED_SPEC`), the command and the gate accuracy (`ship_teachers`, `install_teacher`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kvdistill.config import ConfigError, read_yaml
from kvdistill.data import format_example
from kvdistill.io import REPO_ROOT, read_json, read_jsonl, repo_relative, sha256_file, write_json_atomic
from kvdistill.lab.tasks import binding, modular
from kvdistill.models import build_tokenizer, save_random_model
from kvdistill.synthetic import write_jsonl

SPLIT_MAKERS = {"binding": binding.make_splits, "modular": modular.make_splits}  # task -> make_splits(**knobs)
KNOBS_OF = {"binding": (binding.generate_programs,)}  # where a make_splits hands its other **knobs
TOKENIZER_TEXTS = 4000  # teacher_pool records the tokenizers learn from
MAX_POSITIONS = 256  # default max_position_embeddings (a model's `sizes` may set its own)
MODEL_KEYS = ("model_type", "tokenizer", "tie_word_embeddings", "data", "sizes")  # and `init`, optional
EMBED_INITS = {"random": None, "compositional": binding.compose_lines}  # init -> models.save_random_model's embed_init
SAVED_SPEC = "models.json"  # beside the built models: what they were built from (reuse check)
GATE_SPLIT = {"teacher_pool": "teacher_dev", "other_task": "other_task_dev"}  # a teacher's split -> its gate split
ASSETS = REPO_ROOT / "assets"  # assets/<task>/<teacher>/ and assets/<task>/manifest.json
MANIFEST = "manifest.json"
# a shipped teacher: the model as `from_pretrained` reads it, and its training's summary (a run dir with
# them is a finished training: runs.trained) and config (what it was trained with)
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "train_summary.json", "kvdistill_config.yaml")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # an AutoConfig model type: qwen2, llama, ...
    tokenizer: str  # a key of `tokenizers`
    tie_word_embeddings: bool
    data: str  # the split it trains on
    sizes: dict[str, Any]  # hidden_size, num_hidden_layers, ... (AutoConfig keyword arguments)
    init: str = "random"  # a key of EMBED_INITS


@dataclass(frozen=True)
class Models:
    tokenizers: dict[str, dict[str, Any]]  # name -> build_tokenizer keyword arguments
    models: dict[str, ModelSpec]


def read_models(path: str | Path) -> Models:
    """`models.json` at `path`, checked: a `ConfigError` naming the key and the fix on any defect."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a regime needs its models.json (tokenizers and model shapes; "
                          "configs/demo/binding/models.json is an example)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not JSON ({err}); fix the file") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tokenizers"), dict) or not isinstance(raw.get("models"), dict):
        raise ConfigError(f"{path} needs two objects, tokenizers (name -> build_tokenizer options) and models "
                          "(name -> model_type, tokenizer, tie_word_embeddings, data, sizes)")
    allowed = set(inspect.signature(build_tokenizer).parameters) - {"texts"}
    for name, opts in raw["tokenizers"].items():
        if not isinstance(opts, dict) or set(opts) - allowed or "vocab_size" not in opts:
            raise ConfigError(f"{path}: tokenizer {name}: needs vocab_size, and its options must be among "
                              f"{sorted(allowed)}; got {opts}")
    models = {}
    for name, m in raw["models"].items():
        if not isinstance(m, dict) or not set(MODEL_KEYS) <= set(m) <= {*MODEL_KEYS, "init"}:
            raise ConfigError(f"{path}: model {name} needs exactly the keys {list(MODEL_KEYS)} (and init, optional), "
                              f"got {sorted(m) if isinstance(m, dict) else m}")
        if m.get("init", ModelSpec.init) not in EMBED_INITS:
            raise ConfigError(f"{path}: model {name}: init {m['init']!r} is not one of {sorted(EMBED_INITS)}")
        if m["tokenizer"] not in raw["tokenizers"]:
            raise ConfigError(f"{path}: model {name} names tokenizer {m['tokenizer']!r}, not one of "
                              f"{sorted(raw['tokenizers'])}")
        if not isinstance(m["tie_word_embeddings"], bool) or not isinstance(m["sizes"], dict):
            raise ConfigError(f"{path}: model {name}: tie_word_embeddings must be true or false and sizes an object")
        models[name] = ModelSpec(**m)
    if not models:
        raise ConfigError(f"{path} names no model")
    return Models(raw["tokenizers"], models)


def build_models(spec_path: str | Path, data: str | Path, out: str | Path, seed: int = 0) -> dict[str, Path]:
    """The tokenizers and random-init models of `spec_path` (a models.json), saved at `out/<name>`.

    Tokenizers learn from the first `TOKENIZER_TEXTS` records of `data/teacher_pool.jsonl` (models naming
    the same tokenizer share it); model `i` (in the file's order) is seeded `seed + i`. Models already built
    from the same file, seed and texts are reused; built otherwise, a `ConfigError` says what to delete.
    """
    spec, out = read_models(spec_path), Path(out)
    records = read_jsonl(Path(data) / "teacher_pool.jsonl")[:TOKENIZER_TEXTS]
    if not records:
        raise ConfigError(f"no records in {Path(data) / 'teacher_pool.jsonl'}: the tokenizers learn from the "
                          "teacher pool; write the data first (`kvdistill gen-data --task binding|modular`)")
    texts = [format_example(r).text for r in records]
    paths = {name: out / name for name in spec.models}
    # a random init is left out of the record: models built before `init` existed still match it
    models = {n: {k: v for k, v in vars(m).items() if (k, v) != ("init", ModelSpec.init)} for n, m in spec.models.items()}
    made_from = {"seed": seed, "texts": hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16],
                 "tokenizers": spec.tokenizers, "models": models}
    saved = read_json(out / SAVED_SPEC)
    if saved is not None and saved != made_from:
        raise ConfigError(f"{out} holds models built from another models.json, seed or data than {spec_path} (seed "
                          f"{seed}, {data}); delete {out} and what was made from it to rebuild them")
    if saved is not None and all((p / "config.json").exists() for p in paths.values()):
        return paths
    toks = {name: build_tokenizer(texts, **opts) for name, opts in spec.tokenizers.items()}

    from transformers import AutoConfig

    for i, (name, m) in enumerate(spec.models.items()):
        cfg = AutoConfig.for_model(m.model_type, vocab_size=len(toks[m.tokenizer]), tie_word_embeddings=m.tie_word_embeddings,
                                   **{"max_position_embeddings": MAX_POSITIONS, **m.sizes})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            save_random_model(cfg, toks[m.tokenizer], paths[name], EMBED_INITS[m.init])
    write_json_atomic(out / SAVED_SPEC, made_from)
    return paths


def shipped(task: str) -> dict[str, Any]:
    """`assets/<task>/manifest.json`: `{"init": <SAVED_SPEC record>, "teachers": {name: {"files": {file: sha256},
    "command", "gate", ...}}}`; `{}` when the task ships none."""
    return read_json(ASSETS / task / MANIFEST, {})


def install_teacher(task: str, name: str, init: Path, dst: Path) -> None:
    """Copy shipped teacher `name` of `task` to `dst`, after checking each file against its manifest hash and
    the inits in `init` against the record it was trained from. A `dst` holding that teacher is kept; one
    holding another teacher, or inits built otherwise (another seed or data knobs), is a `ConfigError`."""
    manifest, src = shipped(task), ASSETS / task / name
    entry = manifest["teachers"][name]
    retrain = "or pass --retrain_teachers to train your own (an hour and more on CPU)"
    if read_json(init / SAVED_SPEC) != manifest["init"]:
        raise ConfigError(f"the shipped {task} teachers were trained from the inits of seed {manifest['init']['seed']} "
                          f"and the data knobs of configs/demo/{task}/demo.yaml as committed; {init} was built "
                          f"otherwise: run with --seed {manifest['init']['seed']} and those knobs, {retrain}")
    if changed := changed_files(src, entry):
        raise ConfigError(f"{changed[0]} is missing or does not match its SHA-256 in {ASSETS / task / MANIFEST} "
                          f"(a Git LFS pointer or an edited file); restore it with `git checkout -- {src}`, {retrain}")
    if (dst / "model.safetensors").is_file():
        if sha256_file(dst / "model.safetensors") == entry["files"]["model.safetensors"]:
            return
        raise ConfigError(f"{dst} holds another {name} than the one shipped in {src}; delete {dst.parent.parent} "
                          f"(what was made from it goes with it), {retrain}")
    tmp = dst.with_name(f"{dst.name}.partial")  # a killed copy leaves no teacher behind
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tmp.rename(dst)


def ship_teachers(task: str, out: Path, names: list[str], gates: dict[str, tuple[str, float]],
                  commands: dict[str, list[str]], environment: dict[str, Any]) -> Path:
    """Write the trained teachers `names` of the demo in `out` to `assets/<task>/` with their manifest
    (`gates`: name -> (split, accuracy); `commands`: the `kvdistill train` argv each was trained with)."""
    teachers = {name: ship_run(out / "teachers" / name, ASSETS / task / name, gates[name], commands[name])
                for name in names}
    # the teachers trained in the demo's subprocesses, one torch thread each (demo.run_parallel)
    return write_manifest(ASSETS / task, out / "init", teachers, 1, environment)


def write_manifest(root: Path, init: Path, teachers: dict[str, dict], threads: int,
                   environment: dict[str, Any]) -> Path:
    """`root/manifest.json` of shipped `teachers` (`ship_run` entries), trained from the inits in `init` with
    `threads` torch threads; `environment` is the shipping process's."""
    return write_json_atomic(root / MANIFEST, {"init": read_json(init / SAVED_SPEC), "teachers": teachers,
                                               "training_threads": threads, "environment": environment})


def ship_run(src: Path, dst: Path, gate: tuple[str, float], command: list[str]) -> dict[str, Any]:
    """Copy the trained model of run dir `src` to `dst` (`SHIPPED_FILES`); returns its manifest entry: each
    file's SHA-256, the `kvdistill` argv it was trained with, its gate `(split, accuracy)` and training summary."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in SHIPPED_FILES:
        shutil.copyfile(src / file, dst / file)
    split, acc = gate
    return {"files": {f: sha256_file(dst / f) for f in SHIPPED_FILES},
            "command": "kvdistill " + " ".join(repo_relative(a) if a.startswith("/") else a for a in command),
            "gate": {"split": split, "accuracy": acc}, "train_summary": read_json(src / "train_summary.json")}


def check_shipped(root: Path) -> list[str]:
    """The files under `root` (a task's `assets/` dir, or one below it with its own manifest) whose bytes do not
    match the SHA-256 their manifest records; `[]` when every shipped file is intact."""
    return [str(path) for manifest in sorted(root.rglob(MANIFEST))
            for name, entry in read_json(manifest)["teachers"].items()
            for path in changed_files(manifest.parent / name, entry)]


def changed_files(src: Path, entry: dict[str, Any]) -> list[Path]:
    """The files of shipped teacher dir `src` missing or not matching the SHA-256 its manifest `entry` records."""
    return [src / file for file, digest in entry["files"].items()
            if not (src / file).is_file() or sha256_file(src / file) != digest]


def check_data(task: str, knobs: dict[str, Any]) -> None:
    """A `ConfigError` when `task` has no regime data, or `knobs` miss one its make_splits needs or name one
    that neither it nor the generator it hands the rest to (`KNOBS_OF`) takes."""
    if task not in SPLIT_MAKERS:
        raise ConfigError(f"task {task!r} has no regime data; choose one of {sorted(SPLIT_MAKERS)}")
    maker = inspect.signature(SPLIT_MAKERS[task]).parameters.values()
    required = {p.name for p in maker if p.default is p.empty and p.kind is not p.VAR_KEYWORD}
    takes = {p.name for fn in (SPLIT_MAKERS[task], *KNOBS_OF.get(task, ()))
             for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD} - {"seed", "n", "exclude"}
    missing, unknown = required - set(knobs), set(knobs) - takes
    if missing or unknown:
        raise ConfigError(f"{task} data knobs: missing {sorted(missing)}, unknown {sorted(unknown)}; "
                          f"they are the keyword arguments of kvdistill.lab.tasks.{task}.make_splits: {sorted(takes)}")


def write_data(task: str, knobs: dict[str, Any], out: str | Path, seed: int = 0) -> dict[str, int]:
    """Every split of `task` (`SPLIT_MAKERS[task](**knobs, seed=seed)`, the code `gen-data --task` runs) as
    `out/<split>.jsonl`, and `task.json` (options and sizes); `{split: records}` counts. Reused when written
    with the same options; written with others, a `ConfigError` says what to delete."""
    check_data(task, knobs)
    out = Path(out)
    options = {"task": task, "seed": seed, **knobs}
    saved = read_json(out / "task.json")
    if saved is not None:
        if saved["options"] != options:
            raise ConfigError(f"{out} holds {saved['options'].get('task')} data made with other options than "
                              f"{options}; delete {out} and what was made from it to write it again")
        return saved["splits"]
    try:
        splits = SPLIT_MAKERS[task](**knobs, seed=seed)
    except ValueError as err:  # knobs no dataset can satisfy; the message names them
        raise ConfigError(f"{task} data: {err}") from None
    for name, records in splits.items():
        write_jsonl(records, out / f"{name}.jsonl")
    sizes = {name: len(records) for name, records in splits.items()}
    write_json_atomic(out / "task.json", {"options": options, "splits": sizes})
    return sizes


def teachers_of(models: Models, only: list[str] | None = None) -> dict[str, tuple[str, str]]:
    """`{name: (training split, gate split)}` of every model but the `student`, or of the models in `only`
    (demo.yaml's `teachers:`; the others are still built, so every model keeps its seed)."""
    unknown = sorted(set(only or ()) - set(models.models) | ({"student"} & set(only or ())))
    if unknown:
        raise ConfigError(f"demo.yaml teachers: {unknown} are not teachers of models.json; name some of "
                          f"{sorted(set(models.models) - {'student'})}")
    out = {}
    for name, m in models.models.items():
        if name == "student" or (only is not None and name not in only):
            continue
        if m.data not in GATE_SPLIT:
            raise ConfigError(f"teacher {name} trains on {m.data!r}; a regime's teachers train on one of "
                              f"{sorted(GATE_SPLIT)} (their gate: {GATE_SPLIT})")
        out[name] = (m.data, GATE_SPLIT[m.data])
    if "student" not in models.models or not out:
        raise ConfigError("a regime's models.json names a `student` and at least one teacher")
    return out


@dataclass(frozen=True)
class DemoSettings:
    """A regime's `demo.yaml`."""

    data: dict[str, Any]  # keyword arguments of the task's make_splits (gen-data's knobs; the seed is --seed)
    teacher_steps: int
    gate: float  # teachers' minimum accuracy on their gate split (teacher_dev, other_task_dev)
    curve_steps: int  # length of the student's SFT curve
    curve_every: int  # dev accuracy every N steps
    curve_items: int  # dev items per curve point
    probe: dict[str, Any]  # `kvdistill probe` options (target, rows, samples, max_length, ...) on dev
    teachers: list[str] | None = None  # the models trained and gated as teachers (None: all but the student)
    teacher_overrides: dict[str, dict[str, Any]] | None = None  # teacher -> `kvdistill train` options over teacher.yaml
    layout: dict[str, dict[str, Any]] | None = None  # teacher -> `kvdistill layout` options (numbers, generator)
    # the students stage: `config`, an ablation YAML beside demo.yaml with `{out}` for the output dir, and keys
    # over it (seeds, overrides, eval, workers): the demo runs it from what it built (`students_section`)
    students: dict[str, Any] | None = None


PER_TEACHER = {"teacher_overrides": "teacher_other: {learning_rate: 1.0e-3}, its train options over teacher.yaml",
               "layout": "teacher_other: {numbers: 17, generator: 3}, its kvdistill layout options"}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `over`, a mapping into a mapping key by key, at any depth."""
    return {k: merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
            for k, v in {**base, **over}.items()}


def read_settings(path: str | Path, quick: bool = False) -> DemoSettings:
    """`demo.yaml` at `path`; `quick` applies its `quick:` block (a mapping updates a mapping key by key, at
    any depth)."""
    raw = read_yaml(path, "demo settings")
    over = raw.pop("quick", {}) if quick else {}
    raw.pop("quick", None)
    raw = merged(raw, over)
    names = {f.name for f in fields(DemoSettings)}
    optional = {f.name for f in fields(DemoSettings) if f.default is not MISSING}
    if not names - optional <= set(raw) <= names:
        raise ConfigError(f"{path}: needs the keys {sorted(names - optional)} (optional: {sorted(optional)}, "
                          f"quick:); missing {sorted(names - optional - set(raw))}, unknown {sorted(set(raw) - names)}")
    if not isinstance(raw["data"], dict) or not isinstance(raw["probe"], dict):
        raise ConfigError(f"{path}: data and probe must be mappings (make_splits knobs; kvdistill probe options)")
    for key, example in PER_TEACHER.items():
        if not all(isinstance(v, dict) for v in (raw.get(key) or {}).values()):
            raise ConfigError(f"{path}: {key} maps a teacher's name to its options (e.g. {example})")
    students = raw.get("students")
    if students is not None and not (isinstance(students, dict) and isinstance(students.get("config"), str)):
        raise ConfigError(f"{path}: students needs `config:`, the ablation YAML beside demo.yaml (e.g. students.yaml)")
    if not 0 <= raw["gate"] <= 1:
        raise ConfigError(f"{path}: gate {raw['gate']} is not an accuracy; set it between 0 and 1")
    return DemoSettings(**raw)


def probe_summary(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """Per probed model of a `probe.json` that has an untrained copy beside it: its best cell (kind, layer,
    score, the shuffled-label control there), the majority baseline, the untrained copy's best score, and
    the cell where the trained model beats its untrained copy most (`gain`: what training put there; a
    token's identity, say, decodes from any random embedding)."""
    rows = []
    for m in (m for m in probe["models"] if not m["untrained"]):
        cells = {(c["kind"], c["layer"]): c for c in probe["cells"] if c["model"] == m["name"]}
        untrained = {(c["kind"], c["layer"]): c["score"] for c in probe["cells"]
                     if c["model"] == f"{m['name']} (untrained)"}
        best = max(cells.values(), key=lambda c: c["score"])
        most = max(cells, key=lambda k: cells[k]["score"] - untrained[k])
        rows.append({"model": m["name"], "kind": best["kind"], "layer": best["layer"], "score": best["score"],
                     "shuffled": best["shuffled"], "baseline": m["baseline"], "untrained": max(untrained.values()),
                     "gain": cells[most]["score"] - untrained[most], "gain_at": f"{most[0]} @ {most[1]}"})
    return rows


def layout_rows(layout: dict[str, Any]) -> list[str]:
    """A `layout.json`'s markdown rows: per model, each code's top-2 share (its untrained copy's beside it)."""
    rows = {(r["model"], r["code"]): r for r in layout["rows"]}
    out = []
    for (model, code), r in rows.items():
        if not r["untrained"]:
            copy = rows.get((f"{model} (untrained)", code))
            out.append(f"| {Path(model).name} | {layout['cycle']} | {code} | {r['share']:.3f} {r['frequencies']} | "
                       f"{r['circulant_r2']:.3f} | {copy['share'] if copy else float('nan'):.3f} |")
    return out


def regime_report(task: str, out: Path, gates: dict[str, tuple[str, float]], gate: float,
                  probes: dict[str, dict[str, Any]], curve: dict[str, Any], assets: str,
                  layouts: dict[str, dict[str, Any]] | None = None, students: list[str] | None = None,
                  students_plot: str | None = None) -> str:
    """The markdown of `report.md`: the students' table when the demo ran them (`students_section`; their
    accuracy plot at `students_plot`, relative to `out`), the teachers' gate, the probe audit (and the layout
    audit), the SFT curve and budget, the assets."""
    first = next(iter(probes.values()))
    lines = [f"# kvdistill demo --task {task}", "", *([*students, ""] if students else []),
             f"**Teachers' quality gate** (greedy accuracy on their held-out split; gate {gate:.2f}):", "",
             "| teacher | split | accuracy |", "|---|---|---:|",
             *[f"| {name} | {split} | {acc:.3f} |" for name, (split, acc) in gates.items()], "",
             f"**Probe audit** (`probe/<teacher>/probe.json`, heatmaps `probe.png`): a linear probe of {first['target']} "
             f"at {first['rows']} rows of dev, held-out {first['metric']}: each teacher's best cell beside the "
             "majority baseline, the shuffled-label control there and its untrained copy's best; and the cell "
             "where training added most over the untrained copy.", "",
             "| teacher | best kind @ layer | score | baseline | shuffled | untrained best | most over untrained |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in (r for probe in probes.values() for r in probe_summary(probe)):
        lines.append(f"| {r['model']} | {r['kind']} @ {r['layer']} | {r['score']:.3f} | {r['baseline']:.3f} | "
                     f"{r['shuffled']:.3f} | {r['untrained']:.3f} | {r['gain']:+.3f} at {r['gain_at']} |")
    if layouts:
        lines += ["", "**Layout audit** (`layout/<teacher>/layout.json`, `kvdistill layout`): how cyclic each teacher's "
                  "code of the numbers is on its operation's cycle, which a probe cannot show (distinct number tokens "
                  f"decode from any code): the share of its power in the top 2 frequencies (uniform "
                  f"{next(iter(layouts.values()))['rows'][0]['uniform']:.3f}), the circulant R² of its Gram matrix, and "
                  "the untrained copy's share.", "",
                  "| teacher | cycle | code | share [frequencies] | circulant R² | untrained share |",
                  "|---|---|---|---:|---:|---:|", *[row for layout in layouts.values() for row in layout_rows(layout)]]
    points = ", ".join(f"{s}: {a:.3f}" for s, a in curve["points"])
    lines += ["", f"**SFT learning curve** of the student on its {curve['labelled']} labelled records (dev accuracy, "
              f"`sft_curve.png`): {points}. Budget: {curve['budget']} steps, the first at >= 95 % of the best "
              f"({curve['best']:.3f} at step {curve['best_step']}; dev {curve['at_budget']:.3f} there).", "",
              f"**Assets** `configs/demo/evidence_{task}.yaml` reads (what this demo wrote under `{out}`):", "",
              "```yaml", assets, "```", "", *([f"![students]({students_plot})"] if students_plot else []),
              "![SFT curve](sft_curve.png)",
              *[f"![probe {n}](probe/{n}/probe.png)" for n in probes], ""]
    return "\n".join(lines)


def students_section(report: dict[str, Any], where: str) -> list[str]:
    """The students' table of `report.md`, from their ablation's report (`ablation.json` at `where`): each
    arm's test accuracy (mean, then per seed) and answer NLL, and beside it each comparison the ablation made
    (its reference, then its controls): the difference and the item-level bootstrap interval of accuracy."""
    variants = report["variants"]
    n = {r["n"] for v in variants.values() for r in v["runs"].values()}
    lines = [f"**What transfers** (`{where}`): the students on {'/'.join(map(str, sorted(n)))} test records, seeds "
             f"{', '.join(map(str, report['seeds']))}; Δ is the arm minus the one it is compared with, its interval the "
             f"bootstrap over (seed, record) pairs ({report['n_resamples']:,} resamples): the test set's variance, "
             "with so few seeds hardly the training's.", "",
             "| arm | test accuracy (per seed) | answer NLL | compared with | Δ accuracy [95 % CI] | Δ answer NLL |",
             "|---|---|---:|---|---:|---:|"]
    for v in variants.values():
        per_seed = ", ".join(f"{r['accuracy']:.3f}" for r in v["runs"].values())
        head = f"| {v['label']} | {v['accuracy']['mean']:.3f} ({per_seed}) | {v['answer_nll']['mean']:.3f} |"
        if not v["comparisons"]:
            lines.append(f"{head} – | – | – |")
        for k, (ref, c) in enumerate(v["comparisons"].items()):
            b = c["bootstrap"]
            lines.append(f"{head if k == 0 else '| | | |'} {variants[ref]['label']} | {b['mean_diff']:+.3f} "
                         f"[{b['ci_low']:+.3f}, {b['ci_high']:+.3f}] | {c['answer_nll']['mean_diff']:+.3f} |")
    return lines
