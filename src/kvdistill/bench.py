"""`kvdistill bench`: run the repo's micro-benchmarks and write JSON + one Markdown summary.

Benchmarks live in the repository's `benchmarks/` directory (not in the wheel), one file per
benchmark, `benchmarks/bench_<name>.py`, each exposing::

    def run(quick: bool) -> dict:
        return {
            "results": [{"case": "...", "ms": 1.2, ...}, ...],  # rows of the Markdown table
            "ratio": 3.1, "target": 2.0, "passed": True,         # the headline check (optional)
            "title": "...", "description": "...",                 # optional text
        }

Each benchmark's output goes to `<out>/<name>.json`; `<out>/README.md` is rebuilt from *all*
JSON files in `<out>`, so `--only cka` refreshes one section and keeps the others.

Example:
    kvdistill bench --quick --only align,cka
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

BENCH_PREFIX = "bench_"
README_NAME = "README.md"


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


# --------------------------------------------------------------------------- running


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare timings: torch, threads, cores, date."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def run_benchmark(name: str, path: Path, quick: bool) -> dict[str, Any]:
    """Import and run one benchmark; an exception is recorded, not raised."""
    record: dict[str, Any] = {"benchmark": name, "file": str(path), "quick": quick}
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
    record["machine"] = machine_info()
    return record


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    return str(obj)


# --------------------------------------------------------------------------- Markdown


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0 or not math.isfinite(v):
            return str(v)
        return f"{v:.4g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.3e}"
    if isinstance(v, (list, tuple)):
        return "×".join(_fmt(x) for x in v)
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows (dicts) → a Markdown table; columns are the union of keys in first-seen order."""
    if not rows:
        return "_(no rows)_\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render_section(record: dict[str, Any]) -> str:
    name = record["benchmark"]
    res = record.get("result") or {}
    out = [f"## {res.get('title') or name}\n"]
    if res.get("description"):
        out.append(f"{res['description']}\n")
    if "error" in record:
        out.append(f"**Failed:** `{record['error']}`\n")
    else:
        out.append(markdown_table(list(res.get("results") or [])))
        headline = [f"{k}: **{_fmt(res[k])}**" for k in ("ratio", "target", "passed") if k in res]
        if headline:
            out.append("\n" + " · ".join(headline) + "\n")
        extra = {
            k: v
            for k, v in res.items()
            if k not in {"results", "ratio", "target", "passed", "title", "description"}
            and isinstance(v, (str, int, float, bool))
        }
        if extra:
            out.append("\n" + "\n".join(f"- {k}: {_fmt(v)}" for k, v in extra.items()) + "\n")
    m = record.get("machine", {})
    out.append(
        f"\n<sub>`bench_{name}.py` · quick={record.get('quick')} · {record.get('wall_s')} s · "
        f"torch {m.get('torch')} · {m.get('torch_threads')} threads / {m.get('cpu_count')} CPUs · "
        f"{m.get('processor')} · {m.get('date')}</sub>\n"
    )
    return "\n".join(out)


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
        "Timings depend on the machine noted under each table.\n",
    ]
    summary = [
        {
            "benchmark": r["benchmark"],
            "ratio": (r.get("result") or {}).get("ratio", ""),
            "target": (r.get("result") or {}).get("target", ""),
            "passed": "error" if "error" in r else (r.get("result") or {}).get("passed", ""),
            "quick": r.get("quick"),
            "date": (r.get("machine") or {}).get("date", ""),
        }
        for r in records
    ]
    lines.append(markdown_table(summary))
    lines += [render_section(r) for r in records]
    path = Path(out_dir) / README_NAME
    path.write_text("\n".join(lines))
    return path


# --------------------------------------------------------------------------- command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdistill bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only", default="", help="comma-separated benchmark names (e.g. align,cka,step); default all"
    )
    p.add_argument("--quick", action="store_true", help="small sizes / few repeats (seconds)")
    p.add_argument("--out", default=None, help="output directory (default: <benchmarks dir>/results)")
    p.add_argument("--benchmarks-dir", default=None, help="directory holding bench_*.py (default: found)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before running")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a benchmark misses its target")
    p.add_argument("--list", action="store_true", help="list the benchmarks found and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        bench_dir = Path(args.benchmarks_dir) if args.benchmarks_dir else find_benchmarks_dir()
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    found = discover(bench_dir)
    if args.list:
        print("\n".join(f"{n}\t{p}" for n, p in found.items()) or "(none)")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(found)
    unknown = [n for n in names if n not in found]
    if unknown or not names:
        print(
            f"error: unknown benchmark(s) {unknown} in {bench_dir}; available: {sorted(found)}",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.out) if args.out else bench_dir / "results"
    out_dir.mkdir(parents=True, exist_ok=True)

    rc = 0
    for name in names:
        print(f"[bench] {name} (quick={args.quick}) ...", flush=True)
        record = run_benchmark(name, found[name], args.quick)
        (out_dir / f"{name}.json").write_text(json.dumps(_jsonable(record), indent=2) + "\n")
        if "error" in record:
            print(record["traceback"], file=sys.stderr)
            print(f"[bench] {name}: FAILED {record['error']}")
            rc = 1
            continue
        res = record["result"]
        print(markdown_table(list(res.get("results") or [])))
        verdict = {k: res[k] for k in ("ratio", "target", "passed") if k in res}
        print(f"[bench] {name}: {verdict or 'done'} in {record['wall_s']} s")
        if args.fail_on_miss and res.get("passed") is False:
            rc = 1
    readme = write_readme(out_dir)
    print(f"[bench] wrote {out_dir}/<name>.json and {readme}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
