"""Properties of `KVDistillModel`'s loss, on a wired two-teacher trainer.

The loss is checked by properties, not by a reference number: gradient accumulation with global
token counts equals one big batch, masked tokens never matter, gradients reach exactly the
trained modules.
"""

import json
from pathlib import Path

import pytest
import torch

from kvdistill.cache import PAD
from kvdistill.losses import token_ce_sum
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config
from kvdistill.train.model import LossWeights

KEYS = ("input_ids", "attention_mask", "labels", "segment_ids", "index")


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def _teacher_kvs(trainer, batch: dict) -> dict:
    kvs = {}
    for t in trainer.teachers:
        src = batch.get("teacher_inputs", {}).get(t.name, batch)
        kvs[t.name], _ = trainer.teachers.forward(
            t.name, src["input_ids"], src["attention_mask"], src["segment_ids"]
        )
    return kvs


def _call(trainer, batch: dict, counts=None, kv_scale: float = 1.0) -> dict:
    """The wrapped model's forward on a collated batch, teachers included (what compute_loss does)."""
    return trainer.distill_model(
        **{k: batch[k] for k in KEYS},
        teacher_kvs=_teacher_kvs(trainer, batch),
        kv_scale=kv_scale,
        num_ce_tokens=None if counts is None else counts[0],
        num_kv_tokens=None if counts is None else counts[1],
    )


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _pad_right(batch: dict, extra: int, pad_id: int) -> dict:
    """The same batch with `extra` more padding columns on the right (student and teacher inputs)."""
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": -100, "segment_ids": PAD}

    def pad(d: dict) -> dict:
        out = dict(d)
        for k, v in fill.items():
            if k in d:
                out[k] = torch.cat([d[k], torch.full((d[k].shape[0], extra), v, dtype=d[k].dtype)], 1)
        return out

    padded = pad(batch)
    if "teacher_inputs" in batch:
        padded["teacher_inputs"] = {n: pad(t) for n, t in batch["teacher_inputs"].items()}
    return padded


def _two_teacher_trainer(tiny_world, out, **extra):
    """A wired trainer with two teachers (one with another tokenizer), KV loss at full weight."""
    m = tiny_world.models
    args = {
        "student": m["student"],
        "data": tiny_world.data_dir,
        "max_samples": 32,
        "teachers": f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}, weight: 0.5}}]",
        "output_dir": out,
        "max_length": 160,
        "kv_weight": 1,
        "kv_warmup_steps": 0,
        "use_cpu": "true",
        "report_to": "none",
        **extra,
    }
    return build_trainer(parse_config([x for k, v in args.items() for x in (f"--{k}", str(v))]))


@pytest.fixture(scope="module")
def two_teachers(tiny_world, tmp_path_factory):
    return _two_teacher_trainer(tiny_world, tmp_path_factory.mktemp("loss_math") / "run")


def _uneven_halves(trainer) -> tuple[list[dict], list[dict]]:
    """Two shortest and two longest records: the halves hold very different token counts."""
    ds = trainer.train_dataset
    recs = sorted((ds[i] for i in range(len(ds))), key=lambda r: len(r["answer"]))
    return recs[:2], recs[-2:]


# ------------------------------------------------------------------ (a) gradient accumulation
def test_global_counts_make_micro_batches_sum_to_the_full_batch(two_teachers):
    trainer, model = two_teachers, two_teachers.distill_model
    short, long = _uneven_halves(trainer)
    full = trainer.data_collator(short + long)
    halves = [trainer.data_collator(short), trainer.data_collator(long)]
    counts = trainer._get_num_items_in_batch(halves, torch.device("cpu"))  # [2]: CE tokens, KV tokens
    torch.testing.assert_close(counts, trainer._get_num_items_in_batch([full], torch.device("cpu")))
    ce_per_half = [float((h["labels"][:, 1:] != -100).sum()) for h in halves]
    assert ce_per_half[1] > 1.5 * ce_per_half[0]  # the halves really differ

    model.zero_grad()
    out = _call(trainer, full, counts)
    out["loss"].backward()
    g_full = _grads(model)
    assert any(n.startswith("aligners.") for n in g_full) and any(n.startswith("student.") for n in g_full)

    model.zero_grad()
    loss_sum = 0.0
    for h in halves:  # what gradient accumulation does: backward per micro-batch, grads add up
        part = _call(trainer, h, counts)["loss"]
        part.backward()
        loss_sum += float(part.detach())
    g_acc = _grads(model)
    assert float(out["loss"].detach()) == pytest.approx(loss_sum, rel=1e-5, abs=1e-5)
    assert g_full.keys() == g_acc.keys()
    for n in g_full:
        torch.testing.assert_close(g_acc[n], g_full[n], rtol=1e-4, atol=1e-5, msg=n)

    # per-micro-batch means (each half normalised by its own counts) give another loss
    with torch.no_grad():
        local = [float(_call(trainer, h)["loss"]) for h in halves]
    assert abs(sum(local) / 2 - float(out["loss"].detach())) > 1e-3
    model.zero_grad()


def test_trainer_ga_equals_one_big_batch(base_args, tmp_path):
    """One optimizer step: batch 4 x GA 1 and batch 2 x GA 2 (same samples) give the same weights."""
    states = []
    for bs, ga in ((4, 1), (2, 2)):
        cfg = parse_config(
            base_args(
                output_dir=tmp_path / f"b{bs}",
                per_device_train_batch_size=bs,
                gradient_accumulation_steps=ga,
                max_steps=1,
                max_samples=16,
                kv_weight=1,
                logging_steps=1,
            )
        )
        trainer = build_trainer(cfg)
        trainer.train()
        states.append({k: v.detach().clone() for k, v in trainer.distill_model.state_dict().items()})
        states[-1]["_loss"] = torch.tensor(trainer.state.log_history[0]["loss"])
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def all_terms(tiny_world, tmp_path_factory):
    """Every loss term on: CE, KV (two teachers), CODI and logit KD (the teacher sharing the tokenizer)."""
    out = tmp_path_factory.mktemp("all_terms") / "run"
    return _two_teacher_trainer(tiny_world, out, codi_weight=1, logit_kd_weight=1)


def test_every_term_is_normalised_globally(all_terms):
    """compute_loss as the Trainer calls it: micro-batch losses with global counts add up to the big batch."""
    trainer, model = all_terms, all_terms.distill_model
    short, long = _uneven_halves(trainer)
    full = trainer.data_collator(short + long)
    halves = [trainer.data_collator(short), trainer.data_collator(long)]
    counts = trainer._get_num_items_in_batch(halves, torch.device("cpu"))

    model.zero_grad()
    loss_full = trainer.compute_loss(model, full, num_items_in_batch=counts)
    loss_full.backward()
    g_full = _grads(model)
    assert {"codi", "logit_kd", "kv_loss"} <= set(trainer._metrics)
    assert any(n.startswith("codi.") for n in g_full)
    model.zero_grad()
    loss_acc = 0.0
    for h in halves:
        part = trainer.compute_loss(model, h, num_items_in_batch=counts)
        part.backward()
        loss_acc += float(part.detach())
    g_acc = _grads(model)
    trainer._metrics.clear()
    model.zero_grad()
    assert float(loss_full.detach()) == pytest.approx(loss_acc, rel=1e-5)
    for n in g_full:
        torch.testing.assert_close(g_acc[n], g_full[n], rtol=1e-4, atol=1e-5, msg=n)


# ------------------------------------------------------------------ (b) masks
def test_ce_counts_only_reasoning_and_answer_tokens(two_teachers):
    trainer, model = two_teachers, two_teachers.distill_model
    short, long = _uneven_halves(trainer)
    batch = trainer.data_collator(long + short)
    seg, ids = batch["segment_ids"], batch["input_ids"]
    # prompt and padding are never targets: the collator labels exactly the reasoning + answer tokens
    assert torch.equal(batch["labels"] != -100, seg > 0)
    assert torch.equal(batch["labels"][seg > 0], ids[seg > 0])
    with torch.no_grad():
        out = _call(trainer, batch)
        logits = model.student(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    # reference from the segments alone: mean next-token NLL where the next token is reasoning/answer
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    target = seg[:, 1:] > 0
    assert (seg == 0).sum() > target.sum() / 4  # the prompt is a real share of the tokens
    assert float(out["metrics"]["ce"]) == pytest.approx(float(-logp[target].mean()), rel=1e-5)
    assert float(token_ce_sum(logits, batch["labels"])) == pytest.approx(float(-logp[target].sum()), rel=1e-5)


def test_padding_changes_nothing(two_teachers):
    trainer = two_teachers
    batch = trainer.data_collator(list(_uneven_halves(trainer)[0]) + list(_uneven_halves(trainer)[1]))
    pad_id = trainer.processing_class.pad_token_id
    with torch.no_grad():
        ref = _call(trainer, batch)
        # more padding columns, student and teachers
        padded = _call(trainer, _pad_right(batch, 7, pad_id))
        # other token ids under padding (attention_mask 0, labels -100)
        scrambled = dict(batch)
        ids = batch["input_ids"].clone()
        ids[batch["attention_mask"] == 0] = 5
        scrambled["input_ids"] = ids
        scrambled_out = _call(trainer, scrambled)
    assert (batch["attention_mask"] == 0).any()
    for other in (padded, scrambled_out):
        assert float(other["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-5)
        for key in ("ce", "kv_loss", "cos_sim/qwen2_teacher", "cos_sim/llama_teacher_alt_tok"):
            assert float(other["metrics"][key]) == pytest.approx(
                float(ref["metrics"][key]), rel=1e-5, abs=1e-6
            )


def test_zero_weight_segment_is_outside_the_kv_loss(base_args):
    """segment_weights {prompt: 0}: the teacher's prompt KV can be anything, the loss does not change."""
    trainer = build_trainer(
        parse_config(base_args(max_samples=8, kv_weight=1, segment_weights="{prompt: 0.0}"))
    )
    ds = trainer.train_dataset
    batch = trainer.data_collator([ds[i] for i in range(4)])
    model = trainer.distill_model
    kvs = _teacher_kvs(trainer, batch)
    ((name, kv),) = kvs.items()
    is_prompt = kv.segment_ids == 0  # [B, T]
    noisy = type(kv)(
        kv.keys + 10 * torch.randn_like(kv.keys) * is_prompt[None, :, None, :, None],
        kv.values - 3 * is_prompt[None, :, None, :, None],
        kv.attention_mask,
        kv.segment_ids,
    )
    with torch.no_grad():
        a = model(**{k: batch[k] for k in KEYS}, teacher_kvs={name: kv}, kv_scale=1.0)
        b = model(**{k: batch[k] for k in KEYS}, teacher_kvs={name: noisy}, kv_scale=1.0)
    assert float(a["metrics"]["kv_loss"]) > 0
    assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-6)


def test_element_loss_reads_only_the_rows_relation_rows_selects(base_args):
    """relation_rows answer with an element loss (mercator): the teacher's KV off the answer rows can be anything,
    the loss does not change; on the answer rows it does (the rows are the tokens the loss compares)."""
    trainer = build_trainer(parse_config(base_args(max_samples=8, kv_weight=1, relation_rows="answer")))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ((name, kv),) = _teacher_kvs(trainer, batch).items()

    def noisy(where):  # [B, T] -> the cache with its keys and values moved there
        w = where[None, :, None, :, None]
        return type(kv)(kv.keys + 10 * torch.randn_like(kv.keys) * w, kv.values - 3 * w, kv.attention_mask,
                        kv.segment_ids)

    with torch.no_grad():
        loss = [float(trainer.distill_model(**{k: batch[k] for k in KEYS}, teacher_kvs={name: c}, kv_scale=1.0)["loss"])
                for c in (kv, noisy(kv.segment_ids != 2), noisy(kv.segment_ids == 2))]
    assert loss[1] == pytest.approx(loss[0], rel=1e-6)
    assert abs(loss[2] - loss[0]) > 1e-3


# ------------------------------------------------------------------ (c) where the KV gradient goes
def test_kv_gradient_reaches_student_and_aligner_not_teachers(two_teachers):
    trainer, model = two_teachers, two_teachers.distill_model
    batch = trainer.data_collator(_uneven_halves(trainer)[0])
    saved = model.weights
    model.weights = LossWeights(ce=0.0)  # KV term only
    try:
        model.zero_grad()
        out = _call(trainer, batch)
        out["loss"].backward()
    finally:
        model.weights = saved
    assert float(out["metrics"]["kv_loss"]) > 0
    attn = model.student.model.layers[0].self_attn
    for p in (attn.k_proj.weight, attn.v_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    for name in ("qwen2_teacher", "llama_teacher_alt_tok"):
        grads = [p.grad for p in model.aligners[name].parameters() if p.requires_grad]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    # nothing downstream of the last layer's keys/values gets a KV gradient (ce * 0 leaves zeros)
    g = model.student.model.layers[-1].mlp.down_proj.weight.grad
    assert g is None or not g.any()
    for t in trainer.teachers:
        assert all(not p.requires_grad and p.grad is None for p in t.model.parameters())
    assert all(kv.keys.grad_fn is None for kv in _teacher_kvs(trainer, batch).values())
    model.zero_grad()


class _ZeroTakingTheCEBranch(float):
    """ce_weight 0 that passes `w.ce > 0`: the previous path, the CE computed and multiplied by 0."""

    def __gt__(self, other):
        return True


def test_zero_ce_weight_builds_no_ce_graph_and_keeps_loss_and_gradients(two_teachers, monkeypatch):
    trainer, model = two_teachers, two_teachers.distill_model
    batch = trainer.data_collator(_uneven_halves(trainer)[0])
    import kvdistill.train.model as model_module

    grad_calls = []

    def counting_ce(logits, labels):
        grad_calls.append(torch.is_grad_enabled())
        return token_ce_sum(logits, labels)

    monkeypatch.setattr(model_module, "token_ce_sum", counting_ce)
    saved, results = model.weights, {}
    try:
        for name, ce in (("now", 0.0), ("before", _ZeroTakingTheCEBranch(0.0))):
            model.weights = LossWeights(ce=ce, chunk_tokens=0)  # unchunked: the model's [B, T, V] logits
            grad_calls.clear()
            model.zero_grad()
            out = _call(trainer, batch)
            out["loss"].backward()
            results[name] = out, _grads(model), list(grad_calls)
    finally:
        model.weights = saved
        model.zero_grad()
    (now, g_now, calls_now), (before, g_before, calls_before) = results["now"], results["before"]
    assert calls_now == [False] and calls_before == [True]  # logged under no_grad only: no CE in the graph
    assert torch.equal(now["loss"], before["loss"]) and float(now["metrics"]["kv_loss"]) > 0
    assert torch.equal(now["metrics"]["ce"], before["metrics"]["ce"])  # the logged CE is unchanged
    assert g_now.keys() == g_before.keys() and all(torch.equal(g_now[k], g_before[k]) for k in g_now)


# ------------------------------------------------------------------ (d)-(h) options end to end


def test_target_counts_split_ce_kd_and_transfer_targets_by_hand():
    from kvdistill.train.model import target_counts

    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, 8], [1, 2, 3, 4]])  # targets: 2, 2, 3 (first dropped)
    labelled = torch.tensor([True, False, True])
    assert target_counts(labels, labelled).tolist() == [5, 7, 2]  # CE: rows 0 and 2; transfer: row 1
    assert target_counts(labels, None).tolist() == [7, 7, 7]
