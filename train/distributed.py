"""The launch environment and the process group, shared by every training backend.

What the launcher tells a process (its rank under torchrun or SLURM tasks of Hydra's submitit
launcher), the job's run id that names the one run dir all ranks share, joining the process group
with a timeout, the translation of a dead or hung peer into an error that says what happened, and
`ProcessGroupMixin`: what every backend does alike once its rank and world size are known.

train/backends.py (the `Backend` interface, torch / DDP) and train/deepspeed_backend.py (ZeRO) both
build on this module, so neither imports the other at module level.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
from typing import Iterator

import torch
import torch.distributed as dist


# ---------------------------------------------------------------------------- launch environment
def export_slurm_task_env() -> None:
    """Tasks started by SLURM without torchrun (Hydra's submitit launcher with tasks_per_node > 1)
    carry SLURM_PROCID etc., not RANK/WORLD_SIZE: export the torch names (submitit's own mapping;
    the master is the first node of the job). A no-op under torchrun or outside SLURM."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    if "SUBMITIT_EXECUTOR" not in os.environ:  # srun + torchrun: torchrun sets the variables
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def _agent_start_time() -> str | None:
    """Under torchrun without --rdzv-id, the start time of the torchrun agent (the parent of every
    local rank): the same string on all ranks of the node, unlike each rank's own clock."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    import psutil  # a dependency of accelerate and deepspeed

    started = psutil.Process(os.getppid()).create_time()
    return datetime.datetime.fromtimestamp(started).strftime("%Y-%m-%d_%H-%M-%S")


def run_id() -> str:
    """The id that names this job's run dir, identical on every rank of the job: $RUN_ID, else the
    torchrun rendezvous id (--rdzv-id; torchrun's default is "none"), else $SLURM_JOB_ID (a requeued
    job keeps it, so resume=true finds its checkpoints), else the start time of the torchrun agent
    or of this process. `${now:}` would differ per rank and give every rank its own folder."""
    for var in ("RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var, "")
        if value and value != "none":
            if not re.fullmatch(r"[A-Za-z0-9._-]+", value):
                raise ValueError(f"${var}={value!r} names the run dir: use letters, digits, . _ -")
            return value
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:  # nodes would disagree on a time
        raise ValueError("several torchrun nodes and no run id: pass torchrun --rdzv-id=<id> "
                         "(launch/slurm.sbatch passes the job id), RUN_ID=<id> or run_dir=<dir>")
    return _agent_start_time() or datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


_LAUNCH_VARS = ("RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "GROUP_WORLD_SIZE")
_RUN_IDS: dict[tuple, str] = {}  # run_id() per launch environment, fixed for this process


def job_run_id() -> str:
    """The `${run_id:}` of conf/train.yaml: run_id() (fixed once per process), plus `_<n>` for
    job n of a multirun sweep (`python -m train -m ...`), whose jobs would otherwise share one id
    (a local sweep runs them all in one process) and so one run dir. Registered uncached: Hydra
    resolves it while composing each job, before the job's number is known; a cached value
    would stick."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    key = tuple(os.environ.get(v, "") for v in _LAUNCH_VARS)
    if key not in _RUN_IDS:
        _RUN_IDS[key] = run_id()
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return f"{_RUN_IDS[key]}_{HydraConfig.get().job.num}"
    return _RUN_IDS[key]


def env_rank() -> int:
    """This process's global rank as the launcher tells it, before any process group exists:
    RANK (torchrun), SLURM_PROCID for tasks of Hydra's submitit launcher, else 0."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SUBMITIT_EXECUTOR" in os.environ:
        return int(os.environ.get("SLURM_PROCID", "0"))
    return 0


def rank_zero_log(path: str) -> str:
    """Hydra's log file on rank 0, the null device on the other ranks (one log per job)."""
    return path if env_rank() == 0 else os.devnull


# what gloo / NCCL say when a peer is gone (connection closed) or silent (timeout)
_PEER_FAILURE = re.compile(r"timed out|timeout|connection (closed|reset)|closed by peer|"
                           r"broken pipe|communicator was aborted|watchdog caught", re.IGNORECASE)


def peer_failure_message(exc: BaseException, timeout_s: int) -> str | None:
    """A clear message when `exc` is a collective that failed because another rank died or hung
    (gloo/nccl timeouts, closed connections); None for any other error."""
    dist_error = getattr(dist, "DistError", ())
    if not (isinstance(exc, dist_error) or (isinstance(exc, RuntimeError)
                                             and _PEER_FAILURE.search(str(exc)))):
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return (f"rank {dist.get_rank()}/{dist.get_world_size()}: a collective failed, most likely "
            f"because another rank died or hung (trainer.dist_timeout_s={timeout_s}). Check the "
            f"other ranks' logs; resume=true continues from the last complete checkpoint. "
            f"Cause: {str(exc).splitlines()[0][:300]}")


def init_distributed(device: torch.device, timeout_s: int, always: bool = False) -> None:
    """Join the job's process group (env:// rendezvous; gloo on CPU, nccl on GPU) with a timeout,
    so a dead rank stops the job with an error instead of hanging forever. `always` starts a group
    of one when there is no launcher (DeepSpeed needs one): the env variables torchrun would set."""
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not always:
        return
    if "RANK" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("WORLD_SIZE > 1 but no RANK: start the job with torchrun "
                           "(launch/torchrun.sh, launch/slurm.sbatch)")
    if "RANK" not in os.environ:  # no launcher: a group of one on this machine
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device this rank runs on: `device` itself, or GPU number local_rank for cuda."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    return dev


# ------------------------------------------------------------------------------- process group
class ProcessGroupMixin:
    """What every backend does alike once its rank and world size are known."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            value = value.detach().clone()
            dist.all_reduce(value)
            value /= self.world_size
        return value

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
