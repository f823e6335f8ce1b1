"""Training backends: the loop in train/recipe.py talks only to this interface.

`TorchBackend` runs single-process, or torch DDP when launched by torchrun (WORLD_SIZE > 1; gloo
on CPU, nccl on GPU). A DeepSpeed backend implements the same five methods.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from typing import Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn


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

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class TorchBackend:
    def __init__(self, device: str, timeout_s: int = 600) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        self.ddp = None
        if self.world_size > 1 and not dist.is_initialized():
            # A timeout makes a dead rank stop the job with an error instead of hanging forever.
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

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

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            value = value.detach().clone()
            dist.all_reduce(value)
            value /= self.world_size
        return value

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def build_backend(name: str, device: str) -> Backend:
    if name == "torch":
        return TorchBackend(device)
    if name == "deepspeed":
        raise NotImplementedError("trainer.backend=deepspeed arrives with the scale-out work; "
                                  "use trainer.backend=torch (single process or DDP under torchrun)")
    raise ValueError(f"unknown trainer.backend {name!r}; use torch or deepspeed")


def rank_iter(items: list, rank: int, world_size: int) -> Iterator:
    """Every world_size-th item starting at rank: a disjoint shard per rank."""
    return iter(items[rank::world_size])
