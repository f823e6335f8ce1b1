"""`python -m benchmarks.tau_minutes`: acceptance against training minutes for finished runs
and their branches, every step priced by its kind from one run's measured seconds."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from benchmarks.tau_minutes import main, minutes, step_prices


def fake_run(path, start, max_steps, lines):
    path.mkdir()
    cfg = {"trainer": {"on_policy_heads_start": start, "max_steps": max_steps}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_each_kind_of_step_is_priced_by_its_own_intervals(tmp_path):
    # 20 steps logged every 2, on-policy from step 11 (0-based): teacher-forced steps take 1 s,
    # on-policy ones 3 s; evals after steps 4 and 8 take 100 s; the interval (10, 12] holds both kinds
    t, lines = 0.0, []
    for step in range(2, 21, 2):
        t += sum(3.0 if s >= 11 else 1.0 for s in range(step - 2, step))
        lines.append({"step": step, "time": t, "loss": 1.0})
        if step in (4, 8):
            t += 100.0
            lines.append({"step": step, "time": t, "eval/sim_tau": 1.2})
    run = fake_run(tmp_path / "run", 0.55, 20, lines)
    # clean teacher-forced intervals: (2, 4] and (6, 8]; counting (4, 6], (8, 10] or (10, 12] moves the median
    assert step_prices(run) == {"tf": 1.0, "op": 3.0}
    assert minutes(run, 20, {"tf": 1.0, "op": 3.0}) == pytest.approx((11 * 1 + 9 * 3) / 60)
    # a run teacher-forced throughout, priced by the same measurement
    flat = fake_run(tmp_path / "flat", None, 30, [])
    assert minutes(flat, 30, {"tf": 1.0, "op": 3.0}) == pytest.approx(30 / 60)
    with pytest.raises(SystemExit, match="measured none"):
        minutes(run, 20, {"tf": 1.0})
    with pytest.raises(SystemExit, match="no interval of teacher-forced steps"):
        step_prices(flat)
    clocked = fake_run(tmp_path / "clocked", 0.9, 30, lines)  # its phase followed the clock
    cfg = yaml.safe_load((clocked / "config.yaml").read_text())
    cfg["trainer"]["schedule"] = "minutes"
    (clocked / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit, match="trainer.schedule=minutes"):
        minutes(clocked, 20, {"tf": 1.0, "op": 3.0})


@pytest.mark.timeout(300)
def test_runs_and_a_branch_replay_once_per_checkpoint(tiny_run, tmp_path):
    branch = tmp_path / "branch"
    shutil.copytree(tiny_run, branch)
    steps = sorted(int(c.name.split("-")[-1]) for c in (branch / "checkpoints").iterdir())
    assert len(steps) >= 2
    for c in list((branch / "checkpoints").iterdir())[:-1]:
        shutil.rmtree(c)  # a branch keeps the copied checkpoint it resumed from
    out = tmp_path / "out"
    argv = ["--tiny", "--out", str(out), "--run", f"job={tiny_run}", "--run", f"branch={branch}",
            "--replay-prompts", "2", "--humaneval-prompts", "2", "--replay-tokens", "8", "--mark", "0.01"]
    md = main(argv)
    rep = [json.loads(line) for line in (out / "replay.jsonl").read_text().splitlines()]
    # every checkpoint of the job on both prompt sets; the branch's copy is the job's last: no replay
    assert len(rep) == 2 * len(steps) and len({r["key"] for r in rep}) == len(rep)
    assert sorted(r["run"] for r in rep if "humaneval" in r["key"]) == sorted(f"job@{s}" for s in steps)
    assert f"| branch | {steps[-1]} |" in md and f"| job | {steps[0]} |" in md
    last = [line for line in md.splitlines() if line.startswith(f"| branch | {steps[-1]} |")][0]
    assert last.count("+0.000 ± 0.000") == 2  # the same weights: paired gap 0 to the job's last
    assert (out / "tau_minutes.png").stat().st_size > 0
    main(argv)  # a rerun replays nothing again
    assert len((out / "replay.jsonl").read_text().splitlines()) == len(rep)
    with pytest.raises(SystemExit, match="NAME=DIR"):
        main(["--run", str(tiny_run)])
