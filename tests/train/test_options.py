"""Every training option running end to end: 2 optimizer steps through `kvdistill train`'s `main`."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvdistill.cache import ANSWER, REASONING
from kvdistill.commands.train import main as train_main
from kvdistill.models import ModelLoadError
from kvdistill.train.build import build_trainer
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


def _rows_of(trainer) -> list[dict]:
    return _rows(Path(trainer.args.output_dir))


def _cross_tokenizer_teachers(tiny_world) -> str:
    m = tiny_world.models
    return f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}}}]"


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
    trainer = build_trainer(parse_config(_two_step_argv(base_args, teacher_control="untrained")))
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


# ------------------------------------------------------------------ KV signals: relation loss, shuffled control, privileged teacher
def test_relation_loss_trains_without_projectors(base_args, tiny_world, tmp_path):
    out = tmp_path / "relation"
    argv = _two_step_argv(base_args, output_dir=out, kv_loss="relation", relation_heads=4,
                          teachers=_cross_tokenizer_teachers(tiny_world))
    trainer = build_trainer(parse_config(argv))
    assert trainer.args.key_space == "pre_rope"  # auto: relations of rotated keys depend on position
    assert all(a.k_proj is None and sum(p.numel() for p in a.parameters()) == 0
               for a in trainer.distill_model.aligners.values())
    student_before = {n: p.detach().clone() for n, p in trainer.distill_model.student.named_parameters()}
    trainer.train()
    rows = _rows_of(trainer)
    assert all(r["kv_loss"] > 0 and r["relation_kl/qwen2_teacher"] > 0 for r in rows)
    assert any("relation_kl/llama_teacher_alt_tok" in r for r in rows)  # the other tokenizer, time-aligned
    moved = [n for n, p in trainer.distill_model.student.named_parameters() if not torch.equal(p, student_before[n])]
    assert moved


def test_relation_heads_must_divide_both_widths(base_args):
    with pytest.raises(ConfigError, match="relation_heads=5 does not divide"):
        build_trainer(parse_config(_two_step_argv(base_args, kv_loss="relation", relation_heads=5)))


def _teacher_batch(trainer, n: int = 4) -> dict:
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def test_shuffled_control_never_gives_a_sample_its_own_cache(base_args, tiny_world):
    trainer = build_trainer(parse_config(_two_step_argv(base_args, teacher_control="shuffled",
                                                        teachers=_cross_tokenizer_teachers(tiny_world))))
    batch = _teacher_batch(trainer)
    teacher_inputs = batch.pop("teacher_inputs")
    shuffled, _ = trainer.teacher_targets(batch, teacher_inputs)
    trainer.args.teacher_control = "none"
    own, _ = trainer.teacher_targets(batch, teacher_inputs)
    for name in own:
        s, o = shuffled[name], own[name]
        lengths_s, lengths_o = s.attention_mask.sum(1), o.attention_mask.sum(1)
        for b in range(4):
            # the sample's teacher cache is some other sample's own cache, never its own
            match = [j for j in range(4) if lengths_s[b] == lengths_o[j] and torch.allclose(
                s.keys[:, b, :, : int(lengths_s[b])], o.keys[:, j, :, : int(lengths_o[j])], atol=1e-5)]
            assert match and b not in match, (name, b, match)
    trainer.train()  # and it trains end to end
    assert trainer.state.global_step == 2


def test_privileged_teacher_no_rationale_with_rkv(base_args, tiny_world):
    argv = _two_step_argv(base_args, student_input="no_rationale", teacher_compression="rkv",
                          teachers=_cross_tokenizer_teachers(tiny_world))
    trainer = build_trainer(parse_config(argv))
    batch = _teacher_batch(trainer)
    assert not (batch["segment_ids"] == REASONING).any()  # the student reads no rationale
    teacher_inputs = batch.pop("teacher_inputs")
    assert set(teacher_inputs) == {"qwen2_teacher", "llama_teacher_alt_tok"}  # privileged: own inputs
    assert all((ti["segment_ids"] == REASONING).sum(1).min() > 0 for ti in teacher_inputs.values())
    kvs, _ = trainer.teacher_targets(batch, teacher_inputs)
    for kv in kvs.values():  # the rationale is compressed onto the student's 0 reasoning slots
        assert not (kv.segment_ids == REASONING).any() and (kv.segment_ids == ANSWER).any()
    trainer.train()
    assert trainer.state.global_step == 2 and all(r["kv_loss"] > 0 for r in _rows_of(trainer))


def test_privileged_latent_slots_train_save_and_evaluate(base_args, tiny_world, tmp_path):
    """`latent:N`: the student gets a slot token (one new embedding row), reads N slots where the
    rationale was, every teacher's rationale is compressed onto those N slots, and the saved
    student evaluates with its own tokenizer (it emits the slots, decoding drops them)."""
    from transformers import AutoModelForCausalLM

    from kvdistill.commands.eval import run_eval
    from kvdistill.data import LATENT_TOKEN

    out = tmp_path / "latent"
    argv = _two_step_argv(base_args, output_dir=out, student_input="latent:3", teacher_compression="rkv",
                          teachers=_cross_tokenizer_teachers(tiny_world))
    trainer = build_trainer(parse_config(argv))
    tok = trainer.processing_class
    slot = tok.convert_tokens_to_ids(LATENT_TOKEN)
    student = trainer.distill_model.student
    assert student.get_input_embeddings().weight.shape[0] == len(tok) > slot
    batch = _teacher_batch(trainer)
    reasoning = batch["segment_ids"] == REASONING
    assert torch.equal(reasoning.sum(1), torch.full((4,), 3)) and (batch["input_ids"][reasoning] == slot).all()
    teacher_inputs = batch.pop("teacher_inputs")
    kvs, _ = trainer.teacher_targets(batch, teacher_inputs)
    for kv in kvs.values():
        assert torch.equal((kv.segment_ids == REASONING).sum(1), torch.full((4,), 3))
    trainer.train()
    trainer.save_model()
    assert all(r["kv_loss"] > 0 for r in _rows_of(trainer))
    assert AutoModelForCausalLM.from_pretrained(out).get_input_embeddings().weight.shape[0] == len(tok)
    res = run_eval(out, data=str(tiny_world.data_dir), split="test", limit=2, max_new_tokens=8, log=lambda _: None)
    assert len(res["items"]) == 2 and all(LATENT_TOKEN not in it["prediction"] for it in res["items"])


@pytest.mark.parametrize("method", ["rkv", "uniform", "random"])
def test_privileged_short_rationale_slots_per_teacher(base_args, tiny_world, method):
    argv = _two_step_argv(base_args, student_input="short_rationale:1", teacher_compression=method,
                          teachers=_cross_tokenizer_teachers(tiny_world))
    trainer = build_trainer(parse_config(argv))
    batch = _teacher_batch(trainer)
    teacher_inputs = batch.pop("teacher_inputs")
    slots = (batch["segment_ids"] == REASONING).sum(1)
    kvs, _ = trainer.teacher_targets(batch, teacher_inputs)
    for name, kv in kvs.items():  # each teacher, in its own time axis, keeps as many as the student reads
        full = (teacher_inputs[name]["segment_ids"] == REASONING).sum(1)
        assert torch.equal((kv.segment_ids == REASONING).sum(1), torch.minimum(slots, full)), name
    assert (slots > 0).all() and (slots < (teacher_inputs["qwen2_teacher"]["segment_ids"] == REASONING).sum(1)).all()


@pytest.mark.parametrize("overrides, match", [
    ({"teacher_control": "shuffled", "per_device_train_batch_size": 1}, "batch_size >= 2"),
    ({"teacher_control": "shuffled", "logit_kd_weight": 1.0}, "logit KD"),
    ({"student_input": "no_rationale", "logit_kd_weight": 1.0}, "logit KD"),
    ({"kv_loss": "relation", "fusion": "kv_mean"}, "kv_mean"),
    ({"student_input": "short_rationale:0"}, "short_rationale:K"),
    ({"transfer_data": "x", "fusion": "correctness"}, "transfer set has no gold"),
    ({"transfer_batch_size": -1}, "transfer_batch_size"),
    ({"transfer_field_map": "gsm9k"}, "not a known name"),
    ({"teacher_control": "random"}, "teacher_control"),
    ({"teacher_capture": "x", "fusion": "correctness"}, "captured teacher"),
    ({"capture_dtype": "int8"}, "capture_dtype"),
    ({"capture_keep": 0}, "capture_keep must be in"),
    ({"capture_keep": 0.5, "time_mode": "global"}, "time_mode: segment"),
    ({"capture_keep": 0.5, "logit_kd_weight": 1.0}, "logit KD compares token by token"),
    ({"capture_compression": "every_other"}, "capture_compression"),
    ({"max_length": 0}, "max_length 0 leaves no room"),
    ({"max_steps": 0}, "max_steps 0 would still run one step"),
    ({"fp16": True}, "fp16 mixed precision needs a CUDA GPU"),
    ({"teachers": "[{path: /tmp/t, name: a}, {path: /tmp/t, name: b, weight: 2}]"}, "listed twice"),
])
def test_kv_signal_config_errors(base_args, overrides, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(_two_step_argv(base_args, **overrides))


def test_teacher_cache_equals_live_teachers(base_args, tiny_world, tmp_path):
    """Three epochs over 8 records: the cached run computes each record's teacher once and logs the
    same losses as the live run."""
    logs = {}
    for cache in (False, True):
        argv = base_args(max_steps=6, max_samples=8, per_device_train_batch_size=4, logging_steps=1, kv_weight=1,
                         teachers=_cross_tokenizer_teachers(tiny_world), teacher_cache=cache,
                         output_dir=tmp_path / f"cache_{cache}")
        trainer = build_trainer(parse_config(argv))
        trainer.train()
        logs[cache] = [(r["loss"], r["kv_loss"]) for r in _rows_of(trainer)]
        if cache:
            assert len(trainer.teachers.cache) == 2 * 8  # two teachers x 8 records, computed once
    torch.testing.assert_close(torch.tensor(logs[True]), torch.tensor(logs[False]), rtol=1e-4, atol=1e-5)


def _transfer_argv(base_args, tiny_world, **kw):
    # the fixture's test split stands in for teacher-written completions of unlabelled questions
    return _two_step_argv(base_args, transfer_data=str(tiny_world.data_dir), transfer_split="test",
                          transfer_field_map="{question: question, answer: answer}", transfer_batch_size=3, **kw)


def test_transfer_records_are_drawn_per_batch_reproducibly(base_args, tiny_world):
    trainer = build_trainer(parse_config(_transfer_argv(base_args, tiny_world)))
    n = len(trainer.train_dataset)
    rows = [trainer.train_dataset[i] for i in range(4)]
    a, b = trainer.data_collator(rows), trainer.data_collator(rows)
    assert torch.equal(a["index"], b["index"])  # same batch -> same draw (resume replays it)
    assert a["input_ids"].shape[0] == 7 and a["labelled"].tolist() == [True] * 4 + [False] * 3
    assert (a["index"][:4] < n).all() and (a["index"][4:] >= n).all()  # one id space for the teacher cache
    other = trainer.data_collator([trainer.train_dataset[i] for i in range(4, 8)])
    assert not torch.equal(other["index"][4:], a["index"][4:])  # another batch, another draw


def test_transfer_records_get_teacher_signals_but_no_lm_loss(base_args, tiny_world):
    """CE over labelled + transfer rows equals CE over the labelled rows alone; logit KD (and the
    KV loss) also cover the transfer rows."""
    trainer = build_trainer(parse_config(_transfer_argv(base_args, tiny_world, logit_kd_weight=1.0,
                                                        kv_warmup_steps=0)))
    model = trainer.distill_model
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    teacher_inputs = batch.pop("teacher_inputs", {})

    def forward(keep: torch.Tensor) -> dict:
        part = {k: v[keep] for k, v in batch.items()}
        kvs, logits = trainer.teacher_targets(part, {k: {kk: vv[keep] for kk, vv in v.items()}
                                                    for k, v in teacher_inputs.items()})
        return model(**part, teacher_kvs=kvs, teacher_logits=logits, kv_scale=1.0)["metrics"]

    is_labelled = batch["labelled"]
    both, labelled, transfer = forward(torch.ones_like(is_labelled)), forward(is_labelled), forward(~is_labelled)
    torch.testing.assert_close(both["ce"], labelled["ce"])
    assert float(transfer["ce"]) == 0.0 and float(transfer["logit_kd"]) > 0 and float(transfer["kv_loss"]) > 0


def test_transfer_set_trains_end_to_end_and_sft_ignores_it(base_args, tiny_world):
    trainer = build_trainer(parse_config(_transfer_argv(base_args, tiny_world, kv_loss="relation")))
    trainer.train()
    assert trainer.state.global_step == 2 and all(r["kv_loss"] > 0 for r in _rows_of(trainer))
    sft = build_trainer(parse_config(_transfer_argv(base_args, tiny_world, kv_weight=0)))
    batch = sft.data_collator([sft.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape[0] == 4 and batch["labelled"].all()  # no teacher signal: no transfer rows
