"""One atomic folder commit, shared by checkpoints (train/checkpoint.py), exports (export/folder.py)
and the target's de-quantised cache: a folder is filled under a hidden staging name next to its
destination, flushed to disk and renamed into place, so a crash (kill -9, a full disk) at any moment
leaves either the previous folder or the new one, never half of one.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable


def staging_dir(dest: Path) -> Path:
    """The hidden folder `dest` is written into. Its name depends only on `dest`, so every rank of
    a distributed job writes its part into the same one."""
    dest = Path(dest)
    return dest.parent / f".tmp-{dest.name}"


def fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` to disk (the rename must not outrun the data)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with open(Path(root) / name, "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _ordinary_modes(folder: Path) -> None:
    """Files 0666 and folders 0777 less the umask (0644 / 0755 usually), as `open` would make
    them: safetensors writes 0600, which a serving account reading the export could not open."""
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(Path(root) / d, 0o777 & ~umask)
        for f in files:
            os.chmod(Path(root) / f, 0o666 & ~umask)


def commit_folder(tmp: Path, dest: Path, marker: str | None = None) -> Path:
    """Flush a filled staging folder and rename it to `dest`, replacing an existing one (moved
    aside first, removed after). `marker`: an empty-ish file written last, e.g. COMPLETE, that
    readers take as proof the folder is whole."""
    tmp, dest = Path(tmp), Path(dest)
    if marker is not None:
        (tmp / marker).write_text("ok\n")
    _ordinary_modes(tmp)
    fsync_tree(tmp)
    old = dest.parent / f".old-{dest.name}"
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def write_folder(dest: Path, fill: Callable[[Path], None], marker: str | None = None) -> Path:
    """Create folder `dest` atomically from one process: `fill(tmp)` writes into the staging
    folder, which is then committed. If fill raises, the staging folder is removed and an existing
    `dest` is left as it was."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        return commit_folder(tmp, dest, marker)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
