"""DeepSpeed ZeRO-2/3 behind the `Backend` interface (train/backends.py): `trainer.backend=deepspeed`
with `deepspeed=zero2` (default) or `deepspeed=zero3`.

What goes to DeepSpeed, and why:
  * Only the drafter. The frozen target is a plain attribute of the drafter, not a submodule, so
    `deepspeed.initialize(model=drafter)` never sees it: ZeRO partitions none of its weights and
    engine checkpoints never contain it (tests/test_deepspeed.py checks both).
  * The recipe's own torch AdamW as a client optimizer, wrapped by ZeRO. The recipe's LambdaLR keeps
    driving its learning rate (ZeRO re-points the param groups' params, not the group dicts), and
    no DeepSpeed optimizer is built: its FusedAdam is a C++ JIT build that needs a compiler (what
    `"torch_adam": true` avoids for a config-built optimizer).
  * Batch size, gradient accumulation, clipping and bf16 from `trainer`, so a job means the same on
    both backends. The recipe scales each micro-batch loss by 1/grad_accum and marks the last one
    (`sync`); DeepSpeed is told the boundary explicitly and does not rescale.
Checkpoints: `engine.save_checkpoint` writes every rank's shards into the checkpoint's staging folder
(subfolder `deepspeed/`), which train/checkpoint.py marks COMPLETE and renames only after all ranks
are done; resume loads them with `engine.load_checkpoint`. Evaluation and drafter export run inside
`full_weights()`, which under ZeRO-3 gathers the full 16-bit (or fp32) parameters on every rank.
On CPU the process group is gloo; without a launcher the env variables torchrun would set are set.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from specdistill.train.distributed import (
    ProcessGroupMixin,
    export_slurm_task_env,
    init_distributed,
    rank_device,
)

TAG = "deepspeed"  # engine checkpoint subfolder inside checkpoints/step-XXXXXXX/


def _plain(cfg) -> dict[str, Any]:
    if cfg is None:
        return {}
    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    if hasattr(cfg, "__dataclass_fields__"):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return dict(cfg)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(trainer_cfg, ds_cfg, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON config of a job: ZeRO settings from the `deepspeed` group, the batch
    geometry, clipping and precision from `trainer`, then `deepspeed.extra` merged on top."""
    ds = _plain(ds_cfg)
    stage = int(ds.get("zero_stage", 2))
    if stage not in (2, 3):
        raise ValueError(f"deepspeed.zero_stage={stage}: use 2 or 3 (conf/deepspeed/zero2.yaml, "
                         f"zero3.yaml); for no sharding use trainer.backend=torch")
    if trainer_cfg.precision not in ("fp32", "bf16"):
        raise ValueError(f"trainer.precision={trainer_cfg.precision!r}: use fp32 or bf16")
    zero: dict[str, Any] = {"stage": stage,
                            "overlap_comm": ds.get("overlap_comm", False),
                            "contiguous_gradients": ds.get("contiguous_gradients", True),
                            "reduce_bucket_size": ds.get("reduce_bucket_size", 50_000_000)}
    if stage == 2:
        zero["allgather_bucket_size"] = ds.get("allgather_bucket_size", 50_000_000)
    else:
        zero.update(stage3_prefetch_bucket_size=ds.get("stage3_prefetch_bucket_size", 5_000_000),
                    stage3_param_persistence_threshold=ds.get(
                        "stage3_param_persistence_threshold", 10_000),
                    stage3_gather_16bit_weights_on_model_save=True)
    micro, accum = trainer_cfg.batch_size, trainer_cfg.grad_accum
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,
        "gradient_clipping": float(trainer_cfg.grad_clip),
        "bf16": {"enabled": trainer_cfg.precision == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,  # the recipe logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }
    return _merge(config, ds.get("extra") or {})


class DeepSpeedBackend(ProcessGroupMixin):
    def __init__(self, device: str, trainer_cfg, ds_cfg=None) -> None:
        try:
            import deepspeed
        except ImportError as e:
            raise ImportError("trainer.backend=deepspeed needs DeepSpeed: "
                              "bash launch/install.sh deepspeed (pip install -e '.[deepspeed]')") from e
        deepspeed.utils.logger.setLevel(logging.WARNING)
        if device == "cpu":  # its shared-memory all-reduce serves inference only, and is a C++
            # JIT build (~1 min, needs a compiler): skip it. (`import deepspeed.comm.torch as x`
            # would bind the torch package, an attribute of deepspeed.comm, not this module.)
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        export_slurm_task_env()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = rank_device(device, self.local_rank)
        timeout_s = trainer_cfg.dist_timeout_s
        init_distributed(self.device, timeout_s, always=True)  # DeepSpeed needs a group, even of one
        deepspeed.init_distributed(dist_backend=dist.get_backend(),
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.config = deepspeed_config(trainer_cfg, ds_cfg, self.world_size)
        self.zero_stage = self.config["zero_optimization"]["stage"]
        self.engine = None

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        import deepspeed

        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not owned <= trainable:
            raise ValueError("deepspeed: the optimizer holds parameters outside the drafter's "
                             "trainable ones (the frozen target must stay out of ZeRO)")
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                    config=self.config)
        return self.engine

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        # The recipe already divided the loss by grad_accum and calls step() once per step.
        self.engine.set_gradient_accumulation_boundary(sync)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, optimizer: torch.optim.Optimizer, params, max_norm: float) -> float:
        self.engine.step()  # clips to gradient_clipping (= trainer.grad_clip), steps, zeroes grads
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def full_weights(self) -> ContextManager:
        if self.zero_stage < 3 or self.engine is None:
            return contextlib.nullcontext()  # ZeRO-2 shards optimizer state, not parameters
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        # Gathers every parameter (read-only) and lifts ZeRO-3's forward hooks for the block:
        # with them, each submodule call on rank 0 alone would all-gather again and hang.
        return unwrap_model_for_generation(self.engine)

    def save_state(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        # every rank writes its ZeRO shards; no `latest` file: COMPLETE marks the checkpoint
        self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)
        self.barrier()

    def load_state(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not (Path(folder) / TAG).is_dir():
            raise FileNotFoundError(f"{folder} holds no DeepSpeed state ({TAG}/): it was written by "
                                    f"trainer.backend=torch; resume with that backend")
        saved = len(list((Path(folder) / TAG).glob("*optim_states.pt")))
        if saved != self.world_size:  # ZeRO shards are cut for one world size
            raise ValueError(f"{folder} holds ZeRO shards of {saved} ranks, this job has "
                             f"{self.world_size}: resume with {saved} ranks")
        path, _ = self.engine.load_checkpoint(str(folder), tag=TAG, load_module_strict=True,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {folder / TAG}")
