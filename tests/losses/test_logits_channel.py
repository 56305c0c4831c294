"""The logit channel wired into training: same-vocab and cross-vocab teachers, chunked CE + KD, transfer LM.

Two tiny teachers of different tokenizers (the fixtures' qwen2_teacher shares the student's, llama_teacher_alt_tok
has its own), a tiny student; the loss is checked through `KVDistillTrainer.compute_loss`, as training runs it.
"""

import logging

import pytest
import torch

from kvdistill.config import ConfigError
from kvdistill.losses import token_ce_sum
from kvdistill.teachers import resolve_logit_kd, vocab_map
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config


def _argv(tiny_world, out, **kw) -> list[str]:
    """A fast CPU run on the tiny fixtures, logit KD only."""
    args = {"student": tiny_world.models["student"], "data": tiny_world.data_dir, "output_dir": out, "max_length": 160,
            "learning_rate": 1e-3, "save_steps": 1000, "use_cpu": True, "disable_tqdm": True, "report_to": "none",
            "dataloader_num_workers": 0, **kw}
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


@pytest.fixture(scope="module")
def trainer(tiny_world, tmp_path_factory):
    m = tiny_world.models
    argv = _argv(tiny_world, tmp_path_factory.mktemp("run"),
        teachers=f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}}}]", kv_weight=0,
        logit_kd_weight=1.0, max_samples=8, max_steps=2, per_device_train_batch_size=2, logging_steps=1,
        transfer_data=str(tiny_world.data_dir), transfer_split="test", transfer_max_samples=4, transfer_batch_size=2,
        transfer_lm_weight=0.5, logit_chunk_tokens=0)
    return build_trainer(parse_config(argv))


def _loss_and_grads(trainer, batch, chunk: int):
    model = trainer.distill_model
    model.weights.chunk_tokens = chunk
    model.zero_grad()
    loss, out = trainer.compute_loss(model, batch, return_outputs=True)
    loss.backward()
    head = model.student.get_output_embeddings().weight
    return loss.detach(), out["metrics"], head.grad.clone(), model.student.model.layers[0].mlp.up_proj.weight.grad.clone()


def test_modes_are_resolved_and_logged(tiny_world, tmp_path, caplog):
    m = tiny_world.models
    with caplog.at_level(logging.INFO, logger="kvdistill.train.build"):
        build_trainer(parse_config(_argv(
            tiny_world, tmp_path, kv_weight=0, logit_kd_weight=1.0, max_samples=4,
            teachers=f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, logit_kd: off}}]")))
    assert "teacher qwen2_teacher: logit KD same_vocab (auto: the student's tokenizer)" in caplog.text
    assert "teacher llama_teacher_alt_tok: logit KD off (logit_kd: off)" in caplog.text


def test_chunked_equals_unchunked_with_both_teachers_and_transfer_lm(trainer):
    assert {t.name: t.logit_kd for t in trainer.teachers} == {"qwen2_teacher": "same_vocab",
                                                              "llama_teacher_alt_tok": "cross_vocab"}
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert not batch["labelled"].all()  # transfer records drawn into the batch
    ref = _loss_and_grads(trainer, batch, 0)
    got = _loss_and_grads(trainer, batch, 8)  # several chunks of 8 tokens
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1]["logit_kd"], ref[1]["logit_kd"], rtol=1e-5, atol=1e-5)
    for g, r in zip(got[2:], ref[2:]):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert 0 < ref[1]["logit_kd_shared/llama_teacher_alt_tok"] < 1  # some positions share a boundary, not all


def test_transfer_lm_is_the_lm_loss_on_transfer_records(trainer):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    model, w = trainer.distill_model, trainer.distill_model.weights
    saved = (w.ce, w.logit_kd, w.transfer_lm)
    try:
        w.ce, w.logit_kd, w.transfer_lm = 0.0, 0.0, 1.0
        for chunk in (0, 8):
            w.chunk_tokens = chunk
            loss = trainer.compute_loss(model, batch)
            with torch.no_grad():
                logits = model.student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            transfer = batch["labels"].masked_fill(batch["labelled"][:, None], -100)
            n = (transfer[:, 1:] != -100).sum()
            torch.testing.assert_close(loss.detach(), token_ce_sum(logits, transfer) / n, rtol=1e-5, atol=1e-5)
    finally:
        w.ce, w.logit_kd, w.transfer_lm = saved


def test_training_steps_from_two_tokenizers(trainer):
    before = {n: p.detach().clone() for n, p in trainer.distill_model.student.named_parameters()}
    trainer.distill_model.weights.chunk_tokens = 8
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss" in h]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert all(r["logit_kd"] > 0 for r in rows)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.distill_model.student.named_parameters())


def test_resolve_logit_kd():
    assert resolve_logit_kd("auto", "t", True, True)[0] == "same_vocab"
    assert resolve_logit_kd("auto", "t", False, True)[0] == "cross_vocab"
    assert resolve_logit_kd("auto", "t", True, False)[0] == "off"  # its own rationale: another text
    assert resolve_logit_kd("cross_vocab", "t", True, True)[0] == "cross_vocab"
    with pytest.raises(ConfigError, match="cross_vocab"):
        resolve_logit_kd("same_vocab", "t", False, True)
    with pytest.raises(ConfigError, match="logit_kd: off"):
        resolve_logit_kd("cross_vocab", "t", False, False)


def test_vocab_map_of_the_fixture_tokenizers(tiny_world):
    from kvdistill.models import load_tokenizer

    a, b = (load_tokenizer(tiny_world.tokenizers[k]) for k in ("bpe", "bpe_alt"))
    s, t = vocab_map(a, a)
    decoded = [a.decode([i]) for i in range(len(a))]
    unique = [i for i, d in enumerate(decoded) if decoded.count(d) == 1]  # lone bytes >= 0x80 all decode to U+FFFD
    assert torch.equal(s, t) and s.tolist() == unique and len(unique) > len(a) / 2
    s, t = vocab_map(a, b)
    assert 0 < len(s) < len(a)
    assert all(a.decode([i]) == b.decode([j]) for i, j in zip(s.tolist()[:50], t.tolist()[:50]))
    assert vocab_map(a, b) is vocab_map(a, b)  # mapped once per pair
