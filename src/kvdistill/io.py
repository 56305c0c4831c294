"""Files written by kvdistill: atomic writes and one JSON policy.

Every results file goes through a temporary file and a rename, so a killed run never leaves half
a file. JSON is strict: NaN and inf are written as `null` (one policy for every report), tensors
and numpy scalars as numbers, paths inside the repository relative to its root (a results file
must not record one machine's absolute paths).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_relative(path: str | os.PathLike) -> str:
    """`path` relative to the repository root when it lies inside it (else unchanged, as a string)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def to_jsonable(obj: Any) -> Any:
    """Plain JSON data: NaN/inf -> None, tensors -> lists, numpy scalars -> numbers, paths -> strings."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return repo_relative(obj)
    if hasattr(obj, "tolist"):  # torch tensors, numpy arrays and scalars
        return to_jsonable(obj.tolist())
    return str(obj)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """A JSON file's content, or `default` when the file does not exist."""
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else default


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines file (missing file: none). A line that does not parse is skipped:
    a run killed mid-write (e.g. `metrics.jsonl`) leaves a broken last line."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# errno of a write the file system refused: full, over quota, over the file-size limit, read-only, not ours
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# torch.save's C++ zip writer reports a failed write without its errno (e.g. "unexpected pos 576 vs 534")
_TORCH_WRITER = ("inline_container", "PytorchStreamWriter", "file write failed", "iostream error")


class WriteError(OSError):
    """A write the file system refused (full disk, quota, file-size limit, read-only or unwritable
    path), whatever raised it: Python's `OSError`, torch.save's `RuntimeError`, safetensors'
    `SafetensorError`, tokenizers' `Exception`. The message names the path, the bytes being written
    and the space free there; the half-written files were removed before it was raised."""

    def __init__(self, path: str | os.PathLike, nbytes: int | None, reason: str, code: int | None = None):
        self.path, self.nbytes, self.reason, self.code = Path(path), nbytes, reason, code
        full = code is None or code in _FULL_ERRNOS
        what = "no space left on the device" if full else "cannot write"
        size = f"{_mb(nbytes)} to write, " if nbytes else ""
        super().__init__(code or errno.EIO, f"{what}: writing {self.path} failed ({reason}; {size}"
                         f"{_mb(free_bytes(self.path))} free there); free space there or point the output "
                         "elsewhere, then rerun", str(self.path))

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        # OSError pickles as cls(errno, strerror, filename): an ablation worker's WriteError would reach
        # its parent as a TypeError of unpickling, hiding the full disk behind a broken process pool
        return WriteError, (self.path, self.nbytes, self.reason, self.code)


def _mb(n: int | None) -> str:
    if n is None:
        return "? MB"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n:,} B"


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes free to this user on the file system holding `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def write_failure(err: BaseException) -> tuple[str, int | None] | None:
    """`(reason, errno)` when `err` (or what it was raised from) is a write the file system refused,
    else None. torch and safetensors raise their own types on a full disk, not `OSError`."""
    seen = err
    while seen is not None:
        if isinstance(seen, WriteError):
            return seen.reason, seen.errno
        if isinstance(seen, OSError) and seen.errno in _WRITE_ERRNOS:
            return seen.strerror or os.strerror(seen.errno), seen.errno
        text = str(seen)
        code = re.search(r"os error (\d+)", text)  # safetensors / tokenizers (Rust): "File too large (os error 27)"
        if code and int(code.group(1)) in _WRITE_ERRNOS:
            return os.strerror(int(code.group(1))), int(code.group(1))
        if isinstance(seen, RuntimeError) and any(s in text for s in _TORCH_WRITER):
            return "torch's file writer failed", None
        seen = seen.__cause__ or seen.__context__
    return None


def nbytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (nested mappings / sequences; other values count 0)."""
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return int(getattr(obj, "nbytes", 0) or 0)


@contextmanager
def writing(path: str | os.PathLike, size: int | None = None, scratch: str | os.PathLike | None = None
            ) -> Iterator[None]:
    """Run a block that writes `path` (a file or a directory of `size` bytes) into `scratch` (default
    `path`): when it fails, what the block created under `scratch` is removed (all of `scratch` if it
    did not exist before; a file that did is kept: an append's cut last line is skipped by
    `read_jsonl`), and a write the file system refused becomes one `WriteError` naming `path`; any
    other error passes unchanged."""
    scratch = Path(path if scratch is None else scratch)
    existed = scratch.exists()
    before = set(scratch.rglob("*")) if scratch.is_dir() else set()
    try:
        yield
    except BaseException as err:
        if not existed:
            shutil.rmtree(scratch) if scratch.is_dir() else scratch.unlink(missing_ok=True)
        elif scratch.is_dir():
            for p in sorted(set(scratch.rglob("*")) - before, reverse=True):  # children before their dirs
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        failure = write_failure(err)
        if failure is None:
            raise
        size = size or (err.nbytes if isinstance(err, WriteError) else None)
        raise WriteError(path, size, *failure) from err


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file and a rename; a failed write (full disk) removes
    the temporary file, so `path` is either the old file or the whole new one, and nothing else is left
    (`WriteError` names it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a stale one, left by a killed run
    with writing(path, len(data), scratch=tmp):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        return tmp.replace(path)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`text` as UTF-8, written atomically (`write_bytes_atomic`); text UTF-8 cannot encode fails
    before any file is touched."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    """`to_jsonable(obj)` as strict JSON (no NaN), written atomically."""
    text = json.dumps(to_jsonable(obj), indent=indent, ensure_ascii=False, allow_nan=False)
    return write_text_atomic(path, text + "\n")
