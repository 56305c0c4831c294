"""`kvdistill bench`: discovery, import by path, JSON + README output, error handling."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kvdistill.cli import main as cli_main
from kvdistill.commands import bench

FAKE = """
def run(quick: bool) -> dict:
    n = 2 if quick else 4
    return {
        "title": "Fake speed-up",
        "results": [{"case": f"n={i}", "ms": 0.5 * i, "shape": [2, i]} for i in range(1, n + 1)],
        "ratio": 2.5, "target": 2.0, "passed": True, "note": "synthetic",
    }
"""

SLOW = """
def run(quick: bool) -> dict:
    return {"results": [{"case": "x", "ms": 9.0}], "ratio": 1.1, "target": 2.0, "passed": False}
"""

BROKEN = """
def run(quick: bool) -> dict:
    raise RuntimeError("boom")
"""


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    d = tmp_path / "repo" / "benchmarks"
    d.mkdir(parents=True)
    (d / "bench_fake.py").write_text(FAKE)
    (d / "bench_slow.py").write_text(SLOW)
    (d / "helpers.py").write_text("X = 1\n")  # not a benchmark: ignored
    return d


def test_discover_and_find(bench_dir: Path) -> None:
    assert list(bench.discover(bench_dir)) == ["fake", "slow"]
    # walking up from a nested directory finds <repo>/benchmarks
    nested = bench_dir.parent / "src" / "pkg"
    nested.mkdir(parents=True)
    assert bench.find_benchmarks_dir(nested) == bench_dir


def test_find_reports_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvdistill

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvdistill, "__file__", str(tmp_path / "site" / "kvdistill" / "__init__.py"))
    with pytest.raises(FileNotFoundError, match="--benchmarks-dir"):
        bench.find_benchmarks_dir()


def test_run_writes_json_and_readme(bench_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results"
    rc = bench.main(["--benchmarks-dir", str(bench_dir), "--only", "fake", "--quick", "--out", str(out)])
    assert rc == 0
    rec = json.loads((out / "fake.json").read_text())
    assert rec["benchmark"] == "fake" and rec["quick"] is True
    assert len(rec["result"]["results"]) == 2 and rec["result"]["passed"] is True
    assert {"torch", "torch_threads", "cpu_count", "date"} <= set(rec["machine"])
    readme = (out / "README.md").read_text()
    assert "## Fake speed-up" in readme
    assert "| case | ms | shape |" in readme and "| n=2 | 1 | 2×2 |" in readme
    assert "ratio: **2.5**" in readme and "passed: **yes**" in readme
    assert "note: synthetic" in readme and "threads" in readme
    assert "| case | ms | shape |" in capsys.readouterr().out

    # a later --only run refreshes its own section and keeps the earlier one
    assert bench.main(["--benchmarks-dir", str(bench_dir), "--only", "slow", "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert "## Fake speed-up" in readme and "## slow" in readme and "passed: **no**" in readme
    # --fail-on-miss turns a missed target into exit 1
    args = ["--benchmarks-dir", str(bench_dir), "--only", "slow", "--out", str(out), "--fail-on-miss"]
    assert bench.main(args) == 1


def test_broken_benchmark_is_recorded(bench_dir: Path, tmp_path: Path) -> None:
    (bench_dir / "bench_broken.py").write_text(BROKEN)
    out = tmp_path / "results"
    rc = bench.main(["--benchmarks-dir", str(bench_dir), "--out", str(out)])
    assert rc == 1  # the error is reported ...
    assert "RuntimeError: boom" in json.loads((out / "broken.json").read_text())["error"]
    readme = (out / "README.md").read_text()
    assert "**Failed:**" in readme and "## Fake speed-up" in readme  # ... and the others still ran


def test_unknown_name(bench_dir: Path, tmp_path: Path) -> None:
    assert cli_main(["bench", "--benchmarks-dir", str(bench_dir), "--only", "nope", "--out", str(tmp_path)]) == 2


HEADLINES = """
def run(quick: bool) -> dict:
    return {"results": [{"case": "x", "ms": 2.0}], "ratio": 1.2, "target": 1.3, "passed": True, "over_floor": 1.2}
"""

SPEEDUP = """
def run(quick: bool) -> dict:
    return {"results": [{"case": "x", "ms": 2.0}], "ratio": 2.5, "target": 3.0, "passed": False, "speedup": 2.5}
"""


def test_headlines_name_what_the_ratio_is(bench_dir: Path, tmp_path: Path) -> None:
    (bench_dir / "bench_floor.py").write_text(HEADLINES)
    (bench_dir / "bench_cached.py").write_text(SPEEDUP)
    out = tmp_path / "results"
    assert bench.main(["--benchmarks-dir", str(bench_dir), "--only", "floor,cached,fake", "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert "| floor | over_floor | 1.2 | ≤ 1.3 | yes |" in readme
    assert "| cached | speedup | 2.5 | ≥ 3 | no |" in readme
    assert "| fake | ratio | 2.5 | 2 | yes |" in readme  # no headline key: the plain ratio, as before
    assert "over_floor: **1.2** (time / floor, lower is better) · target: **≤ 1.3** · passed: **yes**" in readme
    assert "speedup: **2.5** (baseline time / time, higher is better) · target: **≥ 3**" in readme
    assert "load average" in readme and "load_average" in json.loads((out / "floor.json").read_text())


def test_interleaved_times_alternate_cases_and_pair_ratios() -> None:
    calls: list[str] = []
    t = bench.interleaved_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then the order flips every repeat
    assert len(t.wall["a"]) == len(t.cpu["b"]) == 3
    t = bench.Timings(wall={"a": [2.0, 9.0, 3.0], "b": [1.0, 3.0, 1.0]}, cpu={"a": [1.0], "b": [1.0]})
    assert t.ratio("a", "b") == 3.0 and t.ms("a") == 3000.0  # medians: of the paired ratios (2, 3, 3), of a
    assert t.ratio("a", "b", "cpu") == 1.0


@pytest.mark.parametrize("name", ["align", "cka"])
def test_real_benchmark_quick_run(tmp_path: Path, name: str) -> None:
    """The repository's benchmark end to end in quick mode: headline against its floor, stage rows."""
    out = tmp_path / "results"
    bench.main(["--only", name, "--quick", "--out", str(out)])
    rec = json.loads((out / f"{name}.json").read_text())
    res = rec["result"]
    assert "error" not in rec and rec["quick"] is True
    assert res["ratio"] == res["over_floor"] > 1.0 and res["target"] == 1.3
    assert res["passed"] == (res["over_floor"] <= 1.3)
    cases = [r["case"] for r in res["results"]]
    if name == "align":
        assert res["max_abs_diff_fused_vs_plain"] < 1e-6 and res["max_abs_grad_diff"] < 1e-6
        assert res["max_abs_diff_fused_vs_naive"] < 1e-5
        assert "stage: backward (fused - fused forward)" in cases and cases[3].startswith("floor")
    else:
        assert res["max_abs_diff_pairwise_vs_batched"] < 1e-6 and cases[1].startswith("floor")
    assert f"over_floor: **{bench._cell(res['over_floor'])}**" in (out / "README.md").read_text()


def test_capture_benchmark_quick_run(tmp_path: Path) -> None:
    """Live teachers vs a real `kvdistill capture` read by the trainer, one short epoch each."""
    out = tmp_path / "results"
    bench.main(["--only", "capture", "--quick", "--out", str(out)])
    rec = json.loads((out / "capture.json").read_text())
    assert "error" not in rec, rec.get("traceback")
    res = rec["result"]
    assert res["ratio"] == res["speedup"] > 0 and res["passed"] == (res["speedup"] >= 3.0)
    one, two = res["results"]
    assert one["teachers_x"] < two["teachers_x"] and one["steps"] == two["steps"] == 4
    assert one["capture_mib"] > 0 and two["capture_mib"] > one["capture_mib"]  # two teachers stored
    assert "| capture | speedup |" in (out / "README.md").read_text()


def test_a_benchmark_file_run_as_a_script_prints_its_run_as_json(monkeypatch, capsys) -> None:
    """`python benchmarks/bench_<name>.py --quick` (each file's `__main__` calls `run_standalone`)."""
    monkeypatch.setattr(sys, "argv", ["bench_fake.py", "--quick"])
    bench.run_standalone(lambda quick: {"ratio": 1.5, "quick": quick}, "Benchmark: fake.\n\nMore.", "small")
    assert json.loads(capsys.readouterr().out) == {"ratio": 1.5, "quick": True}
    monkeypatch.setattr(sys, "argv", ["bench_fake.py", "--help"])
    with pytest.raises(SystemExit):
        bench.run_standalone(lambda quick: {}, "Benchmark: fake.\n\nMore.", "small shapes")
    out = capsys.readouterr().out
    assert "Benchmark: fake." in out and "More." not in out and "small shapes" in out


def test_peer_benchmark_without_trl_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    """`kvdistill bench --only peer` where trl is not installed: a skip that names the extra."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    out = tmp_path / "results"
    bench.main(["--only", "peer", "--quick", "--out", str(out)])
    res = json.loads((out / "peer.json").read_text())["result"]
    assert "pip install 'kvdistill[peer]'" in res["skipped"] and res["results"] == []


def test_peer_losses_equal_trl_on_a_fixed_batch(tiny_world, tmp_path: Path) -> None:
    """TRL's GKDTrainer and kvdistill's trainer (logit-only generalized JSD) on the same tensors and weights:
    the same loss, and the same formula at loss temperature 2 once kvdistill's T^2 is divided out (CI installs
    the `[peer]` extra; untimed: `bench peer` times the steps)."""
    pytest.importorskip("trl")
    peer = bench.load_benchmark(bench.find_benchmarks_dir() / "bench_peer.py")
    m = tiny_world.models
    ours, trl, batch, _ = peer.trainer_pair(m["student"], m["qwen2_teacher"], tiny_world.data_dir, tmp_path, 0.0,
                                            8, True)
    res = peer.fixed_batch_losses(ours, trl, batch)
    assert res["loss_kvdistill"] > 1e-3  # a real JSD between two different models, not 0 == 0
    assert res["loss_abs_diff"] <= peer.LOSS_ATOL and res["loss_abs_diff_all_rows"] <= peer.LOSS_ATOL
    assert res["formula_abs_diff_t1"] < 1e-6 and res["formula_abs_diff_t2_over_t2"] < 1e-6


def test_peer_pairs_run_both_teachers_at_one_precision(tiny_world, tmp_path: Path) -> None:
    """TRL's GKDConfig defaults to bf16=True, which autocasts its teacher: the benchmark's pair turns that off
    (both teachers fp32), and its bf16 pair gives TRL that default and kvdistill's teacher bf16 weights."""
    pytest.importorskip("trl")
    peer = bench.load_benchmark(bench.find_benchmarks_dir() / "bench_peer.py")
    m = tiny_world.models
    for bf16, dtype, mixed in ((False, torch.float32, "no"), (True, torch.bfloat16, "bf16")):
        ours, trl, _, _ = peer.trainer_pair(m["student"], m["qwen2_teacher"], tiny_world.data_dir,
                                            tmp_path / str(bf16), 0.0, 8, True, bf16)
        assert trl.accelerator.mixed_precision == mixed
        assert next(iter(ours.teachers)).model.dtype == dtype and trl.teacher_model.dtype == torch.float32


@pytest.mark.extended
def test_peer_benchmark_runs_against_trl(tmp_path: Path) -> None:
    """`kvdistill bench --only peer` end to end: both trainers timed on one job (ratios), equal loss formulas."""
    pytest.importorskip("trl")
    out = tmp_path / "results"
    bench.main(["--only", "peer", "--quick", "--out", str(out)])
    res = json.loads((out / "peer.json").read_text())["result"]
    row = res["results"][0]
    assert res["ratio_vs_trl"] == max(row["ratio_vs_trl_offpolicy"], row["ratio_vs_trl_onpolicy"]) > 0
    assert row["formula_abs_diff_t1"] < 1e-6 and row["formula_abs_diff_t2_over_t2"] < 1e-6
