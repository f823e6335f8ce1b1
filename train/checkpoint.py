"""Atomic training checkpoints, written by one process or by every rank of a job.

A checkpoint is a folder `checkpoints/step-XXXXXXX/` with the drafter (drafter.safetensors +
drafter.json, never the frozen target), `trainer_state.pt` (scheduler, data position, RNG, step)
and what the backend needs to resume (train/backends.py `save_state`: `optimizer.pt`, or
DeepSpeed's per-rank shards under `deepspeed/`). It is written into a hidden staging folder,
flushed, marked COMPLETE and renamed into place: a crash (kill -9, a full disk) at any moment
leaves either the previous checkpoints or the new one, never half of one, and only folders with
COMPLETE are ever resumed from. The layout (best/, checkpoints/step-*), the manifest and its check
live in drafters/resolve.py, where every reader of a drafter folder finds them.
"""
from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from specdistill.drafters.atomic import commit_folder, staging_dir, write_folder
from specdistill.drafters.base import CONFIG_FILE, WEIGHTS_FILE, save_drafter
from specdistill.drafters.cli import UserError
# the folder layout and its verification are shared with every reader (decode, export, bench):
from specdistill.drafters.resolve import (BEST, CHECKPOINTS, COMPLETE, MANIFEST,  # noqa: F401
                                          DrafterSource, complete_checkpoints, drafter_problems,
                                          is_complete_drafter, reference_drafter, resolve_drafter,
                                          verify, write_manifest)

STATE = "trainer_state.pt"
log = logging.getLogger(__name__)


class CheckpointError(UserError):
    """No checkpoint of a run verifies; the message lists each damaged one and why."""


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def commit(tmp: Path, dest: Path) -> Path:
    """Record the staging folder's manifest, mark it COMPLETE, flush it and rename it to `dest`
    (replacing it)."""
    write_manifest(tmp)
    return commit_folder(tmp, dest, marker=COMPLETE)


def write_atomic(dest: Path, fill) -> Path:
    """Create folder `dest` atomically from one process: `fill(tmp)` writes into the staging
    folder, which is then committed (manifest, COMPLETE)."""
    def fill_and_record(tmp: Path) -> None:
        fill(tmp)
        write_manifest(tmp)

    return write_folder(Path(dest), fill_and_record, marker=COMPLETE)


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


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


REQUIRED = (WEIGHTS_FILE, CONFIG_FILE, STATE)  # every checkpoint has these, whatever the backend


def resumable_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint that verifies (None: the run has none). A damaged newer one
    is named with what is wrong and skipped, loudly; when every one is damaged, CheckpointError
    lists them all."""
    damaged = []
    for ck in reversed(complete_checkpoints(run_dir)):
        problems = verify(ck, REQUIRED)
        if not problems:
            if damaged:
                log.warning("RESUMING FROM AN OLDER CHECKPOINT %s: the newer ones are damaged:\n  %s",
                            ck.name, "\n  ".join(damaged))
            return ck
        damaged += problems
        log.error("checkpoint %s is damaged: %s", ck, "; ".join(problems))
    if damaged:
        raise CheckpointError("no checkpoint in {} verifies:\n  {}\nRestore the files, or delete "
                              "{}/checkpoints and start a new run (resume=false)".format(
                                  run_dir, "\n  ".join(damaged), run_dir))
    return None


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / STATE, map_location="cpu", weights_only=False)


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; remove leftover staging folders."""
    folder = Path(run_dir) / "checkpoints"
    for p in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in [*folder.glob(".tmp-*"), *folder.glob(".old-*")] if folder.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
