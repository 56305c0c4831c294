"""Modular arithmetic in GSM8K format: `a + b mod p` (or `a * b mod p`) over the whole table.

    12+5=17. 40+30=11. 57+2=0. 8+8=16. 3+50=53. What is 7+9?   ->   "#### 16" (p = 59, no rationale)

Every sequence packs `min_equations`..`max_equations` equations: the solved ones are context, the
last is asked. The metric is clean: one item asks one pair, read greedily as `#### c`, and the
context never holds the asked pair nor its swap (both ops commute), so it cannot be copied. The
context pairs come from the pairs the reader was trained on (the labelled ones for the student's
splits), so a teacher's logits on any token of a student sequence tell nothing beyond the labels;
what the teachers know beyond them is how numbers are laid out, in their internals. Packing puts
3 numbers per equation into each sequence: many number rows for a relation signal.

The p*p ordered pairs are split once per seed: the student's labelled pairs (`labelled` of the
table), the teachers' pairs (`teacher_fraction`, a superset) and the rest (the teachers' held-out
gate). The student's dev and test ask disjoint sets of pairs it has no label for.

Per-token fields (`kvdistill.fields`), character spans of the question, on every number (operands,
results, the asked operands):
    number   its value (the probe's target, the oracle's geometry: magnitude or Fourier Gram)
    numeral  1 (the row mask of number tokens: `field:` rows take non-zero tokens, and 0 is a number)
Deterministic in the seed.
"""

from __future__ import annotations

import random

from kvdistill.lab.tasks import Piece, spell

OPS = {"add": ("+", lambda a, b, p: (a + b) % p), "mul": ("*", lambda a, b, p: a * b % p)}

Pair = tuple[int, int]


def make_sequence(query: Pair, context: list[Pair], *, p: int, op: str) -> dict:
    """One record: the solved `context` equations, then `query` asked."""
    sym, fn = OPS[op]

    def number(v: int) -> Piece:
        return str(v), {"number": v, "numeral": 1}

    pieces: list[Piece] = []
    for a, b in context:
        pieces += [number(a), sym, number(b), "=", number(fn(a, b, p)), ". "]
    question, fields = spell([*pieces, "What is ", number(query[0]), sym, number(query[1]), "?"])
    return {"question": question, "answer": f"#### {fn(*query, p)}", "token_fields": fields}


def make_items(rng: random.Random, queries: list[Pair], known: list[Pair], *, p: int, op: str, min_equations: int,
               max_equations: int) -> list[dict]:
    """One record per query; its context: `k - 1` distinct `known` pairs other than the query and its swap."""
    out = []
    for a, b in queries:
        k = rng.randint(min_equations, max_equations)
        context = []
        while len(context) < k - 1:  # known holds far more than k pairs: a few redraws at most
            pair = rng.choice(known)
            if pair not in context and pair not in ((a, b), (b, a)):
                context.append(pair)
        out.append(make_sequence((a, b), context, p=p, op=op))
    return out


def shuffled(rng: random.Random, pairs: list[Pair]) -> list[Pair]:
    return rng.sample(pairs, len(pairs))


def split_table(p: int, labelled: float, teacher_fraction: float, seed: int) -> tuple[list[Pair], list[Pair], list[Pair]]:
    """The p*p ordered pairs as (labelled, teacher-only, held out by everyone), each shuffled."""
    pairs = [(a, b) for a in range(p) for b in range(p)]
    random.Random(seed).shuffle(pairs)
    n_lab, n_teach = round(labelled * p * p), round(teacher_fraction * p * p)
    return pairs[:n_lab], pairs[n_lab:n_teach], pairs[n_teach:]


def check_knobs(*, p: int, op: str, labelled: float, teacher_fraction: float, min_equations: int,
                max_equations: int) -> None:
    """`ValueError` naming the knob when no dataset can be made with these knobs."""
    if not 3 <= p <= 100:
        raise ValueError(f"modulus must be in 3..100 (whole-number tokens stop at 2 digits), got {p}")
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {tuple(OPS)}")
    if not 0 < labelled < teacher_fraction <= 1:
        raise ValueError(f"need 0 < labelled < teacher_fraction <= 1, got {labelled}, {teacher_fraction}")
    if not 1 <= min_equations <= max_equations:
        raise ValueError(f"need 1 <= min_equations <= max_equations, got {min_equations}, {max_equations}")
    if round(labelled * p * p) < max_equations + 2:  # context + the query and its swap
        raise ValueError(f"labelled {labelled} of {p}x{p} is {round(labelled * p * p)} pairs, too few for contexts "
                         f"of {max_equations - 1} equations; raise labelled or modulus, or lower max_equations")


def make_splits(
    *,
    n_dev: int,
    n_test: int,
    n_teacher_dev: int,
    p: int = 59,
    op: str = "add",
    labelled: float = 0.35,
    teacher_fraction: float = 0.9,
    min_equations: int = 6,
    max_equations: int = 8,
    repeats: int = 1,
    other_task: bool = True,
    seed: int = 0,
) -> dict[str, list[dict]]:
    """The splits of the modular regime, `{name: records}`.

    train: every labelled pair asked `repeats` times; teacher_pool: every teacher pair `repeats` times;
    teacher_dev: pairs held out from the teachers; dev, test: disjoint pairs the student has no label
    for (test: "the unseen pairs"). other_task, other_task_dev: the same for the other op (`mul` for
    `add` and back) over its own split of the table.
    """
    knobs = dict(p=p, labelled=labelled, teacher_fraction=teacher_fraction, min_equations=min_equations,
                 max_equations=max_equations)
    check_knobs(op=op, **knobs)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    lab, teach, rest = split_table(p, labelled, teacher_fraction, seed)
    unseen = teach + rest
    if n_dev + n_test > len(unseen) or n_teacher_dev > len(rest):
        raise ValueError(f"{p}x{p} with labelled {labelled}, teacher_fraction {teacher_fraction} leaves {len(unseen)} "
                         f"unlabelled pairs for n_dev + n_test = {n_dev + n_test} and {len(rest)} teacher-held-out "
                         f"pairs for n_teacher_dev = {n_teacher_dev}; ask for fewer or change the fractions")
    rng = random.Random(seed + 1)
    held = random.Random(seed + 2).sample(unseen, n_dev + n_test)  # teacher pairs and held-out ones alike
    shape = dict(p=p, min_equations=min_equations, max_equations=max_equations)
    splits = {
        "teacher_pool": make_items(rng, shuffled(rng, (lab + teach) * repeats), lab + teach, op=op, **shape),
        "train": make_items(rng, shuffled(rng, lab * repeats), lab, op=op, **shape),
        "dev": make_items(rng, held[:n_dev], lab, op=op, **shape),
        "teacher_dev": make_items(rng, rest[:n_teacher_dev], lab + teach, op=op, **shape),
        "test": make_items(rng, held[n_dev:], lab, op=op, **shape),
    }
    if other_task:
        other = "mul" if op == "add" else "add"
        lab_o, teach_o, rest_o = split_table(p, labelled, teacher_fraction, seed + 3)
        known = lab_o + teach_o
        splits.update(other_task=make_items(rng, shuffled(rng, known * repeats), known, op=other, **shape),
                      other_task_dev=make_items(rng, rest_o[:n_teacher_dev], known, op=other, **shape))
    return splits
