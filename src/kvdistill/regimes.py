"""The evidence regimes' assets (issue 31, docs/tasks.md): a task's data splits, and the tokenizers and
random-init models a `models.json` names (`configs/demo/binding/`, `configs/demo/modular/`).

`models.json` holds `tokenizers` (`name -> keyword arguments of models.build_tokenizer`, e.g.
`{"vocab_size": 384, "numbers_whole": 59}`) and `models` (`name -> {model_type, tokenizer,
tie_word_embeddings, data, sizes}`: `data` is the split the model trains on, `sizes` go to
`AutoConfig.for_model` beside `vocab_size` and `max_position_embeddings`). `build_models` trains each
tokenizer once on the texts of `teacher_pool` and saves every model, seeded, with its tokenizer: the
same files whoever builds them (the demo, an ablation, a scratch script).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvdistill.config import ConfigError
from kvdistill.data import format_example
from kvdistill.io import read_json, read_jsonl, write_json_atomic
from kvdistill.models import build_tokenizer, save_random_model
from kvdistill.synthetic import write_jsonl
from kvdistill.tasks import binding, modular

SPLIT_MAKERS = {"binding": binding.make_splits, "modular": modular.make_splits}  # task -> make_splits(**knobs)
TOKENIZER_TEXTS = 4000  # teacher_pool records the tokenizers learn from
MAX_POSITIONS = 256  # default max_position_embeddings (a model's `sizes` may set its own)
MODEL_KEYS = ("model_type", "tokenizer", "tie_word_embeddings", "data", "sizes")
SAVED_SPEC = "models.json"  # beside the built models: what they were built from (reuse check)


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # an AutoConfig model type: qwen2, llama, ...
    tokenizer: str  # a key of `tokenizers`
    tie_word_embeddings: bool
    data: str  # the split it trains on
    sizes: dict[str, Any]  # hidden_size, num_hidden_layers, ... (AutoConfig keyword arguments)


@dataclass(frozen=True)
class Models:
    tokenizers: dict[str, dict[str, Any]]  # name -> build_tokenizer keyword arguments
    models: dict[str, ModelSpec]


def read_models(path: str | Path) -> Models:
    """`models.json` at `path`, checked: a `ConfigError` naming the key and the fix on any defect."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a regime needs its models.json (tokenizers and model shapes; "
                          "configs/demo/binding/models.json is an example)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not JSON ({err}); fix the file") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tokenizers"), dict) or not isinstance(raw.get("models"), dict):
        raise ConfigError(f"{path} needs two objects, tokenizers (name -> build_tokenizer options) and models "
                          "(name -> model_type, tokenizer, tie_word_embeddings, data, sizes)")
    allowed = set(inspect.signature(build_tokenizer).parameters) - {"texts"}
    for name, opts in raw["tokenizers"].items():
        if not isinstance(opts, dict) or set(opts) - allowed or "vocab_size" not in opts:
            raise ConfigError(f"{path}: tokenizer {name}: needs vocab_size, and its options must be among "
                              f"{sorted(allowed)}; got {opts}")
    models = {}
    for name, m in raw["models"].items():
        if not isinstance(m, dict) or set(m) != set(MODEL_KEYS):
            raise ConfigError(f"{path}: model {name} needs exactly the keys {list(MODEL_KEYS)}, got "
                              f"{sorted(m) if isinstance(m, dict) else m}")
        if m["tokenizer"] not in raw["tokenizers"]:
            raise ConfigError(f"{path}: model {name} names tokenizer {m['tokenizer']!r}, not one of "
                              f"{sorted(raw['tokenizers'])}")
        if not isinstance(m["tie_word_embeddings"], bool) or not isinstance(m["sizes"], dict):
            raise ConfigError(f"{path}: model {name}: tie_word_embeddings must be true or false and sizes an object")
        models[name] = ModelSpec(**m)
    if not models:
        raise ConfigError(f"{path} names no model")
    return Models(raw["tokenizers"], models)


def build_models(spec_path: str | Path, data: str | Path, out: str | Path, seed: int = 0) -> dict[str, Path]:
    """The tokenizers and random-init models of `spec_path` (a models.json), saved at `out/<name>`.

    Tokenizers learn from the first `TOKENIZER_TEXTS` records of `data/teacher_pool.jsonl` (models naming
    the same tokenizer share it); model `i` (in the file's order) is seeded `seed + i`. Models already built
    from the same file and seed are reused; built from another, a `ConfigError` says what to delete.
    """
    spec, out = read_models(spec_path), Path(out)
    paths = {name: out / name for name in spec.models}
    made_from = {"seed": seed, "tokenizers": spec.tokenizers,
                 "models": {n: vars(m) for n, m in spec.models.items()}}
    saved = read_json(out / SAVED_SPEC)
    if saved is not None and saved != made_from:
        raise ConfigError(f"{out} holds models built from another models.json or seed than {spec_path} (seed "
                          f"{seed}); delete {out} to rebuild them")
    if saved is not None and all((p / "config.json").exists() for p in paths.values()):
        return paths
    records = read_jsonl(Path(data) / "teacher_pool.jsonl")[:TOKENIZER_TEXTS]
    if not records:
        raise ConfigError(f"no records in {Path(data) / 'teacher_pool.jsonl'}: the tokenizers learn from the "
                          "teacher pool; write the data first (`kvdistill gen-data --task binding|modular`)")
    texts = [format_example(r).text for r in records]
    toks = {name: build_tokenizer(texts, **opts) for name, opts in spec.tokenizers.items()}

    from transformers import AutoConfig

    for i, (name, m) in enumerate(spec.models.items()):
        cfg = AutoConfig.for_model(m.model_type, vocab_size=len(toks[m.tokenizer]), tie_word_embeddings=m.tie_word_embeddings,
                                   **{"max_position_embeddings": MAX_POSITIONS, **m.sizes})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            save_random_model(cfg, toks[m.tokenizer], paths[name])
    write_json_atomic(out / SAVED_SPEC, made_from)
    return paths


def write_data(task: str, knobs: dict[str, Any], out: str | Path, seed: int = 0) -> dict[str, int]:
    """Every split of `task` (`SPLIT_MAKERS[task](**knobs, seed=seed)`, the code `gen-data --task` runs) as
    `out/<split>.jsonl`, and `task.json` (options and sizes); `{split: records}` counts. Reused when written
    with the same options; written with others, a `ConfigError` says what to delete."""
    if task not in SPLIT_MAKERS:
        raise ConfigError(f"task {task!r} has no regime data; choose one of {sorted(SPLIT_MAKERS)}")
    out = Path(out)
    options = {"task": task, "seed": seed, **knobs}
    saved = read_json(out / "task.json")
    if saved is not None:
        if saved["options"] != options:
            raise ConfigError(f"{out} holds {saved['options'].get('task')} data made with other options than "
                              f"{options}; delete {out} to write it again")
        return saved["splits"]
    try:
        splits = SPLIT_MAKERS[task](**knobs, seed=seed)
    except (TypeError, ValueError) as err:  # an unknown knob, or knobs no dataset can satisfy
        raise ConfigError(f"{task} data: {err}") from None
    for name, records in splits.items():
        write_jsonl(records, out / f"{name}.jsonl")
    sizes = {name: len(records) for name, records in splits.items()}
    write_json_atomic(out / "task.json", {"options": options, "splits": sizes})
    return sizes
