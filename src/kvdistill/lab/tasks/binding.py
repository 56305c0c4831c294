"""Variable binding programs in GSM8K format: which digit does the queried name resolve to?

    b=7. k=b. q=4. m=k. z=q. w=z. What is m?   ->   "#### 7" (no rationale)

A program holds 2-3 chains of `depth + 1` single-letter names: a root bound to a digit, then
`depth` names each bound to the one before. The query asks for the last name of one chain, so
answering takes `depth` lookups whose route differs in every problem (names, values and line
order are drawn anew): which position to read next is instance-specific, which is what a teacher's
attention and keys carry and its output distribution (one digit) does not. Depth 0 is recall (the
query's own line holds its digit): the step a teacher learns before the hop (`n_recall`).

Line order: `interleave` (default) merges the chains' lines at random, each chain's lines in
definition order, so every name's value is already determined where the name stands (a causal
model can hold it there: the probe's target is defined at every name token); `shuffle` puts the
lines in any order. The chains' root digits differ, so the answer also says which chain was read.

Per-token fields (`kvdistill.fields`), character spans of the question, on every name token
(definitions, references and the query):
    value  the digit the name resolves to (the probe's target)
    chain  which chain the name belongs to, numbered by first appearance (the oracle's classes)
    name   1 (the row mask of name and query tokens)
    query  1 on the query's name only (the row mask of the query token)

Deterministic in the seed.

`compose_lines` gives a word-level tokenizer's line tokens (`m=k.`, `models.build_tokenizer(word_level=True)`)
an embedding made of a vector of their name and one of their value: the init under which a teacher
learns the hop on CPU (docs/tasks.md).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from kvdistill.lab.tasks import Piece, spell

if TYPE_CHECKING:
    from torch import Tensor

NAME_POOL = string.ascii_lowercase
ORDERS = ("interleave", "shuffle")
UNSEEN = ("question", "program", "chain")  # what a held-out problem must not share with the pool

Chain = tuple[int, tuple[str, ...]]  # (root digit, names from root to tail)


def make_program(rng: random.Random, *, chains: int, depth: int, names: int, order: str = "interleave"
                 ) -> tuple[dict, tuple[Chain, ...], int]:
    """One program: `(record, its chains, index of the queried chain)`."""
    drawn = rng.sample(NAME_POOL[:names], chains * (depth + 1))
    roots = rng.sample(range(10), chains)  # distinct: the answer names the chain that was read
    prog = tuple((roots[c], tuple(drawn[c * (depth + 1):(c + 1) * (depth + 1)])) for c in range(chains))
    # lines as (chain, lhs, rhs); a chain's lines in definition order
    lines = [[(c, ns[0], str(root))] + [(c, ns[i], ns[i - 1]) for i in range(1, depth + 1)]
             for c, (root, ns) in enumerate(prog)]
    if order == "interleave":
        picks = [c for c in range(chains) for _ in range(depth + 1)]
        rng.shuffle(picks)  # which chain's next line comes next
        ordered = [lines[c].pop(0) for c in picks]
    else:
        ordered = [line for chain in lines for line in chain]
        rng.shuffle(ordered)
    query = rng.randrange(chains)
    first_seen = list(dict.fromkeys(c for c, _, _ in ordered))  # chain ids by first appearance

    def name(n: str, c: int) -> Piece:
        return n, {"value": prog[c][0], "chain": first_seen.index(c), "name": 1}

    pieces: list[Piece] = []
    for c, lhs, rhs in ordered:
        pieces += [name(lhs, c), "=", rhs if rhs.isdigit() else name(rhs, c), ". "]
    asked, facts = name(prog[query][1][-1], query)
    question, fields = spell([*pieces, "What is ", (asked, {**facts, "query": 1}), "?"])
    record = {"question": question, "answer": f"#### {prog[query][0]}", "token_fields": fields}
    return record, prog, query


def program_key(question: str) -> frozenset[str]:
    """A program as its set of lines, whatever their order and the query."""
    return frozenset(question.split(". ")[:-1])


def generate_programs(
    n: int,
    seed: int = 0,
    *,
    min_chains: int = 2,
    max_chains: int = 3,
    depth: int = 2,
    names: int = 14,
    order: str = "interleave",
    unseen: str = "question",
    exclude: Iterable[dict] = (),
) -> list[dict]:
    """`n` programs with distinct questions that share with `exclude` (records) nothing `unseen` names.

    unseen: "question" (no question of `exclude`), "program" (no set of lines of `exclude`, whatever
    its order and query) or "chain" (and the queried chain, names and digit, is no chain of `exclude`).
    """
    check_knobs(min_chains=min_chains, max_chains=max_chains, depth=depth, names=names, order=order, unseen=unseen)
    rng = random.Random(seed)
    exclude = list(exclude)
    questions = {r["question"] for r in exclude}
    programs = {program_key(r["question"]) for r in exclude} if unseen != "question" else set()
    seen_chains = {ch for r in exclude for ch in chains_of(r["question"])} if unseen == "chain" else set()
    out = []
    for _ in range(n * 50):
        rec, prog, query = make_program(rng, chains=rng.randint(min_chains, max_chains), depth=depth, names=names,
                                        order=order)
        if rec["question"] in questions or program_key(rec["question"]) in programs or prog[query] in seen_chains:
            continue
        questions.add(rec["question"])
        out.append(rec)
        if len(out) == n:
            return out
    raise ValueError(f"could only make {len(out)} of {n} binding programs unseen by {unseen}; raise names or "
                     "depth, or ask for fewer")


def chains_of(question: str) -> set[Chain]:
    """Every chain of a program `(root digit, names root -> tail)`, read back from its question."""
    bound = dict(line.split("=") for line in program_key(question))
    referenced = set(bound.values())
    out = set()
    for tail in (name for name in bound if name not in referenced):
        path = [tail]
        while not bound[path[-1]].isdigit():
            path.append(bound[path[-1]])
        out.add((int(bound[path[-1]]), tuple(reversed(path))))
    return out


def check_knobs(*, min_chains: int, max_chains: int, depth: int, names: int, order: str, unseen: str) -> None:
    """`ValueError` naming the knob when no program can be made with these knobs."""
    if not 1 <= min_chains <= max_chains <= 10:
        raise ValueError(f"need 1 <= min_chains <= max_chains <= 10 (one distinct root digit per chain), got "
                         f"{min_chains}, {max_chains}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0 (lookups from the query to its digit; 0: recall), got {depth}")
    if not 2 <= names <= len(NAME_POOL):
        raise ValueError(f"names must be in 2..{len(NAME_POOL)} (single letters), got {names}")
    if max_chains * (depth + 1) > names:
        raise ValueError(f"{max_chains} chains of depth {depth} need {max_chains * (depth + 1)} distinct names, "
                         f"only {names} allowed; raise names or lower max_chains or depth")
    if order not in ORDERS:
        raise ValueError(f"order {order!r} is not one of {ORDERS}")
    if unseen not in UNSEEN:
        raise ValueError(f"unseen {unseen!r} is not one of {UNSEEN}")


def make_splits(
    *,
    n_pool: int,
    n_train: int,
    n_dev: int,
    n_test: int,
    n_teacher_dev: int,
    depth: int = 2,
    n_recall: int = 0,
    other_task: bool = True,
    seed: int = 0,
    unseen: str = "program",
    **knobs,
) -> dict[str, list[dict]]:
    """The splits of the binding regime, `{name: records}`.

    teacher_pool: the teachers' training programs, then `n_recall` depth-0 ones (recall beside the hops:
    without it a teacher sits on guessing a prompt digit, docs/tasks.md); train: the student's labelled
    subset (its first `n_train`); dev, teacher_dev (the teachers' gate), test: held-out programs that
    share nothing `unseen` names with the pool nor a question with each other; other_task,
    other_task_dev: programs one lookup shallower, of the same names and chains (the `other_task`
    teacher's pool and gate).
    """
    if n_train > n_pool:
        raise ValueError(f"n_train {n_train} > n_pool {n_pool}: the student's labelled programs are a subset of "
                         "the teachers' pool; raise n_pool")
    pool = generate_programs(n_pool, seed, depth=depth, **knobs)
    recall = generate_programs(n_recall, seed + 3_000_009, depth=0, **knobs) if n_recall else []
    held = generate_programs(n_dev + n_teacher_dev + n_test, seed + 1_000_003, depth=depth, unseen=unseen, exclude=pool,
                             **knobs)
    splits = {"teacher_pool": pool + recall, "train": pool[:n_train], "dev": held[:n_dev],
              "teacher_dev": held[n_dev:n_dev + n_teacher_dev], "test": held[n_dev + n_teacher_dev:]}
    if other_task:
        if depth == 0:
            raise ValueError("other_task programs are one lookup shallower than depth 0; set depth >= 1 or "
                             "turn other_task off")
        other = generate_programs(n_pool + n_teacher_dev, seed + 2_000_006, depth=depth - 1, **knobs)
        splits.update(other_task=other[:n_pool], other_task_dev=other[n_pool:])
    return splits


LINE = re.compile(r"([a-z])=([a-z0-9])\.")  # a line token: name, "=", a name or digit, "."


def compose_lines(embedding: Tensor, vocab: Mapping[str, int]) -> None:
    """Set the rows of `embedding` (`[V, d]`, in place) of every line token in `vocab` to (a vector of its
    name + a vector of its value) / sqrt 2, each drawn once per symbol at the rows' own scale.

    Why: a line read as a whole token is a symbol that says nothing about its parts; this way `m=k.` and
    `m=3.` share their name's direction and `m=k.` and `q=k.` their value's, so matching a name needs no
    table of 336 symbols first (the one hop is learned with it, not without, on CPU: docs/tasks.md).
    Seeding is the caller's (torch's global RNG). Tensor methods only: `gen-data` imports this module and
    stays free of torch."""
    lines = [(i, *m.groups()) for tok, i in vocab.items() if (m := LINE.fullmatch(tok))]
    if not lines:
        raise ValueError("the tokenizer has no line tokens like 'm=k.'; build it with word_level=True")
    ids, names, values = zip(*lines, strict=True)
    name_set, value_set = sorted(set(names)), sorted(set(values))
    rows = embedding.detach()  # the parameter's storage, written without autograd
    std = rows.std()
    name_vec = rows.new_empty(len(name_set), rows.shape[1]).normal_() * std  # [N, d]
    value_vec = rows.new_empty(len(value_set), rows.shape[1]).normal_() * std  # [W, d]
    n = [name_set.index(x) for x in names]
    v = [value_set.index(x) for x in values]
    rows[list(ids)] = (name_vec[n] + value_vec[v]) / 2 ** 0.5  # [lines, d]
