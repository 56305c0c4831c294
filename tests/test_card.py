"""Model cards (`kvdistill.card`): what a saved student states about itself, and that it still loads."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, pipeline

from kvdistill.card import CARD_FILE, card_info, read_card_info, record_evaluation, render_card, write_card
from kvdistill.commands.eval import main as eval_main
from kvdistill.commands.train import main as train_main
from kvdistill.train.config import card_sections

CONFIG = {
    "student": "Qwen/Qwen2.5-0.5B", "output_dir": "runs/qwen-kv", "time_mode": "segment", "layer_map": "cka",
    "ce_weight": 1.0, "kv_loss": "mercator", "kv_weight": 0.1, "kv_warmup_steps": 100, "logit_kd_weight": 0.25,
    "logit_kd_kind": "forward_kl", "data": "openai/gsm8k", "prompt_template": "Q: {question}\nA:", "max_steps": 1000,
}
TEACHERS = [{"name": "qwen2-7b", "path": "Qwen/Qwen2-7B", "config_hash": "abc123", "weight": 0.75},
            {"name": "llama", "path": "/models/llama", "config_hash": "def456", "weight": 0.25}]
SECTIONS = card_sections()
RESULT = {"data": "openai/gsm8k", "split": "test", "n": 1319, "n_correct": 300, "accuracy": 300 / 1319,
          "ci_low": 0.205, "ci_high": 0.251, "perplexity": 3.2, "max_new_tokens": 256, "chat_template": False}


def test_card_states_base_model_teachers_recipe_data_and_steps():
    maps = {"qwen2-7b": torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]), "llama": [[1.0, 0.0], [0.3, 0.7]]}
    card = render_card(card_info(CONFIG, TEACHERS, SECTIONS, step=400, layer_maps=maps))
    text = card.text
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B" and card.data.pipeline_tag == "text-generation"
    for teacher in TEACHERS:
        assert f"| {teacher['name']} | `{teacher['path']}` | {teacher['weight']} | `{teacher['config_hash']}` |" in text
    assert "| KV (mercator) | 0.1 | warm-up 100 steps |" in text
    assert "| logit KD (forward_kl) | 0.25 |" in text
    assert "| time_mode | `segment` |" in text and "| layer_map | `cka` |" in text
    assert "| 0 | 0 (0.50), 1 (0.50) | 0 (1.00) |" in text and "| 1 | 2 (1.00) | 0 (0.30), 1 (0.70) |" in text
    assert "| data | `openai/gsm8k` |" in text and "saved at optimizer step 400" in text
    assert "Not evaluated yet" in text and not card.data.eval_results
    assert "`kvdistill eval --model <this directory> --data <test set>`" in text  # --data is required
    assert '"Q: {question}\\nA:".format(' in text  # the usage example prompts as the student was trained


def test_evaluations_are_recorded_replaced_and_kept_in_the_model_index(tmp_path):
    write_card(tmp_path, CONFIG, TEACHERS, SECTIONS, step=400)
    record_evaluation(tmp_path, RESULT)
    record_evaluation(tmp_path, {**RESULT, "n": 100, "accuracy": 0.5, "ci_low": 0.4, "ci_high": 0.6})
    record_evaluation(tmp_path, {**RESULT, "accuracy": 0.25})  # same data, split and n: replaces the first
    info = read_card_info(tmp_path)
    assert [(e["n"], e["accuracy"]) for e in info["evaluations"]] == [(100, 0.5), (1319, 0.25)]
    assert info["teachers"] == TEACHERS and info["step"] == 400  # the rest survives the re-render
    card_text = (tmp_path / CARD_FILE).read_text()
    meta = yaml.safe_load(card_text.split("---")[1])
    metrics = [(m["name"], m["value"]) for r in meta["model-index"][0]["results"] for m in r["metrics"]]
    assert metrics == [("accuracy (n=100)", 0.5), ("accuracy (n=1319)", 0.25)]
    assert "| openai/gsm8k | test | 1319 | 0.250 | [0.205, 0.251] | 3.2 | 256 |" in card_text
    write_card(tmp_path, CONFIG, TEACHERS, SECTIONS, step=500)  # new weights: no stale result
    assert read_card_info(tmp_path)["evaluations"] == []


def test_other_model_cards_are_left_alone(tmp_path):
    assert record_evaluation(tmp_path, RESULT) is None  # no card
    (tmp_path / CARD_FILE).write_text("---\nlicense: mit\n---\n# someone else's model\n")
    assert record_evaluation(tmp_path, RESULT) is None
    assert (tmp_path / CARD_FILE).read_text() == "---\nlicense: mit\n---\n# someone else's model\n"


@pytest.fixture(scope="module")
def saved_run(tiny_world, tmp_path_factory):
    """4 steps with two teachers, a checkpoint at step 2."""
    m = tiny_world.models
    out = tmp_path_factory.mktemp("card") / "run"
    argv = [
        "--student", str(m["student"]), "--data", str(tiny_world.data_dir), "--output_dir", str(out),
        "--teachers", f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, weight: 0.5}}]",
        "--max_length", "160", "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--kv_weight", "1", "--kv_warmup_steps", "0", "--logging_steps", "2",
        "--save_steps", "2", "--use_cpu", "true", "--disable_tqdm", "true",
    ]
    assert train_main(argv) == 0
    return out


def test_every_saved_student_has_a_card_naming_its_teachers(saved_run):
    for model_dir, step in ((saved_run / "checkpoint-2", 2), (saved_run, 4)):
        info = read_card_info(model_dir)
        assert info is not None, f"no model card in {model_dir}"
        assert info["step"] == step
        manifest = json.loads((model_dir / "teachers.json").read_text())
        assert [(t["name"], t["config_hash"]) for t in info["teachers"]] == [
            (t["name"], t["config_hash"]) for t in manifest]
        assert set(info["layer_maps"]) == {"qwen2_teacher", "llama_teacher_alt_tok"}
        assert len(info["layer_maps"]["qwen2_teacher"]) == 2  # one row per student layer
        assert info["signals"]["kv_weight"] == 1 and info["alignment"]["time_mode"] == "segment"


def test_card_dir_loads_with_auto_classes_and_a_pipeline(saved_run):
    model = AutoModelForCausalLM.from_pretrained(saved_run)
    assert model.config.num_hidden_layers == 2
    generator = pipeline("text-generation", model=str(saved_run), device="cpu")
    out = generator("Question: Tom has 3 apples.\nAnswer:", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("Question: Tom has 3 apples.\nAnswer:")


def _eval_argv(model, tiny_world, out) -> list[str]:
    return ["--model", str(model), "--data", str(tiny_world.data_dir), "--limit", "4", "--batch_size", "4",
            "--max_new_tokens", "8", "--no_progress", "--output_dir", str(out)]


def test_kvdistill_eval_leaves_the_evaluated_model_dir_untouched(saved_run, tiny_world, tmp_path):
    """Evaluating changes nothing of what it evaluates, a run's checkpoint included: the result goes to
    --output_dir; the card gets it only with --update_card."""
    before = {p: p.read_bytes() for p in saved_run.rglob("*") if p.is_file()}
    for model in (saved_run, saved_run / "checkpoint-2"):
        assert eval_main(_eval_argv(model, tiny_world, tmp_path / model.name)) == 0
        assert (tmp_path / model.name / "summary.json").is_file()
    assert {p: p.read_bytes() for p in saved_run.rglob("*") if p.is_file()} == before


def test_kvdistill_eval_records_its_result_in_the_card_when_asked(saved_run, tiny_world, tmp_path):
    argv = [*_eval_argv(saved_run, tiny_world, tmp_path / "eval"), "--update_card"]
    assert eval_main(argv) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    (entry,) = read_card_info(saved_run)["evaluations"]
    assert entry["n"] == 4 and entry["accuracy"] == summary["accuracy"]
    assert entry["perplexity"] == pytest.approx(summary["perplexity"])
    assert read_card_info(saved_run / "checkpoint-2")["evaluations"] == []  # only the evaluated dir
