"""Training backends: the loop in train/recipe.py talks only to the `Backend` interface.

`TorchBackend` runs single-process, or torch DDP when launched by torchrun (WORLD_SIZE > 1; gloo on
CPU, nccl on GPU). `DeepSpeedBackend` (train/deepspeed_backend.py) runs ZeRO-2/3 behind the same
methods. What differs between them (who holds which weights, how optimizer state is saved) stays
behind `full_weights`, `save_state` and `load_state`, so the recipe has one shape for both.

This module also reads the launch environment: the rank variables (torchrun, or SLURM tasks started
by Hydra's submitit launcher), the job's run id that names the one run dir all ranks share, and the
translation of a dead or hung peer into an error that says what happened.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
from pathlib import Path
from typing import ContextManager, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

OPTIMIZER_FILE = "optimizer.pt"  # TorchBackend's optimizer state inside a checkpoint folder


class Backend(Protocol):
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool: ...

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Wrap the trainable model for this backend; return what forward passes go through."""

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        """Accumulate gradients; `sync` is False on micro-batches that do not end a step."""

    def step(self, optimizer: torch.optim.Optimizer, params, max_norm: float) -> float:
        """Clip, take the optimizer step, zero the grads; return the pre-clip grad norm."""

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a tensor over ranks."""

    def full_weights(self) -> ContextManager:
        """Collective: inside the block the prepared model holds its full weights on every rank
        (ZeRO-3 gathers its shards), for evaluation and for saving the drafter."""

    def main_first(self) -> ContextManager:
        """Collective: rank 0 runs the block first (downloads, caches), then the other ranks."""

    def save_state(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """Collective: write what resuming needs beyond drafter.safetensors (optimizer state;
        DeepSpeed: its engine checkpoint) into a checkpoint's staging folder."""

    def load_state(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Collective: restore the model weights and optimizer state saved in a checkpoint."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...


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


def env_rank() -> int:
    """This process's global rank as the launcher tells it, before any process group exists:
    RANK (torchrun), SLURM_PROCID for tasks of Hydra's submitit launcher, else 0."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SUBMITIT_EXECUTOR" in os.environ:
        return int(os.environ.get("SLURM_PROCID", "0"))
    return 0


def rank_zero_only(value: str) -> str | None:
    """`value` on rank 0, None on the other ranks (Hydra's .hydra/ folder is written once)."""
    return value if env_rank() == 0 else None


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


def _device(device: str, local_rank: int) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    return dev


# ------------------------------------------------------------------------------------ torch / DDP
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


class TorchBackend(ProcessGroupMixin):
    def __init__(self, device: str, timeout_s: int = 1800) -> None:
        export_slurm_task_env()
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = _device(device, self.local_rank)
        self.ddp = None
        init_distributed(self.device, timeout_s)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        if self.world_size == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return self.ddp

    def _no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync() if (self.ddp is not None and not sync) else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        with self._no_sync(sync):
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, params, max_norm: float) -> float:
        params = [p for p in params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_weights(self) -> ContextManager:
        return contextlib.nullcontext()  # every rank holds the whole drafter

    def save_state(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        if self.is_main:  # DDP keeps identical optimizer state on every rank
            torch.save(optimizer.state_dict(), Path(folder) / OPTIMIZER_FILE)

    def load_state(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from safetensors.torch import load_file

        from drafters.base import WEIGHTS_FILE
        from train.checkpoint import STATE

        folder = Path(folder)
        if (folder / OPTIMIZER_FILE).is_file():
            state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=False)
        else:  # checkpoints from before optimizer.pt kept it in trainer_state.pt
            state = torch.load(folder / STATE, map_location="cpu", weights_only=False).get("optimizer")
            if state is None:
                raise FileNotFoundError(f"{folder} holds no {OPTIMIZER_FILE}: it was written by "
                                        f"trainer.backend=deepspeed; resume with that backend")
        model.load_state_dict(load_file(str(folder / WEIGHTS_FILE), device=str(self.device)))
        optimizer.load_state_dict(state)


def build_backend(trainer_cfg, device: str, deepspeed_cfg=None) -> Backend:
    """The backend named by trainer.backend, with the job's timeout (and ZeRO settings)."""
    name = trainer_cfg.backend
    if name == "torch":
        return TorchBackend(device, trainer_cfg.dist_timeout_s)
    if name == "deepspeed":
        from train.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(device, trainer_cfg, deepspeed_cfg)
    raise ValueError(f"unknown trainer.backend {name!r}; use torch or deepspeed")

