"""Host memory of a CPU run: what glibc's malloc keeps of the memory torch frees, given back.

    host_memory.tune_malloc()      # once, before the model loads (FSDPEngine does it on CPU runs)
    host_memory.trim()             # after a phase: free pages back to the system
    host_memory.peak_rss()         # this process's peak resident memory, bytes (VmHWM)

On the CPU torch allocates every tensor with ``posix_memalign`` and frees it at once (no caching
allocator). glibc's malloc serves a request above its mmap threshold with a mapping of its own,
unmapped at free; below it, from its heaps, which return memory to the system only from their top.
The threshold starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB: after
the model's first tensors are freed, activations, gathered FSDP layers and gradients (1-20 MiB each)
all come from the heaps, where the long-lived ones (AdamW state, gradients, the next step's tensors)
land between the short-lived ones and pin them. A 2-rank SmolLM2-135M run kept ~3 GiB of free heap
per rank after two steps this way (docs/PERF.md, "Memory per rank"). A fixed threshold of
:data:`MMAP_THRESHOLD` maps every tensor of that size or more on its own, so freeing one returns its
pages; the cost is a page fault per fresh 4 KiB page, a few percent of a CPU step.

Process-wide and idempotent; a no-op where the C library is not glibc (``mallopt`` missing).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys

MMAP_THRESHOLD = 1 << 20
"""Bytes from which a block gets its own mapping (glibc's ``M_MMAP_THRESHOLD``; fixing it also stops
the dynamic rise)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@functools.cache
def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``mmap_threshold`` bytes and its heap trim threshold at twice
    that (module docstring); True where applied. Once per process (later calls are no-ops)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * int(mmap_threshold)))


def trim() -> None:
    """Return the free pages of malloc's heaps to the system (``malloc_trim(0)``); a no-op off glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def peak_rss() -> int:
    """This process's peak resident set size in bytes (``VmHWM``; ``ru_maxrss`` where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    """This process's resident set size now, in bytes (``VmRSS``; 0 where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


__all__ = ["MMAP_THRESHOLD", "peak_rss", "rss", "trim", "tune_malloc"]
