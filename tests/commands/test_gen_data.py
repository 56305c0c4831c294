"""`kvdistill gen-data --task arithmetic|binding|modular|facts`: the splits each task writes, loadable as
training data, deterministic; its knobs in --help; impossible or foreign knobs refused in one line."""

import json
import re
from pathlib import Path

import pytest
import yaml

from kvdistill.cli import main
from kvdistill.data import load_records

ROOT = Path(__file__).resolve().parents[2]

SMALL = {
    "arithmetic": ["--n_train", "20", "--n_dev", "5", "--n_test", "5"],
    "binding": ["--n_pool", "40", "--n_train", "10", "--n_dev", "5", "--n_teacher_dev", "5", "--n_test", "5"],
    "modular": ["--modulus", "13", "--n_dev", "5", "--n_teacher_dev", "5", "--n_test", "5"],
    "facts": ["--entities", "10"],
}
SPLITS = {
    "arithmetic": {"train": 20, "dev": 5, "test": 5},
    "binding": {"teacher_pool": 40, "train": 10, "dev": 5, "teacher_dev": 5, "test": 5, "other_task": 40,
                "other_task_dev": 5},
    "modular": {"teacher_pool": round(0.9 * 13 * 13), "train": round(0.35 * 13 * 13), "dev": 5, "teacher_dev": 5,
                "test": 5, "other_task": round(0.9 * 13 * 13), "other_task_dev": 5},
    "facts": {"train": 20, "dev": 5, "test": 5, "every_fact": 30},  # 10 entities x 3 facts, one each held out
}


def gen(out, task, *extra):
    assert main(["gen-data", "--task", task, "--output_dir", str(out), *SMALL[task], *extra]) == 0
    return out


@pytest.mark.parametrize("task", SPLITS)
def test_writes_each_tasks_splits_loadable_and_deterministic(task, tmp_path):
    out = gen(tmp_path / "a", task)
    manifest = json.loads((out / "task.json").read_text())
    assert manifest["splits"] == SPLITS[task] and manifest["options"]["task"] == task
    assert "modulus" not in manifest["options"] or task == "modular"  # only the task's own options
    questions = set()
    for split, n in SPLITS[task].items():
        recs = load_records(out, split, require_final=True)
        assert len(recs) == n
        if split not in ("train", "other_task", "other_task_dev", "every_fact"):  # subsets of other splits
            assert not questions & {r["question"] for r in recs}, split
            questions |= {r["question"] for r in recs}
        assert task == "arithmetic" or all(r["token_fields"] for r in recs)
    again = gen(tmp_path / "b", task)
    assert all((out / f"{s}.jsonl").read_text() == (again / f"{s}.jsonl").read_text() for s in SPLITS[task])


def test_binding_knobs_reach_the_generator(tmp_path):
    out = gen(tmp_path, "binding", "--depth", "1", "--min_chains", "3", "--max_chains", "3", "--no_other_task")
    assert not (out / "other_task.jsonl").exists()
    rec = load_records(out, "test")[0]
    assert len(rec["question"].split(". ")) - 1 == 3 * 2  # 3 chains of a root and one reference


def test_help_lists_every_tasks_knobs(capsys):
    with pytest.raises(SystemExit):
        main(["gen-data", "--help"])
    text = capsys.readouterr().out
    for flag in ("--task", "--depth", "--names", "--unseen", "--modulus", "--labelled", "--op", "--max_steps"):
        assert flag in text
    assert "[binding] Lookups" in text and "[modular] p of" in text


@pytest.mark.parametrize("argv, message", [
    (["--task", "binding", "--max_chains", "5", "--names", "12"], "need 15 distinct names, only 12 allowed"),
    (["--task", "binding", "--n_pool", "5", "--n_train", "10"], "n_train 10 > n_pool 5"),
    (["--task", "modular", "--labelled", "0.95"], "0 < labelled < teacher_fraction <= 1"),
    (["--task", "modular", "--modulus", "7", "--n_test", "100"], "ask for fewer"),
    (["--task", "modular", "--depth", "1"], "--depth is an option of --task binding, not of modular"),
    (["--task", "arithmetic", "--modulus", "13"], "--modulus is an option of --task modular"),
    (["--task", "sorting"], "task 'sorting' is not one of"),
    (["--task", "text", "--source", "/nonexistent"], "no .txt files there"),
    (["--task", "facts", "--entities", "10", "--n_dev", "6", "--n_test", "5"], "raise --entities or ask for fewer"),
    (["--task", "facts", "--attributes", "7"], "attributes must be in 1..6"),
    (["--task", "facts", "--attributes", "1", "--n_dev", "3"], "with one attribute nothing is held out"),
    (["--task", "binding", "--entities", "10"], "--entities is an option of --task facts, not of binding"),
])
def test_impossible_knobs_are_one_line_errors_and_write_nothing(argv, message, tmp_path, capsys):
    assert main(["gen-data", "--output_dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list(tmp_path.glob("out/*.jsonl"))


def test_facts_sheet_holds_every_answer_and_no_test_fact_is_trained(tmp_path):
    out = gen(tmp_path, "facts", "--attributes", "4")
    sheet = {name: dict(f.split(" ") for f in facts.rstrip(".").split(", "))
             for name, facts in (line.split(": ") for line in (out / "sheet.txt").read_text().splitlines())}
    assert len(sheet) == 10 and all(len(v) == 4 for v in sheet.values())

    def fact(r):  # "What is Tova's desk?" -> ("Tova", "desk"), checked against the sheet
        name, attribute = re.fullmatch(r"What is (\w+)'s (\w+)\?", r["question"]).groups()
        assert r["answer"] == f"#### {sheet[name][attribute]}"
        return name, attribute

    splits = {s: [fact(r) for r in load_records(out, s)] for s in ("train", "dev", "test", "every_fact")}
    assert len(splits["train"]) == 30 and sorted(splits["every_fact"]) == sorted({*splits["every_fact"]})
    held = splits["dev"] + splits["test"]  # one held-out fact per entity, never trained
    assert sorted(n for n, _ in held) == sorted(sheet) and not set(held) & set(splits["train"])
    assert set(splits["train"]) | set(held) == set(splits["every_fact"])
    held_digit = {n: sheet[n][a] for n, a in held}
    for r in map(json.loads, (out / "train.jsonl").read_text().splitlines()):  # the name's row carries the entity's held-out digit (the probe's target)
        (start, end, digit), = r["token_fields"]["held"]
        assert str(digit) == held_digit[r["question"][start:end]]


def test_recall_asks_every_sheet_line_as_a_prompt_completion_record(tmp_path):
    """--attributes 1: the sheet is `Name: digit` lines; train asks each once (shuffled), every_fact in sheet
    order, with_sheet with the sheet before it; fields `value` on the name and ": ", `query` on the ": "."""
    out = gen(tmp_path, "facts", "--attributes", "1")
    lines = (out / "sheet.txt").read_text().splitlines()
    sheet = dict(line.split(": ") for line in lines)
    assert json.loads((out / "task.json").read_text())["splits"] == {"train": 10, "every_fact": 10, "with_sheet": 10}
    splits = {s: load_records(out, s) for s in ("train", "every_fact", "with_sheet")}
    assert [r["prompt"] + r["completion"] for r in splits["every_fact"]] == lines
    assert sorted(r["prompt"] for r in splits["train"]) == sorted(r["prompt"] for r in splits["every_fact"])
    assert [r["prompt"] for r in splits["train"]] != [r["prompt"] for r in splits["every_fact"]]
    for plain, full in zip(splits["every_fact"], splits["with_sheet"]):
        assert full["prompt"] == "\n".join(lines) + "\n" + plain["prompt"] and full["completion"] == plain["completion"]
        name = plain["prompt"][:-2]
        fields = dict(full["token_fields"])
        (start, end, value), = fields["value"][:1]
        assert full["prompt"][start:end] == name and str(value) == sheet[name] == plain["completion"]
        (q0, q1, _), = fields["query"]
        assert full["prompt"][q0:q1] == ": " and q1 == len(full["prompt"])


def test_the_facts_configs_hold_the_sheet_of_data_seed_0(tmp_path):
    """configs/evidence_real/facts_*.yaml inline the sheet their data's teacher reads: a generator change fails here."""
    assert main(["gen-data", "--task", "facts", "--output_dir", str(tmp_path)]) == 0
    sheet = (tmp_path / "sheet.txt").read_text()
    for name in ("facts_probe", "facts_teacher_eval"):
        config = yaml.safe_load((ROOT / "configs" / "evidence_real" / f"{name}.yaml").read_text())
        assert config["template"].startswith(sheet + "\n"), name
    assert main(["gen-data", "--task", "facts", "--attributes", "1", "--entities", "32",
                 "--output_dir", str(tmp_path / "recall")]) == 0
    sheet = (tmp_path / "recall" / "sheet.txt").read_text()
    config = yaml.safe_load((ROOT / "configs" / "evidence_real" / "recall_student.yaml").read_text())
    templates = [t["template"] for t in config["teachers"] if "template" in t]
    assert templates == [sheet + "{question}"]  # sheet.txt ends in a newline


def test_arithmetic_dev_is_disjoint_even_where_problems_are_few(tmp_path):
    """1-step problems up to 2: under 600 distinct questions, so only the exclusion keeps dev apart."""
    out = tmp_path / "crowded"
    assert main(["gen-data", "--output_dir", str(out), "--n_train", "300", "--n_test", "100", "--n_dev", "100",
                 "--min_steps", "1", "--max_steps", "1", "--max_value", "2"]) == 0
    seen = [{r["question"] for r in load_records(out, split)} for split in ("train", "dev", "test")]
    assert sum(map(len, seen)) == len(set.union(*seen)) == 500


def test_text_task_cuts_local_files_into_windows_each_file_in_one_split(tmp_path, capsys):
    """--task text: windows of at most --window_chars of the source's files, paragraphs kept whole where they fit,
    every window of a file in the split its name hashes to; text-format records that load for training."""
    from kvdistill.lab.tasks.corpus import split_of, windows

    src = tmp_path / "notes"
    src.mkdir()
    for i in range(40):
        (src / f"{i}.txt").write_text("\n\n".join(f"File {i} paragraph {j}. " + "word " * (5 * j) for j in range(8)))
    out = tmp_path / "data"
    assert main(["gen-data", "--task", "text", "--source", str(src), "--window_chars", "120", "--n_train", "30",
                 "--n_dev", "5", "--n_test", "5", "--output_dir", str(out)]) == 0
    seen = {}
    for split in ("train", "dev", "test"):
        assert len(load_records(out, split)) == {"train": 30, "dev": 5, "test": 5}[split]  # loadable as text
        for r in map(json.loads, (out / f"{split}.jsonl").read_text().splitlines()):
            assert len(r["text"]) <= 120 and split_of(r["source"], 0.1, 0.1) == split
            seen.setdefault(r["source"], set()).add(split)
    assert all(len(splits) == 1 for splits in seen.values())
    assert windows("a\n\nb\n\n" + "c" * 10, 5) == ["a\n\nb", "ccccc", "ccccc"]  # packed, then cut at the limit
    assert main(["gen-data", "--task", "text", "--source", str(src), "--n_train", "5", "--n_dev", "1", "--n_test", "500",
                 "--output_dir", str(tmp_path / "x")]) == 2
    assert "fewer than the 500 asked" in capsys.readouterr().err and not list(tmp_path.glob("x/*.jsonl"))


def test_a_rerun_rewrites_its_own_data_and_other_options_or_files_are_refused(tmp_path, capsys):
    out, small = tmp_path / "data", ["--n_train", "20", "--n_test", "10", "--n_dev", "10"]
    assert main(["gen-data", "--output_dir", str(out), *small]) == 0
    first = (out / "train.jsonl").read_bytes()
    assert main(["gen-data", "--output_dir", str(out), *small]) == 0  # the same command: the same files
    assert (out / "train.jsonl").read_bytes() == first
    capsys.readouterr()
    assert main(["gen-data", "--output_dir", str(out), *small, "--seed", "1"]) == 2  # never two settings mixed
    assert "already holds data written with other options" in capsys.readouterr().err
    assert (out / "train.jsonl").read_bytes() == first
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["gen-data", "--output_dir", str(tmp_path / "other"), *small]) == 2
    assert "files gen-data did not write" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]
