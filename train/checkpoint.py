"""Atomic training checkpoints.

A checkpoint is a folder `checkpoints/step-XXXXXXX/` with the drafter (drafter.safetensors +
drafter.json, never the frozen target) and `trainer_state.pt` (optimizer, scheduler, data position,
RNG). It is written into a hidden temporary folder, flushed, marked COMPLETE and renamed into place:
a crash at any moment leaves either the previous checkpoints or the new one, never half of one.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from drafters.base import save_drafter

COMPLETE = "COMPLETE"
STATE = "trainer_state.pt"


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def write_atomic(dest: Path, fill) -> Path:
    """Create folder `dest` atomically: `fill(tmp)` writes into a temp folder that is renamed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fill(tmp)
    (tmp / COMPLETE).write_text("ok\n")
    _fsync_tree(tmp)
    old = dest.parent / f".old-{dest.name}-{os.getpid()}"
    if dest.exists():  # replacing (e.g. best/): move the old one aside first, drop it after
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def save_checkpoint(run_dir: Path, step: int, drafter, drafter_cfg, trainer_state: dict) -> Path:
    """Write checkpoints/step-<step>/ atomically and return its path."""

    def fill(tmp: Path) -> None:
        save_drafter(drafter, drafter_cfg, tmp)
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / STATE)

    return write_atomic(Path(run_dir) / "checkpoints" / f"step-{step:07d}", fill)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint, oldest first (half-written temp folders are ignored)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if (p / COMPLETE).is_file() and (p / STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / STATE, map_location="cpu", weights_only=False)


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; remove stale temp folders."""
    folder = Path(run_dir) / "checkpoints"
    for p in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in folder.glob(".tmp-*") if folder.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
