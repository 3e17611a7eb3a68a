"""Settings an edge-agent process makes for itself at its start: how its C allocator keeps the
memory it frees (every process) and how long a thread may keep the GIL (the device agent).

The allocator: glibc maps an allocation above its mmap threshold (128 KiB at first, raised only by
what is freed) straight from the kernel and unmaps it when freed, and hands the top of a heap back
to the kernel once more than its trim threshold lies free there; either way the next buffer of that
size is faulted in again, page by page, while the thread copying into it holds the GIL. A chunk of a
model transfer (256 KiB to 1 MiB, copied out of the socket and held until it is written, a window of
them at a time) is such a buffer, as is a camera frame (6 MB at 1080p): docs/benchmarks.md, "Delivery",
counts what a model pull faulted in before and after. The cost is memory kept: up to
:data:`TRIM_THRESHOLD` free at the top of each heap stays with the process for its next buffers.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

#: How long a Python thread may keep the GIL while another waits for it (CPython's default: 5 ms).
#: The frame path's threads spend most of their time in C (decode, inference) and need the GIL back
#: for a few microseconds after each call; behind a publisher running Python they could wait up to
#: the full interval (docs/benchmarks.md, "Frame path").
GIL_SWITCH_INTERVAL_S = 0.001

#: Allocations up to this size come from a heap and are reused there (glibc allows at most 32 MiB).
MMAP_THRESHOLD = 8 * 1024 * 1024
#: Free memory a heap keeps at its top before handing it back to the kernel.
TRIM_THRESHOLD = 32 * 1024 * 1024

# glibc's mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Variables through which an operator tunes glibc's allocator: where one is set, his word stands.
_OPERATOR_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def shorten_gil_switch() -> None:
    """The device agent's GIL switch interval (:data:`GIL_SWITCH_INTERVAL_S`), for this process."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def keep_freed_buffers(environ: Mapping[str, str] = os.environ) -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when both were set.

    Nothing is changed where the C library is not glibc (musl, macOS), or where the operator tunes
    the allocator through the environment (``GLIBC_TUNABLES`` naming ``glibc.malloc.``, or a
    ``MALLOC_*_`` variable): the process then runs as he set it.
    """
    if any(name in environ for name in _OPERATOR_VARIABLES):
        return False
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    # Setting either one ends glibc's own adjustment of both: so both are set.
    mapped = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return mapped and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _glibc_mallopt() -> ctypes._NamedFuncPointer | None:
    """glibc's ``mallopt`` of this process, or None when the C library is another one."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
