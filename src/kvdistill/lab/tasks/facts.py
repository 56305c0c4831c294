"""A fixed fact sheet only the teacher reads, and questions about it (context distillation).

    sheet (in the teacher's template only):   Tova: room 3, desk 7, bus 2.
                                              Bram: room 1, desk 4, bus 9.  ...
    question (what the student reads):        What is Tova's desk?   ->   "#### 7" (no rationale)

Every entity has `attributes` digits, drawn uniformly. A teacher that reads the sheet answers any
question by looking it up; a student that never sees it can only learn the facts into its weights.
One fact per entity is held out of train (its attribute drawn per entity): dev and test ask those,
`n_dev` and `n_test` entities' worth, so a student's labels never hold a test fact, and only a signal
on the questions it is trained on (the teacher's cache at the entity's name, say) could carry it.
Chance is 0.1: no digit of the answer is in the student's input.

Per-token fields (`kvdistill.fields`), character spans of the question:
    value      the digit asked for, on the entity's name and on the attribute (the probe's target)
    held       the entity's held-out digit, on its name (does the name's row carry the fact not asked?)
    name       1 on the entity's name (a row mask)
    attribute  1 on the attribute asked (a row mask: where a reader of the sheet can know the answer)

Splits: train (every fact but the held-out ones), dev, test (held-out facts, of distinct entities),
every_fact (each fact asked once, for probes; never a training split). `sheet(...)` is the text
a teacher's template holds. Deterministic in the seed.

With one attribute the sheet is key -> value lines and nothing is held out (recall):

    sheet:    Tova: 3            record (standard prompt/completion):   "Tova: " -> "3"
              Bram: 7

The answer follows its key as on the sheet, so a reader of the sheet answers by copying (Gemma-3-270m's
top token is the value for 0.72 of 32 facts with this sheet, 0.08 for the question layout: docs/results/
evidence_real_recall), and a student learns
the facts into its weights: context distillation measures how fast, not whether it generalises.
Splits: train (every fact, shuffled), every_fact (sheet order) and with_sheet (every_fact with the sheet
in its prompt: what the teacher reads, for probes). Fields: `value` on the prompt, `name` on the name,
`query` on the ": " after it (the row a copying reader predicts the value from).
"""

from __future__ import annotations

import random

from kvdistill.lab.tasks import spell

ATTRIBUTES = ("room", "desk", "bus", "gate", "floor", "line")
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def check_knobs(*, entities: int, attributes: int, n_dev: int, n_test: int) -> None:
    """`ValueError` naming the knob when no sheet can be made with these knobs."""
    if not 1 <= attributes <= len(ATTRIBUTES):
        raise ValueError(f"attributes must be in 1..{len(ATTRIBUTES)}, got {attributes}")
    if attributes == 1 and n_dev + n_test:
        raise ValueError("with one attribute nothing is held out (recall: every split asks every fact); "
                         "drop --n_dev and --n_test, or give --attributes 2 or more")
    if not 1 <= entities <= 1000:
        raise ValueError(f"entities must be in 1..1000, got {entities}")
    if n_dev + n_test > entities:
        raise ValueError(f"n_dev {n_dev} + n_test {n_test} held-out facts need as many entities (one each), only "
                         f"{entities}; raise --entities or ask for fewer")


def make_sheet(entities: int, attributes: int, seed: int) -> list[tuple[str, list[int], int]]:
    """`[(name, its digits per attribute, the index of its held-out attribute)]`, names distinct."""
    rng = random.Random(seed)
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    names = rng.sample([(a + b).capitalize() for a in syllables for b in syllables], entities)
    return [(n, [rng.randrange(10) for _ in range(attributes)], rng.randrange(attributes)) for n in names]


def sheet_text(rows: list[tuple[str, list[int], int]]) -> str:
    """The sheet as the teacher reads it: one line per entity."""
    if len(rows[0][1]) == 1:  # recall: the value right after its key
        return "\n".join(f"{name}: {digits[0]}" for name, digits, _ in rows)
    return "\n".join(f"{name}: " + ", ".join(f"{ATTRIBUTES[a]} {d}" for a, d in enumerate(digits)) + "."
                     for name, digits, _ in rows)


def question(name: str, digits: list[int], held: int, attribute: int) -> dict:
    """The record asking `name`'s `attribute`."""
    value = digits[attribute]
    text, fields = spell(["What is ", (name, {"value": value, "held": digits[held], "name": 1}), "'s ",
                          (ATTRIBUTES[attribute], {"value": value, "attribute": 1}), "?"])
    return {"question": text, "answer": f"#### {value}", "token_fields": fields}


def recall(name: str, value: int, sheet: str = "") -> dict:
    """The prompt/completion record asking `name`'s one value (`sheet`: text before it in the prompt)."""
    prompt, fields = spell([sheet, (name, {"value": value, "name": 1}), (": ", {"value": value, "query": 1})])
    return {"prompt": prompt, "completion": str(value), "token_fields": fields}


def make_splits(*, entities: int, attributes: int, n_dev: int, n_test: int, seed: int = 0
                ) -> dict[str, list[dict]]:
    """`{train, dev, test, every_fact}` records; `sheet(...)` with the same knobs is what they ask about."""
    check_knobs(entities=entities, attributes=attributes, n_dev=n_dev, n_test=n_test)
    rows = make_sheet(entities, attributes, seed)
    if attributes == 1:
        every = [recall(n, d[0]) for n, d, _ in rows]
        train = every.copy()
        random.Random(seed + 1).shuffle(train)
        prefix = sheet_text(rows) + "\n"
        return {"train": train, "every_fact": every, "with_sheet": [recall(n, d[0], prefix) for n, d, _ in rows]}
    train = [question(n, d, h, a) for n, d, h in rows for a in range(attributes) if a != h]
    random.Random(seed + 1).shuffle(train)
    held = [question(n, d, h, h) for n, d, h in rows]  # entities in the sheet's (random) order
    every = [question(n, d, h, a) for n, d, h in rows for a in range(attributes)]
    return {"train": train, "dev": held[:n_dev], "test": held[n_dev:n_dev + n_test], "every_fact": every}


def sheet(*, entities: int, attributes: int, seed: int = 0) -> str:
    """The sheet `make_splits` asks about (the same knobs)."""
    return sheet_text(make_sheet(entities, attributes, seed))
