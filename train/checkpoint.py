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

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from specdistill.drafters.atomic import commit_folder, staging_dir, write_folder
from specdistill.drafters.target import file_sha256
from specdistill.drafters.base import CONFIG_FILE, WEIGHTS_FILE, save_drafter

COMPLETE = "COMPLETE"
STATE = "trainer_state.pt"
MANIFEST = "MANIFEST.json"  # every file's size and sha256, written before COMPLETE
log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No checkpoint of a run verifies; the message lists each damaged one and why."""


def _files(folder: Path) -> list[Path]:
    """Every file under `folder` except the manifest and the COMPLETE marker, sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE))


def write_manifest(folder: Path) -> None:
    """Record size and sha256 of every file in `folder` (called on the staging folder)."""
    entries = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
               for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


def verify(folder: Path, required: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with a committed folder (checkpoint, best/): [] when every file the manifest
    vouches for is there with its size and hash, and every `required` file exists. A folder written
    before manifests existed is checked for `required` files only."""
    folder = Path(folder)
    problems = [f"{folder / f}: missing" for f in required if not (folder / f).is_file()]
    if not (folder / MANIFEST).is_file():
        return problems
    try:
        entries = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return problems + [f"{folder / MANIFEST}: unreadable ({e})"]
    for rel, want in sorted(entries.items()):
        f = folder / rel
        if not f.is_file():
            if f"{f}: missing" not in problems:
                problems.append(f"{f}: missing")
        elif f.stat().st_size != want["size"]:
            problems.append(f"{f}: {f.stat().st_size} bytes, the manifest says {want['size']} "
                            f"(truncated or overwritten)")
        elif file_sha256(f) != want["sha256"]:
            problems.append(f"{f}: content differs from the manifest's sha256 (corrupted)")
    return problems


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


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint, oldest first (half-written staging folders are ignored)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if (p / COMPLETE).is_file()]  # damage: verify()
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def is_complete_drafter(folder: Path) -> bool:
    """A committed drafter folder (a checkpoint or best/): COMPLETE marker, both drafter files,
    and every file its manifest vouches for intact (verify)."""
    folder = Path(folder)
    return (folder / COMPLETE).is_file() and not verify(folder, (CONFIG_FILE, WEIGHTS_FILE))


def reference_drafter(run_dir: Path) -> Path | None:
    """The drafter a run's final eval measured: best/, else the latest complete checkpoint."""
    best = Path(run_dir) / "best"
    if is_complete_drafter(best):
        return best
    return next((c for c in reversed(complete_checkpoints(run_dir)) if is_complete_drafter(c)), None)


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
