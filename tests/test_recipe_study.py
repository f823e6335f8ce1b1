"""`python -m benchmarks.recipe_study` (BENCHMARKS.md "Recipe study") on the tiny target: arms trained as real
`python -m train` processes on the study's settings, every checkpoint of a curve arm replayed on
MT-bench and HumanEval answers, the table and the learning-curve plot."""
from __future__ import annotations

import json

import pytest

from benchmarks.recipe_study import ARMS, arm_overrides, main


def test_every_arm_composes_into_a_train_config(tmp_path):
    """A misspelt override in ARMS would only fail hours into a study: compose every arm now."""
    from argparse import Namespace

    from benchmarks.replaying import compose

    args = Namespace(tiny=False, features_dir=str(tmp_path), steps=10, save_every=5, seed=0, set=[])
    for name in ARMS:
        cfg = compose(arm_overrides(name, args))
        # all rows self-generated: features from the store, no capture; a mix captures its file rows
        own_only = cfg.data.get("selfgen") is not None and not cfg.data.selfgen.mix
        assert cfg.trainer.features_dir == (None if own_only else str(tmp_path))
        assert cfg.trainer.max_steps == 10
        assert cfg.drafter.name == ARMS[name][1][0].split("=")[1]
    assert "trainer.max_steps=30" in arm_overrides("eagle:30", args)  # an arm of its own length
    with pytest.raises(SystemExit, match="unknown arm"):
        arm_overrides("eagle4", args)
    with pytest.raises(SystemExit, match="positive integer"):
        arm_overrides("eagle:ten", args)


@pytest.mark.timeout(600)
def test_study_trains_replays_and_plots(tmp_path):
    out = tmp_path / "study"
    md = main(["--tiny", "--out", str(out), "--arms", "eagle:2", "e3_ttt2", "--steps", "4",
               "--save-every", "2", "--jobs", "2", "--threads", "1", "--replay-prompts", "2",
               "--humaneval-prompts", "2", "--replay-tokens", "8", "--curves", "e3_ttt2"])
    arms = [json.loads(line) for line in (out / "arms.jsonl").read_text().splitlines()]
    assert sorted((a["run"], a["steps"]) for a in arms) == [("e3_ttt2", 4), ("eagle", 2)]
    rep = [json.loads(line) for line in (out / "replay.jsonl").read_text().splitlines()]
    # the curve arm: both checkpoints on both prompt sets; the other arm: its last checkpoint
    assert sorted((r["arm"], r["step"], r["kind"]) for r in rep) == [
        ("e3_ttt2", 2, "humaneval"), ("e3_ttt2", 2, "mtbench"), ("e3_ttt2", 4, "humaneval"),
        ("e3_ttt2", 4, "mtbench"), ("eagle", 2, "humaneval"), ("eagle", 2, "mtbench")]
    assert all(r["rounds"] > 0 and r["wall_minutes"] > 0 for r in rep)
    e3 = sorted((r for r in rep if r["arm"] == "e3_ttt2"), key=lambda r: r["step"])
    assert e3[0]["wall_minutes"] < e3[-1]["wall_minutes"]  # the clock runs with the steps
    assert "| eagle |" in md and "| e3_ttt2 |" in md and "replay tau k=5 humaneval" in md
    assert (out / "curves.png").stat().st_size > 0
    # a rerun trains and replays nothing again
    main(["--tiny", "--out", str(out), "--replay-prompts", "2", "--humaneval-prompts", "2",
          "--replay-tokens", "8", "--curves", "e3_ttt2"])
    assert len((out / "replay.jsonl").read_text().splitlines()) == len(rep)


def test_step_costs_interleave_the_arms_in_one_process(tmp_path):
    md = main(["--tiny", "--out", str(tmp_path), "--step-costs", "eagle", "e3_ttt2", "--threads",
               "1", "--cost-rounds", "2", "--cost-steps", "1"])
    rows = json.loads((tmp_path / "step_costs.json").read_text())["rows"]
    assert list(rows) == ["eagle", "e3_ttt2"] and all(len(r["rounds"]) == 2 for r in rows.values())
    assert rows["eagle"]["vs_first"] == 1.0 and rows["e3_ttt2"]["s_per_step"] > 0
    assert "| e3_ttt2 |" in md
    # with measured prices, an arm's minutes are its steps x its seconds per step, not the wall
    from benchmarks.recipe_study import price_minutes

    reps = [{"arm": "e3_ttt2", "step": 60, "wall_minutes": 99.0},
            {"arm": "other", "step": 60, "wall_minutes": 7.0}]
    price_minutes(reps, tmp_path)
    assert reps[0]["minutes"] == pytest.approx(rows["e3_ttt2"]["s_per_step"])  # 60 steps x s / 60
    assert reps[1]["minutes"] == 7.0  # not measured: the wall clock
