"""`kvdistill probe`: where a model's cache carries a fact about a token (linear probes per layer).

For each model (and, with `--untrained`, a seeded random-init copy of the same config, the reference
row), runs `--samples` records of `--data`, keeps the tokens `--rows` selects that have a `--target`,
and fits a ridge probe per layer from the pre-RoPE key, the cached (post-RoPE) key, the value and the
hidden state (`kvdistill.lab.probe`), trained on one set of items and scored on held-out items. Each
cell gets the majority-class (or train-mean) baseline and a shuffled-label control beside it.

Writes `probe.json` (every model x kind x layer: score, baseline, shuffled control, chosen ridge
strength, row counts, per-KV-head scores; provenance) and `probe.png` (heatmap: a row per model and
kind, a column per layer), and prints a table.

Example:
    kvdistill probe --model runs/teacher_qwen2 runs/teacher_llama --untrained --data data --split dev \\
        --target number_value --rows results --samples 300 --output_dir probes/numbers
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdistill.config import ConfigError, as_list, check_choice, check_output_dir, option, parse_config
from kvdistill.data import DEFAULT_TEMPLATE, DataError
from kvdistill.lab.probe import (
    KINDS,
    LAMBDAS,
    READOUTS,
    collect_rows,
    parse_rows,
    parse_target,
    probe_rows,
)
from kvdistill.runs import resolve_model

FORMAT = "kvdistill-probe/1"


@dataclass
class ProbeConfig:
    """Options of `kvdistill probe`."""

    model: list[str] | None = option(None, "One or more models: local dirs (e.g. a teacher's run dir) or Hub ids. "
                                     "Required.")
    data: str = option("synthetic", "Hub id, local jsonl/json/parquet file or dir, or 'synthetic'.")
    split: str = option("test", "Dataset split.")
    field_map: str | None = option(None, 'Column map: a name (gsm8k, svamp, math) or {"question": col, "answer": col}.')
    target: str = option("next_answer_token", "What the probe reads out at each token: next_answer_token (the next "
                         "token's id where it is part of the final answer), number_value (the integer value of the "
                         "number the token is part of), or field:<name> (a per-token field of the data).")
    rows: str = option("all", "Which tokens are probed: all | prompt | reasoning | answer | results (numbers "
                       "written right after '=' or '####') | field:<name> (tokens where that field is non-zero).")
    readout: str = option("classification", f"{READOUTS}: accuracy of a one-hot ridge probe over the classes seen "
                          "in training, or R² of a ridge regression (number_value and field targets only).")
    kinds: list[str] = option(list(KINDS), f"Features to probe, any of {KINDS}: pre-RoPE key, cached key, value, "
                              "layer output.")
    samples: int = option(300, "Records to read, drawn with --seed.")
    train_fraction: float = option(0.7, "Fraction of the records (items, never tokens) whose rows train the probes; "
                                   "the others' rows score them.")
    untrained: bool = option(False, "Also probe a random-init copy of each model's config (seeded by --seed and the "
                             "model's name): the reference row a trained model must beat.")
    output_dir: str | None = option(None, "Directory for probe.json and probe.png. Required.", aliases=["--out"])
    batch_size: int = option(8, "Records per forward pass.")
    max_length: int = option(512, "Tokens per record.")
    template: str = option(DEFAULT_TEMPLATE, "Prompt template with {question} (as in training).")
    chat_template: bool = option(False, "Format prompts with the tokenizer's chat template.")
    dtype: str = option("auto", "Model dtype: auto | fp32 | bf16 | fp16 (features are probed in float64).")
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda if available).")
    seed: int = option(0, "Which records are read, the item split, the ridge-strength split, the shuffled labels and "
                       "the untrained copies' weights.")
    no_progress: bool = option(False, "No progress bar.")

    def __post_init__(self) -> None:
        self.model, self.kinds = as_list(self.model), as_list(self.kinds)
        if not self.model or not self.output_dir:
            raise ConfigError("pass --model (one or more model dirs or Hub ids) and --output_dir DIR")
        for name, parse in (("target", parse_target), ("rows", parse_rows)):
            try:
                parse(getattr(self, name))
            except ValueError as err:
                raise ConfigError(f"--{name}: {err}") from None
        check_choice("readout", self.readout, READOUTS)
        if self.readout == "regression" and self.target == "next_answer_token":
            raise ConfigError("--target next_answer_token is a token id, not a quantity: use --readout classification")
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds:
            raise ConfigError(f"--kinds {unknown or self.kinds} : each kind must be one of {KINDS}")
        if self.samples < 3 or self.batch_size < 1 or self.max_length < 2:
            raise ConfigError("--samples must be >= 3 (two train items and one test item), --batch_size >= 1, "
                              "--max_length >= 2")
        if not 0 < self.train_fraction < 1:
            raise ConfigError(f"--train_fraction must be in (0, 1), got {self.train_fraction}")


def model_cells(name: str, result: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """`probe_rows`' result as one JSON cell per kind x layer."""
    cells = []
    for kind, res in result.items():
        for layer in range(res["score"].numel()):
            cell = {"model": name, "kind": kind, "layer": layer, "score": res["score"][layer].item(),
                    "baseline": res["baseline"], "shuffled": res["shuffled"][layer].item(),
                    "lambda": res["lambda"][layer].item(),
                    **{k: res[k] for k in ("n_train", "n_test", "n_train_items", "n_test_items")}}
            if "heads" in res:
                cell["heads"] = {k: res["heads"][k][layer].tolist() for k in ("score", "shuffled")}
            cells.append(cell)
    return cells


def plot_probe(cells: Sequence[dict[str, Any]], path: Path, *, title: str, metric: str) -> Path:
    """Heatmap of held-out scores: a row per model x kind (labelled with its baseline and best shuffled
    control), a column per layer; blank where a model has fewer layers."""
    import numpy as np

    from kvdistill.plots import plt, save_figure

    rows = list(dict.fromkeys((c["model"], c["kind"]) for c in cells))
    n_layers = max(c["layer"] for c in cells) + 1
    S = np.full((len(rows), n_layers), np.nan)
    labels = []
    for r, key in enumerate(rows):
        mine = [c for c in cells if (c["model"], c["kind"]) == key]
        for c in mine:
            S[r, c["layer"]] = c["score"]
        shuffled = max(c["shuffled"] for c in mine)
        labels.append(f"{key[0]} · {key[1]}  (base {mine[0]['baseline']:.2f}, shuffled ≤ {shuffled:.2f})")
    width = 2.0 + 0.06 * max(map(len, labels)) + 0.7 * n_layers  # the row labels, the cells, the colourbar
    fig, ax = plt.subplots(figsize=(min(width, 20), min(max(3.0, 1.4 + 0.35 * len(rows)), 16)), layout="constrained")
    vmin = min(0.0, float(np.nanmin(S)))
    im = ax.imshow(S, aspect="auto", cmap="viridis", vmin=vmin, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, label=f"held-out {metric}")
    for (r, c), v in np.ndenumerate(S):
        if not math.isnan(v):
            ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if v < vmin + 0.6 * (1 - vmin) else "black")
    ax.set_xticks(range(n_layers))
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("layer")
    for r in range(1, len(rows)):  # a line between models
        if rows[r][0] != rows[r - 1][0]:
            ax.axhline(r - 0.5, color="white", linewidth=2)
    ax.set_title(title, fontsize="medium", wrap=True)
    return save_figure(fig, path)


def _short_name(path: str, taken: set[str]) -> str:
    name = Path(str(path).rstrip("/")).name or str(path)
    while name in taken:
        name += "'"
    taken.add(name)
    return name


def main(argv: list[str]) -> int:
    from kvdistill.data import load_records
    from kvdistill.io import write_json_atomic
    from kvdistill.models import (
        check_length,
        check_vocab,
        config_hash,
        load_model,
        load_tokenizer,
        resolve_device,
        untrained_copy,
    )
    from kvdistill.report import environment

    a = parse_config(ProbeConfig, argv, "kvdistill probe", __doc__)
    out = check_output_dir(a.output_dir, "--output_dir")
    device = resolve_device(a.device)
    records = load_records(a.data, split=a.split, field_map=a.field_map)
    records = [records[i] for i in sorted(random.Random(a.seed).sample(range(len(records)), min(a.samples, len(records))))]
    classification = a.readout == "classification"
    metric = "accuracy" if classification else "R²"
    models, cells, taken = [], [], set()
    for path in a.model:
        found = resolve_model(path, "probing")  # a run: its final model or newest complete checkpoint
        model, tok = load_model(found, dtype=a.dtype, device=device), load_tokenizer(found)
        check_vocab(model, tok, path)
        check_length(model, a.max_length, path, f"--max_length {a.max_length}", "lower --max_length")
        name = _short_name(path, taken)
        variants = [(name, model, False)]
        if a.untrained:
            variants.append((f"{name} (untrained)", untrained_copy(model, name, a.seed).to(model.device), True))
        for label, m, untrained in variants:
            rows = collect_rows(m, tok, records, a.target, a.rows, kinds=a.kinds, batch_size=a.batch_size,
                                max_length=a.max_length, template=a.template, use_chat_template=a.chat_template,
                                progress=False if a.no_progress else None, desc=f"probe {label}")
            try:
                result = probe_rows(rows, a.train_fraction, classification=classification, seed=a.seed)
            except ValueError as err:
                raise DataError(f"{label}: too few rows to fit at --target {a.target} --rows {a.rows} ({err}); "
                                "raise --samples or choose --rows that select more tokens") from None
            first = next(iter(result.values()))
            models.append({"name": label, "path": str(path), "untrained": untrained, "config_hash": config_hash(m),
                           "layers": first["score"].numel(), "baseline": first["baseline"],
                           **{k: first[k] for k in ("n_train", "n_test", "n_train_items", "n_test_items")}})
            cells += model_cells(label, result)
        del model, variants
    title = f"linear probe of {a.target} at {a.rows} rows\nheld-out {metric}, {len(records)} records of {a.split}, seed {a.seed}"
    png = plot_probe(cells, out / "probe.png", title=title, metric=metric)
    write_json_atomic(out / "probe.json", {
        "format": FORMAT, "target": a.target, "rows": a.rows, "readout": a.readout, "metric": metric,
        "models": models, "cells": cells,
        "provenance": {"data": a.data, "split": a.split, "samples": len(records), "train_fraction": a.train_fraction,
                       "seed": a.seed, "kinds": a.kinds, "max_length": a.max_length, "template": a.template,
                       "chat_template": a.chat_template, "dtype": a.dtype, "lambdas": list(LAMBDAS),
                       "probe": "ridge (one-hot classes for classification), lambda per layer on an inner item "
                                "split, features standardised on the train rows",
                       "environment": environment()},
    })
    print(f"{out / 'probe.json'} (+ {png.name}): {a.target} at {a.rows} rows, held-out {metric}")
    for m in models:
        print(f"  {m['name']}: {m['n_train']} train / {m['n_test']} test rows, baseline {m['baseline']:.3f}")
        for kind in a.kinds:
            mine = [c for c in cells if c["model"] == m["name"] and c["kind"] == kind]
            scores = " ".join(f"{c['score']:.3f}" for c in mine)
            print(f"    {kind:<7} {scores}   shuffled ≤ {max(c['shuffled'] for c in mine):.3f}")
    return 0
