"""`KVDistillModel` (train/model.py): the auto chunk rule puts only the rows a loss reads through the head, and
teachers named with a '.' (a directory like `Qwen2.5-0.5B`) train."""

from dataclasses import replace

import pytest
import torch

from kvdistill.train import model as model_module
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config
from kvdistill.train.model import module_key

SAME, ALT = "qwen2_teacher", "llama_teacher_alt_tok"


@pytest.fixture(scope="module")
def trainer(module_base_args, tiny_world):
    m = tiny_world.models
    return build_trainer(parse_config(module_base_args(
        teachers=f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, weight: 0}}]",
        kv_weight=0, logit_kd_weight=1, max_samples=8, logit_kd_rows="answer")))


def _step(trainer, batch, chunk):
    """Loss and student gradients of one forward + backward at `chunk_tokens` `chunk`; the rows the head's loss
    read (None: the model's logits) and the sequence lengths the student's head was run on."""
    model = trainer.distill_model
    model.weights = replace(model.weights, chunk_tokens=chunk)
    read, head_t = [], []
    hook = model.student.get_output_embeddings().register_forward_hook(lambda m, i, out: head_t.append(out.shape[1]))
    real = model_module.chunked_head_loss

    def spy(hidden, *args, **kw):
        read.append(hidden.shape[0])
        return real(hidden, *args, **kw)

    model_module.chunked_head_loss = spy
    try:
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
    finally:
        model_module.chunked_head_loss = real
        hook.remove()
    grads = [p.grad.clone() for p in model.student.parameters() if p.grad is not None]
    return loss.detach(), grads, (read or [None])[0], head_t


def test_auto_chunks_when_kd_reads_fewer_rows_and_projects_only_those(trainer):
    """logit_kd_rows answer on the tiny models (far below 2^26 logits): auto chunks, the student's head runs on
    the last position only, the loss reads only the rows with a CE target or an answer row's KD, and loss and
    gradients are the unchunked run's."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss, grads, read, head_t = _step(trainer, batch, None)
    ce_rows = int((batch["labels"][:, 1:] != -100).sum())
    B, T = batch["input_ids"].shape
    assert read is not None and ce_rows <= read < B * T  # chunked, and fewer rows than B·T through the head
    assert head_t == [1]  # the HF head made no [B, T, V] logits
    ref_loss, ref_grads, ref_read, ref_t = _step(trainer, batch, 0)
    assert ref_read is None and ref_t == [T]  # the check can fail: off, the model's own logits
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_a_teacher_named_with_a_dot_trains_and_saves(module_base_args, tiny_world, tmp_path):
    """torch refuses '.' in a module name: the model keys the teacher's aligner and CODI head `qwen2_5-teacher`
    and keeps its name everywhere else (fusion, logs, KV lookup)."""
    name = "qwen2.5-teacher"
    trainer = build_trainer(parse_config(module_base_args(
        teachers=f"[{{path: {tiny_world.models['qwen2_teacher']}, name: {name}}}]", codi_weight=0.1, max_samples=8,
        output_dir=str(tmp_path / "run"))))
    model = trainer.distill_model
    assert model.teacher_names == [name] and list(model.aligners) == list(model.codi) == ["qwen2_5-teacher"]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    loss, out = trainer.compute_loss(model, batch, return_outputs=True)
    loss.backward()
    assert f"fusion_w/{name}" in out["metrics"] and f"cos_sim/{name}" in out["metrics"]
    assert any(p.grad is not None for p in model.aligners.parameters())
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "aligners" / module_key(name)).is_dir()


def test_teacher_names_that_collide_as_module_keys_are_refused():
    with pytest.raises(ValueError, match=r"give one of them another `name:`"):
        model_module._by_module_key({"a.b": torch.nn.Linear(1, 1), "a_b": torch.nn.Linear(1, 1)})
