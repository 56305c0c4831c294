"""Crash safety: checkpoints are trusted only when saved to the end; a run killed with SIGKILL (during
training, or in the middle of writing a checkpoint) resumes with `last` and ends where an
uninterrupted run ends."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvdistill.commands.train import main as train_main
from kvdistill.io import read_jsonl
from kvdistill.train.config import ConfigError
from kvdistill.train.trainer import COMPLETE_FILE, complete_checkpoints, resolve_checkpoint

STEPS, EVERY = 8, 2

# Runs `kvdistill train` and SIGKILLs itself in the middle of writing checkpoint-4: the student's
# weights file is on disk, nothing after it is (optimizer, trainer state, marker).
KILL_IN_SAVE = """
import os, signal, sys
from kvdistill.train.trainer import KVDistillTrainer
save = KVDistillTrainer._save
def _save(self, output_dir=None, state_dict=None):
    save(self, output_dir, state_dict)
    if output_dir and output_dir.endswith("checkpoint-4"):
        os.kill(os.getpid(), signal.SIGKILL)
KVDistillTrainer._save = _save
from kvdistill.commands.train import main
sys.exit(main(sys.argv[1:]))
"""


def _argv(base_args, out: Path, **kw) -> list[str]:
    return base_args(output_dir=out, max_steps=STEPS, save_steps=EVERY, logging_steps=1, **kw)


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def killed_in_save(module_base_args, tmp_path_factory):
    """`(process, output_dir, argv)` of a `kvdistill train` child that SIGKILLs itself while writing
    checkpoint-4, started before the in-process reference run so that the two run side by side."""
    root = tmp_path_factory.mktemp("killed_in_save")
    out, argv = root / "run", _argv(module_base_args, root / "run")
    with (root / "stderr.log").open("wb") as err:  # a file, not a pipe: nobody reads it until the test
        proc = subprocess.Popen([sys.executable, "-c", KILL_IN_SAVE, *argv], env=_env(), stdout=subprocess.DEVNULL,
                                stderr=err)
    yield proc, out, argv
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def uninterrupted(module_base_args, tmp_path_factory, killed_in_save):
    """The reference: the same run, never stopped (`killed_in_save` starts first, to overlap with it)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert train_main(_argv(module_base_args, out)) == 0
    return out


def _assert_same_end(ref: Path, run: Path) -> None:
    for f in ("model.safetensors", "kvdistill_modules.safetensors"):
        a, b = load_file(ref / f), load_file(run / f)
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    rows_ref = [r for r in read_jsonl(ref / "metrics.jsonl") if "loss" in r]
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    # the resumed run's log has each step once: the rows after its checkpoint were dropped and replayed
    assert [r["step"] for r in rows] == [r["step"] for r in rows_ref] == list(range(1, STEPS + 1))
    assert abs(rows[-1]["loss"] - rows_ref[-1]["loss"]) < 1e-6


def test_resolve_checkpoint(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False), (10, True)):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if complete:
            (d / COMPLETE_FILE).write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-10"]
    assert resolve_checkpoint(tmp_path, "last") == str(tmp_path / "checkpoint-10")  # by step, not by name
    assert resolve_checkpoint(tmp_path, True) == str(tmp_path / "checkpoint-10")
    assert resolve_checkpoint(tmp_path / "none_yet", "last") is None  # nothing saved: a fresh start
    assert resolve_checkpoint(tmp_path, None) is None
    assert resolve_checkpoint(tmp_path, str(tmp_path / "checkpoint-4")) == str(tmp_path / "checkpoint-4")
    with pytest.raises(ConfigError, match=r"checkpoint-6 is incomplete .* pass `last`"):
        resolve_checkpoint(tmp_path, str(tmp_path / "checkpoint-6"))
    with pytest.raises(ConfigError, match=r"checkpoint-99 does not exist"):
        resolve_checkpoint(tmp_path, str(tmp_path / "checkpoint-99"))


def test_checkpoints_carry_the_marker_and_rotation_keeps_complete_ones(uninterrupted, base_args, tmp_path):
    assert [p.name for p in complete_checkpoints(uninterrupted)] == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]
    out = tmp_path / "limited"
    assert train_main(_argv(base_args, out, save_total_limit=1)) == 0
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-8"]
    assert (out / "checkpoint-8" / COMPLETE_FILE).is_file()


def test_kill_during_a_save_then_resume_last(uninterrupted, killed_in_save):
    proc, out, argv = killed_in_save
    assert proc.wait(timeout=600) == -signal.SIGKILL, (out.parent / "stderr.log").read_text()[-2000:]
    assert (out / "checkpoint-4" / "model.safetensors").exists() and not (out / "checkpoint-4" / COMPLETE_FILE).exists()
    # the half-written checkpoint is refused by name, and `last` skips it
    with pytest.raises(ConfigError, match="checkpoint-4 is incomplete"):
        train_main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-4")])
    assert train_main([*argv, "--resume_from_checkpoint", "last"]) == 0
    _assert_same_end(uninterrupted, out)


def test_kill_during_training_then_resume_last(uninterrupted, base_args, tmp_path):
    out = tmp_path / "killed_in_training"
    argv = _argv(base_args, out)
    proc = subprocess.Popen([sys.executable, "-m", "kvdistill.cli", "train", *argv], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (out / "checkpoint-2" / COMPLETE_FILE).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # killed, not finished: the test would prove nothing otherwise
    assert not (out / "train_summary.json").exists()
    assert train_main([*argv, "--resume_from_checkpoint", "last"]) == 0
    _assert_same_end(uninterrupted, out)


def test_full_disk_while_saving_is_one_line_then_resumes(uninterrupted, base_args, tmp_path, monkeypatch, capsys):
    from kvdistill.cli import main as cli_main
    from kvdistill.train.trainer import KVDistillTrainer

    out = tmp_path / "full_disk"
    argv = _argv(base_args, out)
    save = KVDistillTrainer._save

    def full(self, output_dir=None, state_dict=None):
        if output_dir and output_dir.endswith("checkpoint-4"):
            raise OSError(errno.ENOSPC, "No space left on device", output_dir)
        return save(self, output_dir, state_dict)

    monkeypatch.setattr(KVDistillTrainer, "_save", full)
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert "no space left on the device" in err[-1] and "--resume_from_checkpoint last" in err[-1]
    monkeypatch.setattr(KVDistillTrainer, "_save", save)
    assert train_main([*argv, "--resume_from_checkpoint", "last"]) == 0
    _assert_same_end(uninterrupted, out)
