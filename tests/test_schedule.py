"""train/schedule.py: the learning rate and the on-policy phase over steps (a rerun repeats every
number) or over minutes (the whole recipe inside trainer.max_minutes, whatever the machine's
speed), on a clock the tests move by hand."""
import math

import pytest
from omegaconf import OmegaConf

from specdistill.train import schedule as S
from specdistill.train.resume import config_conflicts


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(S, "_now", c)
    return c


def tcfg(**kw):
    base = dict(schedule="minutes", max_steps=1000, max_minutes=10.0, warmup_steps=2,
                min_lr_ratio=0.1, on_policy_heads_start=0.9)
    return OmegaConf.create({**base, **kw})


def drive(s: S.Schedule, clock: Clock, seconds_a_step, steps=10_000):
    """Steps until the schedule ends, each taking seconds_a_step(step); -> (the LR factor each
    step ran at, whether each ran on-policy)."""
    lrs, own = [], []
    s.begin()
    step = 0
    while not s.done(step) and step < steps:
        lrs.append(s.lr_factor(step))
        own.append(s.own(step))
        clock.now += seconds_a_step(step)
        step += 1
        s.advance(step)
    return lrs, own


def test_steps_is_the_cosine_over_max_steps(clock):
    """The default: warm-up, then the cosine to the floor at max_steps; the phase from 90% of the
    steps; the clock changes nothing."""
    s = S.Schedule(tcfg(schedule="steps", max_steps=100, max_minutes=None))
    lrs, own = drive(s, clock, lambda step: 1e6)  # an hour a step: still 100 steps
    assert len(lrs) == 100 and lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs == [S.lr_lambda(2, 100, 0.1)(i) for i in range(100)]
    assert own.index(True) == 90 and all(own[90:])


@pytest.mark.parametrize("seconds", [6.0, 2.0])
def test_minutes_spans_the_budget_at_any_speed(clock, seconds):
    """10 minutes at 6 s or 2 s a step: 100 or 300 steps, and in both the cosine reaches its
    floor and the on-policy phase takes the last 10% of the minutes."""
    s = S.Schedule(tcfg())
    lrs, own = drive(s, clock, lambda step: seconds)
    n = round(600 / seconds)
    assert len(lrs) == n  # ends where the minutes do, far before max_steps=1000
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == pytest.approx(1.0, abs=1e-2)
    assert s.lr_factor(n) == pytest.approx(0.1)  # the floor at the end
    half = n // 2
    p0 = 2 / n
    assert lrs[half] == pytest.approx(S.cosine(0.1, (half / n - p0) / (1 - p0)), rel=1e-6)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # decays monotonically after warm-up
    assert own.index(True) == round(0.9 * n) and all(own[round(0.9 * n):])


def test_minutes_follows_the_pace_as_it_changes(clock):
    """Steps that slow down (an on-policy phase costs more) do not push the end past the minutes:
    the progress is read from the clock, not extrapolated."""
    s = S.Schedule(tcfg())
    lrs, own = drive(s, clock, lambda step: 15.0 if s.on_policy_from is not None else 5.0)
    assert clock.now - 1000.0 == pytest.approx(600, abs=15)  # ends within one step of 10 min
    assert own.index(True) == 108  # 540 s at 5 s a step
    assert len(lrs) == 108 + 4  # 60 s at 15 s a step


def test_max_steps_ends_it_when_it_runs_out_first(clock):
    s = S.Schedule(tcfg(max_steps=50))
    lrs, own = drive(s, clock, lambda step: 1.0)  # 50 steps take 50 s of the 600
    assert len(lrs) == 50 and s.lr_factor(50) == pytest.approx(0.1)
    assert own.index(True) == 45


def test_minutes_carries_over_a_resume_and_keeps_its_phase(clock):
    """A resumed run continues the minutes (and the phase, even when a larger budget puts its
    progress back below the start)."""
    s = S.Schedule(tcfg())
    drive(s, clock, lambda step: 6.0, steps=95)  # 570 s: in the phase since step 90
    state = s.state_dict()
    assert state["seconds"] == pytest.approx(570) and state["on_policy_from"] == 90
    clock.now += 3600  # the job was down for an hour: not training minutes
    again = S.Schedule(tcfg())
    again.load_state_dict(state, 95)
    assert again.seconds() == pytest.approx(570) and again.progress == pytest.approx(0.95)
    lrs, own = drive(again, clock, lambda step: 6.0)
    assert len(lrs) == 5 and all(own)
    longer = S.Schedule(tcfg(max_minutes=20.0))  # a larger budget on resume: progress 0.475
    longer.load_state_dict(state, 95)
    assert not longer.done(95) and longer.progress == pytest.approx(0.475, abs=1e-3) and longer.own(95)


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="trainer.schedule='epochs'"):
        S.Schedule(tcfg(schedule="epochs"))
    with pytest.raises(ValueError, match="trainer.max_minutes, which is null"):
        S.Schedule(tcfg(max_minutes=None))


def test_resume_lets_the_phase_change_only_before_it_began():
    """schedule=minutes: the on-policy settings may change on resume while the checkpoint's state
    says no step ran on-policy (its progress cannot say it: the minutes decide)."""
    old = {"trainer": {"schedule": "minutes", "on_policy_heads_start": 0.9, "max_steps": 1000}}
    new = {"trainer": {**old["trainer"], "on_policy_heads_start": 0.8}}
    assert config_conflicts(old, new, 80, {"on_policy_from": None, "progress": 0.85}) == []
    said = config_conflicts(old, new, 95, {"on_policy_from": 90, "progress": 0.95})
    assert said == ["trainer.on_policy_heads_start: 0.9 -> 0.8"]
    assert math.isclose(S.cosine(0.1, 0.5), 0.55)
