"""Hand the C heap's free pages back to the OS between training steps (glibc's malloc_trim).

A CPU training step allocates and frees tensors of a new size every step (rows of different
lengths, the features read back from the capture, the on-policy drafts). glibc serves those from
its arenas and keeps what is freed there, fragmented, instead of returning it: the default job's
resident memory climbed ~20 MB a step, to 18.7 GB at step 1000 (BENCHMARKS.md "Where the job's
18.7 GB peak is"), while one `malloc_trim(0)` at step ~200 of such a run gave back 5.4 of its 7.0 GB
of anonymous memory. The recipe calls `release_free_memory()` every trainer.log_every steps.

glibc also serves every block over its mmap threshold (32 MB at most: a step's logits, a batch's
activations) with a fresh mmap and unmaps it on free, so the kernel faults in and zeroes those
pages again on every use: the default job took 370 M minor page faults, and on a VM a
teacher-forced step spent a third of its time or more in the kernel. `large_tensors_from_the_heap()`
(the job's entry calls it) serves them from the heap instead, where freed pages stay mapped and are
reused until the next `release_free_memory()`: 5x fewer faults, steps 0.52-0.95x as long
(BENCHMARKS.md "Large tensors from the heap"). Elsewhere (macOS, musl, Windows) both do nothing and say so.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


@functools.lru_cache(maxsize=None)
def _glibc():
    """glibc's handle where malloc_trim exists (Linux with glibc), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):  # musl and others: no malloc_trim
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; True when glibc did it (False: not glibc, or
    nothing could be released)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def large_tensors_from_the_heap() -> str:
    """Serve large blocks from glibc's heap instead of a fresh mmap each (no mmapped blocks; the
    heap's top is trimmed only from 1 GB up, release_free_memory does the rest): what was done, for
    the log. The glibc tunables MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_, where set, win."""
    libc = _glibc()
    if libc is None:
        return "not glibc: the C allocator's settings are left as they are"
    if {"MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"} & os.environ.keys():
        return "glibc: MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_ set in the environment, kept"
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)):
        return "glibc: mallopt refused the settings; large blocks stay mmapped"
    return "glibc: large tensors from the heap, not a fresh mmap each (freed pages reused)"
