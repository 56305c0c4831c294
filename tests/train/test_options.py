"""Every training option running end to end: 2 optimizer steps through `kvdistill train`'s `main`."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvdistill.commands.train import build_trainer
from kvdistill.commands.train import main as train_main
from kvdistill.models import ModelLoadError
from kvdistill.train.config import ConfigError, parse_config


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def _two_step_argv(base_args, **kw):
    args = {"max_steps": 2, "max_samples": 8, "logging_steps": 1, "kv_weight": 1}
    args.update(kw)
    return base_args(**args)


def _two_teacher_list(tiny_world) -> str:
    m = tiny_world.models
    return f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher']}, weight: 3.0}}]"


@pytest.mark.parametrize("fusion", ["loss_sum", "kv_mean", "learned"])
def test_fusion_kinds_train(fusion, base_args, tiny_world, tmp_path):
    out = tmp_path / fusion
    assert (
        train_main(
            _two_step_argv(base_args, output_dir=out, fusion=fusion, teachers=_two_teacher_list(tiny_world))
        )
        == 0
    )
    rows = _rows(out)
    assert len(rows) == 2 and all(r["kv_loss"] > 0 for r in rows)
    w = rows[0]["fusion_w/qwen2_teacher"], rows[0]["fusion_w/llama_teacher"]
    assert sum(w) == pytest.approx(1.0, abs=1e-6)
    modules = load_file(out / "kvdistill_modules.safetensors")
    if fusion == "kv_mean":
        assert "cos_sim/fused" in rows[-1] and "cos_sim/qwen2_teacher" not in rows[-1]
    else:
        assert "cos_sim/qwen2_teacher" in rows[-1] and "cos_sim/llama_teacher" in rows[-1]
    if fusion == "learned":
        logits = modules["fusion.logits"]
        assert not torch.allclose(torch.softmax(logits, 0), torch.tensor([0.25, 0.75]), atol=0, rtol=0)
        assert w == pytest.approx((0.25, 0.75), abs=1e-3)  # starts from the fixed weights
    else:
        assert w == pytest.approx((0.25, 0.75), abs=1e-6)
        assert "fusion.logits" not in modules


def test_correctness_fusion_caches_teacher_answers(base_args, tiny_world, tmp_path, monkeypatch):
    import kvdistill.evaluate.scoring as ev

    out = tmp_path / "correctness"
    argv = _two_step_argv(
        base_args, output_dir=out, fusion="correctness", teachers=_two_teacher_list(tiny_world)
    )
    calls = []
    real = ev.evaluate_model
    monkeypatch.setattr(ev, "evaluate_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert train_main(argv) == 0
    assert len(calls) == 2  # once per teacher
    cache = out / "teacher_correctness.json"
    table = json.loads(cache.read_text())
    assert len(table) == 2 and all(len(v) == 8 and set(v) <= {0, 1} for v in table.values())
    mtime = os.stat(cache).st_mtime_ns

    monkeypatch.setattr(ev, "evaluate_model", lambda *a, **k: pytest.fail("teacher answers were recomputed"))
    assert train_main(argv) == 0
    assert os.stat(cache).st_mtime_ns == mtime
    rows = _rows(out)
    assert rows[-1]["fusion_w/qwen2_teacher"] + rows[-1]["fusion_w/llama_teacher"] == pytest.approx(1.0)


def test_structured_elastic_structural_trains(base_args, tmp_path):
    out = tmp_path / "structured"
    assert (
        train_main(
            _two_step_argv(
                base_args,
                output_dir=out,
                head_mode="structured",
                projector="elastic",
                kv_loss="structural",
                mlp_ratio=0.5,
            )
        )
        == 0
    )
    rows = _rows(out)
    assert len(rows) == 2 and all(r["kv_loss"] == r["kv_loss"] and r["kv_loss"] > 0 for r in rows)  # not NaN
    keys = load_file(out / "kvdistill_modules.safetensors").keys()
    assert any(".k_mix." in k for k in keys) and any("norm" in k for k in keys)  # head mixer + LayerNorm


def test_codi_and_logit_kd_train(base_args, tiny_world, tmp_path):
    out = tmp_path / "codi_kd"
    assert (
        train_main(
            _two_step_argv(
                base_args,
                output_dir=out,
                codi_weight=0.5,
                logit_kd_weight=0.5,
                logit_kd_kind="jsd",
                logit_kd_temperature=2.0,
            )
        )
        == 0
    )
    rows = _rows(out)
    assert all(r["codi"] > 0 and r["logit_kd"] > 0 for r in rows)
    keys = load_file(out / "kvdistill_modules.safetensors").keys()
    assert "codi.qwen2_teacher.weight" in keys


def test_untrained_teacher_control(base_args, tiny_world):
    trainer = build_trainer(parse_config(_two_step_argv(base_args, untrained_teacher_control=True)))
    saved = load_file(Path(tiny_world.models["qwen2_teacher"]) / "model.safetensors")
    (teacher,) = list(trainer.teachers)
    used = teacher.model.state_dict()
    w = "model.layers.0.self_attn.k_proj.weight"
    assert used[w].shape == saved[w].shape and not torch.equal(used[w], saved[w])
    assert all(not p.requires_grad for p in teacher.model.parameters())
    trainer.train()
    assert trainer.state.global_step == 2
    assert torch.equal(teacher.model.state_dict()[w], used[w])  # frozen through training


def test_fixed_projector_stays_at_init_while_the_student_learns(base_args):
    trainer = build_trainer(parse_config(_two_step_argv(base_args, projector_trainable=False)))
    model = trainer.distill_model
    aligner = {n: p.detach().clone() for n, p in model.aligners.named_parameters()}
    student = {n: p.detach().clone() for n, p in model.student.named_parameters()}
    assert aligner and not any(p.requires_grad for p in model.aligners.parameters())
    trainer.train()
    assert all(torch.equal(p, aligner[n]) for n, p in model.aligners.named_parameters())
    assert any(not torch.equal(p, student[n]) for n, p in model.student.named_parameters())


def test_teacher_offload(base_args, monkeypatch):
    trainer = build_trainer(parse_config(_two_step_argv(base_args, teacher_offload=True)))
    assert trainer.teachers.offload
    (teacher,) = list(trainer.teachers)
    moves = []
    real_to = teacher.model.to
    monkeypatch.setattr(teacher.model, "to", lambda *a, **k: moves.append(str(a[0])) or real_to(*a, **k))
    trainer.train()
    assert trainer.state.global_step == 2
    assert moves and moves[-1] == "cpu" and len(moves) % 2 == 0  # on the device for a forward, then back
    assert all(p.device.type == "cpu" for p in teacher.model.parameters())


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_4bit_without_bitsandbytes_is_a_clear_error(base_args, tiny_world):
    teachers = f"[{{path: {tiny_world.models['qwen2_teacher']}, quantization: 4bit}}]"
    cfg = parse_config(base_args(teachers=teachers))
    with pytest.raises(ModelLoadError, match="bitsandbytes"):
        build_trainer(cfg)


# ------------------------------------------------------------------ gradient checkpointing
def test_checkpointing_drops_the_student_cache_in_training(tiny_world):
    """Pins the transformers behaviour docs/training.md describes: no cache comes back in train mode."""
    from kvdistill.cache import forward_with_kv
    from kvdistill.data import DistillCollator, load_records
    from kvdistill.models import load_model, load_tokenizer

    path = tiny_world.models["student"]
    student, tok = load_model(path, dtype="fp32"), load_tokenizer(path)
    batch = DistillCollator(tok, 160)(load_records(tiny_world.data_dir, "train", limit=2))
    enable = (
        getattr(student, "activation_checkpointing_enable", None) or student.gradient_checkpointing_enable
    )
    enable()
    student.train()
    with pytest.raises(ValueError, match="no cache"):
        forward_with_kv(student, batch["input_ids"], batch["attention_mask"], batch["segment_ids"])
    student.eval()  # inference keeps the cache
    _, kv = forward_with_kv(student, batch["input_ids"], batch["attention_mask"], batch["segment_ids"])
    assert kv.keys.shape[0] == 2


def test_checkpointing_refused_with_kv_and_works_for_sft(base_args):
    with pytest.raises(ConfigError, match="checkpointing"):
        parse_config(base_args(gradient_checkpointing="true", kv_weight=0.1))
    cfg = parse_config(
        _two_step_argv(base_args, activation_checkpointing="true", kv_weight=0, codi_weight=0.5)
    )
    trainer = build_trainer(cfg)
    trainer.train()
    student = trainer.distill_model.student
    assert getattr(student, "is_activation_checkpointing", None) or student.is_gradient_checkpointing
    assert trainer.state.global_step == 2 and "codi" in trainer.state.log_history[0]
