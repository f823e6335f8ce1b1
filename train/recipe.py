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

from data.capture import (CaptureConfig, OfflineFeatures, autocast, capture, capture_split,
                          target_logits)
from data.dataset import load_chat_dataset
from data.regenerate import self_distilled
from decode.acceptance import simulate_acceptance
from drafters.base import TrainBatch, build_drafter, fit_draft_vocab, load_drafter
from decode.evaluate import quiet
from drafters.target import cache_root, load_target
from train import checkpoint as ckpt
from train.backends import build_backend, peer_failure_message
from train.batches import BatchIterator
from train.loggers import Loggers
from train.losses import distill_loss
from train.on_policy import OnPolicyMixer
from train.report import write_report

log = logging.getLogger(__name__)

MIN_FREE_BYTES = 64 * 2**20  # config, metrics and logs of a run, before any checkpoint
CKPT_BYTES_PER_PARAM = 16  # fp32 weights + Adam's two moments, + fp32 master weights (DeepSpeed)


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
        self.backend = build_backend(tcfg, cfg.target.device, cfg.get("deepspeed"))
        self._prepare_run_dir()
        self.loggers = Loggers(cfg.logger, self.run_dir, self.backend.is_main, config=cfg)
        # 1. The frozen target and the chat data rendered with its template.
        with self.backend.main_first():  # rank 0 fills the target and data caches, then the rest
            self.target = load_target(cfg.target, training=True)  # auto = float32: see resolve_dtype
            data_cfg = cfg.data
            if data_cfg.get("regenerate") is not None:  # self-distillation: the target's answers
                data_cfg = self_distilled(self.target, data_cfg, progress=not quiet())
            self.data = data = load_chat_dataset(data_cfg, self.target.tokenizer)
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
        n_params = sum(p.numel() for p in self.params)  # before ZeRO-3 partitions them
        self._check_disk_space(CKPT_BYTES_PER_PARAM * n_params * (tcfg.keep_last + 2))
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
                              CaptureConfig(layers=list(self.drafter.feature_layers),
                                            autocast=tcfg.capture_autocast), folder,
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
        self.on_policy = None  # DistillSpec: replaces a share of micro-batches (train/on_policy.py)
        if tcfg.on_policy_fraction > 0:
            self.on_policy = OnPolicyMixer.from_config(self.drafter, cfg, self.backend.rank,
                                                       pad if pad is not None else 0,
                                                       self.target.eos_token_ids)
        # 3. Resume from the latest complete checkpoint.
        if cfg.resume:
            self._resume()
        log.info("drafter %s: %.2f M trainable parameters", cfg.drafter.name, n_params / 1e6)

    def _capture_dir(self, data) -> Path:
        """Where features of this (target, data, layers) are captured when no features_dir is
        given: under the cache root, so a second run on the same data skips the capture."""
        split = hashlib.sha1("\n".join(self.train_ds["id"]).encode()).hexdigest()  # eval_fraction, seed
        key = [self.target.source.split(" (")[0], data.cache_path.name, split,
               list(self.drafter.feature_layers), str(self.target.dtype)]
        if self.tcfg.capture_autocast:
            key.append(self.tcfg.capture_autocast)
        key = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:20]
        return cache_root(self.cfg.target) / "features" / key

    def _prepare_run_dir(self) -> None:
        """Rank 0 checks the one run dir all ranks share (writable, some free space, no other
        run's checkpoints unless resuming) and writes the resolved config; before any heavy work."""
        if self.backend.is_main:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise PermissionError(f"cannot create run_dir {self.run_dir}: {e}; set run_dir=...") from e
            if not os.access(self.run_dir, os.W_OK):
                raise PermissionError(f"run_dir {self.run_dir} is not writable; set run_dir=...")
            if not self.cfg.resume and ckpt.latest_checkpoint(self.run_dir) is not None:
                raise FileExistsError(f"run_dir {self.run_dir} already holds checkpoints of another "
                                      f"run: pass resume=true to continue it or a new run_dir=")
            self._check_disk_space(MIN_FREE_BYTES)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
        self.backend.barrier()

    def _check_disk_space(self, need: int) -> None:
        """Fail before training when the run dir's disk cannot hold the rolling checkpoints."""
        if not self.backend.is_main:
            return
        need = max(need, MIN_FREE_BYTES)
        free = shutil.disk_usage(self.run_dir).free
        if free < need:
            raise OSError(f"only {free / 2**20:.0f} MiB free under {self.run_dir}; this run's "
                          f"checkpoints (keep_last={self.tcfg.keep_last} + best + one being written) "
                          f"need about {need / 2**20:.0f} MiB. Free space or set run_dir= to another disk.")

    def _resume(self) -> None:
        last = ckpt.latest_checkpoint(self.run_dir)
        if last is None:
            log.warning("resume=true but no complete checkpoint in %s: starting fresh", self.run_dir)
            return
        state = ckpt.load_trainer_state(last)
        self.backend.load_state(last, self.drafter, self.optimizer)  # weights + optimizer state
        self.scheduler.load_state_dict(state["scheduler"])
        self.batches.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.best_tau = state["step"], state.get("best_tau", -1.0)
        log.info("resumed from %s (step %d)", last, self.step)

    # ------------------------------------------------------------------------------------- train
    def make_batch(self, raw: dict[str, torch.Tensor]) -> TrainBatch:
        """Run the frozen target on a batch (online capture) and package it for the drafter."""
        dev = self.backend.device
        if self.offline is not None and "index" in raw:  # on-policy batches have no captured rows
            idx = raw["index"].tolist()
            feats, final = self.offline.batch(idx, [self.train_ds[i] for i in idx],
                                              raw["input_ids"].shape[1])
        else:  # online, or an on-policy batch: under the same autocast as an offline capture
            with autocast(self.target, self.tcfg.capture_autocast):
                feats, final = capture(self.target, raw["input_ids"], raw["attention_mask"],
                                       self.drafter.feature_layers)
            feats = None if feats is None else feats.to(self.target.dtype)
            final = final.to(self.target.dtype)
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
            raw = next(self.batches)
            if self.on_policy is not None:  # with prob. on_policy_fraction: the drafter's own text
                raw = self.on_policy(raw, self.step, micro)
                share = self.on_policy.last / tcfg.grad_accum  # logged: the realised fraction
                totals["on_policy"] = totals.get("on_policy", 0.0) + share
            batch = self.make_batch(raw)
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
        totals["loss"] = float(self.backend.mean(torch.tensor(totals["loss"])))  # over all ranks
        self.scheduler.step()
        self.step += 1
        return {**totals, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                "tokens": tokens}

    def train(self) -> None:
        tcfg = self.tcfg
        t0, seen = time.perf_counter(), 0
        while self.step < tcfg.max_steps:
            metrics = self.train_step()
            self.loggers.progress(self.step, tcfg.max_steps, loss=metrics["loss"])
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
        with self.backend.full_weights():  # collective: ZeRO-3 gathers, then rank 0 evaluates
            if not self.backend.is_main:
                return {}
            n = min(self.tcfg.eval_conversations, len(self.eval_ds))
            res = simulate_acceptance(self.target, self.drafter, self.eval_ds.select(range(n)),
                                      k=self.tcfg.eval_k, positions=8)
        flat = {"eval/sim_tau": res["sim_tau"], "eval/mean_accepted": res["mean_accepted"],
                **{f"eval/acc_{i + 1}": a for i, a in enumerate(res["acceptance"])}}
        self.loggers.log(flat, self.step)
        self.last_eval = res
        write_report(self.run_dir)  # plots + report.md, for users without W&B
        return res

    def save_checkpoint(self) -> None:
        """Collective: every rank writes its part of checkpoints/step-N/ (train/checkpoint.py);
        rank 0 keeps the best drafter by simulated tau in best/ and prunes old checkpoints."""
        tau = float(self.last_eval.get("sim_tau", -1.0)) if getattr(self, "last_eval", None) else -1.0
        is_best = tau > self.best_tau  # tau is only known on rank 0; only rank 0 acts on it
        self.best_tau = max(self.best_tau, tau)
        state = {"scheduler": self.scheduler.state_dict(), "data": self.batches.state_dict(),
                 "best_tau": self.best_tau}
        path = ckpt.save_checkpoint(self.run_dir, self.step, self.backend, self.drafter,
                                    self.cfg.drafter, self.optimizer, state)
        if self.backend.is_main:
            if is_best:
                ckpt.export_drafter(path, self.run_dir / "best")
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
        self.loggers.log_decoder_eval(result["summary"], self.step)  # + histogram, bar charts
        write_report(self.run_dir)
        return result

    def cleanup(self) -> None:
        self.loggers.close()
        self.backend.close()


def run(cfg: DictConfig) -> None:
    recipe = DistillRecipe(cfg)
    try:
        recipe.setup()
        recipe.train()
    except Exception as e:  # a dead or hung peer surfaces as an opaque gloo/nccl error: say so
        msg = peer_failure_message(e, cfg.trainer.dist_timeout_s)
        if msg is None:
            raise
        raise RuntimeError(msg) from e
    result = recipe.final_eval()
    if result is not None:
        print(result["markdown"], flush=True)
        (Path(cfg.run_dir) / "summary.json").write_text(json.dumps(result["summary"], indent=2))
    recipe.cleanup()
