"""Depth pruning: a causal LM made of some of another's decoder layers, their weights copied.

The pruned model shares its source's tokenizer, vocabulary, embeddings, final norm and head, so it is a
same-vocabulary student of its source from the first step (logit KD reads every row of both heads), and
its layer `j` starts as the source's layer `keep[j]`: the natural layer map for KV distillation, written
beside the model as `layer_map.json` (`M[j, keep[j]] = 1`, the format of `kvdistill layer-map`; a run reads
it as a teacher's `layer_map:` with `layer_map: cka`, the option that reads a layer-map file). For hidden
states (`key_space: hidden`) the natural map is `layer_map_hidden.json`: layer `j`'s output stands in for
the source's output after the last layer it dropped before `keep[j + 1]` (the input the next kept layer was
trained on), the last layer's for the source's last (both after the final norm).

What changes in the config: `num_hidden_layers`, and every per-layer list (a list attribute of
`num_hidden_layers` entries whose name says `layer`, e.g. Gemma's `layer_types`, SmolLM3's
`no_rope_layers`) is cut to the kept layers, so a kept sliding-window layer stays one and a kept global
layer stays global. Each layer's `layer_idx` (its slot in the KV cache) is the new position: the pruned
model is built from the new config and loaded with the kept layers' weights renamed `layers.{keep[j]}` ->
`layers.{j}`.

Example:
    kvdistill prune --model models/real/smollm2-135m-instruct --keep every_other --output_dir models/smollm2_half
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kvdistill.align.layer_map import save_layer_map
from kvdistill.config import ConfigError
from kvdistill.io import write_json_atomic, writing
from kvdistill.models import config_hash, load_model, load_tokenizer

EVERY_OTHER = "every_other"
MANIFEST = "kvdistill_prune.json"  # where the layers came from: the pruned model's layer map onto its source
LAYER_MAP = "layer_map.json"  # the same as a layer map (student layer j -> source layer keep[j])
LAYER_MAP_HIDDEN = "layer_map_hidden.json"  # student layer j's output -> the source's at keep[j + 1] - 1


def keep_indices(keep: str | Sequence[int], n_layers: int) -> list[int]:
    """The layers to keep, checked against the model's `n_layers`.

    Args:
        keep: "every_other" (0, 2, 4, ...), indices as text ("0,2,4") or a sequence of ints; strictly
            increasing (a pruned model runs its layers in the source's order, each once).
        n_layers: the source's number of decoder layers.
    """
    if isinstance(keep, str):
        if keep.strip() == EVERY_OTHER:
            return list(range(0, n_layers, 2))
        parts = [p.strip() for p in keep.split(",") if p.strip()]
        if not all(re.fullmatch(r"\d+", p) for p in parts):
            raise ConfigError(f"--keep {keep!r} is neither {EVERY_OTHER} nor comma-separated layer indices; "
                              "pass e.g. --keep 0,2,4 or --keep every_other")
        keep = [int(p) for p in parts]
    keep = list(keep)
    if not keep:
        raise ConfigError(f"--keep names no layer; pass at least one index in 0..{n_layers - 1} or {EVERY_OTHER}")
    bad = [i for i in keep if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"--keep {','.join(map(str, keep))}: layer {bad[0]} is out of range (the model has "
                          f"{n_layers} layers, 0..{n_layers - 1}); pass indices in that range")
    if any(a >= b for a, b in itertools.pairwise(keep)):
        raise ConfigError(f"--keep {','.join(map(str, keep))} must list distinct layers in increasing order; "
                          "sort it and drop repeats")
    return keep


def decoder_layers(model: PreTrainedModel) -> str:
    """The qualified name of `model`'s decoder-layer list: the `...layers` ModuleList of `num_hidden_layers`."""
    n = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers" and len(module) == n:
            return name
    raise ConfigError(f"{type(model).__name__} has no list of {n} decoder layers named `layers`; depth pruning "
                      "supports decoder-only causal LMs (Llama, Qwen, Gemma, Mistral, ...)")


def pruned_config(config: PretrainedConfig, keep: Sequence[int]) -> PretrainedConfig:
    """A copy of `config` with `keep`'s layers: `num_hidden_layers` and every per-layer list cut to them."""
    config = copy.deepcopy(config)
    text = config.get_text_config()
    if getattr(text, "is_heterogeneous", False):  # per-layer sub-configs keyed by layer index (transformers 5)
        raise ConfigError(f"{text.model_type} configs with a per_layer_config (layers of different shapes) cannot "
                          "be depth-pruned yet; prune a model whose layers share one config")
    n = text.num_hidden_layers
    for key, value in vars(text).items():
        if "layer" in key and isinstance(value, list) and len(value) == n:
            setattr(text, key, [value[i] for i in keep])
    text.num_hidden_layers = len(keep)
    return config


def prune_model(model: PreTrainedModel, keep: str | Sequence[int]) -> PreTrainedModel:
    """A new model of `model`'s class and dtype with only the `keep` decoder layers (weights copied; the
    embeddings, final norm and head as they are).

    Example:
        >>> small = prune_model(AutoModelForCausalLM.from_pretrained("models/real/gemma-3-270m"), "every_other")
        >>> small.config.num_hidden_layers, small.config.layer_types[:2]
        (9, ['sliding_attention', 'sliding_attention'])
    """
    layers = decoder_layers(model)
    keep = keep_indices(keep, len(model.get_submodule(layers)))
    new_index = {old: new for new, old in enumerate(keep)}
    pattern = re.compile(rf"^{re.escape(layers)}\.(\d+)\.")
    state = {}
    for key, tensor in model.state_dict().items():
        m = pattern.match(key)
        if m is None:
            state[key] = tensor
        elif int(m.group(1)) in new_index:
            state[f"{layers}.{new_index[int(m.group(1))]}.{key[m.end():]}"] = tensor
    pruned = AutoModelForCausalLM.from_config(pruned_config(model.config, keep), dtype=model.dtype)
    pruned.load_state_dict(state, strict=True)
    pruned.generation_config = copy.deepcopy(model.generation_config)
    return pruned


def prune(model: str | os.PathLike, keep: str | Sequence[int], output_dir: str | os.PathLike) -> Path:
    """Prune the causal LM at `model` (a directory or Hub id) to its `keep` layers and save it, with its
    tokenizer, a `kvdistill_prune.json` naming the source and the kept layers and their `layer_map.json`, to
    `output_dir`.

    `output_dir` must not exist or be empty. The model is written to a hidden sibling directory and renamed
    into place, so a failed run leaves nothing at `output_dir`.
    """
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output_dir {out} already exists and is not empty; pass a new directory or remove it")
    source = load_model(model, dtype="auto")  # the stored dtype: a pruned copy keeps its source's precision
    tokenizer = load_tokenizer(model)
    n_layers = source.config.get_text_config().num_hidden_layers
    keep = keep_indices(keep, n_layers)
    pruned = prune_model(source, keep)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a stale one, left by a killed run
    with writing(out, scratch=tmp):
        pruned.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / MANIFEST, {"source": str(model), "source_layers": n_layers, "kept_layers": keep})
        ends = [nxt - 1 for nxt in keep[1:]] + [n_layers - 1]  # where each kept layer's span of the source ends
        for name, cols in ((LAYER_MAP, keep), (LAYER_MAP_HIDDEN, ends)):
            M = torch.zeros(len(keep), n_layers)  # [L_s, L_t]
            M[torch.arange(len(keep)), torch.tensor(cols)] = 1.0
            save_layer_map(tmp / name, M, provenance={
                "method": "prune", "map": name, "source": str(model), "kept_layers": keep,
                "student_config_hash": config_hash(pruned), "teacher_config_hash": config_hash(source)})
        if out.is_dir():
            out.rmdir()  # empty (checked above): the rename below needs the name free
        tmp.rename(out)
    return out
