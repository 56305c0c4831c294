"""`kvdistill train` on CPU checks the estimated peak memory against what the machine has available,
before any weight loads: above it, one refusal line; within 15 % of it, a warning; `allow_low_memory`
trains anyway; on a GPU it checks nothing. The estimate is `kvdistill dry-run`'s (`kvdistill.memory`)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvdistill.memory import GIB, WARN_FRACTION, Component, check_host_memory, estimate, total_gib

REFUSAL = ("training on CPU needs an estimated", "GiB of memory at its peak", "GiB available",
           "--per_device_train_batch_size", "--max_length", "--teacher_capture", "--bf16", "--allow_low_memory true")


def kv_run(c_or_world, train_argv):
    """A 1-step KV run with the world's teacher (its argv without the program name)."""
    return train_argv(kv_weight=0.1, kv_warmup_steps=0, teachers=f"[{{path: {c_or_world.teacher}}}]")


def estimate_of(argv: list) -> float:
    from kvdistill.commands.train import host_estimate_gib
    from kvdistill.train.config import parse_config

    return host_estimate_gib(parse_config([str(a) for a in argv[1:]]))


def available(monkeypatch, n_bytes: float) -> None:
    monkeypatch.setattr("kvdistill.commands.train.available_bytes", lambda: int(n_bytes))


def test_a_run_above_the_available_memory_is_refused_before_anything_is_written(refused, monkeypatch, tmp_path):
    available(monkeypatch, 2**20)  # 1 MiB: the tiny models' run needs more
    err = refused(lambda c: kv_run(c.world, c.train), REFUSAL)
    assert sum("error" in line for line in err.splitlines()) == 1 and "0.0 GiB available" in err
    assert not (tmp_path / "out").exists()  # not even the empty output_dir


def test_a_run_within_15_percent_of_the_available_memory_warns_and_trains(world, train_args, tmp_path, monkeypatch,
                                                                         caplog):
    from kvdistill.cli import main

    argv = kv_run(world, lambda **kw: train_args(output_dir=tmp_path / "out", **kw))
    need = estimate_of(argv)
    available(monkeypatch, need * GIB / ((1 + WARN_FRACTION) / 2))  # need = 92.5 % of it
    with caplog.at_level(logging.WARNING, logger="kvdistill.commands.train"):
        assert main(argv) == 0
    said = [r.getMessage() for r in caplog.records if "needs an estimated" in r.getMessage()]
    assert len(said) == 1 and "less than 15% headroom" in said[0] and "--max_length" in said[0], said
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_allow_low_memory_trains_anyway_and_says_so(world, train_args, tmp_path, monkeypatch, caplog):
    from kvdistill.cli import main

    available(monkeypatch, 2**20)
    argv = kv_run(world, lambda **kw: train_args(output_dir=tmp_path / "out", allow_low_memory="true", **kw))
    with caplog.at_level(logging.WARNING, logger="kvdistill.commands.train"):
        assert main(argv) == 0
    said = [r.getMessage() for r in caplog.records if "needs an estimated" in r.getMessage()]
    assert len(said) == 1 and "training anyway (allow_low_memory)" in said[0], said


def test_plenty_of_memory_says_nothing_and_a_gpu_run_is_not_checked(world, train_args, tmp_path, monkeypatch,
                                                                   caplog):
    from kvdistill.commands.train import check_memory
    from kvdistill.config import ConfigError
    from kvdistill.train.config import parse_config

    cfg = parse_config([str(a) for a in kv_run(world, lambda **kw: train_args(output_dir=tmp_path / "out", **kw))[1:]])
    available(monkeypatch, 64 * GIB)
    with caplog.at_level(logging.INFO, logger="kvdistill.commands.train"):
        check_memory(cfg, torch.device("cpu"))
    assert not caplog.records
    available(monkeypatch, 2**20)
    with pytest.raises(ConfigError, match="needs an estimated"):
        check_memory(cfg, torch.device("cpu"))
    monkeypatch.setattr("kvdistill.commands.train.host_estimate_gib", lambda cfg: pytest.fail("estimated on a GPU"))
    check_memory(cfg, torch.device("cuda"))  # the GPU's memory is dry-run's question, not the host's


def test_the_host_estimate_is_dry_runs_total(world, train_args, tmp_path):
    from kvdistill.commands.dry_run import dry_run, parse_dry_run

    argv = kv_run(world, lambda **kw: train_args(output_dir=tmp_path / "out", logit_kd_weight=0.5, **kw))
    assert estimate_of(argv) == pytest.approx(dry_run(*parse_dry_run([str(a) for a in argv[1:]]))["total_gib"])


def test_the_verdict_bands():
    assert check_host_memory(10.0, None) is None  # no MemAvailable: nothing to compare with
    assert check_host_memory(10.0, 20 * GIB) is None
    assert check_host_memory(0.80 * 20, 20 * GIB) is None
    assert check_host_memory(0.86 * 20, 20 * GIB) == "warn"
    assert check_host_memory(20.01, 20 * GIB) == "refuse"


def meta_llama(h: int, inter: int, L: int, heads: int, kv: int, D: int, V: int) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=L, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=D, vocab_size=V, tie_word_embeddings=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_the_estimate_on_a_hand_computed_pair():
    # student: h 8, I 16, 2 layers, 2 heads x 4, 1 KV head, V 32; per layer q 64 + k 32 + v 32 + o 64 +
    # MLP 3*8*16 + 2 norms * 8 = 592; 2 layers + tied embeddings 32*8 + final norm 8 = 1448
    student = Component("student", "s", None, meta_llama(8, 16, 2, 2, 1, 4, 32), torch.float32)
    # teacher: h 4, I 8, 3 layers, 1 head x 4, 1 KV head, V 16; per layer 4*16 + 3*4*8 + 8 = 168; 504 + 64 + 4
    teacher = Component("teacher", "t", None, meta_llama(4, 8, 3, 1, 1, 4, 16), torch.bfloat16)
    B, T = 2, 3
    items = estimate(student, [teacher], B=B, T=T, mixed="bf16", logits=True, hidden=False, offload=False,
                     captured=False, aligner_params=10, aligner_trainable=6)
    got = {i["item"]: i["bytes"] for i in items}
    # activations, a = 2 under bf16: per layer and token 4h + 2*H*D + 4*H_kv*D + 4*I = 32 + 16 + 16 + 64 = 128
    activations = B * T * (2 * 128 * 2 + 32 * (2 + 8))  # 6 * 832 = 4992
    assert got == {
        "student weights": 1448 * 4,
        "student grads": 1448 * 4,
        "student AdamW (2 states)": 1448 * 8,
        "student bf16 autocast copy": 1448 * 2,
        "student activations (rough)": activations,
        "teacher t weights": 572 * 2,
        "teacher t outputs (1 micro-batch)": 2 * 3 * 1 * 4 * B * T * 2 + B * T * 16 * 2,  # K, V + logits in bf16
        "aligners (fp32 weights + grads + AdamW)": 10 * 4 + 6 * 12,
    }
    total = 1448 * 18 + activations + 572 * 2 + 288 + 192 + 112
    assert total_gib(items) == pytest.approx(total / GIB)
    captured = estimate(student, [teacher], B=B, T=T, mixed=None, logits=False, hidden=False, offload=False,
                        captured=True, aligner_params=0, aligner_trainable=0)
    assert total_gib(captured) * GIB == pytest.approx(1448 * 16 + B * T * (2 * 128 * 4 + 32 * 12) + 2 * 3 * 4 * B * T * 2)


def test_the_estimate_under_key_space_hidden_counts_hidden_states_not_the_cache():
    # the KV loss reads hidden states: the teacher's [L+1, B, T, h] in place of its cache (once, though CODI reads
    # them too), the student's stacked h in place of its stacked 2*H_kv*D; the student of the hand-computed test
    # with h 12 (!= 2*H_kv*D = 8, so the two counts differ)
    student = Component("student", "s", None, meta_llama(12, 16, 2, 2, 1, 4, 32), torch.float32)
    teacher = Component("teacher", "t", None, meta_llama(4, 8, 3, 1, 1, 4, 16), torch.bfloat16)
    B, T = 2, 3
    got = {i["item"]: i["bytes"] for i in estimate(student, [teacher], B=B, T=T, mixed=None, logits=False, hidden=True,
                                                   offload=False, captured=False, aligner_params=0,
                                                   aligner_trainable=0, key_space="hidden")}
    assert got["teacher t outputs (1 micro-batch)"] == (3 + 1) * B * T * 4 * 2  # (L+1)*B*T*h in bf16
    # per layer and token 4h + 2*H*D + 2*H_kv*D + h + 4*I = 48 + 16 + 8 + 12 + 64 = 148, a = 4 in fp32
    assert got["student activations (rough)"] == B * T * (2 * 148 * 4 + 32 * 12)
