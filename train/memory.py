"""Hand the C heap's free pages back to the OS between training steps (glibc's malloc_trim).

A CPU training step allocates and frees tensors of a new size every step (rows of different
lengths, the features read back from the capture, the on-policy drafts). glibc serves those from
its arenas and keeps what is freed there, fragmented, instead of returning it: the default job's
resident memory climbed ~20 MB a step, to 18.7 GB at step 1000 (BENCHMARKS.md "Where the job's
18.7 GB peak is"), while one `malloc_trim(0)` at step ~200 of such a run gave back 5.4 of its 7.0 GB
of anonymous memory. The recipe calls `release_free_memory()` every trainer.log_every steps.
Elsewhere (macOS, musl, Windows) it does nothing and says so.

Large blocks (over glibc's mmap threshold, 32 MB at most) are still mmapped per allocation, i.e.
faulted in and zeroed on every use (the default job: 370 M minor page faults). Serving them from
the heap (`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824` in the environment) made
teacher-forced steps 0.52-0.95x as long, but a whole job then held 6.8 GB of anonymous memory in
that phase and 10.2 GB in the on-policy one (3.9 / 6.3 GB without): not the default, a choice for
machines with memory to spare (BENCHMARKS.md "Large tensors from the heap").
"""
from __future__ import annotations

import ctypes
import functools
import sys


@functools.lru_cache(maxsize=None)
def _glibc():
    """glibc's handle where malloc_trim exists (Linux with glibc), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):  # musl and others: no malloc_trim
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; True when glibc did it (False: not glibc, or
    nothing could be released)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
