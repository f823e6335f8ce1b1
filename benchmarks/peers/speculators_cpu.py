"""Runs `speculators train` on the CPU for a wall-clock budget: executed by speculators' own python
(its virtualenv, benchmarks/peers/venvs.py), never imported by specdistill.

    <venv>/bin/python benchmarks/peers/speculators_cpu.py --minutes 3 --report r.json -- <train args>
    <venv>/bin/python benchmarks/peers/speculators_cpu.py --prepare-data <dir>   # data.jsonl -> its dataset
    <venv>/bin/python benchmarks/peers/speculators_cpu.py --check-loss --report r.json -- <train args>

The shims below are the only changes, each small and named; none changes what the peer computes
(the loss, the model, the optimizer, the data order):
- `cpu_device`: speculators 0.9.0 assumes an accelerator where none is: its device string falls
  back to "cuda:0" (utils/util.py, the checkpointer's loads), the trainer moves model and batches
  to `get_local_rank()` (an int = cuda:<n>) and autocasts on device_type "cuda". Here: "cpu".
- `cpu_synchronize`: its step timer calls `torch.accelerator.synchronize()`, which fails without an
  accelerator; a no-op where there is none.
- `wall_clock_budget`: the same stop as our trainer.max_minutes, through the peer's own
  interrupt path: after the step that crosses the budget, TrainingInterruptedError, which its
  `with_graceful_shutdown` turns into a saved "interrupted" checkpoint.
- `count_tokens`: a forward pre-hook that counts the tokens of each training batch (its
  `document_ids != -1`: packed tokens, no padding) for tokens/s.

`--check-loss` checks that claim on the run's first batch (`check_loss`): the loss the shimmed
trainer gets from its model's forward (its autocast, its loss config, under every shim above)
against the same batch's loss rebuilt from the peer's own loss function called directly on that
forward's logits and targets (speculators/losses: `loss_function` with its eager reference loss
of the configured name and its exponential TTT decay, each step aligned by its `align_for_step`),
value and gradient with respect to every step's logits; the run stops there, nothing is trained.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

try:  # this checkout's package, or (run as a script in the peer's virtualenv) this folder
    from benchmarks.peers.procstat import own_peak_rss_mb
except ImportError:
    from procstat import own_peak_rss_mb

LOSS_TOL = 1e-5  # |shimmed - reference| / max(|reference|, 1) allowed, and the same for gradients


class LossChecked(Exception):
    """Raised after the first batch's loss check: the run stops there."""


def cpu_device() -> None:
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer
    import speculators.utils.util as util

    util.get_current_device = checkpointer.get_current_device = lambda: "cpu"
    trainer.get_local_rank = lambda: "cpu"  # only ever used as a .to() target in the trainer
    setup = trainer.Trainer.setup_trainer

    def setup_trainer(self):
        self.device_type = "cpu"  # autocast's device type (the peer falls back to "cuda")
        return setup(self)

    trainer.Trainer.setup_trainer = setup_trainer


def cpu_synchronize() -> None:
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *a, **k: None


def wall_clock_budget(minutes: float, stats: dict) -> None:
    import speculators.train.trainer as trainer
    from speculators.train.graceful_shutdown import TrainingInterruptedError

    train_epoch = trainer.Trainer.train_epoch

    def budgeted(self, epoch, *, step_callback=None):
        stats.setdefault("start", time.monotonic())

        def callback():
            if step_callback is not None:
                step_callback()
            stats["steps"] = self.global_step
            stats["train_s"] = time.monotonic() - stats["start"]
            if stats["train_s"] >= 60 * minutes:
                stats["stopped_by_budget"] = True
                raise TrainingInterruptedError(f"wall-clock budget of {minutes} min reached")

        return train_epoch(self, epoch, step_callback=callback)

    trainer.Trainer.train_epoch = budgeted


def count_tokens(stats: dict) -> None:
    import speculators.train.trainer as trainer

    setup_model = trainer.Trainer.setup_model

    def counted(self):
        setup_model(self)

        def hook(_module, _args, kwargs):
            if torch.is_grad_enabled():  # training forwards only (not validation)
                ids = kwargs.get("document_ids")
                n = int((ids != -1).sum()) if ids is not None else int(kwargs["input_ids"].numel())
                stats["tokens"] = stats.get("tokens", 0) + n

        self.model.register_forward_pre_hook(hook, with_kwargs=True)

    trainer.Trainer.setup_model = counted


def check_loss(stats: dict, run: dict) -> None:
    """On the first training forward: the trainer's loss against its own loss function (module
    docstring) into `stats`, then LossChecked. `run`: the run's flattened TrainConfig, where the
    loss names, weights and TTT decay are read (not from what the trainer passes its model)."""
    import speculators.models.eagle3.core as core
    import speculators.train.trainer as trainer
    from speculators.losses import utils as L
    from speculators.models.eagle3.metrics import align_for_step

    steps: list = []  # (logits, targets, loss_mask, ttt_step) the model's loss saw, per TTT step
    compute_metrics = core.compute_metrics

    def recorded(logits, targets, loss_mask, prev_correct, ttt_step, *a, **k):
        if torch.is_grad_enabled():
            steps.append((logits, targets, loss_mask, ttt_step))
        return compute_metrics(logits, targets, loss_mask, prev_correct, ttt_step, *a, **k)

    core.compute_metrics = recorded
    setup_model = trainer.Trainer.setup_model

    def checked(self):
        setup_model(self)

        def hook(_module, _args, kwargs, output):
            if not torch.is_grad_enabled():
                return None
            if not steps:
                stats.update(ok=False, error="its model's forward computed no loss step")
                raise LossChecked()
            loss = output[1]  # what the trainer backpropagates
            decay = run["ttt_step_loss_decay"]
            config = L.resolve_loss_config(run["loss_fn"], "eager")  # its reference losses
            reference = torch.zeros((), dtype=torch.float32)
            for logits, targets, mask, i in steps:
                s_logits, s_targets, s_mask, _ = align_for_step(logits, targets, mask, None, i)
                if s_mask is None:
                    s_mask = torch.ones(s_logits.shape[:2], dtype=torch.bool)
                pos = torch.full(s_logits.shape[:2], i, dtype=torch.long)
                for fn, weight in config.values():
                    reference = reference + weight * L.loss_function(
                        s_logits, s_targets, s_mask, pos, loss_fn=fn,
                        decay_fn=lambda p, **_: L.exp_loss_decay(p, gamma=decay))
            logits = [s[0] for s in steps]
            g_shim = torch.autograd.grad(loss, logits, retain_graph=True)
            g_ref = torch.autograd.grad(reference, logits, retain_graph=True)
            loss, reference = float(loss.detach()), float(reference.detach())
            stats.update(loss_shimmed=loss, loss_reference=reference,
                         loss_diff=abs(loss - reference),
                         grad_diff=max(float((a - b).abs().max()) for a, b in zip(g_shim, g_ref))
                         / max(max(float(b.abs().max()) for b in g_ref), 1e-12),
                         ttt_steps=len(steps), tokens=int(kwargs["input_ids"].numel()),
                         loss_names=sorted(config), reference="speculators.losses.utils."
                         "loss_function with speculators.losses.eager losses")
            scale = max(abs(reference), 1.0)
            stats["ok"] = stats["loss_diff"] / scale <= LOSS_TOL and stats["grad_diff"] <= LOSS_TOL
            raise LossChecked()

        self.model.register_forward_hook(hook, with_kwargs=True)

    trainer.Trainer.setup_model = checked


def prepare_data(folder: str) -> None:
    """<folder>/data.jsonl (input_ids, loss_mask per row, in hs_{i} order) -> the dataset its
    trainer loads (load_from_disk: input_ids, loss_mask, seq_len, torch format, as its prepare-data
    writes for pre-tokenised rows) and token_freq.pt (its own counter: the draft vocabulary)."""
    from datasets import Dataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    rows = [json.loads(line) for line in open(f"{folder}/data.jsonl")]
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                            "loss_mask": [r["loss_mask"] for r in rows],
                            "seq_len": [len(r["input_ids"]) for r in rows]})
    ds.set_format(type="torch")
    ds.save_to_disk(folder)
    save_token_frequency_distribution(ds, f"{folder}/token_freq.pt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prepare-data")
    ap.add_argument("--check-loss", action="store_true", help="the first batch's loss check only")
    ap.add_argument("--minutes", type=float)
    ap.add_argument("--report")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.prepare_data:
        return prepare_data(args.prepare_data)
    stats: dict = {"peer": "speculators"}
    cpu_device()
    cpu_synchronize()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    config = TrainConfig.resolve(rest)
    if args.check_loss:
        check_loss(stats, config.flatten())
    else:
        wall_clock_budget(args.minutes, stats)
        count_tokens(stats)
    try:
        train_main(config)
    except LossChecked:
        print(json.dumps({k: stats.get(k) for k in ("loss_shimmed", "loss_reference", "loss_diff",
                                                    "grad_diff", "ok", "error")}))
    finally:
        stats.pop("start", None)
        stats["peak_rss_mb"] = own_peak_rss_mb()
        with open(args.report, "w") as fh:
            json.dump(stats, fh)
    return 0 if stats.get("ok", not args.check_loss) else 1


if __name__ == "__main__":
    sys.exit(main())
