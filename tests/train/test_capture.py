"""`kvdistill capture` and training from a capture: equal losses, refused mismatches, resume."""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from kvdistill.capture import MANIFEST, CaptureError
from kvdistill.commands import capture as capture_cmd
from kvdistill.teachers import is_captured
from kvdistill.train.build import build_trainer
from kvdistill.train.config import parse_config


def _argv(base_args, tiny_world, tmp_path, **kw):
    m = tiny_world.models
    args = {"max_steps": 3, "max_samples": 16, "logging_steps": 1, "kv_weight": 1, "kv_loss": "relation",
            "logit_kd_weight": 1.0, "teachers": f"[{{path: {m['qwen2_teacher']}}}, {{path: {m['llama_teacher_alt_tok']}}}]",
            "transfer_data": str(tiny_world.data_dir), "transfer_split": "test", "transfer_max_samples": 8,
            "transfer_batch_size": 2, "teacher_capture": str(tmp_path / "capture")}
    args.update(kw)
    return base_args(**args)


def _losses(trainer) -> dict[str, list[float]]:
    """Total, KV and logit-KD loss per logged step: the KV term is ~1e-4 of the total under the relation
    loss, so comparing totals alone would miss an error in the teacher KV."""
    trainer.train()
    rows = [h for h in trainer.state.log_history if "loss" in h]
    return {k: [h[k] for h in rows] for k in ("loss", "kv_loss", "logit_kd")}


def test_training_from_a_capture_equals_the_live_teachers(base_args, tiny_world, tmp_path):
    argv = _argv(base_args, tiny_world, tmp_path)
    root = capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    for name in ("qwen2_teacher", "llama_teacher_alt_tok"):
        manifest = json.loads((root / name / MANIFEST).read_text())
        assert manifest["complete"] and manifest["n_records"] == 16 + 8
        # logit KD (logit_kd: auto): the same-vocabulary teacher's logits and the other tokenizer's (cross-vocab)
        assert manifest["settings"]["logits"] is True
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
    ({"capture_layers": "mapped"}, "capture_layers"),  # every layer stored, the run expects the mapped ones
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
    # as if killed after the first shard: the plan (the manifest, not complete) and one shard on disk
    manifest = json.loads((teacher / MANIFEST).read_text())
    (teacher / MANIFEST).write_text(json.dumps({**manifest, "complete": False}))
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
    assert len(build_trainer(parse_config(argv)).teachers.cache)


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
    assert len(_losses(trainer)["loss"]) == 3


def test_capture_of_run_dirs_reads_their_final_model_or_newest_complete_checkpoint(base_args, tiny_world, tmp_path):
    """Run dirs as the student and a teacher: the student run's final model, the teacher run's newest complete
    checkpoint (never the newer cut-short one, nor the run dir, which holds no model), each said in one line."""
    import shutil

    from kvdistill.capture import weights_fingerprint
    from kvdistill.runs import COMPLETE_FILE, TRAIN_CONFIG

    m, student, teacher = tiny_world.models, tmp_path / "student_run", tmp_path / "teacher_run"
    shutil.copytree(m["student"], student)
    (student / TRAIN_CONFIG).write_text("{}")  # the final save went to its end
    shutil.copytree(m["student"], teacher / "checkpoint-4")  # a cut-short save: another model, no marker
    for step in (2, 3):
        shutil.copytree(m["qwen2_teacher"], teacher / f"checkpoint-{step}")
        (teacher / f"checkpoint-{step}" / TRAIN_CONFIG).write_text("{}")
        (teacher / f"checkpoint-{step}" / COMPLETE_FILE).write_text("{}")
    argv = _argv(base_args, tiny_world, tmp_path, student=student, teachers=f"[{{path: {teacher}}}]", max_samples=4,
                 transfer_data="", logit_kd_weight=0)
    said = []
    root = capture_cmd.run_capture(parse_config(argv), log=said.append)
    assert said[:2] == [f"student: loading {student} (the run's final model)",
                        f"teacher teacher_run: loading {teacher / 'checkpoint-3'} (newest complete checkpoint; the run "
                        "has no final model)"]
    settings = json.loads((root / "teacher_run" / MANIFEST).read_text())["settings"]
    assert settings["weights"] == weights_fingerprint(teacher / "checkpoint-3")


def test_capture_cli_needs_a_directory_and_a_teacher_signal(base_args, tiny_world, tmp_path):
    from kvdistill.config import ConfigError

    with pytest.raises(ConfigError, match="--teacher_capture DIR"):
        capture_cmd.main(_argv(base_args, tiny_world, tmp_path, teacher_capture=""))
    with pytest.raises(ConfigError, match="nothing to capture"):
        capture_cmd.main(_argv(base_args, tiny_world, tmp_path, kv_weight=0, logit_kd_weight=0))
    assert capture_cmd.main(_argv(base_args, tiny_world, tmp_path)) == 0


def _size(capture) -> int:
    return sum(f.stat().st_size for f in capture.glob("*/shard-*.safetensors"))


def test_a_mapped_capture_stores_the_mapped_layers_and_trains_as_the_live_teachers(base_args, tiny_world, tmp_path):
    # proportional map of the 2-layer student: teacher layers 0 and L_t - 1; the middle ones are never read
    # mercator: a KV loss of ~1 in a loss of ~7 (relation's ~4e-4 would hide a layer put back at the wrong index)
    full = capture_cmd.run_capture(parse_config(_argv(base_args, tiny_world, tmp_path / "all", kv_loss="mercator")),
                                   log=lambda _: None)
    argv = _argv(base_args, tiny_world, tmp_path / "mapped", kv_loss="mercator", capture_layers="mapped")
    mapped = capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    for name, L in (("qwen2_teacher", 4), ("llama_teacher_alt_tok", 3)):
        manifest = json.loads((mapped / name / MANIFEST).read_text())
        assert manifest["settings"]["capture_layers"] == {"kept": [0, L - 1], "teacher_layers": L}
        a = load_file(next((full / name).glob("shard-*.safetensors")))
        m = load_file(next((mapped / name).glob("shard-*.safetensors")))
        assert a["keys"].shape[1] == L and m["keys"].shape == (a["keys"].shape[0], 2, *a["keys"].shape[2:])
        for field in ("keys", "values"):
            torch.testing.assert_close(m[field], a[field][:, [0, L - 1]])
    assert _size(mapped) < _size(full)
    captured = build_trainer(parse_config(argv))
    live = build_trainer(parse_config([*argv, "--teacher_capture", "", "--output_dir", str(tmp_path / "live")]))
    losses = _losses(captured)
    assert len(losses["kv_loss"]) == 3 and min(losses["kv_loss"]) > 0.5
    torch.testing.assert_close(losses, _losses(live), rtol=1e-5, atol=1e-6)


def test_capture_layers_mapped_from_the_cli(base_args, tiny_world, tmp_path, capsys):
    from kvdistill.cli import main as cli

    argv = _argv(base_args, tiny_world, tmp_path, capture_layers="mapped", layer_map="last_k", max_steps=2)
    assert cli(["capture", *argv]) == 0
    out = capsys.readouterr().out
    assert "layers [3] of 4" in out and "layers [2] of 3" in out  # last_k 1: each teacher's top layer
    # the capture was made for last_k: a run with the proportional map (teacher layers 0 and L-1) refuses it
    assert cli(["train", *argv, "--layer_map", "proportional"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # above it: progress bars only
    assert last.startswith("kvdistill train: error: ") and "does not match this run: capture_layers differ" in last
    assert cli(["train", *argv]) == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 2


@pytest.mark.parametrize("change, named", [
    ({"capture_layers": "some"}, "capture_layers"),
    ({"capture_layers": "mapped", "student_input": "short_rationale:1", "logit_kd_weight": 0}, "teacher_compression: rkv"),
])
def test_capture_layers_is_checked(base_args, tiny_world, tmp_path, change, named):
    from kvdistill.config import ConfigError

    with pytest.raises(ConfigError, match=named):
        parse_config(_argv(base_args, tiny_world, tmp_path, **change))


def _records(shard: dict) -> list[dict]:
    """The records of one loaded shard, each `{field: [T_i, ...]}`."""
    starts = shard["offsets"].tolist()
    return [{k: shard[k][a:b] for k in ("keys", "values", "segment_ids")} for a, b in itertools.pairwise(starts)]


def test_capture_keep_stores_evenly_spaced_rationale_positions_and_trains(base_args, tiny_world, tmp_path):
    from fractions import Fraction
    from math import ceil, floor

    from kvdistill.cache import REASONING

    kw = {"kv_loss": "mercator", "logit_kd_weight": 0}  # logit KD reads every position: refused with capture_keep
    full = capture_cmd.run_capture(parse_config(_argv(base_args, tiny_world, tmp_path / "all", **kw)),
                                   log=lambda _: None)
    argv = _argv(base_args, tiny_world, tmp_path / "half", capture_keep=0.5, **kw)
    half = capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    for name in ("qwen2_teacher", "llama_teacher_alt_tok"):
        settings = json.loads((half / name / MANIFEST).read_text())["settings"]
        assert settings["capture_positions"] == {"keep": 0.5, "method": "uniform"}
        a, h = (load_file(next((d / name).glob("shard-*.safetensors"))) for d in (full, half))
        assert torch.equal(a["index"], h["index"])
        for ra, rh in zip(_records(a), _records(h)):
            r_a, r_h = ra["segment_ids"] == REASONING, rh["segment_ids"] == REASONING
            n = int(r_a.sum())
            k = ceil(n / 2)
            assert int(r_h.sum()) == k and n >= 2
            # prompt and answer whole; rationale ranks round(i (n - 1) / (k - 1)), evenly spaced
            ranks = [floor(Fraction(i * (n - 1), k - 1) + Fraction(1, 2)) for i in range(k)]
            for f in ("keys", "values"):
                torch.testing.assert_close(rh[f][~r_h], ra[f][~r_a], rtol=0, atol=0)
                torch.testing.assert_close(rh[f][r_h], ra[f][r_a][ranks], rtol=0, atol=0)
    assert _size(half) < _size(full)
    trainer = build_trainer(parse_config(argv))
    trainer.train()
    kv_loss = [h["kv_loss"] for h in trainer.state.log_history if "kv_loss" in h]
    assert len(kv_loss) == 3 and all(0.1 < v < 10 for v in kv_loss)
    # a run that expects every position refuses the half capture, naming the setting
    with pytest.raises(CaptureError, match="does not match this run: capture_positions"):
        build_trainer(parse_config(_argv(base_args, tiny_world, tmp_path / "half", **kw)))


@pytest.mark.parametrize("method", ["rkv", "random"])
def test_capture_keep_other_methods_from_the_cli(base_args, tiny_world, tmp_path, capsys, method):
    from kvdistill.cli import main as cli

    argv = _argv(base_args, tiny_world, tmp_path, capture_keep=0.25, capture_compression=method, logit_kd_weight=0,
                 max_steps=2)
    assert cli(["capture", *argv]) == 0
    out = capsys.readouterr().out
    assert f"positions stored ({method}, capture_keep 0.25)" in out
    first = load_file(next((tmp_path / "capture" / "qwen2_teacher").glob("shard-*.safetensors")))
    assert cli(["capture", *argv]) == 0  # complete: nothing recomputed, the same positions
    again = load_file(next((tmp_path / "capture" / "qwen2_teacher").glob("shard-*.safetensors")))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert cli(["train", *argv]) == 0


@pytest.mark.parametrize("student_input", ["no_rationale", "latent:2"])
def test_privileged_runs_from_a_capture_equal_the_live_ones(base_args, tiny_world, tmp_path, student_input):
    # the capture stores the teachers' whole rationale; training compresses it onto the student's slots (R-KV)
    argv = _argv(base_args, tiny_world, tmp_path, student_input=student_input, logit_kd_weight=0, kv_loss="mercator")
    capture_cmd.run_capture(parse_config(argv), log=lambda _: None)
    kv_loss = {}
    for name, extra in (("captured", []), ("live", ["--teacher_capture", "", "--output_dir", str(tmp_path / "live")])):
        trainer = build_trainer(parse_config([*argv, *extra]))
        assert all(is_captured(t) for t in trainer.teachers) == (name == "captured")
        trainer.train()
        kv_loss[name] = [h["kv_loss"] for h in trainer.state.log_history if "kv_loss" in h]
    assert len(kv_loss["live"]) == 3 and min(kv_loss["live"]) > 0.1
    torch.testing.assert_close(kv_loss["captured"], kv_loss["live"], rtol=1e-5, atol=1e-6)
