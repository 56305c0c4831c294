"""The Python API (TRL's shape): `KVDistillTrainer(model=..., args=..., train_dataset=..., teachers=[...])`,
the same run as `build_trainer(cfg)` on the same models, LoRA students, and a package root that imports lazily."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import yaml

from kvdistill.data import DataError
from kvdistill.models import load_model, load_tokenizer
from kvdistill.runs import TRAIN_CONFIG
from kvdistill.train.build import build_trainer
from kvdistill.train.config import ConfigError, KVDistillConfig, TeacherConfig, parse_config
from kvdistill.train.trainer import KVDistillTrainer

FAST = dict(max_length=160, per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=1e-3,
            aligner_learning_rate=1e-3, kv_warmup_steps=0, logging_steps=1, save_steps=1000, use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, report_to="none")


def _records(tiny_world, n=8):
    lines = (tiny_world.data_dir / "train.jsonl").read_text().splitlines()[:n]
    return [json.loads(line) for line in lines]


def _objects(tiny_world):
    m = tiny_world.models
    student, teacher = load_model(m["student"]), load_model(m["qwen2_teacher"])
    return student, load_tokenizer(m["student"]), teacher, load_tokenizer(m["qwen2_teacher"])


def test_import_kvdistill_loads_neither_torch_nor_transformers():
    """`import kvdistill` (and `kvdistill --help`) stay light: the API's names load on first use (PEP 562)."""
    code = ("import sys, kvdistill\n"
            "from kvdistill.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "light = not {'torch', 'transformers'} & set(sys.modules)\n"
            "from kvdistill import KVDistillConfig, KVDistillTrainer, TeacherConfig\n"
            "from kvdistill.train.trainer import KVDistillTrainer as T\n"
            "print(light, KVDistillTrainer is T, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-3:] == ["True", "True", "True"], out.stdout + out.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import kvdistill

        kvdistill.nope  # noqa: B018


def test_a_trainer_from_objects_trains(tiny_world, tmp_path):
    """TRL's manner on the tiny fixtures: loaded models, a `datasets.Dataset`, a teacher spec with its model."""
    from datasets import Dataset

    student, tok, teacher, teacher_tok = _objects(tiny_world)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    args = KVDistillConfig(output_dir=str(tmp_path / "run"), max_steps=2, kv_weight=1.0, **FAST)
    trainer = KVDistillTrainer(model=student, args=args, train_dataset=Dataset.from_list(_records(tiny_world)),
                               processing_class=tok,
                               teachers=[TeacherConfig(model=teacher, tokenizer=teacher_tok, name="t")])
    assert trainer.args.student == str(tiny_world.models["student"])  # the run's config names the objects
    assert trainer.args.teacher_configs[0].path == str(tiny_world.models["qwen2_teacher"])
    assert trainer.distill_model.student is student and list(trainer.distill_model.aligners) == ["t"]
    trainer.train()
    trainer.save_model()
    assert any(not torch.equal(before[n], p) for n, p in student.named_parameters())
    assert (tmp_path / "run" / "config.json").is_file()
    saved = yaml.safe_load((tmp_path / "run" / TRAIN_CONFIG).read_text())
    assert saved["student"] == str(tiny_world.models["student"]) and "model" not in saved["teachers"][0]


def test_the_object_path_and_build_trainer_give_the_same_loss(tiny_world, base_args, tmp_path):
    """The same models by path (`build_trainer(cfg)`) and as objects: the same run config, aligners and loss on
    one batch. Fails as soon as the two doors wire anything differently."""
    options = dict(max_samples=8, kv_weight=1, logit_kd_weight=0.5, max_steps=2)
    by_path = build_trainer(parse_config(base_args(**options)))
    student, tok, teacher, teacher_tok = _objects(tiny_world)
    # the same options without the models' paths: the trainer names the objects
    args = replace(by_path.args, student=None, teachers=[], output_dir=str(tmp_path / "obj"))
    by_object = KVDistillTrainer(model=student, args=args,
                                 train_dataset=_records(tiny_world), processing_class=tok,
                                 teachers=[TeacherConfig(model=teacher, tokenizer=teacher_tok)])
    a, b = by_path.args.to_yaml_dict(), by_object.args.to_yaml_dict()
    assert {k: v for k, v in a.items() if k != "output_dir"} == {k: v for k, v in b.items() if k != "output_dir"}
    assert by_path.distill_model.state_dict().keys() == by_object.distill_model.state_dict().keys()
    for (name, x), y in zip(by_path.distill_model.state_dict().items(), by_object.distill_model.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
    batch = by_path.data_collator(by_path.train_dataset[:4])
    assert torch.equal(batch["input_ids"], by_object.data_collator(by_object.train_dataset[:4])["input_ids"])
    losses = []
    for trainer in (by_path, by_object):
        trainer.model.eval()
        with torch.no_grad():
            losses.append(trainer.compute_loss(trainer.model, batch))
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    assert losses[0] > 0


def test_a_lora_student_trains_its_adapters_and_the_aligners_only(tiny_world, tmp_path):
    """peft_config=LoraConfig(...): the KV hooks find the wrapped attention modules (k_proj / v_proj carry
    adapters), the base weights stay as they were, the adapters and aligners move."""
    from peft import LoraConfig, PeftModel

    from kvdistill.cache import _attentions
    from kvdistill.models import num_layers

    student, tok, teacher, teacher_tok = _objects(tiny_world)
    args = KVDistillConfig(output_dir=str(tmp_path / "lora"), max_steps=3, kv_weight=1.0, **FAST)
    trainer = KVDistillTrainer(model=student, args=args, train_dataset=_records(tiny_world), processing_class=tok,
                               teachers=[TeacherConfig(model=teacher, tokenizer=teacher_tok)],
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                                                      init_lora_weights="gaussian"))
    wrapped = trainer.distill_model.student
    assert isinstance(wrapped, PeftModel) and len(_attentions(wrapped)) == num_layers(student)
    before = {n: p.detach().clone() for n, p in trainer.distill_model.named_parameters()}
    assert all(p.requires_grad == ("lora_" in n) for n, p in wrapped.named_parameters())
    trainer.train()
    trainer.save_model()
    moved = {n for n, p in trainer.distill_model.named_parameters() if not torch.equal(before[n], p)}
    lora = {n for n in before if "lora_" in n}
    assert {n for n in moved if n.startswith("student.")} == lora  # every adapter matrix, and nothing else
    assert any(n.startswith("aligners.") for n in moved)
    assert trainer.state.log_history[0]["kv_loss"] > 0
    assert (tmp_path / "lora" / "adapter_config.json").is_file()


def test_use_peft_on_the_command_line_wraps_the_student(base_args):
    """TRL ModelConfig's names: --use_peft --lora_r --lora_alpha --lora_dropout --lora_target_modules."""
    from peft import PeftModel

    trainer = build_trainer(parse_config(base_args(max_samples=8, use_peft=True, lora_r=2, lora_alpha=4,
                                                   lora_target_modules="q_proj,v_proj")))
    student = trainer.distill_model.student
    assert isinstance(student, PeftModel)
    assert student.peft_config["default"].r == 2 and set(student.peft_config["default"].target_modules) == \
        {"q_proj", "v_proj"}


def test_without_peft_use_peft_names_the_extra(base_args, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'kvdistill\[peft\]'"):
        build_trainer(parse_config(base_args(max_samples=8, use_peft=True)))


def test_train_dataset_rows_are_checked_as_data_files_are(tiny_world, tmp_path):
    student, tok, *_ = _objects(tiny_world)
    args = KVDistillConfig(output_dir=str(tmp_path / "bad"), max_steps=1, kv_weight=0, **FAST)
    rows = [*_records(tiny_world, 2), {"question": "2 + 2?", "answer": ""}]
    with pytest.raises(DataError, match="train_dataset record 2 has no final answer"):
        KVDistillTrainer(model=student, args=args, train_dataset=rows, processing_class=tok)
    with pytest.raises(DataError, match=r"train_dataset has columns \['question'\], which fit no dataset format"):
        KVDistillTrainer(model=student, args=args, train_dataset=[{"question": "q"}], processing_class=tok)


def test_teachers_are_given_in_one_place(tiny_world, base_args):
    student, tok, teacher, teacher_tok = _objects(tiny_world)
    with pytest.raises(ConfigError, match="teachers are given twice"):
        KVDistillTrainer(model=student, args=parse_config(base_args()), processing_class=tok,
                         teachers=[TeacherConfig(model=teacher, tokenizer=teacher_tok)])
    with pytest.raises(ConfigError, match="need at least one teacher"):  # checked once the models are named
        KVDistillTrainer(model=student, args=KVDistillConfig(output_dir="x", kv_weight=0.1, use_cpu=True),
                         processing_class=tok)
    with pytest.raises(ConfigError, match="give 'models/x' as `path:`"):
        TeacherConfig(model="models/x")
