"""Offline fixtures: tokenizers built in-process and tiny random-init models, saved to disk.

Everything is written with `save_pretrained` and read back through the same `from_pretrained`
path users take (`kvdistill.models`), so tests exercise the real loading code without a Hub.
The shapes differ on every KV axis on purpose: layers, KV heads (GQA), head dims, tokenizers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from kvdistill.synthetic import make_splits, write_jsonl

SPECIAL = {"eos_token": "</s>", "pad_token": "<pad>", "bos_token": "<s>", "unk_token": "<unk>"}


def build_tokenizer(texts: list[str], vocab_size: int, split_digits: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`; different sizes give different token counts.

    `split_digits=True` keeps every digit its own token (as Llama/Qwen tokenizers do), which makes
    arithmetic learnable for tiny models while words still merge into short sequences.
    """
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)


def tiny_configs(vocab: int, alt_vocab: int) -> dict[str, tuple[object, str]]:
    """name -> (config, tokenizer name). Teachers differ from the student on L, H_kv and D."""
    common = {"max_position_embeddings": 512, "tie_word_embeddings": True}
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


def save_random_model(cfg: PretrainedConfig, tok: PreTrainedTokenizerBase, path: Path) -> Path:
    """A random-init causal LM of `cfg` using `tok`'s special tokens, saved with `tok` at `path`.

    Seeding is the caller's: the weights come from torch's global RNG.
    """
    from transformers import AutoModelForCausalLM

    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


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
    manifest.write_text(json.dumps({
        "models": {k: str(v) for k, v in world.models.items()},
        "tokenizers": {k: str(v) for k, v in world.tokenizers.items()},
        "data_dir": str(world.data_dir),
    }, indent=1))
    return world


def main(argv: list[str]) -> int:
    """`kvdistill smoke`: build the fixtures, load them back like a user would, print KV shapes."""
    from kvdistill.cache import extract_kv
    from kvdistill.data import DistillCollator, load_records
    from kvdistill.models import load_model, load_tokenizer, param_count

    p = argparse.ArgumentParser(prog="kvdistill smoke", description=main.__doc__)
    p.add_argument("--out", default=None, help="where to write the fixtures (default: a temp dir)")
    a = p.parse_args(argv)
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="kvdistill_smoke_"))
    world = build_tiny_world(root)
    records = load_records(world.data_dir, split="test", limit=2)
    print(f"fixtures in {root}")
    print(f"{'model':<24}{'params':>10}  keys [L, B, H_kv, T, D]")
    for name, path in world.models.items():
        model, tok = load_model(path, dtype="fp32"), load_tokenizer(path)
        batch = DistillCollator(tok, max_length=128)(records)
        kv = extract_kv(model, batch["input_ids"], batch["attention_mask"], batch["segment_ids"])
        print(f"{name:<24}{param_count(model):>10,}  {list(kv.keys.shape)}")
    return 0
