"""Files written by kvdistill: atomic writes and one JSON policy.

Every results file goes through a temporary file and a rename, so a killed run never leaves half
a file. JSON is strict: NaN and inf are written as `null` (one policy for every report), tensors
and numpy scalars as numbers, paths inside the repository relative to its root (a results file
must not record one machine's absolute paths).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
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


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename; a failed write (full disk) removes
    the temporary file, so `path` is either the old file or the whole new one, and nothing else is left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        return tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> Path:
    """`to_jsonable(obj)` as strict JSON (no NaN), written atomically."""
    text = json.dumps(to_jsonable(obj), indent=indent, ensure_ascii=False, allow_nan=False)
    return write_text_atomic(path, text + "\n")
