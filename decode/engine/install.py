"""What installing an engine's environment needs, whichever engine: the folder under the cache, a
lock while one job installs, a step runner whose failure is one line, and the marker written last.

envs.py (vLLM's virtualenv) and llamacpp_build.py (llama.cpp built from source) both install
through these; an install is marked `COMPLETE` only at its end, so an interrupted one is redone.
"""
from __future__ import annotations

import contextlib
import fcntl
import subprocess
from pathlib import Path
from typing import Iterator

COMPLETE = "COMPLETE"  # the marker file an install writes last (what was installed)


class EngineUnavailable(RuntimeError):
    """The engine cannot be installed or started here; the message says why in one line."""


def engines_root(cache_root: Path) -> Path:
    """Where every engine's environment lives: <cache>/engines/."""
    return Path(cache_root) / "engines"


@contextlib.contextmanager
def install_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock next to `folder` while it is being installed (other jobs wait)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_step(cmd: list[str], what: str, timeout: float) -> str:
    """Run an install step; EngineUnavailable with the step's last error line when it fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(f"{what} did not finish in {timeout:.0f} s") from None
    if out.returncode != 0:
        lines = [ln for ln in (out.stderr + out.stdout).splitlines()
                 if ln.strip() and "is ignored: it is neither a file nor a directory" not in ln]
        last = next((ln for ln in reversed(lines) if "error" in ln.lower()),
                    lines[-1] if lines else "")
        raise EngineUnavailable(f"{what} failed: {last.strip()}")
    return out.stdout
