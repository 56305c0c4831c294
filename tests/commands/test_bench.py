"""`kvdistill bench`: discovery, import by path, JSON + README output, error handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
