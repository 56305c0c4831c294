"""GGUF files as a model source: converted once into a Hugging Face directory, cached by the file's hash.

transformers reads a GGUF checkpoint through the `gguf` package and dequantises it on every load (50-75 s for
Gemma-3-270m on 2 cores). Everything in kvdistill reads models from a directory (config.json beside the
weights), so a `.gguf` path is turned into one here, once: `save_pretrained` of the dequantised model and its
tokenizer under `$KVDISTILL_CACHE/gguf/<stem>-<sha256[:16]>/`. A second load is a plain safetensors load
(seconds). The weights are the dequantised fp32 values, not a re-quantisation: what the GGUF holds, exactly.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path

from kvdistill.config import UserError
from kvdistill.io import sha256_file

logger = logging.getLogger(__name__)

MAGIC = b"GGUF"  # the first four bytes of every GGUF file
DONE = "kvdistill_gguf.json"  # written last: a directory without it is an interrupted conversion


class GGUFError(UserError, OSError):
    """A GGUF file could not be read or converted; the message says why and what to do."""


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def cache_root() -> Path:
    """Where converted models live: `$KVDISTILL_CACHE/gguf` (default `~/.cache/kvdistill/gguf`)."""
    return Path(os.environ.get("KVDISTILL_CACHE", Path.home() / ".cache" / "kvdistill")) / "gguf"


@lru_cache(maxsize=32)
def _digest(path: str, size: int, mtime_ns: int) -> str:  # size and mtime in the key: a rewritten file rehashes
    return sha256_file(path)


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise GGUFError(f"no such GGUF file: {str(path)!r}; give the path of an existing .gguf file")
    with path.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r}); give a .gguf "
                        "checkpoint, or the directory of a model saved with `save_pretrained`")
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError(f"reading {path.name} needs the gguf package: pip install 'kvdistill[gguf]' "
                        "(or `pip install gguf`)")


def _supported() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # two are sections, not models


def _convert(path: Path, out: Path) -> None:
    """Dequantise `path` with transformers and save model + tokenizer to `out` (which must not exist yet)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype="float32")
    except ValueError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "not supported" in first.lower():
            raise GGUFError(f"{path.name}: {first} This transformers reads GGUF for {', '.join(_supported())}; "
                            "pass the model's original checkpoint (a `save_pretrained` directory or Hub id) "
                            "instead") from err
        raise GGUFError(f"{path.name} could not be read ({first}); the file may be damaged or incomplete: "
                        "copy or download it again") from err
    except (OSError, EOFError, IndexError, KeyError, TypeError) as err:
        raise GGUFError(f"{path.name} could not be read ({type(err).__name__}: {err}); the file may be damaged "
                        "or incomplete: copy or download it again") from err
    # the dequantised weights are plain fp32 tensors; the quantizer's marker only blocks `save_pretrained`
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def gguf_to_hf(path: str | os.PathLike) -> Path:
    """The Hugging Face directory of GGUF file `path`, converted on first use and cached by its sha256.

    Safe under concurrent callers (DDP ranks, parallel tests): one converts under a file lock, the others
    wait and read its result. Raises `GGUFError` with one line for a missing `gguf` package, a file that is
    not GGUF, a damaged file or an architecture transformers cannot read from GGUF.
    """
    from filelock import FileLock

    file = Path(path).expanduser().resolve()
    _check_file(file)
    stat = file.stat()
    sha = _digest(str(file), stat.st_size, stat.st_mtime_ns)
    out = cache_root() / f"{file.stem}-{sha[:16]}"
    if (out / DONE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / DONE).is_file():  # converted by another process while we waited
            return out
        logger.info("converting %s to a Hugging Face directory (once; cached at %s)", file.name, out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)  # an interrupted conversion: no DONE marker
        try:
            _convert(file, tmp)
            (tmp / DONE).write_text(json.dumps({"source": str(file), "sha256": sha, "bytes": stat.st_size}) + "\n")
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
