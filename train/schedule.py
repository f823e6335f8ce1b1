"""The learning-rate schedule and the on-policy heads phase, over steps or over minutes.

trainer.schedule=steps (the default): a linear warm-up over trainer.warmup_steps, then a cosine to
trainer.min_lr_ratio x lr at trainer.max_steps; the on-policy heads phase runs the steps
s >= trainer.on_policy_heads_start x max_steps. A rerun repeats every number.

trainer.schedule=minutes: the same shapes over the run's *progress*, the larger of step / max_steps
and training minutes / trainer.max_minutes. The cosine ends, and the on-policy phase starts at its
share, where the first of the two budgets runs out: a job given N minutes gets the whole recipe in
them on any machine, without guessing how many steps fit (a step-based schedule cut by
trainer.max_minutes keeps its learning rate high and may never reach its on-policy phase). The
warm-up stays in steps. The minutes are the training loop's (its evals and checkpoints included,
setup and the capture not), carried across resumes, and the ranks' mean, so every rank takes the
same learning rate and the same phase. The steps a run makes then depend on the machine's speed,
so a rerun is not bit for bit the same; metrics.jsonl records each step's learning rate.
"""
from __future__ import annotations

import math
import time
from typing import Callable

SCHEDULES = ("steps", "minutes")


def _now() -> float:
    """The schedule's clock (tests move it by hand)."""
    return time.monotonic()


def lr_lambda(warmup: int, total: int, floor: float):
    """Linear warm-up to 1, then cosine decay to `floor` at `total` steps."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return cosine(floor, (step - warmup) / max(1, total - warmup))

    return f


def cosine(floor: float, progress: float) -> float:
    """1 at progress 0, `floor` at progress >= 1, a half cosine between."""
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


def in_phase(start: float | None, max_steps: int, step: int) -> bool:
    """Does optimizer step `step` (0-based) draft on its own tokens under trainer.schedule=steps
    (trainer.on_policy_heads_start)?"""
    return start is not None and step >= start * max_steps


def check_schedule(tcfg) -> str:
    """trainer.schedule, refused when it names no schedule or spans minutes it is not given."""
    mode = str(tcfg.get("schedule", "steps"))
    if mode not in SCHEDULES:
        raise ValueError(f"trainer.schedule={mode!r}: use steps (the default) or minutes")
    if mode == "minutes" and tcfg.max_minutes is None:
        raise ValueError("trainer.schedule=minutes spans trainer.max_minutes, which is null: give "
                         "the budget (trainer.max_minutes=30) or use trainer.schedule=steps")
    return mode


class Schedule:
    """A run's learning-rate factor (LambdaLR's lambda: `lr_factor`) and on-policy phase (`own`),
    over steps or minutes (the module's doc). `advance` is called once per optimizer step, before
    the LR scheduler steps; its state goes into every checkpoint."""

    def __init__(self, tcfg, mean: Callable[[float], float] = float) -> None:
        """`mean`: the ranks' mean of a float (every rank gets the same value back)."""
        self.mode, self.max_minutes = check_schedule(tcfg), tcfg.max_minutes
        self.warmup, self.max_steps, self.floor = tcfg.warmup_steps, tcfg.max_steps, tcfg.min_lr_ratio
        self.start = tcfg.on_policy_heads_start
        self.mean = mean
        self.earlier_s = 0.0  # training seconds of the launches before this one (a resume)
        self.progress = 0.0  # after the last step (minutes)
        self.warmup_s = 0.0 if self.warmup == 0 else None  # training seconds when the warm-up ended
        self.on_policy_from: int | None = None  # the first on-policy step (minutes: once begun, kept)
        self._t0 = _now()
        self._steps_lr = lr_lambda(self.warmup, self.max_steps, self.floor)

    @property
    def by_minutes(self) -> bool:
        return self.mode == "minutes"

    def begin(self) -> None:
        """The training loop starts: the clock of this launch."""
        self._t0 = _now()

    def seconds(self) -> float:
        """Training seconds so far, this launch and the earlier ones (not averaged over ranks)."""
        return self.earlier_s + _now() - self._t0

    def lr_factor(self, step: int) -> float:
        """The factor of trainer.lr at optimizer step `step` (0-based)."""
        if not self.by_minutes:
            return self._steps_lr(step)
        if step < self.warmup:
            return (step + 1) / max(1, self.warmup)
        p0 = self.progress if self.warmup_s is None else self._progress(self.warmup, self.warmup_s)
        return cosine(self.floor, (self.progress - p0) / max(1e-9, 1 - p0))

    def _progress(self, steps_done: int, seconds: float) -> float:
        return max(steps_done / self.max_steps, seconds / 60 / self.max_minutes)

    def advance(self, steps_done: int) -> None:
        """Optimizer step `steps_done - 1` is done (collective under schedule=minutes: the ranks'
        mean training minutes)."""
        if not self.by_minutes:
            return
        seconds = self.mean(self.seconds())
        self.progress = self._progress(steps_done, seconds)
        if steps_done == self.warmup and self.warmup_s is None:
            self.warmup_s = seconds

    def done(self, step: int) -> bool:
        """Has the schedule ended before optimizer step `step`? (max_steps; with minutes also
        progress 1)"""
        return step >= self.max_steps or (self.by_minutes and self.progress >= 1)

    def own(self, step: int) -> bool:
        """Does optimizer step `step` draft on the drafter's own tokens (the on-policy heads phase)?
        Called once per step, before it runs."""
        if not self.by_minutes:
            return in_phase(self.start, self.max_steps, step)
        if self.on_policy_from is None and self.start is not None and self.progress >= self.start:
            self.on_policy_from = step
        return self.on_policy_from is not None

    def state_dict(self) -> dict:
        return {"mode": self.mode, "seconds": self.seconds(), "progress": self.progress,
                "warmup_s": self.warmup_s, "on_policy_from": self.on_policy_from}

    def load_state_dict(self, state: dict | None, step: int) -> None:
        """The state of a checkpoint at `step` (None: one written before schedules were recorded,
        steps only). schedule=minutes carries the training minutes and the phase on, its progress
        measured against this launch's budgets (a resume may give more minutes or steps); steps
        gives trainer.max_minutes afresh to every launch, as before."""
        if not state or not self.by_minutes:
            return
        self.earlier_s = float(state["seconds"])
        self.warmup_s = state["warmup_s"]
        self.on_policy_from = state["on_policy_from"]
        self.progress = self._progress(step, self.earlier_s)
        self._t0 = _now()


def phase_unbegun(flat: dict, step: int, state: dict | None) -> bool:
    """Were steps 0 .. step-1 of a checkpoint all teacher-forced under this (flattened) config?
    schedule=steps: by the config alone; minutes: by the checkpoint's schedule state (its
    schedule's `on_policy_from`: no on-policy step yet)."""
    if flat.get("trainer.schedule", "steps") != "minutes":
        return step < 1 or not in_phase(flat.get("trainer.on_policy_heads_start"),
                                         flat.get("trainer.max_steps", 0), step - 1)
    return (state or {}).get("on_policy_from") is None
