"""`kvdistill gen-data`: write a generated GSM8K-format dataset as jsonl splits.

Tasks (docs/tasks.md):
  arithmetic  multi-step add/subtract word problems with a rationale: train, dev, test
  binding     variable-binding programs (`b=7. k=b. What is k?` -> `#### 7`): teacher_pool, train (the
              student's labelled subset of the pool), dev, teacher_dev (the teachers' gate), test,
              other_task and other_task_dev (one lookup shallower, for the other-task control teacher)
  modular     `a+b mod p`, several equations per sequence, one asked: the same splits; train covers
              `labelled` of the table, dev and test ask pairs without a label, other_task is `a*b mod p`
  text        real text, not generated: windows of local text files (default Debian's git release notes),
              each file in one split (`lab/tasks/corpus.py`); text-format records (LM loss on every token)
  facts       questions about a fixed fact sheet (`What is Tova's desk?` -> `#### 7`) that only a teacher's
              template holds (`sheet.txt`): train, dev and test (facts held out of train), every_fact;
              with --attributes 1 `Tova: ` -> `7` prompt/completion records: train, every_fact, with_sheet

Every option names its task in `--help` ([binding] ...); setting one of another task is refused.
`task.json` beside the splits records the options and the split sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from kvdistill.config import ConfigError, check_output_dir, option, parse_config
from kvdistill.io import write_json_atomic
from kvdistill.lab.tasks import binding, corpus, facts, modular
from kvdistill.synthetic import OPS, generate_problems, make_splits, write_jsonl

TASKS = ("arithmetic", "binding", "modular", "text", "facts")


def knob(default, help: str, *tasks: str):
    """An option of some tasks only: its help starts with them (`[binding] ...`), which is where
    `__post_init__` reads them to refuse it for the others."""
    return option(default, f"[{', '.join(tasks)}] {help}")


def tasks_of(help: str) -> list[str]:
    """The tasks a `knob`'s help names; [] for an option of every task."""
    return help[1:help.index("]")].split(", ") if help.startswith("[") else []


@dataclass
class GenDataConfig:
    """Options of `kvdistill gen-data`."""

    output_dir: str | None = option(None, "Output directory (one <split>.jsonl per split). Required.",
                                    aliases=["--out"])
    task: str = option("arithmetic", f"Which task: {', '.join(TASKS)}.")
    seed: int = option(0, "Generator seed.")
    n_dev: int | None = option(None, "Dev problems (settings and budgets are chosen on them; never on test); "
                               "default 200, facts: held-out facts of half the entities.")
    n_test: int | None = option(None, "Test problems; default 500, facts: the other entities' held-out facts.")
    n_train: int = knob(2000, "Training problems (binding: the student's labelled subset of the pool; text: "
                        "windows).", "arithmetic", "binding", "text")
    min_steps: int = knob(2, "Fewest arithmetic steps per problem.", "arithmetic")
    max_steps: int = knob(3, "Most arithmetic steps per problem.", "arithmetic")
    max_value: int = knob(20, "Largest operand.", "arithmetic")
    ops: str = knob("add,sub", f"Comma-separated subset of {OPS}.", "arithmetic")
    n_pool: int = knob(20000, "Programs in the teachers' pool (and in other_task).", "binding")
    n_teacher_dev: int = knob(200, "Held-out problems of the teachers' gate (and of other_task_dev).",
                              "binding", "modular")
    other_task: bool = knob(True, "Also write other_task / other_task_dev (binding: one lookup shallower; modular: "
                            "the other op).", "binding", "modular")
    min_chains: int = knob(2, "Fewest chains per program.", "binding")
    max_chains: int = knob(3, "Most chains per program (at most 10: one root digit each).", "binding")
    depth: int = knob(2, "Lookups from the queried name to its digit (1: the depth-1 variant, 0: recall).", "binding")
    n_recall: int = knob(0, "Depth-0 programs added to the teachers' pool (recall beside the hops).", "binding")
    names: int = knob(14, "Variable names to draw from (the first N lowercase letters).", "binding")
    order: str = knob("interleave", f"Line order, one of {binding.ORDERS}: interleave keeps each chain's lines in "
                      "definition order (every name's value is known where it stands); shuffle does not.", "binding")
    unseen: str = knob("program", f"What dev/test share with no pool problem, one of {binding.UNSEEN}: program = its "
                       "set of lines in any order; chain = also the queried chain.", "binding")
    modulus: int = knob(59, "p of `a op b mod p` (3..100; whole-number tokens cover 0..p-1).", "modular")
    op: str = knob("add", f"The operation, one of {tuple(modular.OPS)} (other_task uses the other).", "modular")
    labelled: float = knob(0.35, "Share of the p*p table the student has labels for (train).", "modular")
    teacher_fraction: float = knob(0.9, "Share of the table the teachers train on (includes the labelled "
                                   "pairs; the rest is their held-out gate).", "modular")
    min_equations: int = knob(6, "Fewest equations per sequence (the last one is asked).", "modular")
    max_equations: int = knob(8, "Most equations per sequence.", "modular")
    source: str = knob(str(corpus.GIT_RELNOTES), "A directory of .txt files (or one file) to cut into windows.",
                       "text")
    window_chars: int = knob(1000, "Most characters per window (paragraphs packed whole where they fit).", "text")
    entities: int = knob(30, "Entities on the sheet (one line each; one fact of each is held out of train).",
                         "facts")
    attributes: int = knob(3, f"Digits per entity, the first N of {facts.ATTRIBUTES}; 1: key -> value lines, "
                           "prompt/completion records, nothing held out (recall).", "facts")
    repeats: int = knob(1, "Times each training pair is asked (with other contexts) in train and teacher_pool.",
                        "modular")

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ConfigError("no output directory: pass --output_dir DIR")
        if self.task not in TASKS:
            raise ConfigError(f"task {self.task!r} is not one of {TASKS}")
        for f in fields(self):
            tasks = tasks_of(f.metadata["help"])
            if tasks and self.task not in tasks and getattr(self, f.name) != f.default:
                raise ConfigError(f"--{f.name} is an option of --task {'/'.join(tasks)}, not of {self.task}; "
                                  "drop it or pick that task")
        if self.task == "facts":  # the held-out facts, one per entity, split between dev and test (none in recall)
            held = self.entities if self.attributes > 1 else 0
            self.n_dev = held // 2 if self.n_dev is None else self.n_dev
            self.n_test = max(held - self.n_dev, 0) if self.n_test is None else self.n_test
        self.n_dev = 200 if self.n_dev is None else self.n_dev
        self.n_test = 500 if self.n_test is None else self.n_test
        counts = ("n_train", "n_dev", "n_test", "n_pool", "n_teacher_dev", "n_recall")
        if bad := [n for n in counts if getattr(self, n) < 0]:
            raise ConfigError(f"{', '.join(bad)} must be >= 0")
        if self.task == "text" and self.window_chars < 1:
            raise ConfigError(f"--window_chars must be >= 1, got {self.window_chars}")
        if self.task == "arithmetic":
            if not 1 <= self.min_steps <= self.max_steps or self.max_value < 2:
                raise ConfigError("need 1 <= min_steps <= max_steps and max_value >= 2")
            if bad := set(self.ops.split(",")) - set(OPS):
                raise ConfigError(f"ops: unknown {sorted(bad)}; choose from {OPS}")
        try:  # the task's own checks, before anything is generated
            if self.task == "binding":
                binding.check_knobs(min_chains=self.min_chains, max_chains=self.max_chains, depth=self.depth,
                                    names=self.names, order=self.order, unseen=self.unseen)
            elif self.task == "modular":
                modular.check_knobs(p=self.modulus, op=self.op, labelled=self.labelled,
                                    teacher_fraction=self.teacher_fraction, min_equations=self.min_equations,
                                    max_equations=self.max_equations)
            elif self.task == "facts":
                facts.check_knobs(entities=self.entities, attributes=self.attributes, n_dev=self.n_dev,
                                  n_test=self.n_test)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def make_task_splits(cfg: GenDataConfig) -> dict[str, list[dict]]:
    """`{split: records}` of `cfg.task`; `ValueError` when these knobs cannot make that many."""
    if cfg.task == "binding":
        return binding.make_splits(
            n_pool=cfg.n_pool, n_train=cfg.n_train, n_dev=cfg.n_dev, n_test=cfg.n_test,
            n_teacher_dev=cfg.n_teacher_dev, n_recall=cfg.n_recall, other_task=cfg.other_task, seed=cfg.seed,
            unseen=cfg.unseen, min_chains=cfg.min_chains, max_chains=cfg.max_chains, depth=cfg.depth, names=cfg.names,
            order=cfg.order,
        )
    if cfg.task == "text":
        return corpus.make_splits(cfg.source, n_train=cfg.n_train, n_dev=cfg.n_dev, n_test=cfg.n_test,
                                  window_chars=cfg.window_chars, seed=cfg.seed)
    if cfg.task == "modular":
        return modular.make_splits(
            n_dev=cfg.n_dev, n_test=cfg.n_test, n_teacher_dev=cfg.n_teacher_dev, p=cfg.modulus, op=cfg.op,
            labelled=cfg.labelled, teacher_fraction=cfg.teacher_fraction, min_equations=cfg.min_equations,
            max_equations=cfg.max_equations, repeats=cfg.repeats, other_task=cfg.other_task, seed=cfg.seed,
        )
    if cfg.task == "facts":
        return facts.make_splits(entities=cfg.entities, attributes=cfg.attributes, n_dev=cfg.n_dev,
                                 n_test=cfg.n_test, seed=cfg.seed)
    knobs = dict(min_steps=cfg.min_steps, max_steps=cfg.max_steps, max_value=cfg.max_value, ops=cfg.ops.split(","))
    train, test = make_splits(cfg.n_train, cfg.n_test, cfg.seed, **knobs)
    dev = generate_problems(cfg.n_dev, cfg.seed + 2_000_006, exclude=[r["question"] for r in train + test], **knobs)
    return {"train": train, "dev": dev, "test": test}


def _check_reuse(out: Path, options: dict) -> None:
    """A non-empty `out` is refused unless it holds this very data (same task and options: the same command
    rerun writes the same files): splits of two settings, or of a stale run, are never left side by side."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        old = json.loads((out / "task.json").read_text())["options"]
    except (OSError, ValueError, KeyError, TypeError):
        old = None
    same = json.loads(json.dumps({k: v for k, v in options.items() if k != "output_dir"}))  # as task.json holds it
    if old is not None and {k: v for k, v in old.items() if k != "output_dir"} == same:
        return
    what = "data written with other options (task.json)" if old is not None else "files gen-data did not write"
    raise ConfigError(f"--output_dir {out} already holds {what}; pass a new directory or remove it")


def main(argv: list[str]) -> int:
    cfg = parse_config(GenDataConfig, argv, "kvdistill gen-data", __doc__)
    out = Path(cfg.output_dir)
    options = {f.name: getattr(cfg, f.name) for f in fields(cfg) if cfg.task in (tasks_of(f.metadata["help"]) or [cfg.task])}
    _check_reuse(out, options)
    check_output_dir(out)
    try:
        splits = make_task_splits(cfg)
    except ValueError as err:  # too few distinct problems for these knobs; the message names them
        raise ConfigError(str(err)) from None
    for name, records in splits.items():
        write_jsonl(records, out / f"{name}.jsonl")
    if cfg.task == "facts":  # what the teacher's template holds; the records never do
        (out / "sheet.txt").write_text(facts.sheet(entities=cfg.entities, attributes=cfg.attributes,
                                                   seed=cfg.seed) + "\n")
    sizes = {name: len(records) for name, records in splits.items()}
    write_json_atomic(out / "task.json", {"options": options, "splits": sizes})
    print(f"wrote {cfg.task}: " + ", ".join(f"{name} {n}" for name, n in sizes.items()) + f" to {out}")
    return 0
