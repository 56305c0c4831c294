"""`logit_kd_rows` on a wired trainer: the positions logit KD reads (by hand), its global count under
gradient accumulation, chunked == unchunked, cross-vocab boundaries, and a run through `kvdistill train`.

Position t's distribution (its prediction of token t + 1) is compared when token t + 1 is chosen."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import yaml

from kvdistill.cache import ANSWER
from kvdistill.commands.train import main as train_main
from kvdistill.config import ConfigError
from kvdistill.fields import IGNORE
from kvdistill.losses import cross_vocab_kd_sum, logit_kd_sum, token_ce_sum
from kvdistill.runs import TRAIN_CONFIG
from kvdistill.train.build import build_trainer, capture_settings, load_run
from kvdistill.train.config import parse_config
from kvdistill.train.model import full_logits

SAME, ALT = "qwen2_teacher", "llama_teacher_alt_tok"
ROWS = ("labels", "all", "answer", "field:name")


def _argv(module_base_args, tiny_world, **kw):
    m = tiny_world.models
    # the alt-tokenizer teacher at weight 0: logits only (weight 1 in its KD), so every KD term is unweighted
    args = {"teachers": f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, weight: 0}}]",
            "kv_weight": 0, "logit_kd_weight": 1, "max_samples": 16, "logit_chunk_tokens": 0, **kw}
    return module_base_args(**args)


@pytest.fixture(scope="module")
def trainer(module_base_args, tiny_world):
    return build_trainer(parse_config(_argv(module_base_args, tiny_world)))


def _named(batch: dict) -> dict:
    """The batch with a per-token field `name` (as the binding task's): 1 on every third token id, 0 on the
    others, IGNORE on padding. A function of the token, so a record's rows do not depend on its batch."""
    name = torch.where(batch["attention_mask"] > 0, (batch["input_ids"] % 3 == 0).long(), IGNORE)  # [B, T]
    return {**batch, "token_fields": {"name": name}}


def _batch(trainer, lo: int = 0, hi: int = 4) -> dict:
    return _named(trainer.data_collator([trainer.train_dataset[i] for i in range(lo, hi)]))


def _chosen(batch: dict, rows: str) -> torch.Tensor:
    """`[B, T]` by hand: True at position t when t and t + 1 are real and, for `labels`, token t + 1 is labelled,
    for a row selection, row t itself is selected (its own distribution is distilled)."""
    real = batch["attention_mask"] > 0
    out = torch.zeros_like(real)
    if rows == "labels":
        out[:, :-1] = real[:, :-1] & real[:, 1:] & (batch["labels"] != -100)[:, 1:]
        return out
    sel = {"all": real, "answer": batch["segment_ids"] == ANSWER, "field:name": batch["token_fields"]["name"] > 0}[rows]
    out[:, :-1] = real[:, :-1] & real[:, 1:] & sel[:, :-1]
    return out


def _forward(trainer, batch: dict, rows: str, teachers=(SAME, ALT), chunk: int = 0, counts=None) -> dict:
    """The model's forward as compute_loss calls it, reading logits only from `teachers`."""
    model = trainer.distill_model
    model.logit_kd_rows, model.weights = rows, replace(model.weights, chunk_tokens=chunk)
    inputs = dict(batch)
    teacher_inputs, fields = inputs.pop("teacher_inputs", {}), inputs.pop("token_fields")
    kvs, logits = trainer.teacher_targets(inputs, teacher_inputs, fields)
    return model(**inputs, teacher_kvs=kvs, teacher_logits={n: logits[n] for n in teachers},
                 num_kd_tokens=None if counts is None else counts[3], token_fields=fields,
                 teacher_char_ends={n: v["char_ends"] for n, v in teacher_inputs.items()})


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("rows", ROWS)
def test_kd_is_the_mean_divergence_over_the_chosen_positions(trainer, rows):
    """Same-vocab KD: the sum of KL(teacher_t || student_t) over the positions chosen by hand, over their
    number, which is also the trainer's global count. `labels` is the KD before the option (labelled targets)."""
    batch = _batch(trainer)
    chosen = _chosen(batch, rows)
    assert 0 < int(chosen.sum()) < int((batch["attention_mask"] > 0).sum())
    with torch.no_grad():
        out = _forward(trainer, batch, rows, teachers=(SAME,))
        s = trainer.distill_model.student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t = full_logits(trainer.teacher_targets(batch, batch["teacher_inputs"])[1][SAME])  # [B, T, V]
    per = F.kl_div(s[chosen].log_softmax(-1), t[chosen].log_softmax(-1), log_target=True, reduction="none")  # [n, V]
    torch.testing.assert_close(out["metrics"]["logit_kd"], per.sum(-1).mean(), rtol=1e-5, atol=1e-6)
    counts = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    assert int(counts[3]) == int(chosen.sum())
    assert int(counts[4]) == 1  # no transfer records: the transfer-LM count stays its floor


def test_labels_is_the_loss_before_the_option(trainer):
    """The default reads `labels` itself: the loss is the one before the option, to the bit (CE + KD over the
    labelled targets, both divided by their count), and so are the counts."""
    model, batch = trainer.distill_model, _batch(trainer)
    labels = batch["labels"]
    with torch.no_grad():
        out = _forward(trainer, batch, "labels", teachers=(SAME,))
        s = model.student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t = trainer.teacher_targets(batch, batch["teacher_inputs"])[1][SAME]  # [B, T, V]
    n = (labels[:, 1:] != -100).sum()
    kd = logit_kd_sum(s, t, labels, "forward_kl", 1.0, torch.ones(len(labels)), vocab_size=model.vocab_size)
    assert torch.equal(out["loss"], 1.0 * token_ce_sum(s, labels) / n + 1.0 * kd / n)
    args = (batch["input_ids"], labels, batch["attention_mask"], batch["segment_ids"], batch["token_fields"])
    assert model.kd_targets(*args) is labels
    counts = trainer._get_num_items_in_batch([batch], torch.device("cpu")).tolist()
    assert counts[0] == counts[3] == int(n)  # every record labelled: CE and KD count the same targets


@pytest.mark.parametrize("rows", ROWS)
def test_chunked_equals_unchunked(trainer, rows):
    """Both teachers (same vocab and cross vocab): chunks of 8 tokens give the full-logit loss and gradients."""
    model, batch = trainer.distill_model, _batch(trainer)
    results = []
    for chunk in (0, 8):
        model.zero_grad()
        out = _forward(trainer, batch, rows, chunk=chunk)
        out["loss"].backward()
        results.append((out["loss"].detach(), _grads(model)))
    model.zero_grad()
    (loss0, g0), (loss8, g8) = results
    torch.testing.assert_close(loss8, loss0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g8.keys() and g0
    for n in g0:
        torch.testing.assert_close(g8[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("rows", ["all", "field:name"])
def test_accumulated_micro_batches_equal_one_batch(trainer, rows):
    """compute_loss as the Trainer calls it: two micro-batches of unequal KD counts, each divided by the global
    count of both, add up to the loss and gradients of one batch of both; the count is the chosen positions'."""
    model = trainer.distill_model
    model.logit_kd_rows, model.weights = rows, replace(model.weights, chunk_tokens=0)
    halves, full = [_batch(trainer, 0, 2), _batch(trainer, 2, 6)], _batch(trainer, 0, 6)
    counts = trainer._get_num_items_in_batch(halves, torch.device("cpu"))
    torch.testing.assert_close(counts, trainer._get_num_items_in_batch([full], torch.device("cpu")))
    assert int(counts[3]) == int(_chosen(full, rows).sum())
    assert abs(int(_chosen(halves[1], rows).sum()) - int(_chosen(halves[0], rows).sum())) > 5
    model.zero_grad()
    loss = trainer.compute_loss(model, full, num_items_in_batch=counts)
    loss.backward()
    g_full = _grads(model)
    model.zero_grad()
    parts = []
    for h in halves:
        part = trainer.compute_loss(model, h, num_items_in_batch=counts)
        part.backward()
        parts.append(float(part.detach()))
    g_acc = _grads(model)
    model.zero_grad()
    trainer._metrics.clear()
    assert float(loss.detach()) == pytest.approx(sum(parts), rel=1e-5)
    for n in g_full:
        torch.testing.assert_close(g_acc[n], g_full[n], rtol=1e-4, atol=1e-6, msg=n)


def test_cross_vocab_all_reads_every_shared_boundary(trainer):
    """The alt-tokenizer teacher under `all`: exactly the positions with a next token whose token ends at a
    character where a teacher token ends, prompt included, each against that teacher position (by hand)."""
    batch = _batch(trainer)
    with torch.no_grad():
        out = _forward(trainer, batch, "all", teachers=(ALT,))
        s = trainer.distill_model.student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t = trainer.teacher_targets(batch, batch["teacher_inputs"])[1][ALT]  # [B, T_t, V_t]
    s_ends, t_ends = batch["char_ends"].tolist(), batch["teacher_inputs"][ALT]["char_ends"].tolist()
    chosen = _chosen(batch, "all")
    pairs = [(b, i, t_ends[b].index(e)) for b in range(len(s_ends)) for i, e in enumerate(s_ends[b])
             if chosen[b, i] and e >= 0 and e in t_ends[b]]
    b, i, j = (torch.tensor(x) for x in zip(*pairs))
    assert bool((batch["segment_ids"][b, i] == 0).any())  # prompt positions are read
    assert out["metrics"][f"logit_kd_shared/{ALT}"] == pytest.approx(len(pairs) / int(chosen.sum()))
    lt = trainer.distill_model.logit_teachers[ALT]
    ref = cross_vocab_kd_sum(s[b, i], t[b, j], lt.student_ids, lt.teacher_ids, torch.ones(len(pairs)),
                             student_vocab=trainer.distill_model.vocab_size, teacher_vocab=lt.vocab)
    torch.testing.assert_close(out["metrics"]["logit_kd"], ref / int(chosen.sum()), rtol=1e-5, atol=1e-6)


def test_one_capture_serves_every_choice_of_rows(module_base_args, tiny_world):
    """A capture holds every position's logits: its identity does not depend on logit_kd_rows."""
    settings = []
    for rows in ("labels", "all"):
        cfg = parse_config(_argv(module_base_args, tiny_world, logit_kd_rows=rows))
        settings.append(capture_settings(cfg, load_run(cfg)))
    assert settings[0] == settings[1]


@pytest.mark.parametrize("overrides,match", [
    ({"logit_kd_rows": "answers"}, r"logit_kd_rows 'answers': expected all, answer.*, or labels"),
    ({"logit_kd_rows": "field:name", "lmbda": 0.5}, "logit_kd_rows field:<name> reads the data's per-token fields"),
])
def test_bad_rows_are_refused(module_base_args, tiny_world, overrides, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(_argv(module_base_args, tiny_world, **overrides))


def test_rows_of_a_field_the_records_lack_are_refused(module_base_args, tiny_world):
    with pytest.raises(ConfigError, match="logit_kd_rows field:name: 16 of 16 records have no token field"):
        build_trainer(parse_config(_argv(module_base_args, tiny_world, logit_kd_rows="field:name")))


def test_train_with_all_rows_end_to_end(base_args, tiny_world, tmp_path):
    """`kvdistill train --logit_kd_rows all` on the tiny fixtures: two steps, logit KD logged."""
    out = tmp_path / "all_rows"
    argv = base_args(output_dir=out, max_steps=2, max_samples=8, logging_steps=1, kv_weight=0, logit_kd_weight=1,
                     logit_kd_rows="all", teachers=f"[{{path: {tiny_world.models['llama_teacher_alt_tok']}}}]")
    assert train_main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(rows) == 2 and all(r["logit_kd"] > 0 for r in rows)
    assert yaml.safe_load((out / TRAIN_CONFIG).read_text())["logit_kd_rows"] == "all"
