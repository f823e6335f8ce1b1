"""Hand the C heap's free pages back to the OS between training steps (glibc's malloc_trim).

A CPU training step allocates and frees tensors of a new size every step (rows of different
lengths, the features read back from the capture, the on-policy drafts). glibc serves those from
its arenas and keeps what is freed there, fragmented, instead of returning it: the default job's
resident memory climbed ~20 MB a step, to 18.7 GB at step 1000 (BENCHMARKS.md "Where the job's
18.7 GB peak is"), while one `malloc_trim(0)` at step ~200 of such a run gave back 5.4 of its 7.0 GB
of anonymous memory. The recipe calls `release_free_memory()` after every step on a CPU (a
step's peak then starts from the job's floor, not from the last steps' fragments: the DSpark job's
peak -0.15 GB, tokens/s unchanged within the noise, interleaved; BENCHMARKS.md "DSpark's memory"),
every trainer.log_every steps elsewhere, and unmaps the offline capture's shards after each batch it
reads from them (train/recipe.py).
Elsewhere (macOS, musl, Windows) it does nothing and says so.

Large blocks (over glibc's mmap threshold, 32 MB at most) are still mmapped per allocation, i.e.
faulted in and zeroed on every use (the default job: 370 M minor page faults). Serving them from
the heap (`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824` in the environment) made
teacher-forced steps 0.52-0.95x as long, but a whole job then held 6.8 GB of anonymous memory in
that phase and 10.2 GB in the on-policy one (3.9 / 6.3 GB without): not the default, a choice for
machines with memory to spare (BENCHMARKS.md "Large tensors from the heap"). What the job does
instead: `large_tensors_in_huge_pages`, 2 MB pages for tensors >= 2 MB (14x fewer faults,
teacher-forced steps 0.88x, memory unchanged: BENCHMARKS.md "Large tensors in huge pages").
"""
from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys

THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's (c10) switch: CPU tensors >= 2 MB in transparent huge pages


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


def release_free_memory(*mapped, collect: bool = False) -> bool:
    """Return the heap's free pages to the OS, and unmap the memory-mapped shards of `mapped`
    (offline features with a `release()`; None is skipped: their touched pages count as resident
    until unmapped); True when glibc trimmed (False: not glibc, or nothing could be released).
    collect: first free what only reference cycles still hold (gc; a dropped model's modules)."""
    if collect:
        gc.collect()
    for features in mapped:
        if features is not None:
            features.release()
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def mmap_large_blocks(threshold_mb: int) -> bool:
    """Have glibc mmap every block of at least `threshold_mb` MB (and unmap it when freed) for
    the rest of the process: a fixed M_MMAP_THRESHOLD, which also turns off glibc's dynamic one.
    That one rises to the size of each mmapped block freed (up to 32 MB), after which a training
    step's tensors below it come from the heap and stay there, fragmented, until malloc_trim
    (BENCHMARKS.md "Our trainer's memory": the peak 16% lower at 1 MB, teacher-forced steps ~0.92x:
    more page faults). True when set; False (and a warning from the caller) where there is no
    glibc."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_mb) << 20))


def drop_training_state(optimizer, *mapped) -> bool:
    """After the last step, before the final eval: the optimizer's moments are dropped (the
    checkpoints hold them), the capture's shards unmapped and the freed heap handed back to the
    OS, so that the serving engines the eval starts beside this process (vLLM: ~1.6 GiB each) find
    the memory the training held. The optimizer cannot step again."""
    optimizer.state.clear()
    return release_free_memory(*mapped, collect=True)


def large_tensors_in_huge_pages() -> bool:
    """Back this process's CPU tensors of >= 2 MB with transparent huge pages (torch's
    THP_MEM_ALLOC_ENABLE): a step's large tensors (the (rows, 8,192) logits, ~100 MB each) are
    mmapped fresh by glibc and faulted in 4 KB at a time, ~26 k faults each, on every step; with
    huge pages one fault maps 2 MB, and a freed tensor still goes straight back to the OS (unlike
    serving them from the heap, above). BENCHMARKS.md "Large tensors in huge pages".

    c10 reads the variable once, at its first large allocation: call this before any. It is set
    for that read and removed again, so subprocesses (the serving engine's check) keep their own
    defaults. A value the user set (0 or 1) is left alone. True when this call turned it on."""
    if THP_ENV in os.environ or not sys.platform.startswith("linux"):
        return False
    import torch

    os.environ[THP_ENV] = "1"
    try:
        torch.empty(4 << 20, dtype=torch.uint8)  # c10's one read of the variable
    finally:
        del os.environ[THP_ENV]
    return True
