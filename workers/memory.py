"""Keep freed memory in the process (glibc's allocator), for the transformers engine.

Every decode step re-allocates each layer's whole KV cache (``DynamicCache`` concatenates
the new token), then frees the old one. With glibc's defaults the freed top of the heap
goes back to the kernel, and the next step faults every page in again: once a long prompt
widens the batch, that is most of a step's time (measured on a VM: ~600 ms a step against
~200 ms with the memory kept; ``docs/benchmarks.md``). Raising the trim threshold keeps
it: the worker's resident size stays at its peak, which a dedicated worker holds anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("tokengate.engine")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
_TRIM_THRESHOLD = 2**31 - 1  # bytes; mallopt takes an int
# setting either one freezes glibc's adaptive mmap threshold: set it too, to its maximum
# (32 MiB on 64-bit), or every tensor above 128 KiB would be mmapped, and faulted in, anew
_MMAP_THRESHOLD = 32 * 2**20


def retain_freed_memory() -> bool:
    """True when glibc took the setting; False elsewhere (musl, macOS), where it does nothing."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    log.debug("glibc trim threshold %s", "raised" if ok else "unchanged")
    return ok
