"""Loading models and tokenizers: the real `from_pretrained` path, with errors that say what to do.

A Hub id or a local directory both work. Where the Hub is out of reach we fail fast with a
message naming what was asked and how to fix it, instead of letting `huggingface_hub` retry
for a minute.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from kvdistill.config import ConfigError, UserError
from kvdistill.gguf import gguf_to_hf, is_gguf

DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
QUANTIZATIONS = (None, "4bit", "8bit")


class ModelLoadError(UserError, OSError):
    """A model or tokenizer could not be loaded; the message says why and how to fix it."""


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None:
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` as a `torch.device` ("auto" or None: cuda if available, else cpu); a device this
    machine does not have is a `ConfigError`, not an assertion deep inside torch."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu, "
                          "or install a CUDA build of torch")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here; pick one of "
                          f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return dev


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the Hub endpoint: seconds, instead of huggingface_hub's retry loop."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def model_dir(name_or_path: str | os.PathLike) -> str:
    """`name_or_path` as `from_pretrained` reads it: a `.gguf` file becomes its converted directory (converted
    once, cached by the file's hash: `kvdistill.gguf`); a directory or a Hub id stays as it is."""
    return str(gguf_to_hf(name_or_path)) if is_gguf(name_or_path) else str(name_or_path)


def sliding_window(name_or_path: str | os.PathLike) -> int | None:
    """The sliding window of a local model's attention layers, from its config.json as transformers reads it
    (`layer_types`, Qwen2's `use_sliding_window`, ...); None when no layer slides, for a Hub id, or for a
    config transformers cannot read (loading the model says why)."""
    path = Path(model_dir(name_or_path))
    if not (path / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(path).get_text_config()
    except (OSError, ValueError):
        return None
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    return window if window and (types is None or "sliding_attention" in types) else None


def _source_kwargs(name_or_path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """Decide local dir vs Hub id; for a Hub id out of reach, only the local HF cache is tried."""
    name = model_dir(name_or_path)
    if Path(name).is_file():
        raise ModelLoadError(f"{name} is a file, not a model directory; give the directory that holds its "
                             "config.json and weights (as written by `save_pretrained`)")
    if Path(name).exists():
        return name, {}
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(os.sep)
    if looks_like_path:
        raise ModelLoadError(
            f"no such model directory: {name!r}. Give an existing local directory (one written by "
            "`save_pretrained`) or a Hub id like 'Qwen/Qwen2.5-0.5B'."
        )
    if _hub_offline() or not _hub_reachable():
        return name, {"local_files_only": True}
    return name, {}


# what a damaged weights file raises (a truncated copy or download), besides OSError / ValueError
_DAMAGED = (SafetensorError, pickle.UnpicklingError, EOFError)


def _load_error(kind: str, name: str, err: Exception) -> ModelLoadError:
    """One line: what failed, and the fix for a damaged file, a bad local directory or an unreachable Hub id."""
    why = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    if isinstance(err, _DAMAGED):
        return ModelLoadError(f"could not load {kind} {name!r}, its weights are damaged or incomplete ({why}); "
                              "save or copy the model again")
    return ModelLoadError(
        f"could not load {kind} {name!r} ({why}); for a local directory check that it holds config.json, the "
        "tokenizer and the weights; for a Hub id without network, download it elsewhere (`huggingface-cli "
        "download ID --local-dir DIR`) and pass DIR (HF_HUB_OFFLINE=1 skips network retries)"
    )


def _foreign_weights(name: str, what: str) -> ModelLoadError:
    """The weights of `name` do not fit its config.json (e.g. another model's config.json copied beside them)."""
    local = Path(name) / "config.json"
    config = json.loads(local.read_text()) if local.is_file() else {}
    arch = f" ({config.get('model_type')}, {config.get('num_hidden_layers')} layers)" if config else ""
    return ModelLoadError(f"could not load model {name!r}: its weights belong to another architecture than its "
                          f"config.json describes{arch}: {what} (transformers' load report above lists them); put "
                          "the config.json saved with these weights beside them")


def _saved_class(path: str) -> str | None:
    """`tokenizer_class` of a local directory's tokenizer_config.json (None for a Hub id or none saved)."""
    config = Path(path) / "tokenizer_config.json"
    return json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs: Any):
    """`AutoTokenizer.from_pretrained` with a pad token guaranteed (falls back to EOS)."""
    name, extra = _source_kwargs(name_or_path)
    # A tokenizer saved as a plain `tokenizers` backend (build_tokenizer's) loads as saved: AutoTokenizer
    # would pick the model type's class (Qwen2Tokenizer) and its pre-tokenizer (digits split one by one)
    cls = TokenizersBackend if _saved_class(name) == "TokenizersBackend" else AutoTokenizer
    try:
        tok = cls.from_pretrained(name, **extra, **kwargs)
    except (OSError, ValueError) as err:
        raise _load_error("tokenizer", name, err) from err
    if len(tok.get_vocab()) <= len(set(tok.all_special_tokens)):  # transformers builds an empty one from nothing
        raise ModelLoadError(f"{name} holds no tokenizer (no tokenizer.json or vocabulary files there); save the "
                             "model's tokenizer into it (`tokenizer.save_pretrained(DIR)`), or give a teacher "
                             "`tokenizer:` a directory that holds one")
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    name_or_path: str | os.PathLike,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    quantization: str | None = None,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM from a Hub id, a local directory or a GGUF file.

    Args:
        name_or_path: Hub id ("Qwen/Qwen2.5-0.5B"), a local `save_pretrained` directory, or a `.gguf` file
            (dequantised once into a cached directory, `kvdistill.gguf`).
        dtype: "auto" | "fp32" | "bf16" | "fp16" (or a torch.dtype).
        device: where to put the weights (ignored with quantization, which places them itself).
        quantization: None, "4bit" or "8bit" (bitsandbytes; only when asked for).
    """
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    name, extra = _source_kwargs(name_or_path)
    torch_dtype = resolve_dtype(dtype)
    if quantization is not None:
        extra["quantization_config"] = _bnb_config(quantization, torch_dtype)
        extra["device_map"] = {"": device or (0 if torch.cuda.is_available() else "cpu")}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, output_loading_info=True, **extra,
                                                           **kwargs)
    except RuntimeError as err:  # transformers' load report found tensors of other shapes than the config makes
        if "ignore_mismatched_sizes" not in str(err):
            raise
        raise _foreign_weights(name, "their tensors have other shapes than that model's") from None
    except (OSError, ValueError, *_DAMAGED) as err:
        raise _load_error("model", name, err) from err
    if info["missing_keys"] and info["unexpected_keys"]:  # other names: the config's model would be random-init
        raise _foreign_weights(name, f"{len(info['missing_keys'])} of that model's tensors are missing from them and "
                               f"{len(info['unexpected_keys'])} of theirs are not that model's")
    if device is not None and quantization is None:
        model.to(device)
    return model


def _bnb_config(quantization: str, compute_dtype: torch.dtype | str):
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ModelLoadError(
            f"quantization={quantization!r} needs bitsandbytes: `pip install 'kvdistill[quant]'` "
            "(CUDA only), or set the teacher's quantization to null"
        ) from err
    from transformers import BitsAndBytesConfig

    compute = compute_dtype if isinstance(compute_dtype, torch.dtype) else torch.bfloat16
    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
        )
    return BitsAndBytesConfig(load_in_8bit=True)


# fields that change with how a model was saved, not with what it is
_VOLATILE = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "use_cache"}


def config_hash(model_or_config: PreTrainedModel | PretrainedConfig | dict) -> str:
    """A short, stable hash of an architecture config (for layer-map and checkpoint provenance)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    d = cfg if isinstance(cfg, dict) else cfg.to_dict()
    d = {k: v for k, v in d.items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_device(model: Any) -> torch.device:
    """The device a model's weights are on (its `.device`, else its first parameter's, else CPU)."""
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _text_config(model: PreTrainedModel) -> PretrainedConfig:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def num_layers(model: PreTrainedModel) -> int:
    cfg = _text_config(model)
    return getattr(cfg, "num_hidden_layers", None) or cfg.n_layer


def max_positions(model: PreTrainedModel) -> int | None:
    """The sequence length a model was built for (`max_position_embeddings` / GPT-2's `n_positions`)."""
    return getattr(_text_config(model), "max_position_embeddings", None)


def check_length(model: PreTrainedModel, tokens: int, name: str, what: str, fix: str) -> None:
    """A `ConfigError` when `tokens` (`what`, e.g. "max_length 2048") exceed the positions model `name`
    was built for: beyond them GPT-2 style models index past their position table, RoPE models extrapolate."""
    limit = max_positions(model)
    if limit is not None and tokens > limit:
        raise ConfigError(f"{what} is longer than the {limit} positions of {name} (its max_position_embeddings); "
                          f"{fix}")


def check_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    """A `ModelLoadError` when `tokenizer` makes token ids that `model` has no embedding for."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelLoadError(f"the tokenizer of {name} has {len(tokenizer)} tokens but the model embeds only {rows}; "
                             "use the tokenizer the model was trained with (for a teacher: its `tokenizer:`)")


# ----------------------------------------------------------------------------- building from scratch

SPECIAL = {"eos_token": "</s>", "pad_token": "<pad>", "bos_token": "<s>", "unk_token": "<unk>"}


def build_tokenizer(
    texts: list[str], vocab_size: int, split_digits: bool = False, char_level: bool = False, numbers_whole: int = 0,
    word_level: bool = False,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`; different sizes give different token counts.

    `split_digits=True` keeps every digit its own token (as Llama/Qwen tokenizers do), which makes
    arithmetic learnable for tiny models while words still merge into short sequences.
    `char_level=True` learns no merges at all: one token per byte (`vocab_size` is ignored).
    `numbers_whole=N` (at most 100) makes every number 0..N-1 written as a digit run of its own one
    token, the same token wherever it stands (digit runs are split from the text around them, and
    the merges of the numbers the training did not learn are added): modular tasks' number tokens.
    `word_level=True` makes every whitespace-separated word of `texts` one token (the `vocab_size` most
    frequent; others read as `<unk>`): a binding program's line `m=k.` is one token, so each lookup is one
    content match instead of a previous-token head composed with a matching one (docs/tasks.md).
    """
    if word_level:
        if split_digits or char_level or numbers_whole:
            raise ValueError("word_level excludes split_digits, char_level and numbers_whole (whole words only)")
        tok = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk_token"]))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.train_from_iterator(texts, trainer=trainers.WordLevelTrainer(
            vocab_size=vocab_size, special_tokens=list(SPECIAL.values()), show_progress=False))
        return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    if split_digits and numbers_whole:
        raise ValueError("split_digits and numbers_whole exclude each other (digits split vs whole numbers)")
    if not 0 <= numbers_whole <= 100:  # 3-digit runs would need merges that BPE's ranks cannot order
        raise ValueError(f"numbers_whole must be in 0..100, got {numbers_whole}")
    if char_level:
        vocab_size = 1  # below the byte alphabet: the trainer keeps the alphabet and adds no merge
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=not numbers_whole), byte_level])
        if split_digits or numbers_whole else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if numbers_whole:
        tok = _add_number_merges(tok, numbers_whole)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)


def _add_number_merges(tok: Tokenizer, n: int) -> Tokenizer:
    """`tok` with a token and a merge for each of 10..n-1 it lacks (digits are bytes of the alphabet
    already); a digit run is its own pre-token, so a 2-digit run has one pair: that merge makes it one token."""
    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    missing = [str(x) for x in range(10, n) if str(x) not in vocab]
    next_id = max(vocab.values()) + 1
    vocab.update({s: next_id + i for i, s in enumerate(missing)})
    spec["model"]["merges"] = merges + [[s[0], s[1]] for s in missing]
    return Tokenizer.from_str(json.dumps(spec))


def untrained_copy(model: PreTrainedModel, name: str, seed: int) -> PreTrainedModel:
    """A random init of `model`'s config and dtype, on the CPU, seeded by `seed` and `name`: the untrained
    control of the trainer's teachers, the probe and the layout audit. A seed per name: two controls of one
    architecture differ, and a control never replays the init a model was made with under the run's seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + zlib.crc32(name.encode()))
        return AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)


def save_random_model(cfg: PretrainedConfig, tok: PreTrainedTokenizerBase, path: Path,
                      embed_init: Callable[[torch.Tensor, dict[str, int]], None] | None = None) -> Path:
    """A random-init causal LM of `cfg` using `tok`'s special tokens, saved with `tok` at `path`.

    `embed_init(input embedding [V, d], tok's vocab)` rewrites rows of the input embedding in place
    (a task's structured init, e.g. `tasks.binding.compose_lines`). Seeding is the caller's: the
    weights come from torch's global RNG.
    """
    cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    model = AutoModelForCausalLM.from_config(cfg)
    if embed_init is not None:
        embed_init(model.get_input_embeddings().weight, tok.get_vocab())
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
