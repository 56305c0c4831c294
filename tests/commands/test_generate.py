"""`kvdistill generate`: a teacher's completions written as a transfer set that training reads back."""

import json

import pytest

from kvdistill.commands import generate
from kvdistill.config import ConfigError
from kvdistill.data import load_records


def _argv(tiny_world, out, *extra):
    return ["--model", str(tiny_world.models["gpt2"]), "--data", str(tiny_world.data_dir), "--split", "test",
            "--limit", "3", "--max_new_tokens", "5", "--batch_size", "2", "--output", str(out), *extra]


def test_samples_per_question_are_written_as_a_transfer_set(tiny_world, tmp_path):
    out = tmp_path / "transfer.jsonl"
    assert generate.main(_argv(tiny_world, out, "--n_samples", "2", "--temperature", "1.0",
                               "--filter_correct", "false")) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, k) for i in range(3) for k in range(2)]
    assert all(isinstance(r["correct"], bool) and r["gold"] for r in rows)
    questions = load_records(str(tiny_world.data_dir), split="test", limit=3)
    assert [r["question"] for r in rows[::2]] == [q["question"] for q in questions]
    # read back exactly as `transfer_data` is read: question + the completion as the answer
    back = load_records(str(out), split="train")
    assert [b["answer"] for b in back] == [r["answer"] for r in rows]


def test_sampling_is_seeded_and_differs_from_greedy(tiny_world, tmp_path):
    texts = {}
    for name, extra in {"a": ["--temperature", "1.0"], "b": ["--temperature", "1.0"], "greedy": []}.items():
        generate.main(_argv(tiny_world, tmp_path / f"{name}.jsonl", "--filter_correct", "false", *extra))
        texts[name] = [json.loads(x)["answer"] for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert texts["a"] == texts["b"] and texts["a"] != texts["greedy"]


def test_correctness_filter_keeps_right_answers_and_ungraded_questions(tiny_world, tmp_path, monkeypatch):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?", "answer": "#### 4"},
        {"question": "no gold?", "answer": ""}]))
    fake = ["#### 2", "#### 5", "anything"]  # right, wrong, ungraded
    monkeypatch.setattr(generate, "sample_completions", lambda model, tok, prompts, **kw: [[c] for c in fake])
    out = tmp_path / "t.jsonl"
    summary = generate.run_generate(generate.parse_config(generate.GenerateConfig, [
        "--model", str(tiny_world.models["gpt2"]), "--data", str(data), "--output", str(out)], "g", ""),
        log=lambda _: None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["correct"]) for r in rows] == [(0, True), (2, None)]
    assert summary["kept"] == 2 and summary["kept_correct"] == 1 and summary["completions"] == 3


@pytest.mark.parametrize("extra,match", [(["--n_samples", "3"], "temperature"), (["--top_p", "0"], "top_p")])
def test_bad_options_are_one_line_errors(tiny_world, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        generate.main(_argv(tiny_world, tmp_path / "x.jsonl", *extra))
