"""Runs `speculators train` on the CPU for a wall-clock budget: executed by speculators' own python
(its virtualenv, benchmarks/peers/venvs.py), never imported by specdistill.

    <venv>/bin/python benchmarks/peers/speculators_cpu.py --minutes 3 --report r.json -- <train args>
    <venv>/bin/python benchmarks/peers/speculators_cpu.py --prepare-data <dir>   # data.jsonl -> its dataset

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
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch


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
    ap.add_argument("--minutes", type=float)
    ap.add_argument("--report")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.prepare_data:
        return prepare_data(args.prepare_data)
    stats: dict = {"peer": "speculators"}
    cpu_device()
    cpu_synchronize()
    wall_clock_budget(args.minutes, stats)
    count_tokens(stats)
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    try:
        train_main(TrainConfig.resolve(rest))
    finally:
        stats.pop("start", None)
        stats["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with open(args.report, "w") as fh:
            json.dump(stats, fh)


if __name__ == "__main__":
    sys.exit(main())
