"""`kvdistill capture` and training from a capture: equal losses, refused mismatches, resume."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kvdistill.capture import MANIFEST, CaptureError
from kvdistill.commands import capture as capture_cmd
from kvdistill.commands.train import build_trainer
from kvdistill.teachers import is_captured
from kvdistill.train.config import parse_config


def _argv(base_args, tiny_world, tmp_path, **kw):
    m = tiny_world.models
    args = {"max_steps": 3, "max_samples": 16, "logging_steps": 1, "kv_weight": 1, "kv_loss": "relation",
            "logit_kd_weight": 1.0, "teachers": f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}}}]",
            "transfer_data": str(tiny_world.data_dir), "transfer_split": "test", "transfer_max_samples": 8,
            "transfer_batch_size": 2, "teacher_capture": str(tmp_path / "capture")}
    args.update(kw)
    return base_args(**args)


def _losses(trainer) -> list[float]:
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_training_from_a_capture_equals_the_live_teachers(base_args, tiny_world, tmp_path):
    argv = _argv(base_args, tiny_world, tmp_path)
    root = capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    for name in ("qwen2_teacher", "llama_teacher_alt_tok"):
        manifest = json.loads((root / name / MANIFEST).read_text())
        assert manifest["complete"] and manifest["n_records"] == 16 + 8
        assert manifest["settings"]["logits"] == (name == "qwen2_teacher")  # logit KD: same-vocabulary teacher
    captured = build_trainer(parse_config(argv))
    assert all(is_captured(t) for t in captured.teachers)  # no teacher weights in memory
    live = build_trainer(parse_config([*argv, "--teacher_capture", "", "--output_dir", str(tmp_path / "live")]))
    assert not any(is_captured(t) for t in live.teachers)
    torch.testing.assert_close(_losses(captured), _losses(live), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, named", [
    ({"max_length": 120}, "max_length"),
    ({"max_samples": 12}, "records"),
    ({"teacher_control": "untrained"}, "weights"),
    ({"key_space": "post_rope"}, "key_space"),
])
def test_a_capture_of_another_run_is_refused(base_args, tiny_world, tmp_path, change, named):
    capture_cmd.run_capture(parse_config(_argv(base_args, tiny_world, tmp_path)), log=lambda _: None)
    with pytest.raises(CaptureError, match=f"does not match this run: .*{named}"):
        build_trainer(parse_config(_argv(base_args, tiny_world, tmp_path, **change)))


def test_a_killed_capture_is_refused_then_resumed(base_args, tiny_world, tmp_path, monkeypatch):
    monkeypatch.setattr(capture_cmd, "SHARD_RECORDS", 8)  # 24 records, batches of 4: 3 shards per teacher
    argv = _argv(base_args, tiny_world, tmp_path)
    root = capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    teacher = root / "qwen2_teacher"
    shards = sorted(teacher.glob("shard-*.safetensors"))
    assert len(shards) == 3
    full = {p.name: load_file(p) for p in shards}
    # as if killed after the first shard: manifest lists one shard, not complete
    manifest = json.loads((teacher / MANIFEST).read_text())
    (teacher / MANIFEST).write_text(json.dumps({**manifest, "shards": manifest["shards"][:1], "complete": False}))
    for p in shards[1:]:
        p.unlink()
    with pytest.raises(CaptureError, match="incomplete"):
        build_trainer(parse_config(argv))
    first_mtime = shards[0].stat().st_mtime_ns
    capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    assert shards[0].stat().st_mtime_ns == first_mtime  # kept, not recomputed
    for p in shards:
        for k, v in load_file(p).items():
            torch.testing.assert_close(v, full[p.name][k])
    assert build_trainer(parse_config(argv)).teachers.cache.store


def test_bf16_capture_halves_the_bytes(base_args, tiny_world, tmp_path):
    fp32 = capture_cmd.run_capture(parse_config(_argv(base_args, tiny_world, tmp_path / "a")), log=lambda _: None)
    argv = _argv(base_args, tiny_world, tmp_path / "b", capture_dtype="bf16")
    bf16 = capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    for name in ("qwen2_teacher", "llama_teacher_alt_tok"):
        a = load_file(next((fp32 / name).glob("shard-*.safetensors")))
        b = load_file(next((bf16 / name).glob("shard-*.safetensors")))
        assert b["keys"].dtype == torch.bfloat16 and b["keys"].nbytes * 2 == a["keys"].nbytes
        torch.testing.assert_close(b["keys"].float(), a["keys"], rtol=1e-2, atol=1e-2)
    trainer = build_trainer(parse_config(argv))
    assert len(_losses(trainer)) == 3


def test_capture_cli_needs_a_directory_and_a_teacher_signal(base_args, tiny_world, tmp_path):
    from kvdistill.config import ConfigError

    with pytest.raises(ConfigError, match="--teacher_capture DIR"):
        capture_cmd.main(_argv(base_args, tiny_world, tmp_path, teacher_capture=""))
    with pytest.raises(ConfigError, match="nothing to capture"):
        capture_cmd.main(_argv(base_args, tiny_world, tmp_path, kv_weight=0, logit_kd_weight=0))
    assert capture_cmd.main(_argv(base_args, tiny_world, tmp_path)) == 0
