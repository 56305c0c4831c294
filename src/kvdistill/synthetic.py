"""Synthetic GSM8K-format arithmetic word problems with a step-by-step rationale.

The embedded default and the tests train on these: multi-step add/subtract (optionally
multiply) stories whose answer field is `rationale + "\\n#### <number>"`, exactly like GSM8K.
Everything is deterministic in the seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvdistill.io import write_text_atomic

NAMES = ("Tom", "Ann", "Sam", "Mia", "Leo", "Ava", "Ben", "Zoe", "Max", "Eva", "Jay", "Ivy")
ITEMS = ("apples", "coins", "books", "cards", "pens", "shells", "stamps", "eggs")
OPS = ("add", "sub", "mul")


def make_problem(rng: random.Random, *, steps: int, max_value: int, ops: Sequence[str]) -> dict:
    """One problem: a start amount changed by `steps` operations."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    cur = rng.randint(2, max_value)
    sentences, lines = [f"{name} has {cur} {item}."], []
    for _ in range(steps):
        op = rng.choice([o for o in ops if o != "sub" or cur > 1])
        if op == "add":
            a = rng.randint(1, max_value)
            sentences.append(rng.choice([f"{name} gets {a} more.", f"{name} buys {a} more {item}."]))
            new, sym = cur + a, "+"
        elif op == "sub":
            a = rng.randint(1, cur - 1)
            sentences.append(rng.choice([f"{name} gives away {a}.", f"{name} loses {a} {item}."]))
            new, sym = cur - a, "-"
        else:
            a = rng.randint(2, 3)
            sentences.append(f"{name} gets {a} times as many.")
            new, sym = cur * a, "*"
        lines.append(f"{cur} {sym} {a} = {new}.")
        cur = new
    question = " ".join([*sentences, f"How many {item} does {name} have now?"])
    return {"question": question, "answer": "\n".join(lines) + f"\n#### {cur}"}


def generate_problems(
    n: int,
    seed: int = 0,
    *,
    min_steps: int = 2,
    max_steps: int = 3,
    max_value: int = 20,
    ops: Sequence[str] = ("add", "sub"),
    exclude: Iterable[str] = (),
) -> list[dict]:
    """`n` distinct problems (distinct questions), none of whose questions is in `exclude`."""
    if min_steps < 1 or max_steps < min_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if bad := set(ops) - set(OPS):
        raise ValueError(f"unknown ops {sorted(bad)}; choose from {OPS}")
    rng = random.Random(seed)
    seen, out = set(exclude), []
    for _ in range(n * 50):
        rec = make_problem(rng, steps=rng.randint(min_steps, max_steps), max_value=max_value, ops=ops)
        if rec["question"] not in seen:
            seen.add(rec["question"])
            out.append(rec)
            if len(out) == n:
                return out
    raise ValueError(f"could only make {len(out)} distinct problems; raise max_value or max_steps")


def make_splits(n_train: int, n_test: int, seed: int = 0, **knobs) -> tuple[list[dict], list[dict]]:
    """Train and test sets with no question in common."""
    train = generate_problems(n_train, seed, **knobs)
    test = generate_problems(n_test, seed + 1_000_003, exclude=(r["question"] for r in train), **knobs)
    return train, test


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    """One JSON object a line, written atomically (`io.write_text_atomic`): a killed or failed write
    leaves no half file that a later run would read as a smaller dataset."""
    return write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def write_dataset(out_dir: str | Path, n_train: int, n_test: int, seed: int = 0, **knobs) -> Path:
    """Write `train.jsonl` and `test.jsonl` under `out_dir`."""
    train, test = make_splits(n_train, n_test, seed, **knobs)
    out_dir = Path(out_dir)
    write_jsonl(train, out_dir / "train.jsonl")
    write_jsonl(test, out_dir / "test.jsonl")
    return out_dir
