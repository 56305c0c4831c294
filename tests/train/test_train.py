"""End-to-end training on the tiny fixtures: learning, freezing, resume, saving, DDP."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvdistill.commands.train import main as train_main
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.fixture(scope="module")
def two_teacher_run(tiny_world, tmp_path_factory):
    """30 steps, two teachers: another architecture and another tokenizer than the student."""
    m = tiny_world.models
    out = tmp_path_factory.mktemp("two_teacher") / "run"
    before = {n: load_file(Path(m[n]) / "model.safetensors") for n in ("qwen2_teacher", "llama_teacher_alt_tok")}
    argv = [
        "--student", str(m["student"]), "--data", str(tiny_world.data_dir), "--output_dir", str(out),
        "--teachers", f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, weight: 0.5}}]",
        "--max_length", "160", "--max_steps", "30", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--learning_rate", "1e-3", "--kv_weight", "1",
        "--kv_warmup_steps", "0", "--logging_steps", "5", "--save_steps", "1000", "--use_cpu", "true",
        "--disable_tqdm", "true",
    ]
    assert train_main(argv) == 0
    return out, before


def test_kv_loss_falls_and_cos_sim_rises(two_teacher_run):
    out, _ = two_teacher_run
    rows = _rows(out)
    assert rows[-1]["kv_loss"] < rows[0]["kv_loss"] - 0.05
    for t in ("qwen2_teacher", "llama_teacher_alt_tok"):
        assert rows[-1][f"cos_sim/{t}"] > rows[0][f"cos_sim/{t}"] + 0.05
        assert f"cos_layer/{t}/1" in rows[-1]
    for key in ("ce", "kv_warmup", "grad_norm/student", "grad_norm/aligner", "fusion_w/qwen2_teacher"):
        assert key in rows[-1], key
    for r in rows:  # the parts of the logging step's gradient make up the Trainer's (pre-clipping) grad_norm
        if "grad_norm" in r:
            assert math.hypot(r["grad_norm/student"], r["grad_norm/aligner"]) == pytest.approx(r["grad_norm"], rel=1e-4)
            assert r["grad_norm/aligner"] > 0


def test_teachers_unchanged(two_teacher_run, tiny_world):
    _, before = two_teacher_run
    for name, sd in before.items():
        after = load_file(Path(tiny_world.models[name]) / "model.safetensors")
        for k in sd:
            assert torch.equal(sd[k], after[k])


def test_outputs_and_student_is_a_plain_hf_model(two_teacher_run):
    out, _ = two_teacher_run
    for f in ("train_summary.json", "kvdistill_config.yaml", "teachers.json", "kvdistill_modules.safetensors",
              "curves_loss.png", "curves_cos_sim.png", "cos_sim_layers.png", "aligners/qwen2_teacher/aligner.json"):
        assert (out / f).exists(), f
    assert (out / "curves_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("Question: Tom has 3 apples.", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == 30 and summary["final"]["cos_sim"] is not None


def test_param_groups_have_their_own_learning_rates(base_args):
    cfg = parse_config(base_args(learning_rate=2e-5, aligner_learning_rate=3e-3))
    trainer = build_trainer(cfg)
    opt = trainer.create_optimizer()
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"student": 2e-5, "aligner": 3e-3}
    student_ids = {id(p) for p in trainer.distill_model.student.parameters()}
    for g in opt.param_groups:
        assert all((id(p) in student_ids) == (g["name"] == "student") for p in g["params"])
    teacher_ids = {id(p) for t in trainer.teachers for p in t.model.parameters()}
    assert not teacher_ids & {id(p) for g in opt.param_groups for p in g["params"]}


def test_resume_equals_uninterrupted(base_args, tmp_path):
    full = tmp_path / "full"
    assert train_main(base_args(output_dir=full, max_steps=6, save_steps=3)) == 0
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    assert train_main(base_args(output_dir=resumed, max_steps=6, save_steps=3,
                                resume_from_checkpoint=resumed / "checkpoint-3")) == 0
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    ma, mb = load_file(full / "kvdistill_modules.safetensors"), load_file(resumed / "kvdistill_modules.safetensors")
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], atol=1e-6, rtol=0)
    assert abs(_rows(full)[-1]["loss"] - _rows(resumed)[-1]["loss"]) < 1e-6


def test_resume_with_other_teachers_is_an_error(base_args, tiny_world, tmp_path):
    run = tmp_path / "r"
    assert train_main(base_args(output_dir=run, max_steps=2, save_steps=2)) == 0
    other = f"[{{path: {tiny_world.models['llama_teacher']}}}]"
    with pytest.raises(ValueError, match="same teachers"):
        train_main(base_args(output_dir=run, max_steps=4, teachers=other, resume_from_checkpoint=run / "checkpoint-2"))


def test_accuracy_curve_points_keep_the_loss_rows(base_args, tmp_path):
    out = tmp_path / "curve"
    assert train_main(base_args(output_dir=out, max_steps=4, logging_steps=2, accuracy_eval_steps=2,
                                accuracy_eval_split="test", accuracy_eval_limit=4,
                                accuracy_eval_max_new_tokens=4)) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [2, 4]
    assert min(r["eval_accuracy"] for r in rows if "eval_accuracy" in r) >= 0
    assert [r["step"] for r in rows if "loss" in r] == [2, 4]  # an accuracy point does not swallow the loss row


def test_accuracy_stop_ends_training_at_the_first_point_that_reaches_it(base_args, tmp_path, monkeypatch):
    import kvdistill.evaluate.scoring as scoring

    curve = iter([0.5, 0.9, 1.0])  # dev accuracy at steps 2, 4, 6: the run must end at 4
    monkeypatch.setattr(scoring, "evaluate_model", lambda *a, **k: {"accuracy": next(curve)})
    out = tmp_path / "stop"
    assert train_main(base_args(output_dir=out, max_steps=8, logging_steps=2, accuracy_eval_steps=2,
                                accuracy_stop=0.9, accuracy_eval_split="test", accuracy_eval_limit=4)) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r] == [(2, 0.5), (4, 0.9)]
    assert max(r["step"] for r in rows) == 4
    assert (out / "model.safetensors").exists()  # saved as a run that reached max_steps
