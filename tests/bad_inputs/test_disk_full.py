"""A full disk in the middle of a write: one line naming the path and the bytes, exit 2, nothing
half-written (no temp file, no incomplete checkpoint or shard).

torch.save raises `RuntimeError` and safetensors `SafetensorError` on a full disk, not `OSError`;
the cases make each of them fail for real: a file-size limit (`RLIMIT_FSIZE`, the `subprocess`
mark's `fsize_limit`) turns every write past it into EFBIG, as a full disk does with ENOSPC. The
limits sit above the 64 KiB probe of `check_output_dir` and below the file meant to fail: the tiny
student's `model.safetensors` is ~114 KB, its `optimizer.pt` ~245 KB, a teacher capture shard ~1 MB.
"""

from __future__ import annotations

import errno
import pickle
import resource
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvdistill.io import WriteError, write_bytes_atomic, writing
from tests.bad_inputs.conftest import assert_refused, files_under, run_in_process, teacher_list

SAFETENSORS_FAILS = pytest.mark.subprocess(fsize_limit=80_000)  # the probe passes, model.safetensors does not
TORCH_SAVE_FAILS = pytest.mark.subprocess(fsize_limit=150_000)  # model.safetensors passes, optimizer.pt does not


def checkpointing(c) -> list:
    """A 2-step run saving checkpoint-1 after its first step."""
    return c.train(max_steps=2, save_steps=1)


def capturing(c) -> list:
    args = c.train(kv_weight=0.1, teachers=teacher_list(c.world.teacher), teacher_capture=c.out / "cap")
    return ["capture", *args[1:]]


CASES = [
    pytest.param(checkpointing, ("checkpoint-1", "(File too large;", "MB to write", "--resume_from_checkpoint last"),
                 id="checkpoint_safetensors", marks=SAFETENSORS_FAILS),
    pytest.param(checkpointing, ("checkpoint-1", "(torch's file writer failed;", "MB to write"),
                 id="checkpoint_torch_save", marks=TORCH_SAVE_FAILS),
    pytest.param(capturing, ("shard-00000.safetensors", "(File too large;", "MB to write", "rerun the same capture"),
                 id="capture_shard", marks=SAFETENSORS_FAILS),
]


def half_written(out: Path) -> list[Path]:
    """Temp files, checkpoints without their completion marker, shards not in a manifest."""
    return [p for p in files_under(out) if p.name.endswith(".tmp") or p.name.startswith(".")
            or (p.parent.name.startswith("checkpoint-") and not (p.parent / "checkpoint_complete.json").exists())
            or p.name.startswith("shard-")]


@pytest.mark.parametrize("argv, expect", CASES)
def test_a_full_disk_stops_in_one_line_and_leaves_nothing_half_written(argv, expect, children, request):
    rc, _, err, ctx, args, _ = children.result(request.node.nodeid)
    assert_refused(rc, err, args[0], ("no space left on the device", *expect))
    assert not half_written(ctx.out), half_written(ctx.out)
    assert not list(ctx.out.rglob("checkpoint-*")) and not (ctx.out / "model.safetensors").exists()


def over_an_old_checkpoint(c) -> list:
    """`--overwrite_output_dir` into a dir holding a complete checkpoint-1: the new save goes over it."""
    shutil.copytree(c.checkpoint(), c.out / "checkpoint-1")
    return [*checkpointing(c), "--overwrite_output_dir", "true"]


@pytest.mark.parametrize("argv", [pytest.param(over_an_old_checkpoint, id="over_a_complete_checkpoint",
                                               marks=TORCH_SAVE_FAILS)])
def test_a_save_that_fails_over_an_old_checkpoint_leaves_it_marked_incomplete(argv, children, request):
    rc, _, err, ctx, _, _ = children.result(request.node.nodeid)
    assert_refused(rc, err, "train", ("no space left on the device", "checkpoint-1"))
    assert not (ctx.out / "checkpoint-1" / "checkpoint_complete.json").exists()  # resume `last` will not pick it


def test_eval_items_that_meet_a_full_disk_are_not_left_half_written(world, tmp_path, capsys, monkeypatch):
    """The items file fails half-way (ENOSPC after half its bytes): no items, no temp, no summary."""
    write_bytes = Path.write_bytes

    def full(self, data):
        if self.name.startswith(".items.jsonl"):
            write_bytes(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval"
    rc, _, err = run_in_process(["eval", "--model", world.student, "--data", world.data, "--limit", 2,
                                 "--max_new_tokens", 4, "--output_dir", out, "--no_progress"], capsys)
    assert_refused(rc, err, "eval", ("no space left on the device", "items.jsonl", "B to write", "free there"))
    assert not files_under(out), files_under(out)


@contextmanager
def fsize_limit(n: int):
    """Writes by this process past `n` bytes fail (EFBIG) inside the block. Lifted before the test
    returns: pytest writes its report (to a file, when its output is redirected) under the same limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("write, reason", [
    (lambda p, x: torch.save({"x": x}, p), "torch's file writer failed"),
    (lambda p, x: save_file({"x": x}, str(p)), "File too large"),
    (lambda p, x: p.write_bytes(x.numpy().tobytes()), "File too large"),
], ids=["torch_save", "safetensors", "python"])
def test_each_library_s_failed_write_becomes_one_write_error(write, reason, tmp_path):
    x = torch.zeros(50_000)  # 200 KB
    target = tmp_path / "run" / "weights"
    with fsize_limit(100_000), pytest.raises(WriteError) as caught, writing(tmp_path / "run", x.nbytes):
        target.parent.mkdir()
        write(target, x)
    assert caught.value.reason == reason and caught.value.nbytes == 200_000
    assert f"writing {tmp_path / 'run'} failed ({reason}; 0.2 MB to write" in str(caught.value)
    assert not (tmp_path / "run").exists()  # the dir the block made is gone with its half file


def test_a_write_error_pickles_whole(tmp_path):
    # an ablation worker's error reaches its parent pickled: it must arrive as the same WriteError
    err = WriteError(tmp_path / "run", 5_000_000, "File too large", errno.EFBIG)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is WriteError and (back.path, back.nbytes, back.reason) == (err.path, 5_000_000, "File too large")
    assert back.errno == errno.EFBIG and str(back) == str(err)


def test_a_failed_write_into_an_existing_dir_removes_only_what_it_made(tmp_path):
    (tmp_path / "old.json").write_text("{}")
    with fsize_limit(1000), pytest.raises(WriteError, match=r"new\.bin"), writing(tmp_path / "new.bin", 5000):
        (tmp_path / "new.bin").write_bytes(bytes(5000))
    assert [p.name for p in tmp_path.iterdir()] == ["old.json"]


def test_an_error_that_is_not_a_write_passes_unchanged_and_still_cleans_up(tmp_path):
    with pytest.raises(KeyError), writing(tmp_path / "ckpt"):
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "half").write_bytes(b"x")
        raise KeyError("a bug, not a disk")
    assert not (tmp_path / "ckpt").exists()


def test_atomic_bytes_leave_the_old_file_when_the_disk_is_full(tmp_path):
    path = write_bytes_atomic(tmp_path / "plot.png", b"old")
    with fsize_limit(1000), pytest.raises(WriteError, match=r"plot\.png"):
        write_bytes_atomic(path, bytes(5000))
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_an_append_that_meets_a_full_disk_keeps_the_file_and_names_it(tmp_path):
    """`metrics.jsonl` is appended to: its earlier rows stay, the cut last line is skipped when read."""
    from kvdistill.io import read_jsonl

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    line = '{"step": 2, "loss": ' + "1" * 200 + "}\n"
    with fsize_limit(100), pytest.raises(WriteError, match=r"metrics\.jsonl failed \(File too large; 222 B to write"), \
            writing(metrics, len(line)), metrics.open("a") as f:
        f.write(line)
    assert read_jsonl(metrics) == [{"step": 1}]
