"""The sidecar process's malloc settings: big temporaries served from the heap, and kept.

Conversation renders of long messages build strings of megabytes and drop them at once (a
chat template's ``+`` copies, the output join): glibc serves each from a fresh ``mmap`` above
its threshold and returns it at ``free``, so every render page-faults its strings in again.  A
Qwen3 conversation whose first user message is a 1M-character document took 3-5 ms a token-in
turn that way, 1.8-2.2 ms with the settings below (bench/RESULTS.md, "big temporaries").

`keep_big_allocations` fixes glibc's mmap threshold at 32 MiB (its largest; dynamic by default,
starting at 128 KiB) and lets the heap keep up to `retain` freed bytes at its top instead of
trimming at 128 KiB: a session start's 16 MB buffers would otherwise be faulted in again on
every start (4M-character starts measured 8.7-9.2 ms with both, 8.9-9.9 with neither, 10-12
with the threshold alone).  The cost is memory the process keeps after a burst: at most
`retain` bytes per malloc arena.  A library user embedding toktier in another process decides
for that process (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in its environment).
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit systems (4 * 1024 * 1024 * sizeof(long)); larger
#: values are refused
MMAP_THRESHOLD = 32 << 20


def check_retain(retain: object) -> int:
    """`retain` as mallopt takes it (an int in [0, 2 GiB)), else ValueError saying so."""
    if isinstance(retain, bool) or not isinstance(retain, int) or not 0 <= retain < 1 << 31:
        raise ValueError(f"malloc_retain must be bytes in [0, 2G), not {retain!r}")
    return retain


def keep_big_allocations(retain: int) -> str | None:
    """Apply the settings above; None when applied, else why not (not glibc, or refused).

    `retain`: bytes the heap may keep freed at its top (0: leave glibc's defaults alone)."""
    check_retain(retain)
    if retain == 0:
        return "malloc_retain is 0: glibc's defaults"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return "no mallopt in this C library (not glibc)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, retain) != 1:
        return "mallopt refused the settings"
    return None
