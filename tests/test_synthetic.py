"""Synthetic problems: deterministic, disjoint splits, answers that follow from the rationale."""

import re

import pytest

from kvdistill.data import split_answer
from kvdistill.synthetic import generate_problems, make_splits, write_dataset, write_jsonl


def test_deterministic_by_seed():
    assert generate_problems(20, seed=3) == generate_problems(20, seed=3)
    assert generate_problems(20, seed=3) != generate_problems(20, seed=4)


def test_split_is_disjoint():
    train, test = make_splits(300, 100, seed=0)
    assert len(train) == 300 and len(test) == 100
    assert not {r["question"] for r in train} & {r["question"] for r in test}


@pytest.mark.parametrize("ops", [("add", "sub"), ("add", "sub", "mul")])
def test_rationale_arithmetic_is_right(ops):
    for rec in generate_problems(50, seed=1, min_steps=1, max_steps=4, ops=ops):
        rationale, final = split_answer(rec["answer"])
        lines = rationale.splitlines()
        for line in lines:
            a, op, b, res = re.fullmatch(r"(\d+) ([-+*]) (\d+) = (\d+)\.", line).groups()
            assert eval(f"{a}{op}{b}") == int(res)
        assert lines[-1].split("= ")[1].rstrip(".") == final
        assert int(final) >= 0


def test_difficulty_knobs_and_errors(tmp_path):
    recs = generate_problems(30, seed=0, min_steps=4, max_steps=4)
    assert all(len(split_answer(r["answer"])[0].splitlines()) == 4 for r in recs)
    with pytest.raises(ValueError, match="min_steps"):
        generate_problems(3, min_steps=3, max_steps=2)
    out = write_dataset(tmp_path, 10, 5)
    assert (out / "train.jsonl").read_text().count("\n") == 10


def test_write_jsonl_is_atomic(tmp_path):
    """A write that fails part way (here the records run out with an error) leaves the old file whole and
    no temp file: a later run never reads a cut dataset as a smaller one."""
    path = write_jsonl(generate_problems(4, seed=0), tmp_path / "train.jsonl")
    before = path.read_bytes()
    assert before.decode().splitlines()[0].startswith('{"question": ')

    def cut_short():
        yield from generate_problems(3, seed=1)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_jsonl(cut_short(), path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]
