"""Attention-map loss: zero on identity, full-map reference, chunking, masks, gradients, head groups."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.losses.attention import AttentionMapLoss, head_groups
from kvdistill.losses.kv import token_weights

SEG_W = {PROMPT: 0.5, REASONING: 2.0}


def _batch(L=2, Lt=3, B=2, T=7, Hs=(4, 2), Ht=(6, 3), Ds=4, Dt=6):
    """Student q/k `[L, B, T, H, D]` with GQA, a teacher with other L/H/D, padding at the end of row 1."""
    sq, sk = torch.randn(L, B, T, Hs[0], Ds), torch.randn(L, B, T, Hs[1], Ds)
    tq, tk = torch.randn(Lt, B, T, Ht[0], Dt), torch.randn(Lt, B, T, Ht[1], Dt)
    mix = torch.rand(L, Lt)
    mix = mix / mix.sum(1, keepdim=True)
    mask = torch.ones(B, T)
    mask[1, -2:] = 0
    seg = torch.tensor([[PROMPT, PROMPT, REASONING, REASONING, REASONING, ANSWER, ANSWER]] * B)[:, :T]
    seg[1, -2:] = PAD
    return sq, sk, tq, tk, mix, mask, seg


def _maps(q, k):
    """Full attention probabilities `[L, B, H_q, T, T]` in float64: causal, GQA (repeat_kv)."""
    q, k = q.double().transpose(2, 3), k.double().transpose(2, 3)  # [L, B, H, T, D]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    T = q.shape[3]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(future, -math.inf)


def _reference(sq, sk, tq, tk, mix, mask, seg, seg_w=None, rows=None, reduction="mean"):
    """The definition with full `[L, B, H, T, T]` maps (float64 autograd): mixed teacher maps, KL per row."""
    keys = ((mask > 0) & (seg != PAD))[None, :, None, None, :]  # [1, B, 1, 1, T]
    z_s, z_t = _maps(sq, sk), _maps(tq, tk)
    log_q = z_s.masked_fill(~keys, -math.inf).log_softmax(-1)
    p_t = z_t.masked_fill(~keys, -math.inf).softmax(-1).nan_to_num(0.0)  # [L_t, B, H_t, T, T]
    W = head_groups(sq.shape[3], tq.shape[3]).double()
    p = torch.einsum("ml,hg,lbgct->mbhct", mix.double(), W, p_t)  # [L, B, H, T, T]
    terms = torch.where(p > 0, p * (p.log() - log_q), 0.0)
    kl = terms.nan_to_num(0.0).sum(-1).mean((0, 2))  # [B, T]
    w = token_weights(mask, seg, seg_w).double()
    if rows is not None:
        w = w * rows
    total = (torch.where(w > 0, kl, 0.0) * w).sum()
    return total if reduction == "sum" else total / w.sum()


def test_identical_is_zero_with_padding():
    sq, sk, _, _, _, mask, seg = _batch()
    sq[:, 1, -2:] = 1e3  # garbage on padding
    loss, m = AttentionMapLoss(chunk_size=3, compile=False)(sq, sk, sq.clone(), sk.clone(), mask, seg)
    assert abs(loss.item()) < 1e-6 and m["attention_kl"].abs() < 1e-6


@pytest.mark.parametrize(("reduction", "compile"), [("mean", False), ("sum", False), ("mean", True)])
def test_matches_full_map_reference(reduction, compile):
    sq, sk, tq, tk, mix, mask, seg = _batch()
    loss, m = AttentionMapLoss(segment_weights=SEG_W, reduction=reduction, compile=compile)(
        sq, sk, tq, tk, mask, seg, layer_mix=mix)
    ref = _reference(sq, sk, tq, tk, mix, mask, seg, SEG_W, reduction=reduction)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert m["attention_kl_per_layer"].shape == (2,)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_chunked_equals_unchunked_and_gradient_matches_the_reference(chunk_size):
    sq, sk, tq, tk, mix, mask, seg = _batch()
    rows = torch.rand(2, 7) > 0.4
    s = [x.clone().requires_grad_(True) for x in (sq, sk)]
    s64 = [x.double().requires_grad_(True) for x in (sq, sk)]
    loss, _ = AttentionMapLoss(segment_weights=SEG_W, chunk_size=chunk_size)(*s, tq, tk, mask, seg, layer_mix=mix,
                                                                            rows=rows)
    ref = _reference(*s64, tq, tk, mix, mask, seg, SEG_W, rows=rows.double())
    loss.backward()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for a, b in zip(s, s64):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-6)


def test_chunked_keeps_no_full_map_for_the_backward():
    """What the graph keeps for the backward, chunked: no `[L, B, H, T, T]` map, only inputs and row results."""
    sq, sk, tq, tk, mix, mask, _ = _batch(T=24)
    s = [x.clone().requires_grad_(True) for x in (sq, sk)]
    kept = []

    def pack(x):
        kept.append(x.numel())
        return x

    for chunk, limit in ((4, 2 * 2 * 4 * 24 * 24), (None, None)):
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss, _ = AttentionMapLoss(chunk_size=chunk, compile=False)(*s, tq, tk, mask, layer_mix=mix)
        if limit is not None:
            assert max(kept) < limit / 4  # [L, B, H, T, T] is 4608 floats; the inputs are 768
        else:
            assert max(kept) >= 2 * 2 * 4 * 24 * 24  # unchunked: Q - P of every row, the check can fail
        loss.backward()


def test_gradient_reaches_student_only():
    sq, sk, tq, tk, mix, mask, seg = _batch()
    sq.requires_grad_(True), sk.requires_grad_(True), tq.requires_grad_(True), tk.requires_grad_(True)
    loss, _ = AttentionMapLoss(chunk_size=2)(sq, sk, tq, tk, mask, seg, layer_mix=mix)
    loss.backward()
    assert tq.grad is None and tk.grad is None
    assert sq.grad.abs().sum() > 0 and sk.grad.abs().sum() > 0


def test_masked_rows_and_columns_contribute_nothing():
    """Garbage at padded positions (both sides) and teacher changes on unselected rows change nothing."""
    sq, sk, tq, tk, mix, mask, seg = _batch()
    rows = torch.zeros(2, 7, dtype=torch.bool)
    rows[:, 4:6] = True
    fn = AttentionMapLoss(chunk_size=2)
    s = [x.clone().requires_grad_(True) for x in (sq, sk)]
    loss, m = fn(*s, tq, tk, mask, seg, layer_mix=mix, rows=rows)
    loss.backward()
    grads = [x.grad.clone() for x in s]
    assert s[0].grad[:, 1, -2:].abs().max() == 0 and s[1].grad[:, 1, -2:].abs().max() == 0  # padded: no grad

    sq2, sk2, tq2, tk2 = sq.clone(), sk.clone(), tq.clone(), tk.clone()
    for x in (sq2, sk2, tq2, tk2):
        x[:, 1, -2:] = 1e4 * torch.randn_like(x[:, 1, -2:])  # padded columns and rows
    tq2[:, :, :4] = torch.randn_like(tq2[:, :, :4])  # the teacher's unselected query rows
    s2 = [x.requires_grad_(True) for x in (sq2, sk2)]
    loss2, m2 = fn(*s2, tq2, tk2, mask, seg, layer_mix=mix, rows=rows)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)
    for a, b in zip(s2, grads):
        torch.testing.assert_close(a.grad[:, 0], b[:, 0])
        torch.testing.assert_close(a.grad[:, 1, :-2], b[:, 1, :-2])
    assert m["attention_kl_selected"] == pytest.approx(float(m["attention_kl"]))
    assert float(m2["attention_kl_other"]) != pytest.approx(float(m["attention_kl_other"]))  # reported, not read


def test_head_groups():
    torch.testing.assert_close(head_groups(2, 6), torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1.]]) / 3)
    torch.testing.assert_close(head_groups(3, 3), torch.eye(3))
    torch.testing.assert_close(head_groups(4, 2), torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1.]]))
    # 2 student heads over 3 teacher heads: the middle one is shared half and half
    torch.testing.assert_close(head_groups(2, 3), torch.tensor([[2, 1, 0], [0, 1, 2.]]) / 3)


def test_bad_shapes_name_the_problem():
    sq, sk, tq, tk, mix, mask, seg = _batch()
    with pytest.raises(ValueError, match="layer_mix must be"):
        AttentionMapLoss()(sq, sk, tq, tk, mask, seg)  # 3 teacher layers, no mix
    with pytest.raises(ValueError, match="not a multiple of its 3 KV heads"):
        AttentionMapLoss()(sq, sk, tq[..., :4, :], tk, mask, seg, layer_mix=mix)


@pytest.mark.parametrize("name", ["student", "llama_teacher"])  # a tiny Qwen2 (GQA 4:1) and a tiny Llama
def test_hooked_queries_give_the_models_own_attention(tiny_world, name):
    """softmax(q kᵀ / sqrt(D)) from the hooked post-RoPE queries and the cached keys equals the eager
    attention's `output_attentions` on every real row and column (right padding included)."""
    from transformers import AutoModelForCausalLM

    from kvdistill.cache import forward_with_kv

    model = AutoModelForCausalLM.from_pretrained(tiny_world.models[name], attn_implementation="eager").eval()
    ids = torch.randint(3, 300, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, -3:] = 0
    with torch.no_grad():
        out, kv = forward_with_kv(model, ids, mask, queries=True, output_attentions=True)
    assert kv.queries.shape[:4] == (kv.num_layers, 2, model.config.num_attention_heads, 9)
    z = _maps(kv.queries.transpose(2, 3), kv.keys.transpose(2, 3))  # [L, B, H, T, T]
    probs = z.masked_fill(~mask.bool()[None, :, None, None, :], -math.inf).softmax(-1)
    real = mask.bool()[:, None, :, None] & mask.bool()[:, None, None, :]  # [B, 1, T, T]
    for layer, att in enumerate(out.attentions):  # [B, H, T, T]
        torch.testing.assert_close(probs[layer].float().masked_fill(~real, 0), att.masked_fill(~real, 0),
                                   rtol=1e-5, atol=1e-5)


def test_model_without_queries_is_refused_in_one_line(tiny_world):
    from transformers import AutoModelForCausalLM

    from kvdistill.cache import forward_with_kv

    model = AutoModelForCausalLM.from_pretrained(tiny_world.models["gpt2"])
    with pytest.raises(ValueError, match=r"^GPT2LMHeadModel has no Llama/Qwen2-style attention \(self_attn.q_proj"):
        forward_with_kv(model, torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4), queries=True)


# ------------------------------------------------------------------ end to end: kvdistill train / capture
def _train_argv(tiny_world, out, **kw):
    m = tiny_world.models
    args = {"student": m["student"], "data": tiny_world.data_dir, "output_dir": out, "max_length": 160,
            "max_steps": 2, "max_samples": 8, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
            "learning_rate": 1e-3, "kv_weight": 1, "kv_warmup_steps": 0, "logging_steps": 1, "save_steps": 1000,
            "use_cpu": True, "seed": 0, "dataloader_num_workers": 0, "disable_tqdm": True, "kv_loss": "attention",
            "relation_chunk_size": 16, "relation_compile": False,
            "teachers": f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}}}]"}
    args.update(kw)
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


def _logged(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def test_attention_loss_trains_with_two_tokenizers_and_answer_rows(tiny_world, tmp_path):
    from kvdistill.train.build import build_trainer
    from kvdistill.train.config import parse_config

    trainer = build_trainer(parse_config(_train_argv(tiny_world, tmp_path / "run", relation_rows="answer")))
    assert trainer.args.key_space == "post_rope"
    assert all(sum(p.numel() for p in a.parameters()) == 0 for a in trainer.distill_model.aligners.values())
    before = {n: p.detach().clone() for n, p in trainer.distill_model.student.named_parameters()}
    trainer.train()
    rows = _logged(trainer)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["kv_loss"] > 0 for r in rows)
    for name in ("qwen2_teacher", "llama_teacher_alt_tok"):
        for key in ("attention_kl", "attention_kl_selected", "attention_kl_other"):
            assert all(r[f"{key}/{name}"] > 0 for r in rows), (key, name)
        assert f"attention_layer/{name}/1" in rows[0]
    assert any(not torch.equal(p, before[n]) for n, p in trainer.distill_model.student.named_parameters())


def test_attention_from_a_capture_equals_the_live_teachers(tiny_world, tmp_path):
    from kvdistill.capture import MANIFEST, CaptureError
    from kvdistill.commands import capture as capture_cmd
    from kvdistill.train.build import build_trainer
    from kvdistill.train.config import parse_config

    argv = _train_argv(tiny_world, tmp_path / "run", teacher_capture=tmp_path / "capture")
    root = capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    assert json.loads((root / "qwen2_teacher" / MANIFEST).read_text())["settings"]["queries"] is True
    live = build_trainer(parse_config([*argv, "--teacher_capture", "", "--output_dir", str(tmp_path / "live")]))
    captured = build_trainer(parse_config(argv))
    losses = [[(r["loss"], r["kv_loss"]) for r in _logged(t)] for t in (captured, live) if t.train()]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)

    relation = _train_argv(tiny_world, tmp_path / "rel", kv_loss="relation", relation_heads=4, key_space="post_rope",
                           teacher_capture=tmp_path / "capture_relation")
    capture_cmd.run_capture(parse_config(relation), log=lambda _: None)
    with pytest.raises(CaptureError, match=r"holds no queries .* kv_loss attention reads them"):
        build_trainer(parse_config(_train_argv(tiny_world, tmp_path / "run2",
                                               teacher_capture=tmp_path / "capture_relation")))


def test_attention_config_refusals(tiny_world, tmp_path):
    from kvdistill.config import ConfigError
    from kvdistill.train.build import build_trainer
    from kvdistill.train.config import parse_config

    for change, named in (({"key_space": "pre_rope"}, "set key_space: post_rope"),
                          ({"fusion": "kv_mean"}, "kv_mean"),
                          ({"relation_rows": "answers"}, "relation_rows 'answers'"),
                          ({"relation_rows": "field:digit", "lmbda": 0.5}, "generated completions")):
        with pytest.raises(ConfigError, match=named):
            parse_config(_train_argv(tiny_world, tmp_path / "x", **change))
    with pytest.raises(ConfigError, match="relation_rows field:nope: 8 of 8 records have no token field 'nope'"):
        build_trainer(parse_config(_train_argv(tiny_world, tmp_path / "z", relation_rows="field:nope")))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no Llama/Qwen2-style attention"):
        build_trainer(parse_config(_train_argv(tiny_world, tmp_path / "y", teachers=f"[{{path: {tiny_world.models['gpt2']}}}]")))


def test_relation_rows_from_a_token_field_end_to_end(tiny_world, tmp_path):
    """relation_rows field:<name> reads the rows a task marks in token_fields; both KL splits are logged."""
    import re

    from kvdistill.train.build import build_trainer
    from kvdistill.train.config import parse_config

    data = tmp_path / "data"
    data.mkdir()
    records = [json.loads(x) for x in (tiny_world.data_dir / "train.jsonl").read_text().splitlines()[:8]]
    for r in records:  # mark the numbers of each question
        r["token_fields"] = {"number": [[m.start(), m.end(), 1] for m in re.finditer(r"\d+", r["question"])]}
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = _train_argv(tiny_world, tmp_path / "run", data=data, kv_loss="relation", relation_heads=4,
                       relation_rows="field:number", teachers=f"[{{path: {tiny_world.models['qwen2_teacher']}}}]")
    trainer = build_trainer(parse_config(argv))
    trainer.train()
    rows = _logged(trainer)
    assert all(math.isfinite(r["loss"]) and r["relation_kl_selected/qwen2_teacher"] > 0
               and r["relation_kl_other/qwen2_teacher"] > 0 for r in rows)
    assert all(r["relation_kl/qwen2_teacher"] == pytest.approx(r["relation_kl_selected/qwen2_teacher"]) for r in rows)
