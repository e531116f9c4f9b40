"""Resident memory: handing freed heap back to the OS while models load, and the peak RSS that
summaries report.

glibc serves large allocations from its heap once it has seen large ones freed (its mmap threshold
rises to the largest freed size, up to 32 MB), and keeps what is freed there: a loaded model's float
weights, freed one linear at a time as it is quantized or packed, stayed in RSS until the end of the
load, and the quantized copies were allocated beside them.
"""

from __future__ import annotations

import ctypes
import resource
import sys
from pathlib import Path


def return_freed_memory() -> None:
    """Return the heap's free pages to the OS (`malloc_trim`); nothing where the C library lacks it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started or since `reset_peak_rss` (Linux's VmHWM;
    elsewhere `ru_maxrss`, which cannot be reset)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def reset_peak_rss() -> bool:
    """Start `peak_rss_bytes` again from the current RSS (Linux: `/proc/self/clear_refs`), so that a run
    of several formats in one process reports each one's own peak; False where that cannot be done."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
