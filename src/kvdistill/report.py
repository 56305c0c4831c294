"""Numbers in reports: parameter counts and one way to format every number a table shows.

A missing value (None or NaN) prints as an en dash in every table.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
from typing import Any

import torch
from torch import nn

from kvdistill.malloc import allocator

MISSING = "–"


def param_count(module: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters (optionally only those with `requires_grad`)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def environment() -> dict[str, Any]:
    """What a reader needs to reproduce or compare a number: versions, threads, cores, device, date."""
    import accelerate
    import transformers

    import kvdistill

    return {
        "kvdistill": kvdistill.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "allocator": allocator(),  # kvdistill.malloc: changes CPU timings, not results
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (`AMD EPYC ...`): the same command and seed can differ across CPU models, so a result
    says which one made it. Linux reads `cpuinfo`; elsewhere (or unreadable) `platform.processor()`."""
    try:
        with open(cpuinfo, encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def format_environment(env: dict[str, Any]) -> str:
    """One line of an `environment()` record for a report, without its date (a rerun differs only there)."""
    return ", ".join(f"{k} {v}" for k, v in env.items() if k != "date")


def _missing(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt_num(x: Any, digits: int = 3) -> str:
    """Fixed-point: `0.125`."""
    return MISSING if _missing(x) else f"{x:.{digits}f}"


def fmt_sig(x: Any, digits: int = 3) -> str:
    """`digits` significant figures, scientific outside [1e-3, 1e4): `0.0032`, `19.7`, `1.2e-05`."""
    if _missing(x):
        return MISSING
    if isinstance(x, bool):
        return "yes" if x else "no"
    if not isinstance(x, float):
        return str(x)
    if x == 0 or not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.{max(digits - 1, 1)}e}"


def fmt_signed(x: Any, digits: int = 3) -> str:
    """`+0.010`."""
    return MISSING if _missing(x) else f"{x:+.{digits}f}"


def fmt_mean_std(mean: Any, std: Any, digits: int = 3, sig: bool = False) -> str:
    """`0.115 ± 0.010` (fixed-point, or significant figures with `sig=True`)."""
    if _missing(mean):
        return MISSING
    f = fmt_sig if sig else fmt_num
    return f"{f(mean, digits)} ± {f(std, digits)}"


def fmt_p(p: Any) -> str:
    """A p-value: `0.0350`, `< 0.0001`."""
    if _missing(p):
        return MISSING
    return "< 0.0001" if p < 1e-4 else f"{p:.4f}"


def fmt_pct(x: Any) -> str:
    """`+12.3 %`."""
    return MISSING if _missing(x) or not math.isfinite(x) else f"{x:+.1f} %"


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; cells are `str`ed, `|` escaped, newlines flattened."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
