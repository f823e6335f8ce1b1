"""Which saved drafter a path means, verified before a byte of it is read.

Every reader of a drafter folder goes through `resolve_drafter`: `python -m decode ckpt=`,
`python -m train.export run=`, `python -m decode.bench --ckpt`, `python -m decode.engine export=`,
and training's resume (train/checkpoint.py, which writes the folders this module reads). A path is

  * a drafter folder (drafter.json + drafter.safetensors: a checkpoint, best/, save_drafter's);
  * an export folder (config.json with a `specdistill` section: drafters/export.py);
  * a training run dir: its reference drafter, the one the run's final eval measured (best/, else
    the newest checkpoint). If that one is damaged, the newest checkpoint that verifies is used
    instead, LOUDLY: a warning, and `DrafterSource.fallback` says which and why (the export job
    writes it into the model card).

Verified means: committed (the COMPLETE marker, for folders inside a run dir) and every file that
MANIFEST.json vouches for is there with its size and sha256 (a folder written before manifests
existed is checked for its required files only). A damaged folder named directly is refused with
each damaged file named, never read. This is the one place outside train/ that knows a run dir's
layout (best/, checkpoints/step-*), so decode/ (which never imports train/) resolves it alike.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specdistill.drafters.cli import UserError
from specdistill.drafters.folder import CONFIG_FILE, WEIGHTS_FILE
from specdistill.drafters.manifest import COMPLETE, MANIFEST, verify, write_manifest  # noqa: F401

log = logging.getLogger(__name__)

BEST, CHECKPOINTS = "best", "checkpoints"  # a run dir's best drafter and its rolling checkpoints
EXPORT_CONFIG = "config.json"  # an export folder's config (its `specdistill` section)


class DamagedFolder(UserError):
    """A drafter folder fails its manifest (or is half-written); the message names each file."""


# ---------------------------------------------------------------------------------------------
# A run dir's drafters
# ---------------------------------------------------------------------------------------------
def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every committed checkpoint of a run, oldest first (staging folders are ignored; damage is
    verify's to find)."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


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


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------
@dataclass
class DrafterSource:
    """What a path resolved to."""

    folder: Path  # the folder read: a drafter folder (drafter.json) or an export (config.json)
    is_export: bool = False  # an export folder (drafters/export.py load_export reads it)
    run_dir: Optional[Path] = None  # the training run it lies in (one with config.yaml), else None
    # set when a run dir's reference drafter was damaged: which folder is used instead, and why
    fallback: Optional[str] = None

    @property
    def run_config(self) -> Optional[dict]:
        """The run's resolved config.yaml as a dict (None outside a run)."""
        from omegaconf import OmegaConf

        if self.run_dir is None:
            return None
        return OmegaConf.to_container(OmegaConf.load(self.run_dir / "config.yaml"), resolve=False)


def _with_run(folder: Path, run_dir: Optional[Path], **kw) -> DrafterSource:
    if run_dir is not None and not (run_dir / "config.yaml").is_file():
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
    if (p / EXPORT_CONFIG).is_file() and not (p / "config.yaml").is_file():  # an export
        damage = verify(p)
        if damage:
            raise DamagedFolder(f"{setting}={path} (an export) is damaged: {'; '.join(damage)}. "
                                f"Export it again (python -m train.export)")
        return DrafterSource(folder=p, is_export=True)
    return _from_run_dir(p, setting)


def load_resolved(source: DrafterSource, target, decode_overrides: Optional[dict] = None):
    """The drafter of a resolved source on `target` (an export through load_export). A drafter
    that does not fit the target is refused naming both targets (drafters/base.py load_drafter);
    for a folder saved before drafters recorded their target, the run's config names it."""
    from specdistill.drafters.base import load_drafter
    from specdistill.drafters.folder import TargetMismatch

    if source.is_export:
        from specdistill.drafters.export import load_export

        return load_export(source.folder, target)
    try:
        return load_drafter(source.folder, target, decode_overrides)
    except TargetMismatch as e:
        trained = ((source.run_config or {}).get("target") or {}).get("path")
        if trained is None or "trained for target" in str(e):
            raise
        raise TargetMismatch(f"{e}; its run {source.run_dir} trained it for target {trained}, "
                             f"the given target is {target.source}") from e
