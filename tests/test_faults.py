"""Faults and bad input as a user meets them: damaged checkpoints, changed settings on resume,
two jobs in one run dir, out-of-range settings, Ctrl-C, and a lossless check that fails loudly."""
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from procs import pythonpath, run_cli
from test_train import chat_file, make_cfg  # noqa: F401  (fixture + config helper)
from test_train import run as _train

from specdistill.cli.errors import UserError
from specdistill.cli.ranges import check_ranges
from specdistill.decode import evaluate as ev
from specdistill.store import manifest
from specdistill.store import rundir as runs
from specdistill.train.config import TrainConfig
from specdistill.train.recipe import DistillRecipe
from specdistill.train.runlock import RunDirLocked, RunLock

ROOT = Path(__file__).resolve().parents[1]
# this checkout first, after the test process's own path (a worktree's package folder, if any)
PYTHONPATH = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))


@pytest.fixture
def two_ckpts(tmp_path, chat_file):  # noqa: F811
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=4", "trainer.save_every=2",
                   "trainer.eval_every=0", "trainer.keep_last=3")
    _train(cfg)
    return tmp_path, cfg


def _resume(tmp_path, chat_file, *extra):  # noqa: F811
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=6", "trainer.save_every=2",
                   "trainer.eval_every=0", "trainer.keep_last=3", "resume=true", *extra)
    r = DistillRecipe(cfg)
    try:
        r.setup()
    finally:
        r.release_lock()
    return r


def _step(run: Path, n: int) -> Path:
    return run / "checkpoints" / f"step-{n:07d}"


def test_checkpoints_carry_a_manifest_that_verifies(two_ckpts):
    tmp_path, _ = two_ckpts
    for n in (2, 4):
        entries = json.loads((_step(tmp_path / "run", n) / manifest.MANIFEST).read_text())
        assert {"drafter.safetensors", "drafter.json", "trainer_state.pt", "optimizer.pt"} <= set(entries)
        assert manifest.verify(_step(tmp_path / "run", n), runs.REQUIRED) == []
    assert manifest.verify(tmp_path / "run" / "best", ()) == []


def test_truncated_newest_checkpoint_falls_back_to_the_older_one(two_ckpts, chat_file, caplog):  # noqa: F811
    tmp_path, _ = two_ckpts
    bad = _step(tmp_path / "run", 4) / "drafter.safetensors"
    with open(bad, "r+b") as f:
        f.truncate(1000)
    config_before = (tmp_path / "run" / "config.yaml").read_text()
    with caplog.at_level(logging.WARNING):
        r = _resume(tmp_path, chat_file)
    assert r.step == 2  # the intact older checkpoint
    assert f"{bad}: 1000 bytes" in caplog.text and "OLDER CHECKPOINT step-0000002" in caplog.text
    assert (tmp_path / "run" / "config.prev.yaml").read_text() == config_before


@pytest.mark.parametrize("victim", ["optimizer.pt", "drafter.safetensors", "trainer_state.pt"])
def test_a_deleted_file_is_named_and_all_damaged_refuses(two_ckpts, chat_file, victim):  # noqa: F811
    tmp_path, _ = two_ckpts
    config_before = (tmp_path / "run" / "config.yaml").read_text()
    for n in (2, 4):
        (_step(tmp_path / "run", n) / victim).unlink()
    with pytest.raises(runs.CheckpointError) as e:
        _resume(tmp_path, chat_file)
    for n in (2, 4):
        assert f"{_step(tmp_path / 'run', n) / victim}: missing" in str(e.value)
    assert "deepspeed" not in str(e.value)  # case 2: no wrong guess about the backend
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before  # nothing rewritten


def test_resume_with_a_changed_architecture_names_the_keys(two_ckpts, chat_file):  # noqa: F811
    tmp_path, _ = two_ckpts
    config_before = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(UserError) as e:
        _resume(tmp_path, chat_file, "drafter.num_layers=2", "trainer.lr=1e-2")
    msg = str(e.value)
    assert "drafter.num_layers: 1 -> 2" in msg and "trainer.lr" in msg
    assert "trainer.max_steps" not in msg.split("Settings that may change")[0]  # allowed change
    assert (tmp_path / "run" / "config.yaml").read_text() == config_before


def test_one_job_per_run_dir(tmp_path, chat_file, caplog):  # noqa: F811
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / "run.lock").write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename,
                                                  "started": time.time()}))
        cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=2")
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid}"):
            DistillRecipe(cfg).setup()
        assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.WARNING):  # the holder is dead now: a stale lock is taken over
        lock = RunLock(run).acquire()
    assert "stale lock" in caplog.text
    assert json.loads((run / "run.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / "run.lock").exists()


def test_two_jobs_started_together_one_is_refused(tmp_path):
    """Real processes racing for one run dir: exactly one gets the lock."""
    code = ("import sys, time; sys.path.insert(0, %r); from train.runlock import RunLock, RunDirLocked\n"
            "try:\n    RunLock(%r).acquire(); print('GOT', flush=True); time.sleep(3)\n"
            "except RunDirLocked as e:\n    print('REFUSED', e, flush=True)\n") % (str(ROOT), str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert sorted(o.split()[0] for o in outs) == ["GOT", "REFUSED"]


def test_numeric_settings_are_checked_with_key_and_range(tmp_path, chat_file):  # noqa: F811
    for bad, text in [("trainer.batch_size=-2", "trainer.batch_size=-2 is outside [1, 4096]"),
                      ("trainer.max_steps=0", "trainer.max_steps=0 is outside [1, 1000000000]"),
                      ("trainer.on_policy_fraction=1.5", "trainer.on_policy_fraction=1.5 is outside [0, 1]"),
                      ("trainer.lr=0", "trainer.lr=0.0 is outside (0, 1]")]:
        with pytest.raises(UserError, match=text.replace("[", r"\[").replace("(", r"\(")):
            check_ranges(make_cfg(tmp_path, chat_file, bad), TrainConfig)
    check_ranges(make_cfg(tmp_path, chat_file), TrainConfig)  # the defaults pass


def _cli(*args, timeout=300):
    return run_cli(*args, timeout=timeout)


def test_cli_user_errors_are_one_line_and_exit_2(tmp_path):
    res = _cli("train", "target=tiny", "trainer=smoke", "trainer.batch_size=-2",
               f"run_dir={tmp_path / 'run'}")
    assert res.returncode == 2
    assert ("python -m train: error: invalid settings: trainer.batch_size=-2 is outside [1, 4096]"
            in res.stderr)
    assert "Traceback" not in res.stderr and "SPECDISTILL_DEBUG=1" in res.stderr
    res = _cli("decode", "target=tiny", "drafter=ngram", "eval.limit=0", f"run_dir={tmp_path / 'd'}")
    assert res.returncode == 2 and "eval.limit=0 is outside [1, 1000000000]" in res.stderr
    for cmd in ("train", "decode"):  # an uncreatable run_dir (case 15): one line, before Hydra
        res = _cli(cmd, "target=tiny", "run_dir=/proc/specdistill-run")
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert f"python -m {cmd}: error: cannot create or write run_dir=/proc/specdistill-run" in res.stderr


def test_ctrl_c_says_how_to_resume(tmp_path, chat_file):  # noqa: F811
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "train", "target=tiny", "data=jsonl",
                          f"data.path={chat_file}", "data.max_length=128", "trainer=smoke",
                          "trainer.max_steps=100000", "trainer.final_eval=null", "logger=jsonl",
                          f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run}",
                          "drafter.draft_vocab_size=512"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         # a job a shell starts in the background (CI scripts, `nohup ... &`)
                         # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt:
                         # give the child a terminal's default, as a user's Ctrl-C would meet
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:  # interrupted after its first checkpoint (before it, the hint says so: test_folders.py)
        deadline = time.time() + 240
        while time.time() < deadline and runs.latest_checkpoint(run) is None:
            time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:  # never leak a training process
            p.kill()
    assert p.returncode == 130, err[-2000:]
    assert f"run_dir={run} resume=true" in err and "Traceback" not in err
    assert not (run / "run.lock").exists()  # released on the way out


def test_a_lossless_failure_is_reported_with_the_margin(monkeypatch, tiny_target_cfg):
    from specdistill.drafters.base import build_drafter
    from specdistill.target.model import load_target

    target = load_target(tiny_target_cfg)
    real = ev.generate

    def broken(target_, drafter, ids, **kw):  # the speculative output gets a wrong token
        out = real(target_, drafter, ids, **kw)
        if drafter is not None:
            out.tokens = out.tokens.clone()
            logits = target_.model(torch.cat([ids, out.tokens[:3]])[None]).logits[0, -1]
            out.tokens[3] = int(logits.argmin())
        return out

    monkeypatch.setattr(ev, "generate", broken)
    res = ev.evaluate_drafter(target, build_drafter({"name": "ngram"}, target), limit=1,
                              max_new_tokens=8, k=2)
    assert res["summary"]["lossless_check"] == "failed"
    where = res["prompts"][0]["first_difference"]
    assert where["position"] == 3 and not where["near_tie"] and where["margin"] > 0


def test_near_tie_tells_case_6_from_a_bug():
    """Case 6 of the fault report (tiny random target, 2000 tokens, ngram drafter): speculative
    and plain greedy first differ at new token 1457, where the target's two best logits are
    0.63510 and 0.63510 - 6e-8 (measured: margin -5.96e-08, one fp32 ulp at that size). That is a
    floating-point tie-break between a 6-token verify and a one-token step, not a bug; a real bug
    moves whole logits."""
    ulp = torch.finfo(torch.float32).eps * 2.0 ** -1  # at |logit| in [0.5, 1)
    assert ev.is_near_tie({"margin": -5.96e-08, "ulp": ulp})
    assert not ev.is_near_tie({"margin": 1e-3, "ulp": ulp})
    assert not ev.is_near_tie({"margin": None, "ulp": None})  # different lengths: not a tie


def test_decode_budget_cap_is_recorded(tiny_target_cfg, caplog):
    from specdistill.drafters.base import build_drafter
    from specdistill.target.model import load_target

    tiny_target_cfg.model_config["max_position_embeddings"] = 160  # the prompt leaves a few tokens
    target = load_target(tiny_target_cfg)
    with caplog.at_level(logging.WARNING):
        res = ev.evaluate_drafter(target, build_drafter({"name": "ngram"}, target), limit=1,
                                  max_new_tokens=10_000, k=2)
    assert res["summary"]["max_new_tokens_capped"] == 1 and "capped" in caplog.text


def test_empty_prompts_are_refused(tmp_path):
    from specdistill.data.prompts import PromptFormatError, load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": 1, "prompt": "  "}) + "\n")
    with pytest.raises(PromptFormatError, match="p.jsonl:1: an empty prompt"):
        load_prompts("jsonl", path=str(f))


def test_no_eval_conversations_skips_evals_and_keeps_best(tmp_path, chat_file, caplog):  # noqa: F811
    cfg = make_cfg(tmp_path, chat_file, "data.eval_fraction=0", "trainer.max_steps=2",
                   "trainer.eval_every=1", "trainer.save_every=2")
    with caplog.at_level(logging.WARNING):
        _train(cfg)
    assert "evals skipped" in caplog.text
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert not any("eval/sim_tau" in r for r in rows)
    assert (tmp_path / "run" / "best" / "drafter.safetensors").is_file()


def test_rows_of_redone_steps_are_not_logged_twice(two_ckpts, chat_file):  # noqa: F811
    tmp_path, _ = two_ckpts
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as f:  # logged by the interrupted job after its last checkpoint
        f.write(json.dumps({"step": 5, "loss": 99.0}) + "\n")
    before = [json.loads(x) for x in open(metrics)]
    _resume(tmp_path, chat_file)
    after = [json.loads(x) for x in open(metrics)]
    assert after == [r for r in before if r["step"] <= 4] and len(after) < len(before)
