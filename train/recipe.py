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

import logging
import math
import os
import random
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.cli.ranges import check_ranges
from specdistill.data import quiet
from specdistill.data.capture import (
    CaptureConfig,
    OfflineFeatures,
    autocast,
    capture,
    capture_dir,
    offline_features,
)
from specdistill.data.mix import MixedFeatures
from specdistill.data.report import REPORT_FILE
from specdistill.data.sources import training_data
from specdistill.decode.simulate import simulate_acceptance
from specdistill.drafters.base import TrainBatch, build_drafter
from specdistill.drafters.parts.head import fit_draft_vocab
from specdistill.store import rundir as runs
from specdistill.target.model import cache_root, load_target
from specdistill.train import checkpoint as ckpt
from specdistill.train.backends import build_backend
from specdistill.train.batches import BatchIterator, first_conversations, row_windows
from specdistill.train.config import TrainConfig
from specdistill.train.distributed import peer_failure_message
from specdistill.train.final_eval import final_eval, prepare_engine, publish
from specdistill.train.loggers import Loggers
from specdistill.train.losses import drafter_loss
from specdistill.train.memory import drop_training_state, mmap_large_blocks, release_free_memory
from specdistill.train.on_policy import OnPolicyMixer
from specdistill.train.on_policy_heads import (
    anchor_generator,
    check_on_policy_heads,
    own_drafts,
    score_own_drafts,
)
from specdistill.train.precision import features_storage, training_precision
from specdistill.train.report import write_eval_by_context, write_report
from specdistill.train.resume import check_resume_config
from specdistill.train.schedule import Schedule, check_schedule, in_phase
from specdistill.train.rundir import check_contents, check_disk_space, set_aside_unfinished, write_config
from specdistill.train.runlock import RunLock
from specdistill.train.teacher import train_batch

log = logging.getLogger(__name__)

CKPT_BYTES_PER_PARAM = 16  # fp32 weights + Adam's two moments, + fp32 master weights (DeepSpeed)


class NonFiniteLoss(RuntimeError):
    pass


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
        """Build everything `train()` needs, one named step each; the pieces live in the library."""
        cfg = self.cfg
        check_schedule(self.tcfg)  # before any heavy work
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self._resolve_precision(str(cfg.target.device))
        self._cap_heap(self.tcfg.mmap_threshold_mb)
        self.backend = build_backend(self.tcfg, cfg.target.device, cfg.get("deepspeed"))
        self._prepare_run_dir()
        self.loggers = Loggers(cfg.logger, self.run_dir, self.backend.is_main, config=cfg)
        self.target, self.data = self._setup_data(cfg)  # 1. the frozen target and its chat data
        self.split_ds, self.eval_ds = self.data.train, self.data.eval  # the split: what is captured
        self.train_ds = first_conversations(self.split_ds, self.tcfg.train_conversations)  # trained on
        self.drafter = self._setup_drafter(cfg)  # 2. the drafter on the backend's device
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self._setup_optimizer(self.tcfg)  # 3. optimizer, schedule, the backend-wrapped model
        prepare_engine(cfg, self.run_dir, self.drafter, self.backend.is_main)  # vLLM installs meanwhile
        self.offline = self._setup_features(self.tcfg)  # 4. offline features (None: online)
        self._setup_batches(cfg)  # 5. the data order, and on-policy batches (DistillSpec)
        if cfg.resume:  # 6. resume from the newest checkpoint that verifies
            self._resume()
        self._write_config()  # 7. only now: a failed setup leaves the run's config.yaml as it was
        log.info("drafter %s: %.2f M trainable parameters", cfg.drafter.name,
                 sum(p.numel() for p in self.params) / 1e6)

    @staticmethod
    def _cap_heap(threshold_mb: int | None) -> None:
        """trainer.mmap_threshold_mb: blocks from that size on are mmapped and unmapped when freed."""
        if threshold_mb is None:
            return
        if mmap_large_blocks(threshold_mb):
            log.info("trainer.mmap_threshold_mb=%d: blocks of %d MB or more are mmapped and "
                     "handed back to the OS when freed (glibc mallopt)", threshold_mb, threshold_mb)
        else:
            log.warning("trainer.mmap_threshold_mb=%d is ignored: no glibc malloc in this process "
                        "(macOS, musl, Windows); the allocator keeps its own policy", threshold_mb)

    def _resolve_precision(self, device: str) -> None:
        """trainer.precision / capture_autocast = auto -> bf16 where `device` runs it natively."""
        tcfg, asked = self.tcfg, (self.tcfg.precision, self.tcfg.capture_autocast)
        tcfg.precision, tcfg.capture_autocast, why = training_precision(*asked, device)
        tcfg.capture_features_dtype = features_storage(tcfg.capture_features_dtype, tcfg.precision)
        if "auto" in asked:
            log.info("trainer.precision=%s -> %s, trainer.capture_autocast=%s -> %s (%s)", asked[0],
                     tcfg.precision, asked[1], tcfg.capture_autocast, why)

    def _setup_data(self, cfg: DictConfig):
        """The frozen target, and the chat data rendered with its template (the target's own
        answers where data.regenerate / data.selfgen say so: data/sources.py). Rank 0 fills the
        caches first."""
        with self.backend.main_first():
            target = load_target(cfg.target, training=True)  # auto = float32: see resolve_dtype
            layers = lambda: build_drafter(cfg.drafter, target).feature_layers  # noqa: E731
            self.sources = training_data(target, cfg.data, layers, progress=not quiet())
        data = self.sources.data
        log.info("data: %d train / %d eval rows", len(data.train), len(data.eval))
        if data.report is not None and self.backend.is_main:  # the run report's "Training data"
            data.report.save(self.run_dir / REPORT_FILE)
        return target, data

    @property
    def selfgen(self):  # the self-generated store of the rows (data.selfgen), or None
        return self.sources.selfgen

    def _setup_drafter(self, cfg: DictConfig):
        """The drafter built on the target, its draft vocabulary fitted to the training data's
        assistant tokens (when it prunes its head), moved to the backend's device."""
        drafter = build_drafter(cfg.drafter, self.target)
        if fit_draft_vocab(drafter, token_counts(self.train_ds, self.target.vocab_size),
                           always_include=self.target.eos_token_ids):
            log.info("draft vocabulary: the %d most frequent assistant tokens of the training data",
                     len(drafter.d2t))
        drafter.to(self.backend.device)
        if not any(p.requires_grad for p in drafter.parameters()):
            raise ValueError(f"drafter {cfg.drafter.name!r} has no trainable parameters")
        check_on_policy_heads(self.tcfg, drafter)
        if drafter.objective is not None:  # said once, here: the loss below follows the drafter
            log.warning("trainer.loss=%s is ignored: drafter %s trains on its own objective (%s; "
                        "drafters/base.py SlotObjective, train/losses.py slot_loss)",
                        self.tcfg.loss, drafter.name, drafter.objective)
        return drafter

    def _setup_optimizer(self, tcfg) -> None:
        """AdamW over the trainable parameters, warm-up + cosine schedule, the backend-wrapped
        model; first a check that the disk holds the rolling checkpoints of this many parameters."""
        n_params = sum(p.numel() for p in self.params)  # before ZeRO-3 partitions them
        self._check_disk_space(CKPT_BYTES_PER_PARAM * n_params * (tcfg.keep_last + 2))
        self.optimizer = torch.optim.AdamW(self.params, lr=tcfg.lr, weight_decay=tcfg.weight_decay,
                                           betas=(0.9, 0.95))
        # the learning rate and the on-policy phase, over steps or minutes (train/schedule.py)
        self.schedule = Schedule(tcfg, mean=lambda x: float(self.backend.mean(torch.tensor(x))))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: self.schedule.lr_factor(step))
        self.model = self.backend.prepare(self.drafter, self.optimizer)

    def _setup_features(self, tcfg) -> OfflineFeatures | None:
        """trainer.features=offline: the target's features of the train split, captured once
        (data/capture.py) into trainer.features_dir or a folder keyed by what they depend on."""
        if tcfg.features == "online":
            return None
        if tcfg.features != "offline":
            raise ValueError(f"trainer.features must be online or offline, not {tcfg.features!r}")
        layers = list(self.drafter.feature_layers)
        own = self.sources.selfgen and self.sources.selfgen.features(layers)  # written with the rows
        file = self.sources.captured  # the file's train split (the first rows of a mix)
        if file is None:
            return own
        ccfg = CaptureConfig(layers=layers, autocast=tcfg.capture_autocast,
                             features_dtype=tcfg.capture_features_dtype, chunk=tcfg.capture_chunk)
        folder = Path(tcfg.features_dir) if tcfg.features_dir else capture_dir(
            cache_root(self.cfg.target), self.target, file.train, file.cache_path.name, layers,
            ccfg.autocast, ccfg.features_dtype)
        feats = offline_features(self.target, file.train, folder, ccfg, is_main=self.backend.is_main,
                                 barrier=self.backend.barrier, progress=not quiet())
        return feats if own is None else MixedFeatures(feats, own)

    def _setup_batches(self, cfg: DictConfig) -> None:
        """This rank's micro-batches of the train split, and the on-policy mixer that replaces a
        share of them with the drafter's own text (train/on_policy.py) when on_policy_fraction > 0."""
        pad = self.target.tokenizer.pad_token_id
        pad = pad if pad is not None else 0
        self.batches = BatchIterator(self.train_ds, self.tcfg.batch_size, cfg.seed, pad,
                                     self.backend.rank, self.backend.world_size,
                                     self.tcfg.group_by_length)
        self.on_policy = None
        if self.tcfg.on_policy_fraction > 0:
            self.on_policy = OnPolicyMixer.from_config(self.drafter, cfg, self.backend.rank, pad,
                                                       self.target.eos_token_ids)

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
            RunLock(self.run_dir).check_free()  # a live job's run dir is refused first
            check_contents(self.run_dir, self.cfg.resume)  # no other job's files, no other run's
            self.lock = RunLock(self.run_dir).acquire()  # one job per run dir
            if runs.latest_checkpoint(self.run_dir) is None:  # a fresh start: an earlier job's
                set_aside_unfinished(self.run_dir)  # metrics become metrics.prev.jsonl
            self._check_disk_space(0)
        self._resume_from = None
        if self.cfg.resume:  # every rank: verify before any heavy work, refuse a changed run
            self._resume_from = runs.resumable_checkpoint(self.run_dir)
            if self._resume_from is not None:
                check_resume_config(self._resume_from, self.cfg)
        self.backend.barrier()

    def _write_config(self) -> None:
        if self.backend.is_main:  # only now: a refused job leaves the run's own config untouched
            write_config(self.run_dir, self.cfg)

    def _check_disk_space(self, need: int) -> None:
        if self.backend.is_main:
            check_disk_space(self.run_dir, need, self.tcfg.keep_last)

    def _resume(self) -> None:
        last = self._resume_from
        if last is None:
            log.warning("resume=true but no complete checkpoint in %s: starting fresh", self.run_dir)
            return
        state = ckpt.load_trainer_state(last)
        self.backend.load_state(last, self.drafter, self.optimizer)  # weights + optimizer state
        self.scheduler.load_state_dict(state["scheduler"])
        self.schedule.load_state_dict(state.get("schedule"), state["step"])
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.schedule.lr_factor(state["step"])  # this launch's budgets
        self.batches.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.best_tau = state["step"], state.get("best_tau", -1.0)
        self.loggers.rewind(self.step)  # the steps after it are redone: no metrics row twice
        log.info("resumed from %s (step %d)", last, self.step)

    # ------------------------------------------------------------------------------------- train
    def make_batch(self, raw: dict[str, torch.Tensor]) -> TrainBatch:
        """The frozen target's outputs on a batch, packaged for the drafter with its teacher."""
        feats, final = self.target_outputs(raw)
        return train_batch(raw, feats, self.target, final, getattr(self.drafter, "d2t", None),
                           self.backend.device, self.drafter)

    def make_batches(self, raw: dict[str, torch.Tensor]):
        """The micro-batch's TrainBatches: the whole rows, or with trainer.window, rows longer than
        it in consecutive windows of it (the target's features of the whole rows, sliced: each
        window keeps its full-context features; the drafter's own attention sees the window).
        Yields (batch, its share of the micro-batch's trained tokens, whether it is the last)."""
        spans = row_windows(raw["loss_mask"] * raw["attention_mask"], self.tcfg.window)
        if len(spans) == 1:
            yield self.make_batch(raw), 1.0, True
            return
        feats, final = self.target_outputs(raw)
        d2t = getattr(self.drafter, "d2t", None)
        for i, (cut, share) in enumerate(spans):
            part = {k: raw[k][:, cut] for k in ("input_ids", "attention_mask", "loss_mask")}
            yield (train_batch(part, None if feats is None else feats[:, cut], self.target,
                               final[:, cut], d2t, self.backend.device, self.drafter), share,
                   i == len(spans) - 1)

    def target_outputs(self, raw: dict[str, torch.Tensor]):
        """(features of the drafter's layers or None, final hidden): read from the offline capture,
        or the target's forward (online capture)."""
        if self.offline is not None and "index" in raw:  # on-policy batches have no captured rows
            idx = raw["index"].tolist()
            try:
                return self.offline.batch(idx, [self.train_ds[i] for i in idx], raw["input_ids"].shape[1])
            finally:  # unmapped once read: a reopen costs a header parse, the pages stay in the OS's
                self.offline.release()  # file cache; mapped, they counted in the job's memory
        with autocast(self.target, self.tcfg.capture_autocast):  # as an offline capture's
            feats, final = capture(self.target, raw["input_ids"], raw["attention_mask"],
                                   self.drafter.feature_layers, self.tcfg.capture_chunk)
        return None if feats is None else feats.to(self.target.dtype), final.to(self.target.dtype)

    def own_depth(self, step: int) -> int:
        """The on-policy draft depth of optimizer step `step` (0 = teacher-forced): the schedule's
        phase (train/schedule.py). Asked once per step, before it runs."""
        return self.tcfg.on_policy_heads_depth if self.schedule.own(step) else 0

    def train_step(self) -> dict[str, float]:
        tcfg = self.tcfg
        self.model.train()
        totals: dict[str, float] = {}
        tokens = 0
        own = self.own_depth(self.step)  # > 0 in the on-policy phase of the heads
        for micro in range(tcfg.grad_accum):
            raw = next(self.batches)
            if self.on_policy is not None:  # with prob. on_policy_fraction: the drafter's own text
                raw = self.on_policy(raw, self.step, micro)
                share = self.on_policy.last / tcfg.grad_accum  # logged: the realised fraction
                totals["on_policy"] = totals.get("on_policy", 0.0) + share
            for batch, share, last in self.make_batches(raw):  # whole rows, or trainer.window's
                tokens += int(batch.attention_mask.sum())
                sync = micro == tcfg.grad_accum - 1 and last
                self._micro_step(batch, micro, share / tcfg.grad_accum, sync, totals, own)
        grad_norm = self.backend.step(self.optimizer, self.params, tcfg.grad_clip)
        totals["loss"] = float(self.backend.mean(torch.tensor(totals["loss"])))  # over all ranks
        self.schedule.advance(self.step + 1)  # before the LR scheduler reads it
        self.scheduler.step()
        self.step += 1
        return {**totals, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                "tokens": tokens}

    def _micro_step(self, batch: TrainBatch, micro: int, weight: float, sync: bool,
                    totals: dict[str, float], own: int = 0) -> None:
        """Forward, loss and backward of one (window of a) micro-batch, its loss scaled by `weight`
        (1 / grad_accum, times the window's share of the micro-batch's trained tokens); the
        loss and its parts are added to `totals` with the same weight. `own` > 0: the step's
        on-policy draft depth (own_depth)."""
        tcfg = self.tcfg
        with torch.autocast(self.backend.device.type, dtype=torch.bfloat16,
                            enabled=tcfg.precision == "bf16"):
            if own:  # the drafter drafts on its own tokens; the target scores the drafts
                preds = own_drafts(self.model, batch, tcfg, own, anchor_generator(
                    self.cfg.seed, self.step, micro, self.backend.rank))
                totals["scored"] = totals.get("scored", 0.0) + score_own_drafts(
                    self.target, batch, preds, getattr(self.drafter, "d2t", None),
                    tcfg.capture_autocast)
            else:
                preds = self.model(batch)
            loss, parts = drafter_loss(self.drafter, preds, batch, tcfg.loss,
                                       tcfg.loss_temperature, tcfg.feature_weight)
        if not torch.isfinite(loss):
            raise NonFiniteLoss(f"loss is {loss.item()} at step {self.step} (micro-batch {micro}); "
                                f"stopping. The last good checkpoint is kept in "
                                f"{self.run_dir / 'checkpoints'}; lower trainer.lr or use "
                                f"trainer.precision=fp32, then resume=true.")
        self.backend.backward(loss * weight, sync=sync)
        for name, v in {"loss": loss, **parts}.items():
            totals[name] = totals.get(name, 0.0) + float(v.detach()) * weight

    def train(self) -> None:
        tcfg = self.tcfg
        self.schedule.begin()
        t0, seen, n = time.perf_counter(), 0, 0
        self.stopped_early = False
        while not self.schedule.done(self.step):
            metrics, n = self.train_step(), n + 1
            if self.backend.device.type == "cpu" or self.step % tcfg.log_every == 0:
                release_free_memory()  # the step's freed heap pages (memory.py): on a CPU, where
                # the step's tensors live in that heap, before every step
            self.loggers.progress(self.step, tcfg.max_steps, loss=metrics["loss"])
            seen += metrics.pop("tokens")
            self.stopped_early = self._out_of_time() and self.step < tcfg.max_steps
            if self.stopped_early:
                metrics["train_minutes"] = self.schedule.seconds() / 60
                log.info("trainer.max_minutes=%s reached after %.2f min at step %d of %d: stopping "
                         "here with an eval and a checkpoint%s", tcfg.max_minutes,
                         metrics["train_minutes"], self.step, tcfg.max_steps,
                         self._schedule_end() if self.schedule.by_minutes else "")
                if not self.schedule.by_minutes:
                    self._say_what_the_budget_cut()
            if self.step % tcfg.log_every == 0 or self.step == tcfg.max_steps or self.stopped_early:
                dt = time.perf_counter() - t0
                self.loggers.log({**metrics, "target_tokens_per_s": seen * self.backend.world_size
                                  / max(dt, 1e-9), "tokens_per_step": seen / max(n, 1)}, self.step)
                t0, seen, n = time.perf_counter(), 0, 0
            last = self.step == tcfg.max_steps or self.stopped_early
            if (tcfg.eval_every and self.step % tcfg.eval_every == 0) or last:
                self.evaluate()
            if (tcfg.save_every and self.step % tcfg.save_every == 0) or last:
                self.save_checkpoint()
            if self.stopped_early:
                break

    def _say_what_the_budget_cut(self) -> None:
        """A run stopped by trainer.max_minutes keeps its schedules' plan of max_steps: say what
        of the recipe did not happen (the on-policy phase, the LR decay) and the max_steps that
        would fit it into the minutes."""
        tcfg, cut = self.tcfg, []
        start = tcfg.on_policy_heads_start
        if start is not None and not in_phase(start, tcfg.max_steps, self.step - 1):
            cut.append(f"the on-policy heads phase (trainer.on_policy_heads_start={start}: from "
                       f"step {math.ceil(start * tcfg.max_steps)}) never ran")
        lr = self.optimizer.param_groups[0]["lr"] / tcfg.lr if tcfg.lr else 1.0
        if lr > tcfg.min_lr_ratio + 0.05:
            cut.append(f"the learning rate stood at {lr:.0%} of trainer.lr (the cosine ends at "
                       f"{tcfg.min_lr_ratio:.0%} at step {tcfg.max_steps})")
        if cut:
            log.warning("trainer.max_minutes cut the recipe short: %s. For the whole recipe in "
                        "these minutes set trainer.schedule=minutes (the schedule spans the "
                        "minutes), or trainer.max_steps to the steps that fit (about %d at this "
                        "run's pace, fewer with an on-policy phase, whose steps cost more)",
                        "; ".join(cut), self.step)

    def _schedule_end(self) -> str:
        """What a trainer.schedule=minutes run did in its minutes (said when they end it)."""
        first, phase = self.schedule.on_policy_from, ""
        if first is not None:
            phase = f", on-policy heads phase from step {first + 1}"
        elif self.tcfg.on_policy_heads_start is not None:
            phase = ", the on-policy heads phase never began (its first step would have crossed the minutes)"
        return (f" (trainer.schedule=minutes: the whole schedule in the minutes: learning rate down to "
                f"{self.optimizer.param_groups[0]['lr'] / self.tcfg.lr:.0%} of trainer.lr{phase})")

    def _out_of_time(self) -> bool:
        """trainer.max_minutes has passed (on any rank: all ranks stop together; schedule=minutes:
        the ranks' mean, the schedule's own clock)."""
        if self.tcfg.max_minutes is None:
            return False
        if self.schedule.by_minutes:
            return self.schedule.progress >= 1
        late = float(self.schedule.seconds() >= 60 * self.tcfg.max_minutes)
        return float(self.backend.mean(torch.tensor(late))) > 0

    # -------------------------------------------------------------------------------------- eval
    def evaluate(self) -> dict[str, object]:
        """Per-position acceptance unrolled on the drafter's own outputs, and the simulated tau."""
        self.last_eval = {}
        with self.backend.full_weights():  # collective: ZeRO-3 gathers, then rank 0 evaluates
            if not self.backend.is_main:
                return {}
            n = min(self.tcfg.eval_conversations, len(self.eval_ds))
            if n == 0:  # no held-out data: no eval (and best/ follows the latest checkpoint)
                log.warning("no eval conversations (data.eval_fraction=%s of this data gives 0): "
                            "evals skipped, best/ = the latest checkpoint", self.cfg.data.eval_fraction)
                return {}
            res = simulate_acceptance(self.target, self.drafter, self.eval_ds.select(range(n)),
                                      k=self.tcfg.eval_k, positions=8)
        if res["sim_tau"] is None:
            log.warning("simulated eval at step %d: not measured (no assistant position with a "
                        "draft in %d eval conversations)", self.step, n)
        flat = {"eval/sim_tau": res["sim_tau"], "eval/k": self.tcfg.eval_k,
                "eval/mean_accepted": res["mean_accepted"],
                **{f"eval/acc_{i + 1}": a for i, a in enumerate(res["acceptance"])}}
        self.loggers.log(flat, self.step)
        self.last_eval = res
        write_eval_by_context(self.run_dir, self.step, self.tcfg.eval_k, res["by_context"])
        write_report(self.run_dir)  # plots + report.md, for users without W&B
        return res

    def save_checkpoint(self) -> None:
        """Collective: every rank writes its part of checkpoints/step-N/ (train/checkpoint.py);
        rank 0 keeps the best drafter by simulated tau in best/ and prunes old checkpoints."""
        tau = (getattr(self, "last_eval", None) or {}).get("sim_tau")
        tau = -1.0 if tau is None else float(tau)  # None: the eval measured nothing
        is_best = tau > self.best_tau or len(self.eval_ds) == 0  # no eval data: best = latest
        self.best_tau = max(self.best_tau, tau)
        state = {"scheduler": self.scheduler.state_dict(), "schedule": self.schedule.state_dict(),
                 "data": self.batches.state_dict(),
                 "best_tau": self.best_tau, "config": OmegaConf.to_container(self.cfg, resolve=True)}
        path = ckpt.save_checkpoint(self.run_dir, self.step, self.backend, self.drafter,
                                    self.cfg.drafter, self.optimizer, state)
        if self.backend.is_main:
            if is_best:
                runs.publish_best(path, self.run_dir / "best")
            runs.prune_checkpoints(self.run_dir, self.tcfg.keep_last)
        self.backend.barrier()

    def final_eval(self) -> dict | None:
        """The best drafter in the real decoder and the engine check (train/final_eval.py)."""
        if not self.tcfg.final_eval or not self.backend.is_main:
            return None
        drop_training_state(self.optimizer, self.offline)  # the engines' memory
        return final_eval(self.cfg, self.run_dir, self.target, self.drafter, self.loggers, self.step)

    def cleanup(self) -> None:
        self.loggers.close()
        self.backend.close()
        self.release_lock()

    def release_lock(self) -> None:
        if getattr(self, "lock", None) is not None:
            self.lock.release()


def run(cfg: DictConfig) -> None:
    check_ranges(cfg, TrainConfig)  # before any work
    recipe = DistillRecipe(cfg)
    try:
        recipe.setup()
        recipe.train()
    except BaseException as e:  # a dead or hung peer surfaces as an opaque gloo/nccl error: say so
        recipe.release_lock()
        msg = peer_failure_message(e, cfg.trainer.dist_timeout_s) if isinstance(e, Exception) else None
        if msg is None:
            raise
        raise RuntimeError(msg) from e
    try:
        result = recipe.final_eval()
        if result is not None:
            publish(result, Path(cfg.run_dir))
    finally:
        recipe.cleanup()
