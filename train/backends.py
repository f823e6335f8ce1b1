"""Training backends: the loop in train/recipe.py talks only to the `Backend` interface.

`TorchBackend` runs single-process, or torch DDP when launched by torchrun (WORLD_SIZE > 1; gloo on
CPU, nccl on GPU). `DeepSpeedBackend` (train/deepspeed_backend.py) runs ZeRO-2/3 behind the same
methods. What differs between them (who holds which weights, how optimizer state is saved) stays
behind `full_weights`, `save_state` and `load_state`, so the recipe has one shape for both.

The launch environment (ranks, the run id, the process group, dead-peer errors) is
train/distributed.py, shared with the DeepSpeed backend.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import ContextManager, Protocol

import torch
from torch import nn

from specdistill.train.distributed import (
    ProcessGroupMixin,
    export_slurm_task_env,
    init_distributed,
    rank_device,
)

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


# ------------------------------------------------------------------------------------ torch / DDP
class TorchBackend(ProcessGroupMixin):
    def __init__(self, device: str, timeout_s: int = 1800) -> None:
        export_slurm_task_env()
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = rank_device(device, self.local_rank)
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

        from specdistill.store.drafter import WEIGHTS_FILE
        from specdistill.store.rundir import STATE

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
        from specdistill.train.deepspeed_backend import DeepSpeedBackend

        return DeepSpeedBackend(device, trainer_cfg, deepspeed_cfg)
    raise ValueError(f"unknown trainer.backend {name!r}; use torch or deepspeed")

