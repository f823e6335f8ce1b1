"""What a training job may find in its run dir, and what it leaves of an earlier job there.

A run dir belongs to ONE training run: its first job and the jobs that resume it. Before a job
writes anything (`check_run_dir_arg` runs before Hydra creates the folder; the recipe repeats
the check for programmatic use), it refuses
  * a run dir a live job holds (run.lock),
  * a folder that holds another kind of job's or the user's files under a name training writes
    (a decode run dir's config.yaml and .hydra/, a project's own config.yaml or report.md),
  * another run's checkpoints without resume=true.
A job that starts fresh in the run dir of a job that died before its first checkpoint keeps that
job's metrics, W&B id and TensorBoard events as `*.prev` (`set_aside_unfinished`) instead of
appending to them. Hydra's `.hydra/` record is written by the job itself, after setup succeeded
(`write_hydra_record`), so a refused job never rewrites the first job's.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import yaml

from specdistill.cli.errors import UserError
from specdistill.cli.paths import listing, override, present
from specdistill.store.rundir import RUN_CONFIG, TRAIN_MARKERS, TRAIN_OUTPUTS, UNFINISHED, latest_checkpoint
from specdistill.train.runlock import RunLock

log = logging.getLogger(__name__)



def is_training_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a training run's files (its markers, or a config.yaml with a
    `trainer` section)."""
    if present(run_dir, TRAIN_MARKERS):
        return True
    config = Path(run_dir) / RUN_CONFIG
    try:
        return isinstance(cfg := yaml.safe_load(config.read_text()), dict) and "trainer" in cfg
    except (OSError, yaml.YAMLError):
        return False


def check_contents(run_dir: Path, resume: bool) -> None:
    """Refuse a run dir holding another kind of job's files under names training writes, or
    another run's checkpoints without resume=true."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    if not is_training_run(run_dir):
        clash = present(run_dir, TRAIN_OUTPUTS)
        if clash:
            raise FileExistsError(
                f"run_dir {run_dir} holds files that are not a training run's ({listing(clash)}: "
                f"another command's output or your own); training would replace them. Give a new "
                f"run_dir=")
    if not resume and latest_checkpoint(run_dir) is not None:
        raise FileExistsError(f"run_dir {run_dir} already holds checkpoints of another run: pass "
                              f"resume=true to continue it or a new run_dir=")


def check_run_dir_arg(argv: list[str]) -> None:
    """`python -m train ...` before Hydra creates or writes anything in the run dir: the run dir
    the command names (run_dir=, else a launcher's run id) must be free (no live lock) and fit
    (check_contents). A multirun sweep gives each job its own dir; ranks > 0 leave it to rank 0."""
    from specdistill.train.distributed import env_rank, run_id

    if "-m" in argv or "--multirun" in argv or env_rank() != 0:
        return
    run_dir = override(argv, "run_dir")
    if run_dir is None:
        if not any(os.environ.get(v, "none") != "none"
                   for v in ("RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")):
            return  # the default: a new folder named by the start time
        run_dir = f"runs/train/{run_id()}"
    run_dir = Path(run_dir).expanduser()
    RunLock(run_dir).check_free()
    check_contents(run_dir, resume=str(override(argv, "resume")).lower() in ("true", "1", "yes"))


def set_aside_unfinished(run_dir: Path) -> list[str]:
    """A job starting fresh in the run dir of a job that wrote no checkpoint: that job's
    metrics.jsonl, wandb_run_id and tensorboard/ become `<name>.prev` (numbered when taken), so
    its rows are not mixed with this job's (steps 1-3 twice). Returns what was moved."""
    run_dir = Path(run_dir)
    moved = []
    for name in present(run_dir, UNFINISHED):
        src = run_dir / name
        stem, dot, ext = name.partition(".")
        dest, n = run_dir / f"{stem}.prev{dot}{ext}", 1
        while dest.exists():
            n += 1
            dest = run_dir / f"{stem}.prev{n}{dot}{ext}"
        os.replace(src, dest)
        moved.append(f"{name} -> {dest.name}")
    if moved:
        log.warning("run_dir %s: an earlier job stopped there before its first checkpoint; this "
                    "job starts fresh and keeps that job's records aside (%s)", run_dir,
                    ", ".join(moved))
    return moved


def write_hydra_record(run_dir: Path, cfg) -> None:
    """Hydra's `.hydra/` record of this job (config.yaml, hydra.yaml, overrides.yaml, as Hydra
    writes them), written once setup succeeded; an earlier job's becomes `.hydra.prev/`. Nothing
    outside a Hydra run (tests, the API)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    folder, prev = Path(run_dir) / ".hydra", Path(run_dir) / ".hydra.prev"
    if folder.is_dir():
        shutil.rmtree(prev, ignore_errors=True)
        os.replace(folder, prev)
    folder.mkdir()
    OmegaConf.save(cfg, folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hydra_cfg)}),
                   folder / "hydra.yaml")
    OmegaConf.save(hydra_cfg.overrides.task, folder / "overrides.yaml")


def write_config(run_dir: Path, cfg) -> None:
    """The resolved config.yaml (the previous one kept as config.prev.yaml) and Hydra's .hydra/
    record of a training job."""
    from omegaconf import OmegaConf

    path = run_dir / RUN_CONFIG
    if path.is_file():
        os.replace(path, run_dir / "config.prev.yaml")
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    write_hydra_record(run_dir, cfg)


MIN_FREE_BYTES = 64 * 2**20  # config, metrics and logs of a run, before any checkpoint


def check_disk_space(run_dir: Path, need: int, keep_last: int) -> None:
    """Fail before training when the run dir's disk cannot hold the rolling checkpoints."""
    need = max(need, MIN_FREE_BYTES)
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise UserError(f"only {free / 2**20:.0f} MiB free under {run_dir}; this run's checkpoints "
                      f"(keep_last={keep_last} + best + one being written) need about "
                      f"{need / 2**20:.0f} MiB. Free space or set run_dir= to another disk.")


def interrupt_hint(run_dir: str) -> str:
    """What Ctrl-C tells the user: resume=true only when there is a checkpoint to resume."""
    if latest_checkpoint(Path(run_dir)) is not None:
        return (f"Continue this run with: python -m train run_dir={run_dir} resume=true (plus the "
                f"same overrides)")
    return (f"No checkpoint was written yet, so there is nothing to resume: run the same command "
            f"again (it starts fresh in run_dir={run_dir}, keeping this job's metrics as "
            f"metrics.prev.jsonl)")
