"""`key_space: hidden`: the KV term on each layer's hidden state (an intermediate-state loss, as Minitron's),
through the same layer map, aligner and kv_loss."""

from __future__ import annotations

import json

import torch

from kvdistill.commands.train import run_training
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

HIDDEN = {"key_space": "hidden", "kv_loss": "cosine", "kv_weight": 1.0, "kv_warmup_steps": 0, "time_mode": "index",
          "layer_map": "proportional", "projector": "linear", "max_samples": 8, "max_steps": 2}


def _metrics(trainer) -> tuple[dict, dict]:
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    teacher_inputs = batch.pop("teacher_inputs", {})
    kvs, logits = trainer.teacher_targets(batch, teacher_inputs, batch.pop("token_fields", None))
    with torch.no_grad():
        return trainer.distill_model(**batch, teacher_kvs=kvs, teacher_logits=logits, kv_scale=1.0)["metrics"], kvs


def test_the_student_as_its_own_hidden_state_teacher_has_zero_loss(base_args, tiny_world):
    """The same weights on both sides, an identity projector and the identity layer map: every aligned hidden
    state equals its target, so the cosine loss is 0; a teacher of another width gives `[L, B, 1, T, d]` targets
    and a positive loss."""
    student = tiny_world.models["student"]
    own = build_trainer(parse_config(base_args(**HIDDEN, projector_init="identity", allow_self_teacher="true",
                                               teachers=f"[{{path: {student}}}]")))
    metrics, _ = _metrics(own)
    assert float(metrics["kv_loss"]) < 1e-6
    other = build_trainer(parse_config(base_args(**HIDDEN)))
    metrics, kvs = _metrics(other)
    (kv,) = kvs.values()
    cfg = other.teachers.teachers[next(iter(kvs))].model.config
    assert kv.keys.shape[0] == cfg.num_hidden_layers and kv.keys.shape[2] == 1 and kv.keys.shape[-1] == cfg.hidden_size
    assert float(metrics["kv_loss"]) > 0.01


def test_a_hidden_state_run_trains_end_to_end(base_args, tmp_path):
    out = run_training(parse_config(base_args(**HIDDEN, output_dir=str(tmp_path / "run"))))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert rows and all(0 < r["kv_loss"] < 2 for r in rows)
