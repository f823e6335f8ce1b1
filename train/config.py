"""Config schemas of `python -m train` (Hydra structured configs, stored in the ConfigStore)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from specdistill.cli.ranges import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_DRAFT,
    MAX_SECONDS,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    SEED,
    rng,
    sub,
)
from specdistill.data.dataset import DataConfig
from specdistill.drafters.base import drafter_schema
from specdistill.target.model import TargetConfig
from specdistill.train.distributed import job_run_id, rank_zero_log

# conf/train.yaml: `${run_id:}` names the run dir all ranks share (each job of a multirun sweep its
# own); Hydra's log file is written by rank 0 only. Not cached: job_run_id fixes the id itself.
OmegaConf.register_new_resolver("run_id", job_run_id, replace=True)
OmegaConf.register_new_resolver("rank_zero_log", rank_zero_log, replace=True)


@dataclass
class TrainerConfig:
    """How long and how the drafter trains."""

    backend: str = "torch"  # torch (single process or DDP under torchrun) | deepspeed (ZeRO)
    # a collective waiting longer fails the job (a dead or hung rank)
    dist_timeout_s: int = rng(1800, 1, MAX_SECONDS)
    max_steps: int = rng(1000, 1, MAX_COUNT)  # optimizer steps
    # wall-clock budget of the training loop in minutes (None = none): the loop stops after the step
    # that crosses it, evaluates and saves a checkpoint like at max_steps, and logs that it stopped
    # early. Setup and the offline capture are not counted; a resumed run gets the budget afresh.
    # The schedule still runs to max_steps (equal-minutes comparisons: benchmarks/peers), unless:
    max_minutes: Optional[float] = rng(None, 0, MAX_SECONDS / 60, lo_open=True)
    # what the learning-rate cosine and the on-policy heads phase span (train/schedule.py): steps
    # (max_steps; reruns repeat every number) | minutes (the run's progress, the larger of
    # step / max_steps and training minutes / max_minutes, the minutes carried across resumes:
    # the whole recipe in the minutes on any machine, the steps it makes depend on its speed)
    schedule: str = "steps"
    batch_size: int = rng(4, 1, MAX_BATCH)  # conversations per micro-batch per process
    grad_accum: int = rng(1, 1, MAX_BATCH)  # micro-batches per optimizer step
    # sort each run of this many global batches by length before batching (0 = plain shuffle):
    # batches of similar lengths pad less (train/batches.py)
    group_by_length: int = rng(0, 0, MAX_COUNT)
    # train rows longer than this many tokens in consecutive windows of it, one forward and backward
    # each (None = whole rows): the drafter's training forward is what grows with a row's length
    # (EAGLE-3's test-time-training attention and per-step logits: ~6 GB at 4k tokens on the tiny
    # target, BENCHMARKS.md "Long context"); each window keeps the target's features of the whole row
    window: Optional[int] = rng(None, 64, MAX_TOKENS)
    # blocks of at least this many MB are mmapped by glibc and handed back to the OS when freed
    # (mallopt M_MMAP_THRESHOLD; None = glibc's own threshold, which rises to 32 MB as large
    # blocks are freed and then keeps a step's freed tensors in its heap): 1 held the peers'
    # benchmark recipe's peak 16% lower (2.23 GB against 2.65) with teacher-forced steps ~0.92x
    # (BENCHMARKS.md "Our trainer's memory"); not glibc: said and ignored (train/memory.py)
    mmap_threshold_mb: Optional[int] = rng(None, 1, 32)
    lr: float = rng(3e-4, 0, 1, lo_open=True)  # peak learning rate (AdamW)
    weight_decay: float = rng(0.0, 0, 1)  # AdamW weight decay
    # linear warm-up, then cosine decay to min_lr_ratio * lr
    warmup_steps: int = rng(50, 0, MAX_COUNT)
    min_lr_ratio: float = rng(0.1, 0, 1)  # floor of the cosine schedule, as a fraction of lr
    grad_clip: float = rng(1.0, 0, 1e6)  # max global grad norm (0 = off)
    # fp32 | bf16 (autocast for the drafter; the target runs in target.dtype) | auto (bf16 where
    # the device runs it natively, fp32 elsewhere: target/precision.py native_bf16)
    precision: str = "fp32"
    # forward_kl | reverse_kl | jsd | tv | nla | lk_hybrid | hard_ce (train/losses.py)
    loss: str = "forward_kl"
    # temperature of the target (and draft) distributions in the loss
    loss_temperature: float = rng(1.0, 0.1, MAX_TEMPERATURE)
    # weight of the feature regression (EAGLE) next to the divergence
    feature_weight: float = rng(1.0, 0, 1000)
    eval_k: int = rng(5, 1, MAX_DRAFT)  # draft length of the evals (simulated and real decoder)
    features: str = "online"  # online: target forward every step | offline: capture once, reuse every epoch
    # the target's training forwards (offline capture, online, on-policy batches) under
    # torch.autocast: bfloat16 | float16 | auto (bfloat16 where native, else off) | None (target.dtype)
    capture_autocast: Optional[str] = None
    # storage of the captured layers' features: float32 | bfloat16 | auto (bfloat16 when precision is
    # bf16: the drafter reads them at bf16 anyway; train/precision.py features_storage)
    capture_features_dtype: Optional[str] = "float32"
    # the target's training forwards over rows longer than this many tokens go in chunks of it over
    # a KV cache (None = whole rows): data/capture.py capture; the same features within rounding
    capture_chunk: Optional[int] = rng(None, 16, MAX_TOKENS)
    # offline: a `python -m specdistill.data.capture` out folder (None = auto, in the cache)
    features_dir: Optional[str] = None
    # train on the first N conversations of the train split only (None = all): data-scaling studies
    # (tokens vs passes) on ONE capture of the whole split; the draft vocabulary is fitted to them
    train_conversations: Optional[int] = rng(None, 1, MAX_COUNT)
    # share of micro-batches replaced by drafter-written text (train/on_policy.py)
    on_policy_fraction: float = rng(0.0, 0, 1)
    # tokens the drafter samples per on-policy continuation
    on_policy_max_new_tokens: int = rng(64, 1, MAX_TOKENS)
    # sampling temperature of on-policy continuations (0 = greedy)
    on_policy_temperature: float = rng(1.0, 0, MAX_TEMPERATURE)
    # optimizer steps on fixed data only before on-policy batches start
    on_policy_start_step: int = rng(0, 0, MAX_COUNT)
    # on-policy distillation of chain heads (train/on_policy_heads.py): from this fraction of
    # max_steps on, each step drafts on the drafter's own tokens and the target scores the drafts
    # (None = off; 0 = every step). Drafters with forward_own (eagle3)
    on_policy_heads_start: Optional[float] = rng(None, 0, 1)
    # draft steps unrolled on the drafter's own tokens (>= 2)
    on_policy_heads_depth: int = rng(2, 2, 16)
    # share of the scored rows' answer positions whose drafts the target scores
    on_policy_heads_anchors: float = rng(0.25, 1e-3, 1)
    # rows of each micro-batch whose drafts the target scores (None = every row): its forward
    # runs over these rows only, so fewer rows at a larger anchor share score as many drafts for less
    on_policy_heads_rows: Optional[int] = rng(None, 1, MAX_COUNT)
    eval_every: int = rng(200, 0, MAX_COUNT)  # steps between held-out evals (0 = only at the end)
    save_every: int = rng(200, 0, MAX_COUNT)  # steps between checkpoints (0 = only at the end)
    keep_last: int = rng(2, 1, 1000)  # rolling checkpoints kept (the best one is always kept)
    log_every: int = rng(10, 1, MAX_COUNT)  # steps between log lines
    eval_conversations: int = rng(64, 1, MAX_COUNT)  # held-out conversations per eval
    final_eval: Optional[str] = "mtbench"  # real-decoder eval at the end (None = skip)
    final_eval_limit: int = rng(20, 1, MAX_COUNT)  # prompts of the final eval
    final_eval_max_new_tokens: int = rng(128, 1, MAX_TOKENS)  # generation budget of the final eval
    # after the final eval: export the best drafter in a layout this serving engine reads, load it
    # there (decode/engine/) and compare its acceptance with ours on the same prompts (vllm;
    # None = off). An engine that cannot be installed here is skipped with the reason logged
    engine_check: Optional[str] = None
    # prompts of the engine check (None = final_eval_limit)
    engine_check_limit: Optional[int] = rng(None, 1, MAX_COUNT)


@dataclass
class DeepSpeedConfig:
    """ZeRO settings of trainer.backend=deepspeed (conf/deepspeed/<name>.yaml; ignored by the torch
    backend). Batch size, gradient accumulation, clipping and bf16 come from `trainer` and the
    optimizer is the recipe's AdamW, so both backends train the same job."""

    # 2 = shard gradients + optimizer state | 3 = also the drafter's parameters
    zero_stage: int = rng(2, 2, 3)
    overlap_comm: bool = False  # overlap gradient reduction with the backward pass (GPU)
    contiguous_gradients: bool = True  # copy gradients into one buffer as they are produced
    reduce_bucket_size: int = rng(50_000_000, 1, 10**12)  # elements per gradient reduce bucket
    # ZeRO-2: elements per parameter all-gather bucket
    allgather_bucket_size: int = rng(50_000_000, 1, 10**12)
    # ZeRO-3: elements prefetched ahead of use
    stage3_prefetch_bucket_size: int = rng(5_000_000, 0, 10**12)
    # ZeRO-3: smaller params stay unpartitioned
    stage3_param_persistence_threshold: int = rng(10_000, 0, 10**12)
    extra: dict[str, Any] = field(default_factory=dict)  # merged into the DeepSpeed JSON config last


@dataclass
class LoggerConfig:
    """Where metrics go (rank 0 only). Several kinds at once; train/loggers.py implements them."""

    # console | jsonl | wandb | tensorboard
    kinds: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # W&B: online | offline | disabled, or auto = offline under pytest/CI, else WANDB_MODE from the
    # environment, else online when an API key is configured (WANDB_API_KEY or ~/.netrc) and
    # offline when not (sync later with `wandb sync <run_dir>/wandb/offline-run-*`)
    wandb_mode: str = "auto"
    wandb_project: str = "specdistill"  # W&B project: one per target/drafter study
    wandb_entity: Optional[str] = None  # W&B team or user (None = the key's default entity)
    wandb_run_name: Optional[str] = None  # display name (None = the run dir's name)
    wandb_tags: list[str] = field(default_factory=list)  # extra tags; drafter and target are added
    tensorboard_dir: Optional[str] = None  # event files (None = <run_dir>/tensorboard)


@dataclass
class TrainConfig:
    """`python -m train`: distil a drafter from a frozen target."""

    target: TargetConfig = MISSING
    data: DataConfig = MISSING
    # the drafter's own schema (conf/drafter/<name>.yaml)
    drafter: Any = sub(MISSING, drafter_schema)
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # trainer.backend=deepspeed only
    # one folder per job (config, ckpts, logs), shared by all ranks: the job's id under a launcher
    # (RUN_ID, torchrun --rdzv-id, SLURM_JOB_ID), else its start time (train/distributed.py: run_id)
    run_dir: str = "runs/train/${run_id:}"
    resume: bool = False  # continue from the latest complete checkpoint in run_dir
    seed: int = rng(0, *SEED)  # seeds torch, the data order and sampling


# Settings that may change when a run resumes (everything else must match the checkpoint's run):
# how long it runs (a new max_steps stretches the cosine schedule to the new end from the current
# step), how often it evaluates, saves and logs, the final eval, where metrics go, the device.
RESUMABLE_CHANGES = (
    "run_dir", "resume", "logger", "target.device", "trainer.max_steps", "trainer.max_minutes",
    "trainer.eval_every",
    "trainer.save_every", "trainer.keep_last", "trainer.log_every", "trainer.eval_conversations",
    "trainer.eval_k", "trainer.final_eval", "trainer.final_eval_limit",
    "trainer.final_eval_max_new_tokens", "trainer.dist_timeout_s", "data.num_proc", "data.cache_dir",
    "trainer.engine_check", "trainer.engine_check_limit",
)
