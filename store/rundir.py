"""A training run dir: its layout, read and written here and nowhere else, and which saved drafter
a path means, verified before a byte of it is read.

    <run_dir>/config.yaml            the job's resolved config (train/rundir.py writes it)
    <run_dir>/checkpoints/step-N/    rolling checkpoints: the drafter (drafter.json +
                                     drafter.safetensors), trainer_state.pt, the backend's state
    <run_dir>/best/                  the drafter with the best simulated tau
    <run_dir>/final_eval/, report.md, metrics.jsonl, plots/, ...   (TRAIN_OUTPUTS)

Every folder is committed atomically (store/atomic.py) with a MANIFEST.json of each file's size and
sha256 and a COMPLETE marker (store/manifest.py). Training writes through `checkpoint_dir`,
`commit`, `write_atomic`, `publish_best` and `prune_checkpoints` (train/checkpoint.py drives them);
every reader goes through `resolve_drafter`: `python -m decode ckpt=`, `specdistill export run=`,
the decode benchmark's --ckpt, `specdistill engine export=`, and training's resume
(`resumable_checkpoint`). A path is

  * a drafter folder (drafter.json + drafter.safetensors: a checkpoint, best/, save_drafter's);
  * an export folder (config.json with a `specdistill` section: export/folder.py);
  * a training run dir: its reference drafter, the one the run's final eval measured (best/, else
    the newest checkpoint). If that one is damaged, the newest checkpoint that verifies is used
    instead, LOUDLY: a warning, and `DrafterSource.fallback` says which and why (the export job
    writes it into the model card).

Verified means: committed (the COMPLETE marker, for folders inside a run dir) and every file that
MANIFEST.json vouches for is there with its size and sha256 (a folder written before manifests
existed is checked for its required files only). A damaged folder named directly is refused with
each damaged file named, never read.
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specdistill.cli.errors import UserError
from specdistill.store.atomic import commit_folder, write_folder
from specdistill.store.drafter import CONFIG_FILE, WEIGHTS_FILE
from specdistill.store.manifest import COMPLETE, verify, write_manifest

log = logging.getLogger(__name__)

# -- the layout ----------------------------------------------------------------------------------
BEST, CHECKPOINTS = "best", "checkpoints"  # a run dir's best drafter and its rolling checkpoints
RUN_CONFIG = "config.yaml"  # the job's resolved config
STATE = "trainer_state.pt"  # a checkpoint's scheduler, data position, RNG and step
REQUIRED = (WEIGHTS_FILE, CONFIG_FILE, STATE)  # every checkpoint has these, whatever the backend
EXPORT_CONFIG = "config.json"  # an export folder's config (its `specdistill` section)
# names a training job writes into its run dir (its log file is appended to, never replaced)
TRAIN_OUTPUTS = ("config.yaml", "config.prev.yaml", ".hydra", ".hydra.prev", "metrics.jsonl",
                 "metrics.prev.jsonl", "checkpoints", "best", "final_eval", "plots", "report.md",
                 "summary.json", "wandb", "wandb_run_id", "tensorboard", "run.lock")
# what only a training job leaves: a folder holding one of these is a training run dir
TRAIN_MARKERS = ("run.lock", "metrics.jsonl", "checkpoints", "wandb_run_id")
# an unfinished job's records that a fresh job sets aside instead of appending to
UNFINISHED = ("metrics.jsonl", "wandb_run_id", "tensorboard")


# -- reading a run dir's drafters ---------------------------------------------------------------
class DamagedFolder(UserError):
    """A drafter folder fails its manifest (or is half-written); the message names each file."""


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every committed checkpoint of a run, oldest first (staging folders are ignored; damage is
    verify's to find)."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest committed checkpoint of a run (None: none)."""
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def drafter_problems(folder: Path) -> list[str]:
    """What stops a committed drafter folder (checkpoint, best/) from being read: [] when none."""
    folder = Path(folder)
    if not (folder / COMPLETE).is_file():
        return [f"{folder}: no {COMPLETE} marker (a crash interrupted writing it)"]
    return verify(folder, (CONFIG_FILE, WEIGHTS_FILE))


def is_complete_drafter(folder: Path) -> bool:
    """A committed drafter folder whose every file verifies."""
    return not drafter_problems(folder)


def reference_drafter(run_dir: Path) -> Optional[Path]:
    """The drafter a run's final eval measured, damaged or not: best/ when the run committed one,
    else its newest checkpoint (train/final_eval.py)."""
    best = Path(run_dir) / BEST
    if (best / COMPLETE).is_file():
        return best
    ckpts = complete_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def _run_dir_of(folder: Path) -> Optional[Path]:
    """The training run a drafter folder lies in (best/ or checkpoints/step-*), else None."""
    if folder.name == BEST:
        return folder.parent
    if folder.parent.name == CHECKPOINTS:
        return folder.parent.parent
    return None


# -- writing a run dir's drafters (train/checkpoint.py) ------------------------------------------
def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """checkpoints/step-<step>/ of a run (zero-padded: names sort in step order)."""
    return Path(run_dir) / CHECKPOINTS / f"step-{step:07d}"


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


def publish_best(ckpt: Path, dest: Path) -> Path:
    """Copy a checkpoint's drafter (drafter.safetensors + drafter.json: the full weights, no
    optimizer state) atomically to `dest`, e.g. run_dir/best."""
    return write_atomic(Path(dest), lambda tmp: [shutil.copy2(Path(ckpt) / f, tmp / f)
                                                 for f in (WEIGHTS_FILE, CONFIG_FILE)])


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; remove leftover staging folders."""
    folder = Path(run_dir) / CHECKPOINTS
    for p in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in [*folder.glob(".tmp-*"), *folder.glob(".old-*")] if folder.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)


# -- resuming ------------------------------------------------------------------------------------
class CheckpointError(UserError):
    """No checkpoint of a run verifies; the message lists each damaged one and why."""


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


# -- resolution: which drafter a path means ------------------------------------------------------
@dataclass
class DrafterSource:
    """What a path resolved to."""

    folder: Path  # the folder read: a drafter folder (drafter.json) or an export (config.json)
    is_export: bool = False  # an export folder (export/folder.py load_export reads it)
    run_dir: Optional[Path] = None  # the training run it lies in (one with config.yaml), else None
    # set when a run dir's reference drafter was damaged: which folder is used instead, and why
    fallback: Optional[str] = None

    @property
    def run_config(self) -> Optional[dict]:
        """The run's resolved config.yaml as a dict (None outside a run)."""
        from omegaconf import OmegaConf

        if self.run_dir is None:
            return None
        return OmegaConf.to_container(OmegaConf.load(self.run_dir / RUN_CONFIG), resolve=False)


def _with_run(folder: Path, run_dir: Optional[Path], **kw) -> DrafterSource:
    if run_dir is not None and not (run_dir / RUN_CONFIG).is_file():
        run_dir = None
    return DrafterSource(folder=folder, run_dir=run_dir, **kw)


def _from_run_dir(run_dir: Path, setting: str) -> DrafterSource:
    """A run dir's reference drafter, else the newest checkpoint that verifies (loudly)."""
    ref = reference_drafter(run_dir)
    if ref is None:
        raise FileNotFoundError(f"{setting}={run_dir} holds no drafter: expected a training run dir "
                                f"({BEST}/ or {CHECKPOINTS}/step-*/ with {COMPLETE}), a checkpoint "
                                f"or drafter folder ({CONFIG_FILE}) or an export ({EXPORT_CONFIG})")
    damage = drafter_problems(ref)
    if not damage:
        return _with_run(ref, run_dir)
    for ck in reversed(complete_checkpoints(run_dir)):
        if ck != ref and not drafter_problems(ck):
            why = (f"{ref.name}/ is damaged ({'; '.join(damage)}), so {ck.relative_to(run_dir)} is "
                   f"used: the newest checkpoint that verifies, NOT the drafter the run's final "
                   f"eval measured")
            log.warning("USING AN OLDER DRAFTER of %s: %s", run_dir, why)
            return _with_run(ck, run_dir, fallback=why)
        if ck != ref:
            damage += drafter_problems(ck)
    raise DamagedFolder(f"no drafter in {run_dir} verifies: {'; '.join(damage)}. Restore the files "
                        f"(or retrain)")


def resolve_drafter(path, setting: str = "ckpt") -> DrafterSource:
    """A run dir, checkpoint, best/, drafter folder or export folder -> the verified folder to
    read. `setting` names the option in messages (ckpt, run, --ckpt, export)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{setting}={path} does not exist; give a training run dir, a "
                                f"checkpoint or drafter folder, or an export folder")
    if (p / CONFIG_FILE).is_file():  # a drafter folder
        run_dir = _run_dir_of(p)
        damage = drafter_problems(p) if run_dir is not None else verify(p, (WEIGHTS_FILE,))
        if damage:
            hint = (f"; or pass the run dir {setting}={run_dir}, which falls back to the newest "
                    f"checkpoint that verifies" if run_dir is not None else "")
            raise DamagedFolder(f"{setting}={path} is damaged: {'; '.join(damage)}. Restore the "
                                f"files{hint}")
        return _with_run(p, run_dir)
    if (p / EXPORT_CONFIG).is_file() and not (p / RUN_CONFIG).is_file():  # an export
        damage = verify(p)
        if damage:
            raise DamagedFolder(f"{setting}={path} (an export) is damaged: {'; '.join(damage)}. "
                                f"Export it again (python -m train.export)")
        return DrafterSource(folder=p, is_export=True)
    return _from_run_dir(p, setting)
