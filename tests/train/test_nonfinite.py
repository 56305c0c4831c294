"""The NaN/inf guard: a non-finite loss or gradient stops the run naming where it appeared, or, with
`on_nonfinite: skip`, the step is skipped and training goes on."""

import math

import pytest
import torch
from safetensors.torch import load_file

from kvdistill.cli import main as cli_main
from kvdistill.commands.train import main as train_main
from kvdistill.io import read_jsonl
from kvdistill.teachers import TeacherSet
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config
from kvdistill.train.trainer import NonFiniteError


@pytest.fixture
def nan_in_teacher_cache(monkeypatch):
    """At optimizer step 2 (call 3: build_trainer's probe batch is call 1), sample 0's keys in teacher
    qwen2_teacher's cache are NaN at layer 3."""
    forward, calls = TeacherSet.forward, []

    def poisoned(self, name, *args, **kwargs):
        kv, logits = forward(self, name, *args, **kwargs)
        calls.append(name)
        if len(calls) == 3:
            kv.keys[3, 0] = float("nan")  # [L, B, H, T, D]: the last layer (the layer map uses it), sample 0
        return kv, logits

    monkeypatch.setattr(TeacherSet, "forward", poisoned)
    return calls


def test_nan_in_a_teacher_cache_stops_naming_teacher_layer_and_tensor(base_args, nan_in_teacher_cache, capsys):
    rc = cli_main(["train", *base_args(max_steps=4)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "Traceback" not in "\n".join(err)
    assert "teacher qwen2_teacher: its cache's keys at layer 3" in err[-1]
    assert "on_nonfinite: skip" in err[-1]  # the fix is named
    nan_in_teacher_cache.clear()
    with pytest.raises(NonFiniteError, match="step 2: loss is nan"):
        train_main(base_args(max_steps=4))  # --debug path: the exception itself


def test_skip_goes_on_with_finite_weights(base_args, nan_in_teacher_cache, tmp_path):
    out = tmp_path / "skip"
    assert train_main(base_args(output_dir=out, max_steps=4, logging_steps=1, on_nonfinite="skip")) == 0
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r.get("nonfinite_skipped", 0) for r in rows] == [0, 1, 0, 0]
    assert all(math.isfinite(r["loss"]) for r in rows if r["step"] != 2)
    for name, t in load_file(out / "model.safetensors").items():
        assert torch.isfinite(t).all(), name


def test_nonfinite_gradient_names_the_parameter(base_args):
    trainer = build_trainer(parse_config(base_args(max_steps=2)))
    name, p = next((n, p) for n, p in trainer.distill_model.named_parameters() if n.startswith("aligners."))
    p.register_hook(lambda g: g * float("inf"))
    with pytest.raises(NonFiniteError, match=rf"gradient of {name} is non-finite"):
        trainer.train()


def test_find_nonfinite_walks_the_loss_path(base_args):
    trainer = build_trainer(parse_config(base_args()))
    model = trainer.distill_model
    batch = next(iter(trainer.get_train_dataloader()))
    kvs, logits = trainer.teacher_targets(batch, batch.get("teacher_inputs", {}))
    args = (batch["input_ids"], batch["attention_mask"], batch["segment_ids"])
    assert model.find_nonfinite(*args, kvs, logits).startswith("the CE")  # nothing is non-finite
    kvs["qwen2_teacher"].values[0, :, :, 3] = float("inf")
    assert model.find_nonfinite(*args, kvs, logits) == "teacher qwen2_teacher: its cache's values at layer 0"
    kvs["qwen2_teacher"].values[0, :, :, 3] = 0.0
    with torch.no_grad():
        next(model.student.parameters()).fill_(float("nan"))  # the embeddings
    assert model.find_nonfinite(*args, kvs, logits) == "the student: its logits"


@pytest.mark.parametrize("norm, fp16, raises", [
    (float("inf"), False, True),
    (float("nan"), False, True),
    (1.5, False, False),
    (None, False, False),  # ZeRO-1/2 with the norm computation off
    (float("inf"), True, False),  # fp16: DeepSpeed's loss scaler skips the step itself
])
def test_deepspeed_step_check_reads_the_engine_norm(norm, fp16, raises):
    """Under DeepSpeed the step has been taken inside backward: a non-finite engine norm ends the run."""
    from types import SimpleNamespace

    from kvdistill.train.trainer import KVDistillTrainer

    stub = SimpleNamespace(model_wrapped=SimpleNamespace(get_global_grad_norm=lambda: norm),
                           args=SimpleNamespace(fp16=fp16), state=SimpleNamespace(global_step=6))
    if raises:
        with pytest.raises(NonFiniteError, match=r"step 7: the gradient norm is .* DeepSpeed has already applied"):
            KVDistillTrainer._check_deepspeed_step(stub)
    else:
        KVDistillTrainer._check_deepspeed_step(stub)
