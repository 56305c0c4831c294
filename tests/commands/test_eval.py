"""`kvdistill eval`: the command, model-dir resolution and a run dir's own prompt settings."""

import json
import math
import shutil

import pytest

from kvdistill.commands.eval import main
from kvdistill.config import ConfigError
from kvdistill.evaluate.scoring import (
    read_items,
)
from kvdistill.runs import COMPLETE_FILE, TRAIN_CONFIG, checkpoint_step, checkpoints, resolve_model


def test_cli_writes_items_and_summary(tiny_world, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = main(
        [
            "--model",
            str(tiny_world.models["gpt2"]),
            "--data",
            str(tiny_world.data_dir),
            "--limit",
            "4",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "6",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy", "ci_low", "ci_high", "n", "perplexity", "model", "answer_nll"):
        assert key in summary
    assert summary["n"] == 4 and summary["model"] == str(tiny_world.models["gpt2"])
    assert math.isfinite(summary["perplexity"]) and summary["perplexity"] > 1
    rows = read_items(out)
    assert len(rows) == 4 and all(isinstance(r["correct"], bool) for r in rows)
    # per-item answer NLL beside exact match; the summary holds their mean
    assert all(r["answer_nll"] > 0 and r["answer_tokens"] >= 1 for r in rows)
    assert summary["answer_nll"] == pytest.approx(sum(r["answer_nll"] for r in rows) / 4)
    assert "answer NLL" in capsys.readouterr().out


def test_resolve_model(tmp_path):
    """A run dir: its final model, else its newest complete checkpoint (never an incomplete one)."""
    run, said = tmp_path / "run", []
    for step in (5, 10, 9, 12):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "config.json").write_text("{}")
        (run / f"checkpoint-{step}" / TRAIN_CONFIG).write_text("{}")
        if step != 12:  # checkpoint-12 was cut short
            (run / f"checkpoint-{step}" / COMPLETE_FILE).write_text("{}")
    for name in ("checkpoint-best-20", "checkpoint-３０", "checkpoint-"):  # a copy, a non-ASCII digit: no checkpoint
        shutil.copytree(run / "checkpoint-5", run / name)
    assert [checkpoint_step(p) for p in checkpoints(run)] == [5, 9, 10, 12]
    assert resolve_model(run, "evaluating", said.append) == str(run / "checkpoint-10")
    assert said == [f"evaluating {run / 'checkpoint-10'} (newest complete checkpoint; the run has no final model)"]
    (run / "config.json").write_text("{}")  # the final save began, and did not reach its last file
    assert resolve_model(run, "evaluating", said.append) == str(run / "checkpoint-10")
    (run / TRAIN_CONFIG).write_text("{}")
    assert resolve_model(run, "evaluating", said.append) == str(run)
    assert said[-1] == f"evaluating {run} (the run's final model)"
    with pytest.raises(ConfigError, match=r"checkpoint-12 is incomplete .* pass .*checkpoint-10 instead"):
        resolve_model(run / "checkpoint-12", "evaluating")
    assert resolve_model(run / "checkpoint-9", "evaluating", said.append) == str(run / "checkpoint-9")
    assert resolve_model("Qwen/Qwen2.5-0.5B", "evaluating", said.append) == "Qwen/Qwen2.5-0.5B"
    plain = tmp_path / "model"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert resolve_model(plain, "evaluating", said.append) == str(plain)
    assert len(said) == 3  # a checkpoint, a Hub id or a plain model dir: nothing to say


def test_kvdistill_run_dir_uses_its_training_template(tiny_world, tmp_path):
    from kvdistill.commands.eval import run_eval, training_prompt_settings

    run = tmp_path / "run"
    shutil.copytree(tiny_world.models["student"], run)
    (run / "kvdistill_config.yaml").write_text(
        'prompt_template: "Q: {question}\\nA:"\nuse_chat_template: true\n'
    )
    assert training_prompt_settings(run) == {"template": "Q: {question}\nA:", "chat_template": "auto",
                                             "student_input": "full"}
    assert training_prompt_settings(tiny_world.models["student"]) is None
    out = run_eval(
        run,
        data=str(tiny_world.data_dir),
        limit=2,
        max_new_tokens=2,
        perplexity=False,
        progress=False,
        template=None,
        log=lambda s: None,
    )
    assert out["template"] == "Q: {question}\nA:" and out["stop_strings"] == ["\nQ:"]
    assert out["chat_template"] is False  # "auto" and the tokenizer has none


@pytest.mark.parametrize("flag, value", [("--limit", "0"), ("--limit", "-5"), ("--batch_size", "0"),
                                         ("--max_new_tokens", "0")])
def test_eval_refuses_non_positive_sizes(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} must be >= 1"):
        main(["--model", "some/model", flag, value])


def test_privileged_student_perplexity_is_on_the_text_it_read(tiny_world, tmp_path):
    """A `student_input: no_rationale` student is scored on `#### n` answers, not the full rationale."""
    from kvdistill.commands.eval import run_eval

    run = tmp_path / "run"
    shutil.copytree(tiny_world.models["student"], run)
    (run / "kvdistill_config.yaml").write_text("student_input: no_rationale\n")
    kw = dict(data=str(tiny_world.data_dir), limit=3, max_new_tokens=2, progress=False, log=lambda s: None)
    short = run_eval(run, **kw)
    (run / "kvdistill_config.yaml").write_text("student_input: full\n")
    full = run_eval(run, **kw)
    assert short["student_input"] == "no_rationale" and full["student_input"] == "full"
    assert short["target_tokens"] < full["target_tokens"]  # the rationale is not scored
    assert [i["gold"] for i in short["items"]] == [i["gold"] for i in full["items"]]


def test_eval_requires_data():
    """No silent default dataset: `--data` left out is an error naming the flag."""
    with pytest.raises(ConfigError, match="no data: pass --data"):
        main(["--model", "some/model"])


def test_no_answer_nll_flag(tiny_world, tmp_path):
    argv = ["--model", str(tiny_world.models["student"]), "--data", str(tiny_world.data_dir), "--limit", "2",
            "--max_new_tokens", "2", "--no_perplexity", "--no_answer_nll", "--no_progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["answer_nll"] is None
    assert "answer_nll" not in read_items(tmp_path)[0]


def test_kl_to_the_teacher_is_the_per_token_kl_on_the_perplexity_tokens(tiny_world, tmp_path, capsys):
    """--teacher: KL(teacher || model) summed over the vocabulary, mean over the perplexity's target tokens; zero for
    the model itself; a teacher of another tokenizer is refused in one line."""
    import torch

    from kvdistill.data import load_records, pad_batch, tokenize_example
    from kvdistill.models import load_model, load_tokenizer

    m = tiny_world.models
    argv = ["--model", str(m["student"]), "--data", str(tiny_world.data_dir), "--limit", "3", "--max_new_tokens", "2",
            "--no_answer_nll", "--no_progress"]
    assert main([*argv, "--teacher", str(m["student"]), "--out", str(tmp_path / "self")]) == 0
    assert json.loads((tmp_path / "self" / "summary.json").read_text())["kl_to_teacher"] == pytest.approx(0, abs=1e-6)
    assert main([*argv, "--teacher", str(m["qwen2_teacher"]), "--out", str(tmp_path / "t")]) == 0
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert "KL to the teacher" in capsys.readouterr().out and summary["teacher"] == str(m["qwen2_teacher"])
    # the same number from the definition, record by record
    tok = load_tokenizer(m["student"])
    records = load_records(str(tiny_world.data_dir), split="test", limit=3)
    batch = pad_batch([tokenize_example(tok, r) for r in records], tok.pad_token_id)
    with torch.no_grad():
        p_s, p_t = (load_model(m[k])(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                    .logits[:, :-1, :len(tok)].double().softmax(-1) for k in ("student", "qwen2_teacher"))
    target = batch["labels"][:, 1:] != -100  # [B, T-1]
    kl = (p_t * (p_t.log() - p_s.log())).sum(-1)[target]
    assert summary["kl_to_teacher"] == pytest.approx(float(kl.mean()), rel=1e-4) and summary["kl_to_teacher"] > 0
    from kvdistill.cli import main as cli

    capsys.readouterr()
    assert cli(["eval", *argv, "--teacher", str(m["llama_teacher_alt_tok"])]) == 2
    err = capsys.readouterr().err
    assert "has another tokenizer than" in err and err.count("\n") == 1
