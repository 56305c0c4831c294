"""Keep freed memory in the process: glibc malloc set up for a training loop on the CPU.

PyTorch's CPU allocator caches nothing: every tensor is a `malloc` and a `free`. glibc serves a
large block with `mmap` and unmaps it on `free`, and it trims free memory at the heap's top back to
the OS, so a step that allocates the same large temporaries as the step before (relation matrices,
aligned teacher KV, gradients) faults every page of them in again, and the kernel zeroes each one.
On the 2-core CPU machine of `docs/results` that was 18 % of a relation-KV training step and made
the gather of a whole teacher cache 4.5x slower (`benchmarks/results`).

`keep_freed_memory()` raises both thresholds (`M_MMAP_THRESHOLD`, `M_TRIM_THRESHOLD`) to
`KEEP_BYTES`: blocks up to that size come from the heap and freed memory stays there for the next
step, the way PyTorch's CUDA caching allocator keeps GPU memory. The cost: the process's resident
memory stays at its peak instead of shrinking between steps. The CLI calls it once at start, and
`ablate` in each worker it spawns; `KVDISTILL_KEEP_FREED_MEMORY=0` leaves glibc's defaults. Outside glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

KEEP_BYTES = 1 << 30  # blocks above 1 GiB are still mapped and unmapped: a one-off buffer is given back
ENV = "KVDISTILL_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>

_state = "default"  # what `allocator()` reports: "keep_freed" once `keep_freed_memory()` took effect


def keep_freed_memory(keep_bytes: int = KEEP_BYTES) -> bool:
    """Set glibc's mmap and trim thresholds to `keep_bytes`; True if both took effect.

    False (nothing changed) when `KVDISTILL_KEEP_FREED_MEMORY=0`, off Linux, or without glibc's `mallopt`.
    """
    global _state
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: setting either one stops glibc's own adjustment of the mmap threshold
    ok = mallopt(_M_MMAP_THRESHOLD, keep_bytes) == 1 and mallopt(_M_TRIM_THRESHOLD, keep_bytes) == 1
    if ok:
        _state = "keep_freed"
    return ok


def allocator() -> str:
    """`"keep_freed"` after `keep_freed_memory()` took effect in this process, else `"default"`."""
    return _state
