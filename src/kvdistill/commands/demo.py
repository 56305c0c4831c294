"""`kvdistill demo`: the whole method end to end on a laptop CPU, offline.

1. generate GSM8K-format arithmetic problems (`kvdistill gen-data`)
2. build a character-level tokenizer and three random-init models (two teachers of different
   architectures, one smaller student) and train the teachers (`kvdistill train`, kv_weight 0)
3. CKA layer maps student <- each teacher (`kvdistill layer-map`)
4. train the student twice from the same init and data order: SFT only, and SFT + multi-teacher
   KV distillation with full 4D alignment (`kvdistill train`)
5. evaluate everything (`kvdistill eval`) and write `report.md` + plots

The demo only picks tiny sizes: every step is a public command with a config from
`configs/demo/`, exactly what a GPU user runs with real model names. Finished steps are
skipped on a second run (teachers are cached in the output directory).
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdistill.config import option, parse_config
from kvdistill.data import format_example
from kvdistill.io import REPO_ROOT, write_text_atomic

CONFIG_DIR = REPO_ROOT / "configs" / "demo"

# architectures of the demo: teachers differ from the student (and each other) on L, H_kv, D
ARCHS = {
    "teacher_qwen2": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2)),   # L4, 2 x 32
    "teacher_llama": ("llama", dict(hidden_size=96, intermediate_size=256, num_hidden_layers=5,
                                    num_attention_heads=4, num_key_value_heads=4)),   # L5, 4 x 24
    "student": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1)),          # L2, 1 x 32
}
# (n_train, n_test, teacher steps, student steps, eval items)
SIZES = {"full": (4000, 400, 800, 500, 400), "quick": (600, 60, 40, 30, 60)}


def _log(msg: str) -> None:
    print(f"\n=== {msg}", flush=True)


def _run(command: str, *argv: str) -> None:
    """Run one public command in-process, exactly as `kvdistill COMMAND ...` would."""
    print(f"$ kvdistill {command} " + " ".join(argv), flush=True)
    rc = importlib.import_module(f"kvdistill.commands.{command.replace('-', '_')}").main(list(argv))
    if rc != 0:
        raise SystemExit(f"kvdistill {command} failed with exit code {rc}")


def config_path(name: str) -> Path:
    path = CONFIG_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"demo config {path} is missing (the demo runs from a source checkout)")
    return path


def build_models(out: Path, train_texts: list[str], seed: int = 0) -> dict[str, Path]:
    """A small BPE tokenizer (digits split into single tokens) and random-init models, saved."""
    from transformers import AutoConfig

    from kvdistill.models import build_tokenizer, save_random_model

    paths = {name: out / "init" / name for name in ARCHS}
    if all((p / "config.json").exists() for p in paths.values()):
        return paths
    tok = build_tokenizer(train_texts, vocab_size=384, split_digits=True)
    for i, (name, (model_type, sizes)) in enumerate(ARCHS.items()):
        cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), max_position_embeddings=512,
                                   tie_word_embeddings=True, **sizes)
        torch.manual_seed(seed + i)
        save_random_model(cfg, tok, paths[name])
    return paths


def _summary(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def write_report(out: Path, rows: list[dict]) -> Path:
    """`report.md` with the results table and the plots, plus `accuracy.png`."""
    from kvdistill.plots import plot_bars_with_errors

    plot_bars_with_errors(  # error bars: half the 95 % Wilson interval
        [r["model"] for r in rows], [r["accuracy"] for r in rows],
        [(r["ci_high"] - r["ci_low"]) / 2 for r in rows], out / "accuracy.png",
        ylabel="held-out accuracy", title="teachers vs students",
    )
    lines = [
        "# kvdistill demo report", "",
        "Held-out accuracy on generated multi-step arithmetic problems (greedy decoding, exact match",
        "of the final number), 95 % Wilson interval; `cos-sim` is the final student-vs-aligned-teacher",
        "key/value cosine similarity of the distillation run. All numbers are read from the eval files.", "",
        "| model | params | accuracy | 95 % CI | perplexity | final cos-sim |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cos = "" if r.get("cos_sim") is None else f"{r['cos_sim']:.3f}"
        ppl = "" if r.get("perplexity") is None else f"{r['perplexity']:.2f}"
        lines.append(f"| {r['model']} | {r['params']:,} | {r['accuracy']:.3f} | [{r['ci_low']:.3f}, "
                     f"{r['ci_high']:.3f}] | {ppl} | {cos} |")
    lines += ["", "![accuracy](accuracy.png)", ""]
    for png in sorted(out.glob("maps/*.png")):
        lines += [f"![CKA {png.stem}]({png.relative_to(out)})"]
    for run in ("student_sft", "student_kv"):
        for png in ("curves_loss.png", "curves_cos_sim.png", "cos_sim_layers.png"):
            if (out / "runs" / run / png).exists():
                lines.append(f"![{run} {png}](runs/{run}/{png})")
    return write_text_atomic(out / "report.md", "\n".join(lines) + "\n")


def run_demo(out: Path, quick: bool = False, seed: int = 0, threads: int | None = None) -> Path:
    """Run every stage (skipping finished ones) and return the report path."""
    if threads:
        torch.set_num_threads(threads)
    n_train, n_test, teacher_steps, student_steps, n_eval = SIZES["quick" if quick else "full"]
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"

    _log(f"[1/5] data: {n_train} train / {n_test} test problems -> {data}")
    if not (data / "test.jsonl").exists():
        _run("gen-data", "--output_dir", str(data), "--n-train", str(n_train), "--n-test", str(n_test),
             "--seed", str(seed), "--min-steps", "2", "--max-steps", "2", "--max-value", "20")
    train_texts = [format_example(json.loads(x)).text for x in (data / "train.jsonl").read_text().splitlines()]
    init = build_models(out, train_texts, seed)

    teachers = {}
    for i, name in enumerate(("teacher_qwen2", "teacher_llama")):
        _log(f"[2/5] teacher {i + 1}/2: {name} ({teacher_steps} steps, SFT)")
        teachers[name] = out / "teachers" / name
        if not (teachers[name] / "train_summary.json").exists():
            _run("train", "--config", str(config_path("teacher.yaml")), "--student", str(init[name]),
                 "--data", str(data), "--output_dir", str(teachers[name]), "--max_steps", str(teacher_steps),
                 "--seed", str(seed))

    _log("[3/5] CKA layer maps: student <- each teacher")
    maps = {}
    for name, path in teachers.items():
        maps[name] = out / "maps" / f"{name}.json"
        if not maps[name].exists():
            _run("layer-map", "--teacher", str(path), "--student", str(init["student"]), "--data", str(data),
                 "--samples", "32" if quick else "100", "--top-k", "2", "--max-length", "256",
                 "--output_file", str(maps[name]), "--no-progress")

    teacher_list = "[" + ", ".join(f"{{path: {p}, layer_map: {maps[n]}}}" for n, p in teachers.items()) + "]"
    students = {"student_sft": "student_sft.yaml", "student_kv": "student_kv.yaml"}
    for i, (name, cfg_name) in enumerate(students.items()):
        _log(f"[4/5] student {i + 1}/2: {name} ({student_steps} steps)")
        run = out / "runs" / name
        if not (run / "train_summary.json").exists():
            _run("train", "--config", str(config_path(cfg_name)), "--student", str(init["student"]),
                 "--teachers", teacher_list, "--data", str(data), "--output_dir", str(run),
                 "--max_steps", str(student_steps), "--seed", str(seed))

    _log(f"[5/5] evaluation on {n_eval} held-out problems")
    models = {**{n: teachers[n] for n in teachers}, **{n: out / "runs" / n for n in students}}
    rows = []
    for name, path in models.items():
        ev = out / "eval" / name
        if not (ev / "summary.json").exists():
            _run("eval", "--model", str(path), "--data", str(data), "--split", "test", "--limit", str(n_eval),
                 "--batch-size", "50", "--max-new-tokens", "48", "--max-length", "256", "--output_dir", str(ev),
                 "--no-progress")
        s = _summary(ev / "summary.json")
        final = _summary(path / "train_summary.json").get("final", {})
        rows.append({"model": name, "params": _params(path), "accuracy": s["accuracy"], "ci_low": s["ci_low"],
                     "ci_high": s["ci_high"], "perplexity": s.get("perplexity"),
                     "cos_sim": final.get("cos_sim") if name == "student_kv" else None})
    report = write_report(out, rows)
    print("\n" + report.read_text().split("\n\n![")[0])
    print(f"\nreport: {report}  ({time.time() - t0:.0f} s)")
    return report


def _params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)


@dataclass
class DemoConfig:
    """Options of `kvdistill demo`."""

    output_dir: str = option("outputs/demo", "Output directory.", aliases=["--out"])
    quick: bool = option(False, "~1-minute smoke version (tiny data and steps).")
    seed: int = option(0, "Seed of data, inits and training.")
    threads: int | None = option(None, "torch threads (default: torch's choice).")
    fresh: bool = option(False, "Delete the output directory first.")


def main(argv: list[str]) -> int:
    cfg = parse_config(DemoConfig, argv, "kvdistill demo", __doc__)
    out = Path(cfg.output_dir)
    if cfg.fresh and out.exists():
        shutil.rmtree(out)
    run_demo(out, quick=cfg.quick, seed=cfg.seed, threads=cfg.threads)
    return 0
