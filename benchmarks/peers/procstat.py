"""A process's peak resident set from /proc (standard library only: the CPU shims import it in the
peers' own virtualenvs too).

VmHWM belongs to the process's address space since its exec. getrusage's ru_maxrss does not:
Linux carries it across fork + exec, so a child forked from a parent holding 11 GB reports 11 GB
whatever it uses itself (seen in the peers' ranking, BENCHMARKS.md).
"""
from __future__ import annotations

import resource


def status_mbs(keys: tuple[str, ...], pid: int | str = "self") -> dict[str, float]:
    """Fields `keys` of /proc/<pid>/status (VmHWM, VmRSS, RssAnon, ...) in MB, read in one pass;
    a field absent (gone, no /proc, no such field) is left out."""
    got = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key = line.split(":", 1)[0]
                if key in keys:
                    got[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return got


def status_mb(key: str, pid: int | str = "self") -> float | None:
    """Field `key` of /proc/<pid>/status in MB (None: gone, no /proc, or no such field)."""
    return status_mbs((key,), pid).get(key)


def vm_hwm_mb(pid: int | str = "self") -> float | None:
    """VmHWM of process `pid` in MB (None: gone, or no /proc)."""
    return status_mb("VmHWM", pid)


def own_peak_rss_mb() -> float:
    """This process's peak RSS since its exec (VmHWM), else getrusage's (no /proc)."""
    got = vm_hwm_mb()
    return got if got is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
