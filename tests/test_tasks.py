"""Task generators (binding, modular): answers resolved independently, fields on the right characters,
disjoint splits, determinism, the depth-1 variant, the table coverage and the unseen-pairs test."""

import re

import pytest

from kvdistill.data import load_records
from kvdistill.lab.tasks import binding, modular
from kvdistill.synthetic import write_jsonl

# ----------------------------------------------------------------------------- binding


def resolve(question: str) -> tuple[dict[str, int], dict[str, int], str]:
    """An independent reading of a program: `(value of each name, hops from it to its digit, query)`."""
    *lines, ask = question.split(". ")
    bound = dict(line.split("=") for line in lines)
    assert len(bound) == len(lines), "a name defined twice"
    values, hops = {}, {}
    for name in bound:
        cur, n = name, 0
        while not bound[cur].isdigit():
            cur, n = bound[cur], n + 1
        values[name], hops[name] = int(bound[cur]), n
    query = re.fullmatch(r"What is ([a-z])\?", ask).group(1)
    return values, hops, query


def queried_chain(rec: dict) -> tuple[int, tuple[str, ...]]:
    """The chain the query reads, `(root digit, names root -> query)`, by the independent reading."""
    values, _, query = resolve(rec["question"])
    *lines, _ = rec["question"].split(". ")
    bound = dict(line.split("=") for line in lines)
    path = [query]
    while not bound[path[-1]].isdigit():
        path.append(bound[path[-1]])
    return values[query], tuple(reversed(path))


def spans(rec: dict, field: str) -> list[tuple[str, int]]:
    """`(the text under the span, its value)` for every span of `field`."""
    return [(rec["question"][s:e], v) for s, e, v in rec["token_fields"][field]]


@pytest.mark.parametrize("order", binding.ORDERS)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_binding_answer_is_the_resolved_query(order, depth):
    for rec in binding.generate_programs(60, seed=depth, depth=depth, order=order):
        values, hops, query = resolve(rec["question"])
        assert rec["answer"] == f"#### {values[query]}"
        assert hops[query] == depth and max(hops.values()) == depth  # the depth-1 variant has depth 1
        roots = [v for n, v in values.items() if hops[n] == 0]
        assert 2 <= len(roots) <= 3 and len(set(roots)) == len(roots)  # 2-3 chains, distinct root digits
        assert len(values) == len(roots) * (depth + 1)
        assert set(values) <= set("abcdefghijklmn")  # the 14-name pool


def test_binding_interleave_defines_before_use_and_shuffle_does_not():
    def defined_before_use(question):
        *lines, _ = question.split(". ")
        defined = set()
        for lhs, rhs in (line.split("=") for line in lines):
            if not rhs.isdigit() and rhs not in defined:
                return False
            defined.add(lhs)
        return True

    assert all(defined_before_use(r["question"]) for r in binding.generate_programs(100, seed=0))
    assert not all(defined_before_use(r["question"]) for r in binding.generate_programs(100, seed=0, order="shuffle"))


def test_binding_fields_cover_every_name_with_its_value_and_chain():
    for rec in binding.generate_programs(60, seed=3, max_chains=3):
        values, _, _ = resolve(rec["question"])
        q = rec["question"]
        name_positions = [m.start() for m in re.finditer(r"\b[a-z]\b", q)]
        starts = [s for s, _, _ in rec["token_fields"]["name"]]
        assert starts == name_positions  # every definition, reference and the query; nothing else
        assert all(text in values and v == 1 for text, v in spans(rec, "name"))
        assert all(values[text] == v for text, v in spans(rec, "value"))
        # the query's name, and only it: "What is m?" -> "m", the last name of the question
        assert [(s, e, v) for s, e, v in rec["token_fields"]["query"]] == [(q.rindex("What is ") + 8, len(q) - 1, 1)]
        chain = [v for _, v in spans(rec, "chain")]
        assert chain[0] == 0 and all(c <= max(chain[:i], default=-1) + 1 for i, c in enumerate(chain))  # first seen
        # same chain <=> same root (the roots' digits differ, so: same resolved value)
        value = [v for _, v in spans(rec, "value")]
        assert all((chain[i] == chain[j]) == (value[i] == value[j]) for i in range(len(chain)) for j in range(i))


def test_binding_is_deterministic_in_the_seed():
    assert binding.generate_programs(30, seed=5) == binding.generate_programs(30, seed=5)
    assert binding.generate_programs(30, seed=5) != binding.generate_programs(30, seed=6)


@pytest.mark.parametrize("unseen", binding.UNSEEN)
def test_binding_splits_are_disjoint_and_held_out_ones_unseen(unseen):
    splits = binding.make_splits(n_pool=300, n_train=50, n_dev=40, n_test=60, n_teacher_dev=30, seed=1,
                                 unseen=unseen)
    sizes = {k: len(v) for k, v in splits.items()}
    assert sizes == {"teacher_pool": 300, "train": 50, "dev": 40, "teacher_dev": 30, "test": 60,
                     "other_task": 300, "other_task_dev": 30}
    questions = {k: {r["question"] for r in v} for k, v in splits.items()}
    assert questions["train"] <= questions["teacher_pool"]
    held = ("dev", "teacher_dev", "test")
    for i, a in enumerate(("teacher_pool", *held)):
        for b in held[i:]:
            assert a == b or not questions[a] & questions[b], (a, b)
    pool_programs = {binding.program_key(q) for q in questions["teacher_pool"]}
    pool_chains = {c for q in questions["teacher_pool"] for c in binding.chains_of(q)}
    for split in held:
        if unseen != "question":
            assert not any(binding.program_key(q) in pool_programs for q in questions[split])
        if unseen == "chain":
            assert not any(queried_chain(r) in pool_chains for r in splits[split])
    # the other task: depth 1, its own questions
    assert all(max(resolve(r["question"])[1].values()) == 1 for r in splits["other_task"] + splits["other_task_dev"])
    assert not {r["question"] for r in splits["other_task"]} & {r["question"] for r in splits["other_task_dev"]}


def test_binding_recall_joins_the_teachers_pool_only_and_other_task_is_one_lookup_shallower():
    splits = binding.make_splits(n_pool=80, n_train=30, n_dev=20, n_test=20, n_teacher_dev=10, depth=1, n_recall=40,
                                 seed=3)

    def depths(split):
        return [resolve(r["question"])[1][resolve(r["question"])[2]] for r in splits[split]]

    assert depths("teacher_pool") == [1] * 80 + [0] * 40  # the hops, then recall
    assert all(set(depths(s)) == {1} for s in ("train", "dev", "teacher_dev", "test"))  # the student's task: hops
    assert set(depths("other_task")) == set(depths("other_task_dev")) == {0}
    assert all(r["answer"] == f"#### {resolve(r['question'])[0][resolve(r['question'])[2]]}"
               for r in splits["teacher_pool"][80:])  # recall: the query's own line
    with pytest.raises(ValueError, match="one lookup shallower than depth 0"):
        binding.make_splits(n_pool=10, n_train=5, n_dev=2, n_test=2, n_teacher_dev=2, depth=0)


def test_binding_queried_chain_unseen_is_stricter_than_program():
    """Held-out programs drawn without the chain rule do reuse pool chains (so the rule does something)."""
    pool = binding.generate_programs(2000, seed=0, names=12)
    pool_chains = {c for r in pool for c in binding.chains_of(r["question"])}
    loose = binding.generate_programs(200, seed=9, names=12, unseen="program", exclude=pool)
    strict = binding.generate_programs(200, seed=9, names=12, unseen="chain", exclude=pool)
    assert any(queried_chain(r) in pool_chains for r in loose)
    assert not any(queried_chain(r) in pool_chains for r in strict)


@pytest.mark.parametrize("knobs, message", [
    (dict(max_chains=5, depth=2, names=14), "need 15 distinct names, only 14 allowed"),
    (dict(min_chains=3, max_chains=2), "min_chains <= max_chains"),
    (dict(max_chains=11, names=26, depth=1), "one distinct root digit per chain"),
    (dict(depth=-1), "depth must be >= 0"),
    (dict(names=27), "names must be in 2..26"),
    (dict(order="random"), "order 'random' is not one of"),
    (dict(unseen="pair"), "unseen 'pair' is not one of"),
])
def test_binding_impossible_knobs_are_refused(knobs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        binding.generate_programs(3, **knobs)


def test_binding_pool_must_hold_the_labelled_subset():
    with pytest.raises(ValueError, match="n_train 20 > n_pool 10"):
        binding.make_splits(n_pool=10, n_train=20, n_dev=1, n_test=1, n_teacher_dev=1)


# ----------------------------------------------------------------------------- modular

P = 11


def equations(question: str) -> tuple[list[tuple[int, str, int, int]], tuple[int, str, int]]:
    """An independent reading: the solved `(a, op, b, c)` equations and the asked `(a, op, b)`."""
    *solved, ask = question.split(". ")
    context = [(int(a), op, int(b), int(c)) for a, op, b, c in
               (re.fullmatch(r"(\d+)([+*])(\d+)=(\d+)", e).groups() for e in solved)]
    a, op, b = re.fullmatch(r"What is (\d+)([+*])(\d+)\?", ask).groups()
    return context, (int(a), op, int(b))


def apply(a: int, op: str, b: int, p: int) -> int:
    return (a + b) % p if op == "+" else (a * b) % p


@pytest.fixture(scope="module")
def table():
    return modular.make_splits(n_dev=10, n_test=30, n_teacher_dev=8, p=P, labelled=0.4, teacher_fraction=0.9,
                               repeats=2, seed=4)


def test_modular_answers_and_context_equations_are_right(table):
    for split, recs in table.items():
        op = "*" if split.startswith("other_task") else "+"
        for rec in recs:
            context, (a, qop, b) = equations(rec["question"])
            assert qop == op and all(e[1] == op for e in context)
            assert all(c == apply(x, op, y, P) for x, _, y, c in context)
            assert rec["answer"] == f"#### {apply(a, op, b, P)}"
            assert 6 <= len(context) + 1 <= 8
            pairs = [(x, y) for x, _, y, _ in context]
            assert len(set(pairs)) == len(pairs) and not {(a, b), (b, a)} & set(pairs)  # nothing to copy


def test_modular_number_field_marks_every_number_with_its_value(table):
    for rec in table["train"][:50] + table["test"]:
        numbers = [(m.start(), m.end(), int(m.group())) for m in re.finditer(r"\d+", rec["question"])]
        assert [tuple(s) for s in rec["token_fields"]["number"]] == numbers
        assert all(text == str(v) and 0 <= v < P for text, v in spans(rec, "number"))
        assert [tuple(s[:2]) for s in rec["token_fields"]["numeral"]] == [s[:2] for s in numbers]
        assert {v for _, v in spans(rec, "numeral")} == {1}


def queries(recs):
    return [(a, b) for a, _, b in (equations(r["question"])[1] for r in recs)]


def test_modular_coverage_and_the_unseen_pairs_test_split(table):
    labelled = set(queries(table["train"]))
    assert len(labelled) == round(0.4 * P * P)  # the student's share of the table
    assert len(table["train"]) == 2 * len(labelled)  # each labelled pair asked `repeats` times
    teacher = set(queries(table["teacher_pool"]))
    assert labelled <= teacher and len(teacher) == round(0.9 * P * P)
    dev, test, teacher_dev = set(queries(table["dev"])), set(queries(table["test"])), set(queries(table["teacher_dev"]))
    assert len(dev) == 10 and len(test) == 30  # one item per pair
    assert not test & labelled and not dev & labelled and not dev & test
    assert not teacher_dev & teacher
    # context pairs come from what the reader was trained on: labelled pairs for the student's splits
    for split, known in (("train", labelled), ("dev", labelled), ("test", labelled), ("teacher_pool", teacher)):
        assert all((a, b) in known for r in table[split] for a, _, b, _ in equations(r["question"])[0])


def test_modular_is_deterministic_in_the_seed():
    kw = dict(n_dev=5, n_test=5, n_teacher_dev=5, p=P, labelled=0.4)
    assert modular.make_splits(**kw, seed=1) == modular.make_splits(**kw, seed=1)
    assert modular.make_splits(**kw, seed=1)["test"] != modular.make_splits(**kw, seed=2)["test"]


@pytest.mark.parametrize("knobs, message", [
    (dict(p=101), "modulus must be in 3..100"),
    (dict(labelled=0.95), "0 < labelled < teacher_fraction <= 1"),
    (dict(op="sub"), "op 'sub' is not one of"),
    (dict(min_equations=9), "min_equations <= max_equations"),
    (dict(p=3, labelled=0.5), "too few for contexts of 7 equations"),
    (dict(n_test=5000), "ask for fewer"),
    (dict(teacher_fraction=1.0), "teacher-held-out pairs for n_teacher_dev = 5"),
])
def test_modular_impossible_knobs_are_refused(knobs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        modular.make_splits(**{"n_dev": 5, "n_test": 5, "n_teacher_dev": 5, **knobs})


# ----------------------------------------------------------------------------- both


@pytest.mark.parametrize("make", [
    lambda: binding.generate_programs(20, seed=0),
    lambda: modular.make_splits(n_dev=2, n_test=2, n_teacher_dev=2, p=P)["train"],
])
def test_records_load_as_labelled_training_data_with_their_fields(make, tmp_path):
    recs = make()
    write_jsonl(recs, tmp_path / "train.jsonl")
    loaded = load_records(tmp_path, "train", require_final=True)
    assert [r["question"] for r in loaded] == [r["question"] for r in recs]
    assert all(r["answer"].startswith("#### ") and r["token_fields"] for r in loaded)
