"""`kvdistill bench`: run the repo's micro-benchmarks and write JSON + one Markdown summary.

Benchmarks live in the repository's `benchmarks/` directory (not in the wheel), one file per
benchmark, `benchmarks/bench_<name>.py`, each exposing::

    def run(quick: bool) -> dict:
        return {
            "results": [{"case": "...", "ms": 1.2, ...}, ...],  # rows of the Markdown table
            "ratio": 3.1, "target": 2.0, "passed": True,         # the headline check (optional)
            "over_floor": 1.1,  # or "speedup": 3.1 -- what `ratio` is (see HEADLINES), optional
            "title": "...", "description": "...",                 # optional text
        }

`ratio` is the headline number, `target` its goal and `passed` whether it was met. A benchmark
that measures time against a floor (the work no implementation can skip) also stores the ratio
as `over_floor` (time / floor, lower is better, passed when <= target); one that measures a
speed-up against a slower way stores `speedup` (baseline / time, higher is better, passed when
>= target); `bench_logits` stores `mem_over_ce` (peak extra memory / CE alone's, lower is better).
The README names which one each headline is.

Each benchmark's output goes to `<out>/<name>.json`; `<out>/README.md` is rebuilt from *all*
JSON files in `<out>`, so `--only cka` refreshes one section and keeps the others.

`interleaved_times` is the timing loop the benchmarks share: cases alternate within every
repeat, so a machine that slows down mid-run slows all of them, and ratios are taken per repeat.

Example:
    kvdistill bench --quick --only align,cka
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvdistill.config import ConfigError, option, parse_config
from kvdistill.io import repo_relative, write_json_atomic, write_text_atomic
from kvdistill.malloc import keep_freed_memory
from kvdistill.report import environment, fmt_sig, markdown_table

BENCH_PREFIX = "bench_"
README_NAME = "README.md"
# headline keys: (comparison with the target, what the number is)
HEADLINES = {
    "over_floor": ("≤", "time / floor, lower is better"),
    "speedup": ("≥", "baseline time / time, higher is better"),
    # before ratio_vs_trl: a result holding both (bench_peer) is headlined by TRL's stable trainer
    "ratio_vs_trl_distillation": ("≤", "kvdistill on-policy step time / TRL DistillationTrainer's on the same job, "
                                  "lower is better"),
    "ratio_vs_trl": ("≤", "kvdistill step time / TRL's on the same job, lower is better"),
    "mem_over_ce": ("≤", "peak extra memory / CE alone's, lower is better"),
}


# --------------------------------------------------------------------------- discovery


def find_benchmarks_dir(start: Path | None = None) -> Path:
    """The repo's `benchmarks/` directory: walk up from `start`, the package source and the CWD.

    Benchmarks are not installed with the wheel, so from an installed package this only works
    when the CWD is inside a checkout; the error says so.
    """
    import kvdistill

    roots = [Path(start)] if start is not None else []
    roots += [Path(kvdistill.__file__).resolve().parent, Path.cwd().resolve()]
    tried: list[str] = []
    for root in roots:
        for d in [root, *root.parents]:
            cand = d / "benchmarks"
            tried.append(str(cand))
            if cand.is_dir() and any(cand.glob(f"{BENCH_PREFIX}*.py")):
                return cand
    raise FileNotFoundError(
        "no benchmarks/ directory with bench_*.py files found (benchmarks ship with the source "
        "checkout, not the wheel). Run from the repository, or pass --benchmarks-dir. Looked in: "
        + ", ".join(dict.fromkeys(tried[:6]))
        + (" ..." if len(tried) > 6 else "")
    )


def discover(bench_dir: Path) -> dict[str, Path]:
    """`{name: path}` for every `bench_<name>.py` in `bench_dir`, sorted by name."""
    return {p.stem[len(BENCH_PREFIX) :]: p for p in sorted(Path(bench_dir).glob(f"{BENCH_PREFIX}*.py"))}


def load_benchmark(path: Path) -> ModuleType:
    """Import one benchmark file by path (benchmarks/ is not a package)."""
    name = f"kvdistill_bench_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import benchmark {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses / pickling inside the benchmark need this
    spec.loader.exec_module(module)
    if not callable(getattr(module, "run", None)):
        raise AttributeError(f"{path} has no `run(quick: bool) -> dict`")
    return module


def run_standalone(run: Callable[..., dict], doc: str, quick_help: str) -> None:
    """A benchmark file run as a script (`python benchmarks/bench_<name>.py [--quick]`): its `run`'s
    dict as JSON on stdout, with the allocator settings every `kvdistill` process has."""
    keep_freed_memory()
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    json.dump(run(quick=parser.parse_args().quick), sys.stdout, indent=1)
    print()


# --------------------------------------------------------------------------- timing


@dataclass
class Timings:
    """Seconds per repeat of every case: wall clock, and this process's CPU time (user + system).

    On a CPU shared with other jobs the wall clock also counts the time the process waits for a
    core; its CPU time does not, so `cpu` ratios stay meaningful there (not on CUDA, where the
    work is on the GPU).
    """

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def ms(self, case: str, clock: str = "wall") -> float:
        """Median milliseconds of `case`."""
        return statistics.median(getattr(self, clock)[case]) * 1e3

    def ratio(self, case: str, base: str, clock: str = "wall") -> float:
        """Median over repeats of `case / base`, each repeat's pair measured back to back."""
        times = getattr(self, clock)
        return statistics.median(a / b for a, b in zip(times[case], times[base]))


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block at `n` torch threads (a benchmark's numbers must not depend on free cores), then
    restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def interleaved_times(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    warmup: int = 1,
    device: torch.device | str = "cpu",
    setup: Callable[[], None] | None = None,
) -> Timings:
    """Time every case of `fns` `repeats` times, interleaved (A, B, A, B, ...; order reversed every
    other repeat), after `warmup` untimed rounds; `setup()` runs untimed before each call."""
    device = torch.device(device)
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            if setup:
                setup()
            fns[n]()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names if r % 2 == 0 else names[::-1]:
            if setup:
                setup()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            fns[n]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    return Timings(wall, cpu)


# --------------------------------------------------------------------------- running


def run_benchmark(name: str, path: Path, quick: bool) -> dict[str, Any]:
    """Import and run one benchmark; an exception is recorded, not raised."""
    record: dict[str, Any] = {"benchmark": name, "file": repo_relative(path), "quick": quick}
    load = os.getloadavg()[0]  # other jobs on the machine: a loaded one slows every wall time
    t0 = time.perf_counter()
    try:
        result = load_benchmark(path).run(quick=quick)
        if not isinstance(result, dict):
            raise TypeError(f"run() returned {type(result).__name__}, expected dict")
        record["result"] = result
    except Exception as exc:  # one broken benchmark must not hide the others' numbers
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    record["wall_s"] = round(time.perf_counter() - t0, 3)
    record["machine"] = environment()
    record["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # 1-min, before and after
    return record


# --------------------------------------------------------------------------- Markdown


def _cell(v: Any) -> str:
    if isinstance(v, (list, tuple)):  # shapes
        return "×".join(_cell(x) for x in v)
    return fmt_sig(v, 4)


def rows_table(rows: list[dict[str, Any]]) -> str:
    """Rows (dicts) → a Markdown table; columns are the union of keys in first-seen order."""
    if not rows:
        return "_(no rows)_\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return markdown_table(cols, [[_cell(r.get(c, "")) for c in cols] for r in rows])


def headline(res: dict[str, Any]) -> tuple[str, str, str] | None:
    """`(key, comparison, meaning)` of a result's headline (`over_floor` or `speedup`), or None."""
    key = next((k for k in HEADLINES if k in res), None)
    return None if key is None else (key, *HEADLINES[key])


def headline_line(res: dict[str, Any]) -> str:
    """`over_floor: **1.2** (time / floor, lower is better) · target: **≤ 1.3** · passed: **yes**`."""
    head = headline(res)
    if head is None:  # a plain ratio
        return " · ".join(f"{k}: **{_cell(res[k])}**" for k in ("ratio", "target", "passed") if k in res)
    key, op, meaning = head
    parts = [f"{key}: **{_cell(res[key])}** ({meaning})"]
    if "target" in res:
        parts.append(f"target: **{op} {_cell(res['target'])}**")
    if "passed" in res:
        parts.append(f"passed: **{_cell(res['passed'])}**")
    return " · ".join(parts)


def render_section(record: dict[str, Any]) -> str:
    name = record["benchmark"]
    res = record.get("result") or {}
    out = [f"## {res.get('title') or name}\n"]
    if res.get("description"):
        out.append(f"{res['description']}\n")
    if "error" in record:
        out.append(f"**Failed:** `{record['error']}`\n")
    else:
        out.append(rows_table(list(res.get("results") or [])))
        line = headline_line(res)
        if line:
            out.append("\n" + line + "\n")
        shown = {"results", "ratio", "target", "passed", "title", "description", *HEADLINES}
        extra = {k: v for k, v in res.items() if k not in shown and isinstance(v, (str, int, float, bool))}
        if extra:
            out.append("\n" + "\n".join(f"- {k}: {_cell(v)}" for k, v in extra.items()) + "\n")
    m = record.get("machine", {})
    load = record.get("load_average")
    load = f" · load average {load[0]} → {load[1]}" if load else ""
    out.append(
        f"\n<sub>`bench_{name}.py` · quick={record.get('quick')} · {record.get('wall_s')} s · "
        f"torch {m.get('torch')} · {m.get('torch_threads')} threads / {m.get('cpu_count')} CPUs{load} · "
        f"allocator {m.get('allocator')} · {m.get('processor')} · {m.get('date')}</sub>\n"
    )
    return "\n".join(out)


def summary_row(record: dict[str, Any]) -> dict[str, Any]:
    """One benchmark's line of the README summary: its headline against its target."""
    res = record.get("result") or {}
    head = headline(res)
    key, op = (head[0], head[1]) if head else ("ratio", "")
    target = res.get("target", "")
    return {
        "benchmark": record["benchmark"],
        "headline": key,
        "value": res.get(key, ""),
        "target": f"{op} {_cell(target)}".strip() if target != "" else "",
        "passed": "error" if "error" in record else res.get("passed", ""),
        "quick": record.get("quick"),
        "date": (record.get("machine") or {}).get("date", ""),
    }


def write_readme(out_dir: Path) -> Path:
    """Rebuild `<out>/README.md` from every benchmark JSON in `out_dir`."""
    records = []
    for p in sorted(Path(out_dir).glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and "benchmark" in rec:
            records.append(rec)
    lines = [
        "# Benchmarks\n",
        "Written by `kvdistill bench`; each section comes from `<name>.json` next to this file. "
        "Timings depend on the machine noted under each table (and on other jobs: its load average). "
        "`over_floor` = time / floor, the floor being the work no implementation can skip (lower "
        "is better); `speedup` = baseline time / time (higher is better).\n",
    ]
    lines.append(rows_table([summary_row(r) for r in records]))
    lines += [render_section(r) for r in records]
    return write_text_atomic(Path(out_dir) / README_NAME, "\n".join(lines))


# --------------------------------------------------------------------------- command


@dataclass
class BenchConfig:
    """Options of `kvdistill bench`."""

    only: str = option("", "Comma-separated benchmark names (e.g. align,cka,step); default all.")
    quick: bool = option(False, "Small sizes / few repeats (seconds).")
    output_dir: str | None = option(None, "Output directory (default: <benchmarks dir>/results).", aliases=["--out"])
    benchmarks_dir: str | None = option(None, "Directory holding bench_*.py (default: found from the checkout).")
    threads: int | None = option(None, "torch.set_num_threads before running (recorded with every result).")
    fail_on_miss: bool = option(False, "Exit 1 when a benchmark misses its target.")
    list: bool = option(False, "List the benchmarks found and exit.")


def main(argv: list[str] | None = None) -> int:
    args = parse_config(BenchConfig, argv, "kvdistill bench", __doc__)
    try:
        bench_dir = Path(args.benchmarks_dir) if args.benchmarks_dir else find_benchmarks_dir()
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    found = discover(bench_dir)
    if args.list:
        print("\n".join(f"{n}\t{p}" for n, p in found.items()) or "(none)")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(found)
    unknown = [n for n in names if n not in found]
    if unknown or not names:
        raise ConfigError(f"unknown benchmark(s) {unknown} in {bench_dir}; available: {sorted(found)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.output_dir) if args.output_dir else bench_dir / "results"
    out_dir.mkdir(parents=True, exist_ok=True)

    rc = 0
    for name in names:
        print(f"[bench] {name} (quick={args.quick}) ...", flush=True)
        record = run_benchmark(name, found[name], args.quick)
        write_json_atomic(out_dir / f"{name}.json", record, indent=2)
        if "error" in record:
            print(record["traceback"], file=sys.stderr)
            print(f"[bench] {name}: FAILED {record['error']}")
            rc = 1
            continue
        res = record["result"]
        print(rows_table(list(res.get("results") or [])))
        print(f"[bench] {name}: {headline_line(res) or 'done'} in {record['wall_s']} s")
        if args.fail_on_miss and res.get("passed") is False:
            rc = 1
    readme = write_readme(out_dir)
    print(f"[bench] wrote {out_dir}/<name>.json and {readme}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
