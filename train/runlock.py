"""One job per run dir: a lock file naming its holder (pid, host, start time).

Two jobs writing into one run dir interleave their metrics and overwrite each other's checkpoints,
best/ and config. The first job to start creates `run_dir/run.lock` atomically (O_EXCL); a second
one is refused with the holder named. A lock whose holder is a dead process on this host (a job
killed with -9) is stale and is taken over with a warning. Under torchrun only rank 0 takes it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from specdistill.cli.errors import UserError

log = logging.getLogger(__name__)
LOCK = "run.lock"


class RunDirLocked(UserError):
    """Another live job holds the run dir (a user error: one line, exit 2)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """`with RunLock(run_dir):` or acquire()/release(). Re-entrant within one process."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self.held = False

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # vanished, or being written right now

    def acquire(self) -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # written this instant: give the writer a moment
                    time.sleep(0.2)
                    holder = self._holder()
                if holder is not None and holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                    self.held = True
                    return self
                if holder is not None and holder.get("host") == me["host"] and not _alive(int(holder["pid"])):
                    log.warning("run dir %s: taking over the stale lock of pid %s (no longer running)",
                                self.path.parent, holder["pid"])
                    self.path.unlink(missing_ok=True)
                    continue
                raise self._locked(holder)
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise RunDirLocked(f"could not take {self.path}: another job keeps re-creating it")

    def _locked(self, holder: dict | None) -> RunDirLocked:
        holder = holder or {"pid": "?", "host": "?", "started": 0}
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        return RunDirLocked(
            f"run_dir {self.path.parent} is in use by another job (pid {holder['pid']} on "
            f"{holder['host']}, started {started}); wait for it to finish or pick another "
            f"run_dir=. If that job is gone, delete {self.path}.")

    def check_free(self) -> None:
        """Without taking it: refuse when a live job holds the lock (a stale one of a dead process
        on this host is left for acquire() to take over). For checks before the job starts."""
        if not self.path.is_file():
            return
        holder = self._holder()
        here = holder is not None and holder.get("host") == socket.gethostname()
        if here and (holder.get("pid") == os.getpid() or not _alive(int(holder["pid"]))):
            return
        raise self._locked(holder)

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
