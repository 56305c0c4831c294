"""A tiny offline model world: tokenizers built in-process and tiny random-init models, saved to disk.

Used by `kvdistill smoke`, the step benchmark and the test suite.

Everything is written with `save_pretrained` and read back through the same `from_pretrained`
path users take (`kvdistill.models`), so tests exercise the real loading code without a Hub.
The shapes differ on every KV axis on purpose: layers, KV heads (GQA), head dims, tokenizers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from kvdistill.io import write_json_atomic
from kvdistill.models import build_tokenizer, save_random_model
from kvdistill.synthetic import make_splits, write_jsonl


def tiny_configs(vocab: int, alt_vocab: int, tie_word_embeddings: bool = True) -> dict[str, tuple[object, str]]:
    """name -> (config, tokenizer name). Teachers differ from the student on L, H_kv and D.

    `tie_word_embeddings=False` gives every model its own output embedding (the modular regime:
    tied ones would let logit KD shape the input geometry too).
    """
    common = {"max_position_embeddings": 512, "tie_word_embeddings": tie_word_embeddings}
    return {
        # 4 layers, 2 KV heads of 16
        "qwen2_teacher": (Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      **common), "bpe"),
        # 3 layers, 2 KV heads of 24, other RoPE base
        "llama_teacher": (LlamaConfig(vocab_size=vocab, hidden_size=96, intermediate_size=192,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      rope_theta=500000.0, **common), "bpe"),
        # the same Llama shape over a different tokenizer: cross-tokenizer distillation
        "llama_teacher_alt_tok": (LlamaConfig(vocab_size=alt_vocab, hidden_size=96, intermediate_size=192,
                                              num_hidden_layers=3, num_attention_heads=4,
                                              num_key_value_heads=2, **common), "bpe_alt"),
        # student: 2 layers, 1 KV head of 8
        "student": (Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=1, **common), "bpe"),
        "mistral": (MistralConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                  **common), "bpe"),
        "gpt2": (GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=512,
                            bos_token_id=0, eos_token_id=0), "bpe"),
    }


@dataclass
class TinyWorld:
    """Paths of the fixtures: models (each dir also holds its tokenizer), tokenizers, data."""

    root: Path
    models: dict[str, Path] = field(default_factory=dict)
    tokenizers: dict[str, Path] = field(default_factory=dict)
    data_dir: Path | None = None


def build_tiny_world(root: str | Path, seed: int = 0, n_train: int = 256, n_test: int = 64) -> TinyWorld:
    """Write tokenizers, tiny random-init models and a small synthetic dataset under `root`.

    Idempotent: a finished world (its `world.json`) is reused.
    """
    root = Path(root)
    manifest = root / "world.json"
    if manifest.exists():
        d = json.loads(manifest.read_text())
        return TinyWorld(root, {k: Path(v) for k, v in d["models"].items()},
                         {k: Path(v) for k, v in d["tokenizers"].items()}, Path(d["data_dir"]))
    train, test = make_splits(n_train, n_test, seed=seed)
    world = TinyWorld(root, data_dir=root / "data")
    write_jsonl(train, world.data_dir / "train.jsonl")
    write_jsonl(test, world.data_dir / "test.jsonl")

    texts = [r["question"] + " " + r["answer"] for r in train]
    toks = {"bpe": build_tokenizer(texts, 320), "bpe_alt": build_tokenizer(texts, 600)}
    for name, tok in toks.items():
        world.tokenizers[name] = root / "tokenizers" / name
        tok.save_pretrained(world.tokenizers[name])

    torch.manual_seed(seed)
    for name, (cfg, tok_name) in tiny_configs(len(toks["bpe"]), len(toks["bpe_alt"])).items():
        world.models[name] = save_random_model(cfg, toks[tok_name], root / "models" / name)
    write_json_atomic(manifest, {  # written last: its presence means the world is whole
        "models": {k: str(v) for k, v in world.models.items()},
        "tokenizers": {k: str(v) for k, v in world.tokenizers.items()},
        "data_dir": str(world.data_dir),
    })
    return world
