"""Config schemas of `python -m train` (Hydra structured configs, stored in the ConfigStore)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from data.dataset import DataConfig
from drafters.target import TargetConfig


@dataclass
class TrainerConfig:
    """How long and how the drafter trains."""

    backend: str = "torch"  # torch (single process or DDP under torchrun) | deepspeed
    max_steps: int = 1000  # optimizer steps
    batch_size: int = 4  # conversations per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-4  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 50  # linear warm-up, then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.1  # floor of the cosine schedule, as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    precision: str = "fp32"  # fp32 | bf16 (autocast for the drafter; the target runs in target.dtype)
    loss: str = "forward_kl"  # forward_kl | reverse_kl | jsd | tv | hard_ce (train/losses.py)
    loss_temperature: float = 1.0  # temperature of the target (and draft) distributions in the loss
    feature_weight: float = 1.0  # weight of the feature regression (EAGLE) next to the divergence
    eval_k: int = 5  # draft length of the evals (simulated and real decoder)
    features: str = "online"  # online: target forward every step | offline: capture once, reuse every epoch
    features_dir: Optional[str] = None  # offline: a `python -m data.capture` out folder (None = auto, in the cache)
    eval_every: int = 200  # steps between held-out evals (0 = only at the end)
    save_every: int = 200  # steps between checkpoints (0 = only at the end)
    keep_last: int = 2  # rolling checkpoints kept (the best one is always kept)
    log_every: int = 10  # steps between log lines
    eval_conversations: int = 64  # held-out conversations per eval
    final_eval: Optional[str] = "mtbench"  # real-decoder eval at the end (None = skip)
    final_eval_limit: int = 20  # prompts of the final eval
    final_eval_max_new_tokens: int = 128  # generation budget of the final eval


@dataclass
class LoggerConfig:
    """Where metrics go (rank 0 only)."""

    kinds: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # console | jsonl


@dataclass
class TrainConfig:
    """`python -m train`: distil a drafter from a frozen target."""

    target: TargetConfig = MISSING
    data: DataConfig = MISSING
    drafter: Any = MISSING  # the drafter's own schema (conf/drafter/<name>.yaml)
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    run_dir: str = "runs/train/${now:%Y-%m-%d_%H-%M-%S}"  # one folder per job: config, ckpts, logs
    resume: bool = False  # continue from the latest complete checkpoint in run_dir
    seed: int = 0  # seeds torch, the data order and sampling
