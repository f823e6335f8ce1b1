"""Training checkpoints, written by one process or by every rank of a job.

A checkpoint is a folder `checkpoints/step-XXXXXXX/` with the drafter (drafter.safetensors +
drafter.json, never the frozen target), `trainer_state.pt` (scheduler, data position, RNG, step)
and what the backend needs to resume (train/backends.py `save_state`: `optimizer.pt`, or
DeepSpeed's per-rank shards under `deepspeed/`). It is written into a hidden staging folder,
flushed, marked COMPLETE and renamed into place: a crash (kill -9, a full disk) at any moment
leaves either the previous checkpoints or the new one, never half of one, and only folders with
COMPLETE are ever resumed from. The run dir's layout, its commits and their verification live in
store/rundir.py, where every reader finds them; this module adds what only training has: the
collective write, the trainer state and its RNG.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from specdistill.store.atomic import staging_dir
from specdistill.store.drafter import save_drafter
from specdistill.store.rundir import STATE, checkpoint_dir, commit


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_checkpoint(run_dir: Path, step: int, backend, drafter, drafter_cfg,
                    optimizer: torch.optim.Optimizer, trainer_state: dict) -> Path:
    """Collective (every rank calls it): write checkpoints/step-<step>/ atomically, return it.

    1. Rank 0 clears the staging folder (a crash may have left one) and creates it.
    2. Inside backend.full_weights() (ZeRO-3 gathers the shards) rank 0 writes the full drafter.
    3. backend.save_state: the optimizer (torch), or every rank's ZeRO shards (DeepSpeed).
    4. Once every rank is done, rank 0 writes trainer_state.pt and commits the folder.
    """
    dest = checkpoint_dir(run_dir, step)
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


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / STATE, map_location="cpu", weights_only=False)
