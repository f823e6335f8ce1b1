"""The distillation recipe: setup -> train -> eval -> save, in that visible shape.

    recipe = DistillRecipe(cfg)
    recipe.setup()          # run dir, target, data, drafter, optimizer, backend, resume
    recipe.train()          # the loop: capture target outputs, loss, step, eval, checkpoint
    recipe.final_eval()     # the real decoder on MT-bench with the best drafter
    recipe.cleanup()

The recipe depends only on the drafter interface (drafters/base.py) and the backend interface
(train/backends.py); it never names a concrete drafter.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from data.capture import CaptureConfig, OfflineFeatures, capture, capture_split, target_logits
from data.dataset import load_chat_dataset
from decode.acceptance import simulate_acceptance
from drafters.base import TrainBatch, build_drafter, fit_draft_vocab, load_drafter
from decode.evaluate import quiet
from drafters.target import cache_root, load_target
from train import checkpoint as ckpt
from train.backends import build_backend
from train.batches import BatchIterator
from train.loggers import Loggers
from train.losses import distill_loss

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    pass


def lr_lambda(warmup: int, total: int, floor: float):
    """Linear warm-up to 1, then cosine decay to `floor` at `total` steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def token_counts(ds, vocab_size: int) -> torch.Tensor:
    """(V,) how often each token occurs as an assistant (loss-masked) token in `ds`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in ds.with_format("torch"):
        counts += torch.bincount(row["input_ids"][row["loss_mask"].bool()], minlength=vocab_size)
    return counts


class DistillRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.run_dir = Path(cfg.run_dir)
        self.step = 0
        self.best_tau = -1.0

    # ------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg, tcfg = self.cfg, self.tcfg
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.backend = build_backend(tcfg.backend, cfg.target.device)
        self._prepare_run_dir()
        self.loggers = Loggers(list(cfg.logger.kinds), self.run_dir, self.backend.is_main)
        # 1. The frozen target and the chat data rendered with its template.
        self.target = load_target(cfg.target)
        self.data = data = load_chat_dataset(cfg.data, self.target.tokenizer)
        self.train_ds, self.eval_ds = data.train, data.eval
        log.info("data: %d train / %d eval conversations", len(self.train_ds), len(self.eval_ds))
        # 2. The drafter, its optimizer and schedule.
        self.drafter = build_drafter(cfg.drafter, self.target)
        if fit_draft_vocab(self.drafter, token_counts(self.train_ds, self.target.vocab_size),
                           always_include=self.target.eos_token_ids):
            log.info("draft vocabulary: the %d most frequent assistant tokens of the training data",
                     len(self.drafter.d2t))
        self.drafter.to(self.backend.device)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"drafter {cfg.drafter.name!r} has no trainable parameters")
        self.optimizer = torch.optim.AdamW(self.params, lr=tcfg.lr, weight_decay=tcfg.weight_decay,
                                           betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(tcfg.warmup_steps, tcfg.max_steps, tcfg.min_lr_ratio))
        self.model = self.backend.prepare(self.drafter, self.optimizer)
        self.offline = None
        if tcfg.features == "offline":
            folder = Path(tcfg.features_dir) if tcfg.features_dir else self._capture_dir(data)
            if self.backend.is_main:  # capture once (resumable; a no-op when complete)
                capture_split(self.target, self.train_ds,
                              CaptureConfig(layers=list(self.drafter.feature_layers)), folder,
                              progress=not quiet())
            self.backend.barrier()
            self.offline = OfflineFeatures(folder, self.drafter.feature_layers, self.target)
            if len(self.offline) != len(self.train_ds):
                raise ValueError(f"capture {folder} holds {len(self.offline)} conversations, "
                                 f"the train split {len(self.train_ds)}: capture the same data")
        elif tcfg.features != "online":
            raise ValueError(f"trainer.features must be online or offline, not {tcfg.features!r}")
        pad = self.target.tokenizer.pad_token_id
        self.batches = BatchIterator(self.train_ds, tcfg.batch_size, cfg.seed,
                                     pad if pad is not None else 0,
                                     self.backend.rank, self.backend.world_size)
        # 3. Resume from the latest complete checkpoint.
        if cfg.resume:
            self._resume()
        n_params = sum(p.numel() for p in self.params)
        log.info("drafter %s: %.2f M trainable parameters", cfg.drafter.name, n_params / 1e6)

    def _capture_dir(self, data) -> Path:
        """Where features of this (target, data, layers) are captured when no features_dir is
        given: under the cache root, so a second run on the same data skips the capture."""
        key = hashlib.sha1(json.dumps([self.target.source.split(" (")[0], data.cache_path.name,
                                       list(self.drafter.feature_layers), str(self.target.dtype)])
                           .encode()).hexdigest()[:20]
        return cache_root(self.cfg.target) / "features" / key

    def _prepare_run_dir(self) -> None:
        if self.backend.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.run_dir, os.W_OK):
                raise PermissionError(f"run_dir {self.run_dir} is not writable; set run_dir=...")
            free = shutil.disk_usage(self.run_dir).free
            if free < 200 * 2**20:
                raise OSError(f"only {free / 2**20:.0f} MiB free under {self.run_dir}; checkpoints "
                              f"need more. Free space or set run_dir= to another disk.")
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
        self.backend.barrier()

    def _resume(self) -> None:
        last = ckpt.latest_checkpoint(self.run_dir)
        if last is None:
            log.warning("resume=true but no complete checkpoint in %s: starting fresh", self.run_dir)
            return
        state = ckpt.load_trainer_state(last)
        loaded = load_drafter(last, self.target)
        self.drafter.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.batches.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.best_tau = state["step"], state.get("best_tau", -1.0)
        log.info("resumed from %s (step %d)", last, self.step)

    # ------------------------------------------------------------------------------------- train
    def make_batch(self, raw: dict[str, torch.Tensor]) -> TrainBatch:
        """Run the frozen target on a batch (online capture) and package it for the drafter."""
        dev = self.backend.device
        if self.offline is not None:
            idx = raw["index"].tolist()
            feats, final = self.offline.batch(idx, [self.train_ds[i] for i in idx],
                                              raw["input_ids"].shape[1])
        else:
            feats, final = capture(self.target, raw["input_ids"], raw["attention_mask"],
                                   self.drafter.feature_layers)
        d2t = getattr(self.drafter, "d2t", None)
        logits = target_logits(self.target, final, d2t)  # (B, T, Vd) restricted when pruned
        return TrainBatch(input_ids=raw["input_ids"].to(dev),
                          attention_mask=raw["attention_mask"].to(dev),
                          loss_mask=raw["loss_mask"].to(dev), target_logits=logits.to(dev).clone(),
                          features=None if feats is None else feats.to(dev).clone())

    def train_step(self) -> dict[str, float]:
        tcfg = self.tcfg
        self.model.train()
        totals: dict[str, float] = {}
        tokens = 0
        for micro in range(tcfg.grad_accum):
            batch = self.make_batch(next(self.batches))
            tokens += int(batch.attention_mask.sum())
            with torch.autocast(self.backend.device.type, dtype=torch.bfloat16,
                                enabled=tcfg.precision == "bf16"):
                preds = self.model(batch)
                loss, parts = distill_loss(preds, batch, divergence=tcfg.loss,
                                           temperature=tcfg.loss_temperature,
                                           feature_weight=tcfg.feature_weight)
            if not torch.isfinite(loss):
                raise NonFiniteLoss(f"loss is {loss.item()} at step {self.step} (micro-batch {micro}); "
                                    f"stopping. The last good checkpoint is kept in "
                                    f"{self.run_dir / 'checkpoints'}; lower trainer.lr or use "
                                    f"trainer.precision=fp32, then resume=true.")
            self.backend.backward(loss / tcfg.grad_accum, sync=micro == tcfg.grad_accum - 1)
            for name, v in {"loss": loss, **parts}.items():
                totals[name] = totals.get(name, 0.0) + float(v.detach()) / tcfg.grad_accum
        grad_norm = self.backend.step(self.optimizer, self.params, tcfg.grad_clip)
        self.scheduler.step()
        self.step += 1
        return {**totals, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                "tokens": tokens}

    def train(self) -> None:
        tcfg = self.tcfg
        t0, seen = time.perf_counter(), 0
        while self.step < tcfg.max_steps:
            metrics = self.train_step()
            seen += metrics.pop("tokens")
            if self.step % tcfg.log_every == 0 or self.step == tcfg.max_steps:
                dt = time.perf_counter() - t0
                self.loggers.log({**metrics, "target_tokens_per_s": seen * self.backend.world_size
                                  / max(dt, 1e-9)}, self.step)
                t0, seen = time.perf_counter(), 0
            last = self.step == tcfg.max_steps
            if (tcfg.eval_every and self.step % tcfg.eval_every == 0) or last:
                self.evaluate()
            if (tcfg.save_every and self.step % tcfg.save_every == 0) or last:
                self.save_checkpoint()

    # -------------------------------------------------------------------------------------- eval
    def evaluate(self) -> dict[str, object]:
        """Per-position acceptance unrolled on the drafter's own outputs, and the simulated tau."""
        self.last_eval = {}
        if not self.backend.is_main:
            return {}
        n = min(self.tcfg.eval_conversations, len(self.eval_ds))
        res = simulate_acceptance(self.target, self.drafter, self.eval_ds.select(range(n)),
                                  k=self.tcfg.eval_k, positions=8)
        flat = {"eval/sim_tau": res["sim_tau"], "eval/mean_accepted": res["mean_accepted"],
                **{f"eval/acc_{i + 1}": a for i, a in enumerate(res["acceptance"])}}
        self.loggers.log(flat, self.step)
        self.last_eval = res
        return res

    def save_checkpoint(self) -> None:
        if self.backend.is_main:
            tau = float(self.last_eval.get("sim_tau", -1.0)) if getattr(self, "last_eval", None) else -1.0
            is_best = tau > self.best_tau
            self.best_tau = max(self.best_tau, tau)
            state = {"optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(),
                     "data": self.batches.state_dict(), "best_tau": self.best_tau}
            path = ckpt.save_checkpoint(self.run_dir, self.step, self.drafter, self.cfg.drafter, state)
            if is_best:  # keep the best by simulated tau as its own folder
                ckpt.write_atomic(self.run_dir / "best",
                                  lambda tmp: [shutil.copy2(f, tmp) for f in path.iterdir()
                                               if f.name != ckpt.COMPLETE])
            ckpt.prune_checkpoints(self.run_dir, self.tcfg.keep_last)
        self.backend.barrier()

    def final_eval(self) -> dict | None:
        """The real decoder on the final-eval set with the best drafter, vs plain decoding."""
        name = self.tcfg.final_eval
        if not name or not self.backend.is_main:
            return None
        from decode.evaluate import evaluate_drafter

        best = self.run_dir / "best"
        drafter = load_drafter(best, self.target) if best.is_dir() else self.drafter
        result = evaluate_drafter(self.target, drafter.eval(), eval_kind=name,
                                  limit=self.tcfg.final_eval_limit,
                                  max_new_tokens=self.tcfg.final_eval_max_new_tokens,
                                  k=self.tcfg.eval_k, out_dir=self.run_dir / "final_eval")
        self.loggers.log({f"final/{k}": v for k, v in result["summary"].items()}, self.step)
        return result

    def cleanup(self) -> None:
        self.loggers.close()
        self.backend.close()


def run(cfg: DictConfig) -> None:
    recipe = DistillRecipe(cfg)
    recipe.setup()
    recipe.train()
    result = recipe.final_eval()
    if result is not None:
        print(result["markdown"], flush=True)
        (Path(cfg.run_dir) / "summary.json").write_text(json.dumps(result["summary"], indent=2))
    recipe.cleanup()
