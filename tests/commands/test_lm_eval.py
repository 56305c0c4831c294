"""lm-evaluation-harness on a saved kvdistill student: the shipped task scores as `kvdistill eval` does.

`configs/lm_eval/kvdistill_gsm8k_local.yaml` is run through `lm_eval.simple_evaluate(model="hf")`
on a local JSONL (conftest sets HF_HUB_OFFLINE=1: no Hub) and compared with `kvdistill eval` item
by item: the completion, the extracted answer, exact match, and the accuracy.
"""

import json
from pathlib import Path

import pytest

from kvdistill.commands.eval import EvalConfig
from kvdistill.commands.eval import main as eval_main
from kvdistill.commands.train import main as train_main
from kvdistill.data import DEFAULT_TEMPLATE, format_prompt
from kvdistill.evaluate.answers import gold_answer
from kvdistill.evaluate.scoring import default_stop_strings, read_items

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed: pip install -e '.[eval]'")

TASKS = Path(__file__).resolve().parents[2] / "configs" / "lm_eval"
N_ITEMS, MAX_NEW_TOKENS, BATCH = 20, 48, 8


@pytest.fixture(scope="module")
def student(tiny_world, tmp_path_factory):
    """The tiny student after 60 SFT steps: it writes GSM8K-shaped text ending in `#### n`."""
    out = tmp_path_factory.mktemp("lm_eval") / "student"
    argv = ["--student", str(tiny_world.models["student"]), "--data", str(tiny_world.data_dir),
            "--output_dir", str(out), "--kv_weight", "0", "--max_length", "160", "--max_steps", "60",
            "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1",
            "--learning_rate", "1e-2", "--logging_steps", "20", "--save_steps", "1000", "--use_cpu", "true",
            "--disable_tqdm", "true", "--report_to", "none"]
    assert train_main(argv) == 0
    return out


def _kvdistill_eval(model: Path, data: Path, out: Path) -> tuple[list[dict], dict]:
    assert eval_main(["--model", str(model), "--data", str(data), "--limit", str(N_ITEMS), "--batch_size",
                      str(BATCH), "--max_new_tokens", str(MAX_NEW_TOKENS), "--no_perplexity", "--no_progress",
                      "--output_dir", str(out)]) == 0
    return read_items(out), json.loads((out / "summary.json").read_text())


def _local_task(tmp_path: Path, data_file: Path) -> "lm_eval.tasks.TaskManager":
    """The shipped local task, renamed `kvdistill_gsm8k_test` and pointed at `data_file` (as a user
    copies the YAML), in a TaskManager that indexes no built-in task."""
    from lm_eval.tasks import TaskManager

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "test_task.yaml").write_text(
        f"include: {TASKS / 'kvdistill_gsm8k_local.yaml'}\ntask: kvdistill_gsm8k_test\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data_file}\n"
    )
    return TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)


def test_shipped_task_settings_are_kvdistill_evals(tiny_world, tmp_path):
    """Prompt, stop strings, budget, greedy, zero-shot: what the end-to-end test's model may not reach."""
    from lm_eval.tasks import TaskManager

    assert {"kvdistill_gsm8k", "kvdistill_gsm8k_local"} <= set(
        TaskManager(include_path=str(TASKS), include_defaults=False).all_tasks
    )
    task = _local_task(tmp_path, tiny_world.data_dir / "test.jsonl").load_task_or_group(
        ["kvdistill_gsm8k_test"])["kvdistill_gsm8k_test"]
    doc = task.test_docs()[0]
    n_shot = task.config.num_fewshot
    assert n_shot == 0 and task.fewshot_context(doc, n_shot) == format_prompt(doc["question"], DEFAULT_TEMPLATE)
    assert task.doc_to_target(doc) == gold_answer(doc["answer"])
    gen = task.config.generation_kwargs
    assert gen["until"] == default_stop_strings(DEFAULT_TEMPLATE)
    assert gen["max_gen_toks"] == EvalConfig(model="m", data="d").max_new_tokens and gen["do_sample"] is False


def test_lm_eval_scores_like_kvdistill_eval(student, tiny_world, tmp_path):
    # Accuracy 0 on both sides would hide a broken comparison: every other item's gold becomes the
    # number this student answers there (from a first `kvdistill eval`), so about half are right.
    first, _ = _kvdistill_eval(student, tiny_world.data_dir, tmp_path / "first")
    records = [json.loads(x) for x in (tiny_world.data_dir / "test.jsonl").read_text().splitlines()][:N_ITEMS]
    for i, (rec, row) in enumerate(zip(records, first)):
        if i % 2 == 0 and row["extracted"] is not None:
            rec["answer"] = rec["answer"].rsplit("####", 1)[0] + f"#### {row['extracted']}"
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ours, summary = _kvdistill_eval(student, data, tmp_path / "ours")
    assert 0 < summary["accuracy"] < 1, "the comparison needs right and wrong items"

    result = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(student), "dtype": "float32"}, device="cpu",
        tasks=["kvdistill_gsm8k_test"], batch_size=BATCH, limit=N_ITEMS, bootstrap_iters=0,
        gen_kwargs={"max_gen_toks": MAX_NEW_TOKENS}, log_samples=True,
        task_manager=_local_task(tmp_path, data / "test.jsonl"),
    )
    samples = sorted(result["samples"]["kvdistill_gsm8k_test"], key=lambda s: s["doc_id"])
    assert len(samples) == len(ours) == N_ITEMS
    for s, row in zip(samples, ours):
        assert s["doc"]["question"] == row["question"]
        assert s["resps"][0][0] == row["prediction"], f"item {s['doc_id']}: the tools generated different text"
        extracted = s["filtered_resps"][0]
        assert (extracted if extracted != "[no answer]" else None) == row["extracted"]
        assert s["target"] == row["gold"]
        assert s["exact_match"] == float(row["correct"])
    assert result["results"]["kvdistill_gsm8k_test"]["exact_match,kvdistill"] == pytest.approx(summary["accuracy"])
