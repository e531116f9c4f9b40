"""Handing freed heap back to the OS while models load.

glibc serves large allocations from its heap once it has seen large ones freed (its mmap threshold
rises to the largest freed size, up to 32 MB), and keeps what is freed there: a loaded model's float
weights, freed one linear at a time as it is quantized or packed, stayed in RSS until the end of the
load, and the quantized copies were allocated beside them.
"""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    """Return the heap's free pages to the OS (`malloc_trim`); nothing where the C library lacks it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
