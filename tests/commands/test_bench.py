"""`kvdistill bench`: discovery, import by path, JSON + README output, error handling."""

from __future__ import annotations

import json
import os
import shutil
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
    cases = [r["case"] for r in res["results"]]
    if name == "align":
        assert res["max_abs_diff_fused_vs_plain"] < 1e-6 and res["max_abs_grad_diff"] < 1e-6
        assert res["max_abs_diff_fused_vs_naive"] < 1e-5
        assert "stage: backward (fused - fused forward)" in cases and cases[3].startswith("floor")
        # the real pair's shapes (random tensors: no models needed), held to the same target
        assert cases[4:6] == ["real pair shapes: KVAligner + loss (fused)", "real pair shapes: floor"]
        assert res["real_pair_over_floor"] == res["results"][4]["over_floor"] > 1.0
        assert "teacher 18x2x1x56x256, student 30x2x3x64x64" in res["description"]
        assert res["passed"] == (res["over_floor"] <= 1.3 and res["real_pair_over_floor"] <= 1.3)
    else:
        assert res["passed"] == (res["over_floor"] <= 1.3)
        assert res["max_abs_diff_pairwise_vs_batched"] < 1e-6 and cases[1].startswith("floor")
    assert f"over_floor: **{bench._cell(res['over_floor'])}**" in (out / "README.md").read_text()


def _quick_result(name: str, out: Path, benchmarks_dir: Path | None = None) -> dict:
    """`kvdistill bench --only <name> --quick`'s result; the benchmark must not have failed."""
    where = ["--benchmarks-dir", str(benchmarks_dir)] if benchmarks_dir else []
    bench.main(["--only", name, "--quick", "--out", str(out), *where])
    rec = json.loads((out / f"{name}.json").read_text())
    assert "error" not in rec, rec.get("traceback")
    return rec["result"]


@pytest.fixture
def real_pair_benchmarks():
    """The repository's benchmarks where models/real holds the real pair; skipped without it (failed under
    KVDISTILL_REQUIRE_REAL_PAIR=1, as the real pair's tests)."""
    bench_dir = bench.find_benchmarks_dir()
    if bench.load_benchmark(bench_dir / "bench_step.py").real_pair_dirs() is None:
        if os.environ.get("KVDISTILL_REQUIRE_REAL_PAIR") == "1":
            pytest.fail("models/real has no real pair; run scripts/real_pair.sh")
        pytest.skip("models/real has no real pair (scripts/real_pair.sh)")
    return bench_dir


def test_capture_benchmark_quick_run(tmp_path: Path) -> None:
    """Live teachers vs a real `kvdistill capture` read by the trainer, one short epoch each; from a copy of the
    benchmarks with no models/real beside it, so the real pair's row says how to get it."""
    copy = tmp_path / "checkout" / "benchmarks"
    copy.mkdir(parents=True)
    for name in ("bench_capture.py", "bench_step.py"):  # bench_capture reads bench_step's pairs
        shutil.copy(bench.find_benchmarks_dir() / name, copy)
    out = tmp_path / "results"
    res = _quick_result("capture", out, copy)
    assert res["ratio"] == res["speedup"] > 0 and res["passed"] == (res["speedup"] >= 3.0)
    one, two, real = res["results"]
    assert one["teachers_x"] < two["teachers_x"] and one["steps"] == two["steps"] == 4
    assert one["capture_mib"] > 0 and two["capture_mib"] > one["capture_mib"]  # two teachers stored
    assert two["share_of_bound"] > 0
    assert two["share_of_bound"] == pytest.approx(two["speedup"] / two["bound"])  # one repeat: the same ratio
    assert real == {"case": "real pair: Gemma-3-270m -> SmolLM2-135M", "skipped": "skipped: run scripts/real_pair.sh"}
    assert res["real_pair_share_of_bound"] is None and res["real_pair_speedup"] is None
    assert res["share_of_bound_target"] == 0.85
    assert "| capture | speedup |" in (out / "README.md").read_text()


@pytest.mark.real
@pytest.mark.extended
def test_capture_benchmark_real_pair(real_pair_benchmarks, tmp_path: Path) -> None:
    """The real pair's rows: its epochs from a capture vs live, and the bytes per token of captures written by
    `run_capture` with each setting, against the cache's size (2 x L x H_kv x D values a token)."""
    res = _quick_result("capture", tmp_path / "results")
    rows = {r["case"]: r for r in res["results"]}
    real = rows["real pair: Gemma-3-270m -> SmolLM2-135M"]
    assert real["teachers_x"] == pytest.approx(2.0, abs=0.05) and real["steps"] == 2
    assert res["real_pair_speedup"] == real["speedup"] > 0 and res["real_pair_share_of_bound"] == real["share_of_bound"]
    assert res["passed"] == (res["speedup"] >= 3.0 and real["share_of_bound"] >= 0.85)
    cfg = json.loads((real_pair_benchmarks.parent / "models/real/gemma-3-270m/config.json").read_text())
    values = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]  # 9,216
    fp32 = rows["real pair capture, fp32"]["bytes_per_token"]
    assert res["real_pair_fp32_bytes_per_token"] == fp32 and 4 * values <= fp32 < 4 * values * 1.01  # + segment ids
    share = {case.removeprefix("real pair capture, "): r["of_fp32"] for case, r in rows.items() if "of_fp32" in r}
    assert share["bf16"] == pytest.approx(0.5, rel=0.01)
    assert share["capture_layers mapped, proportional map"] == 1.0  # 30 student layers read all 18
    assert share["capture_layers mapped, layer_map last_k 6"] == pytest.approx(6 / 18, rel=0.01)
    assert 0.5 < share["capture_keep 0.5"] < 1  # half the rationale; prompt and answer are kept whole


@pytest.mark.real
@pytest.mark.extended
def test_step_benchmark_real_pair(real_pair_benchmarks, tmp_path: Path) -> None:
    """The real pair's step against its floor (teacher forward + student CE step), held to the same target."""
    res = _quick_result("step", tmp_path / "results")
    real = res["results"][3]
    assert real["case"] == "real pair: Gemma-3-270m -> SmolLM2-135M" and real["student_M"] == pytest.approx(134.5, abs=1)
    assert res["real_pair_over_floor"] == real["ratio"] > 1.0
    assert res["passed"] == (res["over_floor"] <= 1.1 and res["real_pair_over_floor"] <= 1.1)


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
    """TRL's GKDTrainer and DistillationTrainer and kvdistill's trainer (logit-only generalized JSD) on the same
    tensors and weights: the same loss, and the same formula at loss temperature 2 once kvdistill's T^2 is
    divided out (CI installs the `[peer]` extra; untimed: `bench peer` times the steps)."""
    pytest.importorskip("trl")
    peer = bench.load_benchmark(bench.find_benchmarks_dir() / "bench_peer.py")
    m = tiny_world.models
    ours, trl, gold, _, given, _ = peer.build_job(m["student"], m["qwen2_teacher"], tiny_world.data_dir, tmp_path,
                                                  torch.device("cpu"), 8)
    res = peer.fixed_batch_losses(ours, trl, gold, given)
    assert res["loss_kvdistill"] > 1e-3  # a real JSD between two different models, not 0 == 0
    assert res["loss_abs_diff_gkd"] <= peer.LOSS_ATOL and res["loss_abs_diff_distillation"] <= peer.LOSS_ATOL
    for k in ("gkd_t1", "distillation_t1", "gkd_t2_over_t2", "distillation_t2_over_t2"):
        assert res[f"formula_abs_diff_{k}"] < 1e-6, k


def test_peer_trainers_share_the_job_settings(tiny_world, tmp_path: Path) -> None:
    """TRL's defaults that differ from kvdistill's (bf16, which autocasts the teacher; gradient checkpointing,
    which turns off the KV cache of GKD's generation; DistillationConfig's beta 1) are set to the job's on
    every TRL trainer, and every trainer sees the same teacher in fp32."""
    pytest.importorskip("trl")
    peer = bench.load_benchmark(bench.find_benchmarks_dir() / "bench_peer.py")
    m = tiny_world.models
    ours, trl, _, _, _, _ = peer.build_job(m["student"], m["qwen2_teacher"], tiny_world.data_dir, tmp_path,
                                           torch.device("cpu"), 8)
    assert set(trl) == {"gkd_0", "gkd_1", "distillation"}
    for t in trl.values():
        assert t.accelerator.mixed_precision == "no" and not t.args.gradient_checkpointing
        assert t.args.beta == peer.BETA and t.teacher_model.dtype == torch.float32
    assert next(iter(ours.teachers)).model.dtype == torch.float32 and not ours.args.gradient_checkpointing
    assert (trl["gkd_0"].args.lmbda, trl["gkd_1"].args.lmbda) == (0.0, 1.0)


@pytest.mark.extended
def test_peer_benchmark_runs_against_trl(tmp_path: Path) -> None:
    """`kvdistill bench --only peer` end to end: both trainers timed on one job (ratios), equal loss formulas."""
    pytest.importorskip("trl")
    out = tmp_path / "results"
    bench.main(["--only", "peer", "--quick", "--out", str(out)])
    res = json.loads((out / "peer.json").read_text())["result"]
    row = res["results"][0]
    assert res["ratio_vs_trl_distillation"] == row["ratio_vs_trl_distillation"] > 0
    assert res["ratio_vs_trl"] == max(row["ratio_vs_trl_gkd_offpolicy"], row["ratio_vs_trl_gkd_onpolicy"]) > 0
    assert row["formula_abs_diff_distillation_t1"] < 1e-6 and row["formula_abs_diff_gkd_t2_over_t2"] < 1e-6
