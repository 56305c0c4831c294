"""`kvdistill profile` on the tiny offline models: every stage reported, shapes consistent."""

from __future__ import annotations

import json

import pytest

from kvdistill.commands.profile import main, measure


def test_measure_reports_time_and_cpu_peak_memory():
    import torch

    out, seconds, peak = measure(lambda: torch.ones(256, 1024).sum())  # a 1 MiB temporary
    assert out.item() == 256 * 1024 and seconds >= 0
    assert peak >= 256 * 1024 * 4


@pytest.mark.parametrize(
    ("teacher", "mode"), [("qwen2_teacher", "flat"), ("llama_teacher_alt_tok", "structured")]
)
def test_profile_runs_each_stage(tiny_world, tmp_path, capsys, teacher, mode):
    out = tmp_path / "profile.json"
    argv = [
        "--teacher", str(tiny_world.models[teacher]),
        "--student", str(tiny_world.models["student"]),
        "--mode", mode,
        "--batch-size", "2",
        "--max-length", "128",
        "--data", str(tiny_world.data_dir),
        "--device", "cpu",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    for name in ("teacher KV", "time: index", "time+layer: gather", "head+dim", "loss (K+V)", "backward"):
        assert name in text
    report = json.loads(out.read_text())
    stages = {r["stage"]: r for r in report["stages"]}
    L_s, H_s, D_s = 2, 1, 8  # the tiny student
    T_s = int(stages["time: index"]["shape"].split("x")[1])
    expected = f"{L_s}x2x{T_s}x{H_s * D_s}" if mode == "flat" else f"{L_s}x2x{T_s}x{H_s}x{D_s}"
    assert stages["aligner forward (all)"]["shape"] == f"{expected} / {expected}"
    assert report["aligner"]["params"]["total"] > 0 and "aligner parameters" in text
    assert all(r["ms"] >= 0 and r["peak_mib"] >= 0 for r in report["stages"])
