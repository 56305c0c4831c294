"""Per-teacher `control`: one run takes logit KD from the real teacher (weight 0: logits only) and the
relation signal from a control copy of it; a teacher's unset control is the run's `teacher_control`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kvdistill.commands.dry_run import dry_run, parse_dry_run
from kvdistill.commands.train import run_training
from kvdistill.config import ConfigError
from kvdistill.runs import read_run
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

RELATION = {"kv_loss": "relation", "kv_weight": 1.0, "relation_heads": 1, "relation_compile": False, "max_samples": 8,
            "max_steps": 2}
W = "model.layers.0.self_attn.k_proj.weight"


def _teachers(path: Path, *entries: str) -> str:
    return "[" + ", ".join(f"{{path: {path}, {e}}}" for e in entries) + "]"


def _batch(trainer) -> dict:
    return trainer.data_collator([trainer.train_dataset[i] for i in range(4)])


def _metrics(trainer, batch: dict) -> dict:
    """The model's loss terms on `batch`, teachers (controls applied) included, as compute_loss runs them."""
    batch = dict(batch)
    teacher_inputs = batch.pop("teacher_inputs", {})
    kvs, logits = trainer.teacher_targets(batch, teacher_inputs, batch.pop("token_fields", None))
    with torch.no_grad():
        return trainer.distill_model(**batch, teacher_kvs=kvs, teacher_logits=logits, kv_scale=1.0)["metrics"]


def test_logits_from_the_teacher_and_relation_from_its_untrained_copy(base_args, tiny_world, tmp_path):
    teacher = tiny_world.models["qwen2_teacher"]
    mixed = {**RELATION, "logit_kd_weight": 1.0,
             "teachers": _teachers(teacher, "name: real, logit_kd: same_vocab, weight: 0",
                                   "name: ctrl, control: untrained, logit_kd: off")}
    trainer = build_trainer(parse_config(base_args(**mixed)))
    real, ctrl = (trainer.teachers.teachers[n].model.state_dict()[W] for n in ("real", "ctrl"))
    assert torch.equal(real, load_file(teacher / "model.safetensors")[W]) and not torch.equal(ctrl, real)
    assert list(trainer.distill_model.aligners) == ["ctrl"]  # weight 0: outside the fusion, no aligner
    assert [r["teacher"] for r in dry_run(*parse_dry_run(base_args(**mixed)))["aligners"]] == ["ctrl"]  # as planned
    batch = _batch(trainer)
    kvs, logits = trainer.teacher_targets({k: v for k, v in batch.items() if k != "teacher_inputs"},
                                          batch.get("teacher_inputs", {}))
    assert set(kvs) == {"ctrl"} and set(logits) == {"real"}  # the control gives no logits, the real one no KV
    got = _metrics(trainer, batch)

    # each signal as a one-teacher run gives it: logit KD from the real teacher, relation from its untrained copy
    logits_only = build_trainer(parse_config(base_args(**{**mixed, "kv_weight": 0, "teachers": _teachers(
        teacher, "name: real, logit_kd: same_vocab")})))
    relation_only = build_trainer(parse_config(base_args(**{**mixed, "logit_kd_weight": 0, "teachers": _teachers(
        teacher, "name: ctrl, logit_kd: off"), "teacher_control": "untrained"})))
    torch.testing.assert_close(got["logit_kd"], _metrics(logits_only, batch)["logit_kd"])
    torch.testing.assert_close(got["kv_loss"], _metrics(relation_only, batch)["kv_loss"])
    assert float(got["logit_kd"]) > 0 and float(got["kv_loss"]) > 0

    out = run_training(parse_config(base_args(**mixed, output_dir=str(tmp_path / "mixed"))))  # end to end
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert rows and all(r["logit_kd"] > 0 and r["kv_loss"] > 0 for r in rows)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["teacher_control"] == "none"
    assert summary["teacher_controls"] == {"real": "none", "ctrl": "untrained"}
    card = (out / "README.md").read_text()
    assert "**Control teachers** (`ctrl: untrained`)" in card and card.count("| untrained |") == 1
    saved = yaml.safe_load((out / "kvdistill_config.yaml").read_text())["teachers"]
    assert [t.get("control") for t in saved] == [None, "untrained"]  # written only when set
    (out / "eval").mkdir()
    (out / "eval" / "items.jsonl").write_text(json.dumps({"index": 0, "correct": True}) + "\n")
    (out / "eval" / "summary.json").write_text(json.dumps({"accuracy": 1.0, "n": 1}))
    assert read_run(out)["teacher_controls"] == {"real": "none", "ctrl": "untrained"}


@pytest.mark.parametrize("control, extra", [
    ("untrained", {}),
    ("shuffled", {}),
    ("permuted", {"permute": "numbers", "permute_vocab": "0..99"}),
])
def test_an_unset_teacher_control_is_the_runs(base_args, tiny_world, control, extra):
    teacher = tiny_world.models["qwen2_teacher"]
    def trainer(run_control: str, own_control: str | None = None, **options):
        own = "" if own_control is None else f", control: {own_control}"
        return build_trainer(parse_config(base_args(**RELATION, **options, teacher_control=run_control,
                                                    teachers=_teachers(teacher, "name: t" + own))))

    run_wide, own, plain = trainer(control, **extra), trainer("none", control, **extra), trainer("none")
    batch, own_batch = _batch(run_wide), _batch(own)
    assert torch.equal(batch["input_ids"], own_batch["input_ids"])
    if control == "permuted":  # the teacher reads the rewritten text in both
        assert torch.equal(batch["teacher_inputs"]["t"]["input_ids"], own_batch["teacher_inputs"]["t"]["input_ids"])
    loss = _metrics(run_wide, batch)["kv_loss"]
    torch.testing.assert_close(_metrics(own, own_batch)["kv_loss"], loss)
    assert not torch.allclose(_metrics(plain, _batch(plain))["kv_loss"], loss)  # and the control acts


@pytest.mark.parametrize("teachers, change, match", [
    ("name: c, control: shuffled, logit_kd: same_vocab", {},
     "teacher c: logit KD .* a shuffled teacher does not read; set its logit_kd: off"),
    ("name: c, control: permuted", {"permute": "numbers", "permute_vocab": "0..9"}, "a permuted teacher does not read"),
    ("name: c, control: oracle", {}, "teacher c: control oracle replaces every teacher, not one; set the run's"),
    ("name: c, weight: 0, logit_kd: off, control: untrained", {}, "teacher c has weight 0 .* gives no logits"),
    ("name: c, control: untrained", {"logit_kd_weight": 0}, "teacher real has weight 0 .* gives no logits"),
])
def test_a_control_teacher_whose_logits_would_be_used_is_refused(base_args, tiny_world, teachers, change, match):
    teacher = tiny_world.models["qwen2_teacher"]
    argv = base_args(**{**RELATION, "logit_kd_weight": 1.0, **change,
                        "teachers": _teachers(teacher, "name: real, weight: 0", teachers)})
    with pytest.raises(ConfigError, match=match) as err:
        parse_config(argv)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("chunk", [0, 64])  # the model's logits | the head a chunk of tokens at a time
def test_logits_only_teachers_give_logit_kd_in_full_and_no_kv_signal(base_args, tiny_world, chunk):
    teacher = tiny_world.models["qwen2_teacher"]
    with pytest.raises(ConfigError, match="every teacher has weight 0"):
        parse_config(base_args(**RELATION, logit_kd_weight=1.0, teachers=_teachers(teacher, "weight: 0")))

    def trainer(weight: float):
        return build_trainer(parse_config(base_args(**{**RELATION, "kv_weight": 0}, logit_kd_weight=1.0,
                                                    logit_chunk_tokens=chunk,
                                                    teachers=_teachers(teacher, f"weight: {weight}"))))

    logits_only, fused = trainer(0), trainer(1)
    assert not logits_only.distill_model.aligners
    batch = _batch(fused)
    kd = _metrics(logits_only, batch)["logit_kd"]
    torch.testing.assert_close(kd, _metrics(fused, batch)["logit_kd"])  # as the one teacher at fusion weight 1
    assert float(kd) > 0


def test_ablate_captures_a_run_with_an_untrained_teacher_per_seed(tmp_path):
    from kvdistill.commands import ablate

    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"student": "s", "kv_weight": 1.0, "teachers": [
        {"path": "t", "name": "real"}, {"path": "t", "name": "ctrl", "control": "untrained"}]}))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({
        "base_config": "train.yaml", "output_dir": str(tmp_path / "o"), "seeds": [0, 1], "capture": True,
        "variants": [{"name": "mixed", "overrides": {}},
                     {"name": "plain", "overrides": {"teachers": [{"path": "t"}]}}]}))
    cfg = ablate.load_ablation_config(tmp_path / "a.yaml")
    dirs = {v.name: ablate.run.capture_dir_for(cfg, v, ablate.run.train_config_for(cfg, v, 1)) for v in cfg.variants}
    captures = tmp_path / "o" / "captures"
    assert dirs == {"mixed": captures / "mixed_seed1", "plain": captures / "plain"}


@pytest.mark.parametrize("run_control", ["none", "untrained", "shuffled"])
@pytest.mark.parametrize("b_control", [None, "none", "untrained", "shuffled"])
def test_the_card_and_ablate_read_each_teachers_control_as_the_trainer_does(tmp_path, run_control, b_control):
    """One rule, a teacher's own `control` else the run's, read by the trainer (the config), the card (its
    teachers' entries) and ablate (whose captures are per seed): a copy of it drifting apart fails here."""
    from kvdistill.card import card_info
    from kvdistill.commands import ablate
    from kvdistill.train.config import KVDistillConfig

    (tmp_path / "b").mkdir()
    teachers = ["org/a", {"path": f"{tmp_path / 'b'}/", "control": b_control},  # named from their paths
                {"path": "org/c", "name": "named", "control": "none"}]
    expected = {"a": run_control, "b": b_control or run_control, "named": "none"}
    train = {"student": "org/s", "kv_weight": 1.0, "per_device_train_batch_size": 2, "teachers": teachers,
             "teacher_control": run_control}
    cfg = KVDistillConfig(**train, output_dir=str(tmp_path / "run"))
    assert cfg.teacher_controls == expected

    card = card_info(cfg.to_yaml_dict(), [{"name": t.name} for t in cfg.teacher_configs], {})
    assert {t["name"]: t.get("control", "none") for t in card["teachers"]} == expected

    (tmp_path / "train.yaml").write_text(yaml.safe_dump(train))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"base_config": "train.yaml", "output_dir": str(tmp_path / "o"),
                                                     "seeds": [1], "capture": True, "variants": [{"name": "x", "overrides": {}}]}))
    abl = ablate.load_ablation_config(tmp_path / "a.yaml")
    (v,) = abl.variants
    per_seed = bool({"untrained", "permuted"} & set(expected.values()))
    assert ablate.run.capture_dir_for(abl, v, ablate.run.train_config_for(abl, v, 1)).name == ("x_seed1" if per_seed else "x")
