"""Chunked head losses read the teachers' final hidden states through their heads (same vocabulary and
cross-vocabulary): no teacher's `[B, T, V]` logits are made, in training, in the teacher cache or in a capture."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kvdistill.capture import MANIFEST, CaptureError
from kvdistill.commands import capture as capture_cmd
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config

SAME = ("qwen2_teacher", "llama_teacher")  # both read the student's tokens (hidden 64 and 96)
CROSS = "llama_teacher_alt_tok"  # another tokenizer: cross-vocab KD at the shared boundaries (hidden 96)
ALL = (*SAME, CROSS)


def _argv(base_args, tiny_world, tmp_path, **kw):
    m = tiny_world.models
    args = {"teachers": f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher']}}}, "
                        f"{{path: {m['llama_teacher_alt_tok']}}}]",
            "kv_weight": 0, "logit_kd_weight": 1.0, "logit_chunk_tokens": 8, "max_samples": 8, "max_steps": 2,
            "per_device_train_batch_size": 2, "logging_steps": 1}
    return base_args(**{**args, **kw})


def _loss_and_grads(trainer, batch):
    model = trainer.distill_model
    model.zero_grad()
    loss, out = trainer.compute_loss(model, batch, return_outputs=True)
    loss.backward()
    grads = [p.grad.clone() for p in model.student.parameters() if p.grad is not None]
    return loss.detach(), out["metrics"]["logit_kd"], grads


def _full_logits_made(trainer) -> list:
    """Hooks on each teacher's head: the `[B, T, V]` outputs it makes (T > 1) are listed."""
    made = []
    for t in trainer.teachers:
        t.model.get_output_embeddings().register_forward_hook(
            lambda m, i, out, n=t.name: made.append(n) if out.shape[1] > 1 else None)
    return made


def test_teacher_hidden_head_equals_the_full_logits_and_makes_no_teacher_logits(base_args, tiny_world, tmp_path):
    trainer = build_trainer(parse_config(_argv(base_args, tiny_world, tmp_path)))
    assert {t.name: t.head_hidden for t in trainer.teachers} == dict.fromkeys(ALL, True)
    made = _full_logits_made(trainer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    got = _loss_and_grads(trainer, batch)
    assert made == []  # chunked: the teachers' heads ran on the last position only
    for t in trainer.teachers:
        t.head_hidden = False  # the reference: the teachers' full logits, the student's too (unchunked)
    trainer.distill_model.weights.chunk_tokens = 0
    ref = _loss_and_grads(trainer, batch)
    assert set(made) == set(ALL)  # the check can fail: the reference made them
    assert float(ref[1]) > 0
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    assert len(got[2]) == len(ref[2]) > 0
    for g, r in zip(got[2], ref[2]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    # hidden states from the teachers, a batch the model does not chunk: the logits through their heads
    for t in trainer.teachers:
        t.head_hidden = True
    unchunked = _loss_and_grads(trainer, batch)
    torch.testing.assert_close(unchunked[0], ref[0], rtol=1e-5, atol=1e-5)


def test_unchunked_runs_keep_the_teachers_logits(base_args, tiny_world, tmp_path):
    """logit_chunk_tokens 0, and auto (unset) below 2^26 logits (the tiny models): the logits path, as before."""
    argv = _argv(base_args, tiny_world, tmp_path, logit_chunk_tokens=0)
    auto = [*argv[:argv.index("--logit_chunk_tokens")], *argv[argv.index("--logit_chunk_tokens") + 2:]]
    for a in (argv, auto):
        assert not any(t.head_hidden for t in build_trainer(parse_config(a)).teachers)


def test_a_chunked_capture_stores_final_hidden_states_and_a_logits_capture_is_refused(base_args, tiny_world,
                                                                                        tmp_path):
    argv = _argv(base_args, tiny_world, tmp_path, teacher_capture=str(tmp_path / "capture"))
    root = capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    for name, d in (("qwen2_teacher", 64), ("llama_teacher", 96), (CROSS, 96)):
        assert json.loads((root / name / MANIFEST).read_text())["settings"]["logits"] == "final_hidden"
        shard = load_file(root / name / "shard-00000.safetensors")
        assert "logits" not in shard and shard["final_hidden"].shape == (shard["segment_ids"].shape[0], d)
    captured = build_trainer(parse_config(argv))
    live = build_trainer(parse_config([*argv, "--teacher_capture", "", "--output_dir", str(tmp_path / "live")]))
    assert all(t.head is not None for t in captured.teachers)
    batch = captured.data_collator([captured.train_dataset[i] for i in range(2)])
    torch.testing.assert_close(_loss_and_grads(captured, batch)[:2], _loss_and_grads(live, batch)[:2],
                               rtol=1e-5, atol=1e-6)
    # the same capture for an unchunked run (it reads logits), and a logits capture for a chunked run
    with pytest.raises(CaptureError, match=r"holds final hidden states \[T, d\].*this run reads logits \[T, V\]"):
        build_trainer(parse_config([*argv, "--logit_chunk_tokens", "0"]))
    old = _argv(base_args, tiny_world, tmp_path, teacher_capture=str(tmp_path / "old"), logit_chunk_tokens=0)
    capture_cmd.run_capture(parse_config(old), log=lambda _: None)
    with pytest.raises(CaptureError, match=r"holds logits \[T, V\].*this run reads final hidden states"):
        build_trainer(parse_config([*old, "--logit_chunk_tokens", "8"]))


def test_teacher_cache_holds_final_hidden_states(base_args, tiny_world, tmp_path):
    """A cached record of a teacher with logit KD: `[T_i, d]` in place of `[T_i, V]`."""
    trainer = build_trainer(parse_config(_argv(base_args, tiny_world, tmp_path, teacher_cache="true")))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    first = _loss_and_grads(trainer, batch)
    entries = {k[0]: e for k, e in trainer.teachers.cache._store.items()}
    assert entries["qwen2_teacher"]["final_hidden"].shape[1] == 64 and "logits" not in entries["qwen2_teacher"]
    assert entries[CROSS]["final_hidden"].shape[1] == 96 and "logits" not in entries[CROSS]
    torch.testing.assert_close(_loss_and_grads(trainer, batch)[:2], first[:2])  # read back from the cache


@pytest.mark.slow  # a 2-process launch (~40 s on 2 cores); the head path itself is tested in process above
@pytest.mark.extended  # an extra multi-process check: DDP = one process stays in CI (tests/train/test_distributed.py)
def test_two_process_ddp_with_teacher_heads_equals_one_process(base_args, tiny_world, launch, tmp_path):
    """2 ranks × 1 record × 2 accumulated micro-batches = 1 process × 4: the same logged losses with the
    teachers' heads chunked, the ranks' parameters equal, and one teacher-answer cache for both ranks
    (fusion: correctness; rank 0 writes it)."""
    out = tmp_path / "ddp"
    ddp_args = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, fusion="correctness")
    r = launch(["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no"], ["-m", "kvdistill.cli", "train", *_argv(base_args, tiny_world, tmp_path,
                                                                                    output_dir=out, **ddp_args)])
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((out / "ranks" / f"rank{i}.json").read_text()) for i in range(2)]
    assert ranks[0]["param_checksum"] == pytest.approx(ranks[1]["param_checksum"], rel=1e-9)
    assert ranks[0]["logged_loss"] == pytest.approx(ranks[1]["logged_loss"], rel=1e-9)
    answers = json.loads((out / "teacher_correctness.json").read_text())  # teacher:config:n_records -> 0/1 each
    assert len(answers) == 3 and all(len(a) == 8 and set(a) <= {0, 1} for a in answers.values())
    assert not (out / "teacher_correctness.json.tmp").exists()
    ddp = [row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    one = build_trainer(parse_config(_argv(base_args, tiny_world, tmp_path, output_dir=tmp_path / "one",
                                           per_device_train_batch_size=4, fusion="correctness")))
    assert all(t.head_hidden for t in one.teachers)
    one.train()
    ref = [h["loss"] for h in one.state.log_history if "loss" in h]
    assert len(ddp) == len(ref) == 2
    assert ddp == pytest.approx(ref, rel=1e-5)
