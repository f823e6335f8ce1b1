"""Atomic training checkpoints, written by one process or by every rank of a job.

A checkpoint is a folder `checkpoints/step-XXXXXXX/` with the drafter (drafter.safetensors +
drafter.json, never the frozen target), `trainer_state.pt` (scheduler, data position, RNG, step)
and what the backend needs to resume (train/backends.py `save_state`: `optimizer.pt`, or
DeepSpeed's per-rank shards under `deepspeed/`). It is written into a hidden staging folder,
flushed, marked COMPLETE and renamed into place: a crash (kill -9, a full disk) at any moment
leaves either the previous checkpoints or the new one, never half of one, and only folders with
COMPLETE are ever resumed from.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from drafters.atomic import commit_folder, staging_dir, write_folder
from drafters.base import CONFIG_FILE, WEIGHTS_FILE, save_drafter

COMPLETE = "COMPLETE"
STATE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def commit(tmp: Path, dest: Path) -> Path:
    """Mark a filled staging folder COMPLETE, flush it and rename it to `dest` (replacing it)."""
    return commit_folder(tmp, dest, marker=COMPLETE)


def write_atomic(dest: Path, fill) -> Path:
    """Create folder `dest` atomically from one process: `fill(tmp)` writes into the staging
    folder, which is then committed (marked COMPLETE)."""
    return write_folder(Path(dest), fill, marker=COMPLETE)


def save_checkpoint(run_dir: Path, step: int, backend, drafter, drafter_cfg,
                    optimizer: torch.optim.Optimizer, trainer_state: dict) -> Path:
    """Collective (every rank calls it): write checkpoints/step-<step>/ atomically, return it.

    1. Rank 0 clears the staging folder (a crash may have left one) and creates it.
    2. Inside backend.full_weights() (ZeRO-3 gathers the shards) rank 0 writes the full drafter.
    3. backend.save_state: the optimizer (torch), or every rank's ZeRO shards (DeepSpeed).
    4. Once every rank is done, rank 0 writes trainer_state.pt and commits the folder.
    """
    dest = Path(run_dir) / "checkpoints" / f"step-{step:07d}"
    tmp = staging_dir(dest)
    if backend.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    backend.barrier()
    with backend.full_weights():
        if backend.is_main:
            save_drafter(drafter, drafter_cfg, tmp)
    backend.save_state(tmp, optimizer)
    backend.barrier()
    if backend.is_main:
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / STATE)
        commit(tmp, dest)
    return dest


def publish_best(ckpt: Path, dest: Path) -> Path:
    """Copy a checkpoint's drafter (drafter.safetensors + drafter.json: the full weights, no
    optimizer state) atomically to `dest`, e.g. run_dir/best."""
    return write_atomic(Path(dest), lambda tmp: [shutil.copy2(Path(ckpt) / f, tmp / f)
                                                 for f in (WEIGHTS_FILE, CONFIG_FILE)])


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint, oldest first (half-written staging folders are ignored)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if (p / COMPLETE).is_file() and (p / STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def is_complete_drafter(folder: Path) -> bool:
    """A committed drafter folder: a checkpoint or best/ (COMPLETE marker) with both drafter files."""
    folder = Path(folder)
    return all((folder / f).is_file() for f in (COMPLETE, CONFIG_FILE, WEIGHTS_FILE))


def reference_drafter(run_dir: Path) -> Path | None:
    """The drafter a run's final eval measured: best/, else the latest complete checkpoint."""
    best = Path(run_dir) / "best"
    return best if is_complete_drafter(best) else latest_checkpoint(run_dir)


def resolve_drafter(path) -> tuple[Path, Path | None]:
    """A run dir, checkpoint, best/ or saved-drafter folder -> (the drafter folder to use, the run
    dir it lies in or None). A run dir gives its reference drafter (best/, else the latest
    complete checkpoint); a half-written folder is refused."""
    p = Path(path).expanduser()
    if (p / CONFIG_FILE).is_file():
        inside = p.name == "best" or p.parent.name == "checkpoints"
        if inside and not is_complete_drafter(p):
            raise FileNotFoundError(f"{p} is not a complete checkpoint (no {COMPLETE} marker): a "
                                    f"crash interrupted it; use the run dir or another checkpoint")
        run_dir = p.parent if p.name == "best" else p.parent.parent if inside else None
    else:
        run_dir, p = p, reference_drafter(p)
        if p is None:
            raise FileNotFoundError(f"{run_dir} holds no drafter: expected a training run dir "
                                    f"(best/ or checkpoints/step-*/ with {COMPLETE}) or a folder "
                                    f"with {CONFIG_FILE}")
    if run_dir is not None and not (run_dir / "config.yaml").is_file():
        run_dir = None
    return p, run_dir


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / STATE, map_location="cpu", weights_only=False)


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; remove leftover staging folders."""
    folder = Path(run_dir) / "checkpoints"
    for p in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in [*folder.glob(".tmp-*"), *folder.glob(".old-*")] if folder.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
