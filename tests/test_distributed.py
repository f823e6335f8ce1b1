"""Scale-out with real processes: two torchrun "nodes" on 127.0.0.1, DeepSpeed ZeRO-2/3 on two
ranks, kill -9 in the middle of a step and of a checkpoint write followed by resume=true, and a hung
rank that must stop the job with a clear error.

Every run trains the same job (tiny target, fixed seed, 8 steps of 4 conversations) and is compared
with one single-process run in this process. All conversations tokenise to the same length, so a
global batch split over ranks averages exactly what one process averages: losses must agree to
float precision, not merely in expectation. Subprocesses run tests/dist_entry.py (`python -m
train` plus fault hooks) with one OpenMP thread each: two ranks share the two cores.
"""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

import specdistill.train.__main__  # noqa: F401  (stores the schemas)
from specdistill.store import rundir as runs
from specdistill.store.drafter import load_drafter
from specdistill.train import checkpoint as ckpt
from specdistill.train.recipe import DistillRecipe

pytestmark = pytest.mark.slow
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="the deepspeed extra (bash launch/install.sh dev)")

ROOT = Path(__file__).resolve().parents[1]
ENTRY = Path(__file__).with_name("dist_entry.py")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
TOL = dict(rel=1e-5, abs=1e-6)


@dataclass
class Job:
    root: Path
    overrides: list[str]
    losses: dict[int, float]  # the single-process run: step -> loss
    grad_norms: dict[int, float]  # step -> global grad norm before clipping (clipping is active)
    weights: dict[str, torch.Tensor]  # its drafter after the last step
    run_dir: Path

    def args(self, batch_size: int, *extra: str) -> list[str]:
        return [*self.overrides, f"trainer.batch_size={batch_size}", *extra]


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """step -> loss (or another metric) of the last run that logged the step (a resumed run logs
    steps again)."""
    out = {}
    for line in open(Path(run_dir) / "metrics.jsonl"):
        row = json.loads(line)
        if key in row:
            out[row["step"]] = row[key]
    return out


def assert_same_losses(got: dict[int, float], ref: dict[int, float]) -> None:
    assert sorted(got) == sorted(ref), (got, ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], **TOL), (step, got, ref)


def assert_close_weights(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) >= set(ref)
    for k, v in ref.items():
        assert got[k].shape == v.shape, k  # full weights, not a ZeRO-3 shard
        torch.testing.assert_close(got[k].float(), v.float(), rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Job:
    """The job and its single-process reference run (batch 2 x grad_accum 2 per step)."""
    root = tmp_path_factory.mktemp("dist")
    chats = root / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(48):  # rotations of one list: every conversation has the same length
            words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(len(WORDS)))
            f.write(json.dumps({"conversations": [{"from": "human", "value": "Continue the list."},
                                                  {"from": "gpt", "value": f"List: {words}"}]}) + "\n")
    overrides = ["target=tiny", "data=jsonl", f"data.path={chats}", "data.max_length=128",
                 "data.eval_fraction=0.1", f"data.cache_dir={root / 'cache'}", "trainer=smoke",
                 "trainer.final_eval=null", "logger=jsonl", "drafter=eagle",
                 "drafter.draft_vocab_size=512", "trainer.max_steps=8", "trainer.save_every=2",
                 "trainer.eval_every=4", "trainer.keep_last=2", "trainer.log_every=1",
                 "trainer.grad_accum=2", "trainer.lr=3e-3", "trainer.grad_clip=0.2"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*overrides, "trainer.batch_size=2",
                                                      f"run_dir={root / 'single'}"])
    recipe = DistillRecipe(cfg)
    recipe.setup()
    lengths = {len(row["input_ids"]) for row in recipe.train_ds}
    assert len(lengths) == 1, f"conversations must tokenise to one length, got {lengths}"
    recipe.train()
    recipe.cleanup()
    weights = {k: v.detach().clone() for k, v in recipe.drafter.state_dict().items()
               if v.is_floating_point()}
    norms = losses(root / "single", "grad_norm")
    assert max(norms.values()) > 0.2, f"grad_clip=0.2 must clip some steps: {norms}"
    return Job(root, overrides, losses(root / "single"), norms, weights, root / "single")


# --------------------------------------------------------------------------- process helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], nnodes: int = 1, port: int | None = None,
             rdzv_id: str = "test") -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port or _free_port()}", f"--rdzv-id={rdzv_id}",
            "--max-restarts=0", str(ENTRY), *args]


def start(cmd: list[str], cwd: Path, log: Path, **env: str) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items()
            if k not in ("RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    full.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                PYTHONUNBUFFERED="1", PATH=f"{Path(sys.executable).parent}:{full.get('PATH', '')}",
                **env)
    return subprocess.Popen(cmd, cwd=cwd, env=full, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def tail(log: Path, n: int = 4000) -> str:
    return log.read_text()[-n:]


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        pytest.fail(f"job still running after {timeout} s:\n{tail(log)}")
    assert rc == 0, tail(log)


def kill_job(proc: subprocess.Popen) -> None:
    """kill -9 the launcher and every process under it (torchrun's ranks included)."""
    try:
        tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = [proc.pid]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def wait_for_marks(mark: Path, names: list[str], proc: subprocess.Popen, log: Path,
                   timeout: float = 300) -> None:
    """Until every rank in `names` stopped at its fault (dist_entry.py writes the files)."""
    deadline = time.monotonic() + timeout
    while not all((mark / n).is_file() for n in names):
        if proc.poll() is not None:
            pytest.fail(f"job ended (rc {proc.returncode}) before its fault:\n{tail(log)}")
        if time.monotonic() > deadline:
            kill_job(proc)
            pytest.fail(f"no fault reached after {timeout} s:\n{tail(log)}")
        time.sleep(0.2)


def assert_checkpoints(run_dir: Path, complete: list[int], staging: int | None = None) -> None:
    """Exactly these steps are complete, and each of them loads; a half-written one is ignored."""
    found = runs.complete_checkpoints(run_dir)
    assert [int(p.name.split("-")[1]) for p in found] == complete
    for p in found:
        assert ckpt.load_trainer_state(p)["step"] == int(p.name.split("-")[1])
        assert load_file(str(p / "drafter.safetensors"))
    tmps = sorted(p.name for p in (run_dir / "checkpoints").glob(".tmp-*"))
    if staging is None:
        assert tmps == []
        return
    assert tmps == [f".tmp-step-{staging:07d}"]
    half = run_dir / "checkpoints" / tmps[0] / runs.STATE
    with pytest.raises(Exception):  # the kill really hit the middle of a write
        torch.load(half, weights_only=False)


# ------------------------------------------------------------------------------------ tests
def test_two_torchrun_nodes_on_one_machine_train_like_one_process(job, tmp_path):
    port, log = _free_port(), [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [start(torchrun(1, job.args(1), nnodes=2, port=port, rdzv_id="twonodes"), tmp_path,
                   log[i], SPECDISTILL_DUMP="1") for i in range(2)]
    for proc, lg in zip(nodes, log):
        finish(proc, lg)
    # one run dir, named by the rendezvous id, shared by both nodes (no run_dir= was given)
    assert [p.name for p in (tmp_path / "runs" / "train").iterdir()] == ["twonodes"]
    run = tmp_path / "runs" / "train" / "twonodes"
    assert_same_losses(losses(run), job.losses)
    assert_same_losses(losses(run, "grad_norm"), job.grad_norms)
    steps = [json.loads(line)["step"] for line in open(run / "metrics.jsonl")
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 9))  # rank 0 alone logs
    rank0, rank1 = (load_file(str(run / f"weights-rank{r}.safetensors")) for r in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # both nodes: identical drafters
    assert_close_weights(rank0, job.weights)
    assert (run / "config.yaml").is_file() and (run / ".hydra" / "config.yaml").is_file()


@needs_deepspeed
def test_deepspeed_zero3_on_two_ranks_trains_like_one_process_and_exports_full_weights(job, tmp_path):
    """Launched by launch/torchrun.sh; the ranks evaluate and save under ZeRO-3 sharding."""
    log = tmp_path / "z3.log"
    proc = start(["bash", str(ROOT / "launch" / "torchrun.sh"),
                  *job.args(1, "trainer.backend=deepspeed", "deepspeed=zero3")],
                 tmp_path, log, NPROC="2", RUN_ID="z3job")
    finish(proc, log)
    run = tmp_path / "runs" / "train" / "z3job"
    assert_same_losses(losses(run), job.losses)
    assert_same_losses(losses(run, "grad_norm"), job.grad_norms)  # DeepSpeed clips the same way
    evals = [json.loads(line) for line in open(run / "metrics.jsonl") if "eval/acc_1" in line]
    ref_evals = [json.loads(line) for line in open(job.run_dir / "metrics.jsonl")
                 if "eval/acc_1" in line]
    assert [e["step"] for e in evals] == [4, 8]
    for e, r in zip(evals, ref_evals):
        assert e["eval/acc_1"] == pytest.approx(r["eval/acc_1"], abs=1e-6)
    last = runs.latest_checkpoint(run)
    assert_close_weights(load_file(str(last / "drafter.safetensors")), job.weights)
    shards = sorted(p.name for p in (last / "deepspeed").iterdir())
    assert any("rank_0" in s for s in shards) and any("rank_1" in s for s in shards), shards
    # the frozen target is in no checkpoint: each is far smaller than the target's embedding
    target_bytes = 49152 * 64 * 4  # the tiny target's embedding alone, fp32
    for p in runs.complete_checkpoints(run):
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        assert size < target_bytes / 2, (p, size)
    # best/ holds the full drafter, loadable on its own
    ref_best = load_file(str(job.run_dir / "best" / "drafter.safetensors"))
    got_best = load_file(str(run / "best" / "drafter.safetensors"))
    assert_close_weights(got_best, {k: v for k, v in ref_best.items() if v.is_floating_point()})


def _kill_and_resume(job: Job, tmp_path: Path, launch, extra: list[str], ranks: int) -> None:
    """kill -9 mid-write of the step-4 checkpoint, resume, kill -9 inside step 7, resume to the
    end: every checkpoint on disk stays loadable and the losses are the uninterrupted run's."""
    run = tmp_path / "run"
    args = [*extra, f"run_dir={run}"]
    log = tmp_path / "1.log"
    proc = start(launch(args), tmp_path, log, SPECDISTILL_FAULT="ckpt:4",
                 SPECDISTILL_MARK=str(tmp_path / "m1"))
    wait_for_marks(tmp_path / "m1", ["paused-0"], proc, log)
    kill_job(proc)
    assert_checkpoints(run, complete=[2], staging=4)

    log = tmp_path / "2.log"
    proc = start(launch([*args, "resume=true"]), tmp_path, log, SPECDISTILL_FAULT="step:7",
                 SPECDISTILL_MARK=str(tmp_path / "m2"))
    wait_for_marks(tmp_path / "m2", [f"paused-{r}" for r in range(ranks)], proc, log)
    kill_job(proc)
    assert_checkpoints(run, complete=[4, 6])  # keep_last=2; the half-written step 4 was redone

    log = tmp_path / "3.log"
    finish(start(launch([*args, "resume=true"]), tmp_path, log), log)
    assert_checkpoints(run, complete=[6, 8])
    assert_same_losses(losses(run), job.losses)


def test_single_process_survives_kill_9_mid_step_and_mid_checkpoint(job, tmp_path):
    _kill_and_resume(job, tmp_path, lambda a: [sys.executable, str(ENTRY), *a], job.args(2), 1)


@needs_deepspeed
def test_deepspeed_zero2_two_ranks_survive_kill_9_mid_step_and_mid_checkpoint(job, tmp_path):
    _kill_and_resume(job, tmp_path, lambda a: torchrun(2, a),
                     job.args(1, "trainer.backend=deepspeed", "deepspeed=zero2"), 2)


def test_a_hung_rank_stops_the_job_with_a_clear_error(job, tmp_path):
    """Rank 1 stops answering inside step 3; rank 0 gives up after dist_timeout_s, not never."""
    log = tmp_path / "hang.log"
    proc = start(torchrun(2, job.args(1, "trainer.dist_timeout_s=5", "trainer.max_steps=50",
                                      f"run_dir={tmp_path / 'run'}")),
                 tmp_path, log, SPECDISTILL_FAULT="step:3:1", SPECDISTILL_MARK=str(tmp_path / "m"))
    wait_for_marks(tmp_path / "m", ["paused-1"], proc, log)
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        pytest.fail(f"the job hangs with a stopped rank:\n{tail(log)}")
    assert rc != 0
    assert time.monotonic() - t0 < 60
    out = log.read_text()
    assert "another rank died or hung (trainer.dist_timeout_s=5)" in out, tail(log)


@needs_deepspeed
def test_deepspeed_bf16_without_a_launcher(job, tmp_path):
    """One process, no torchrun: the backend sets up its own group; bf16 weights train and save."""
    run, log = tmp_path / "run", tmp_path / "bf16.log"
    finish(start([sys.executable, str(ENTRY), *job.args(
        2, "trainer.backend=deepspeed", "trainer.precision=bf16", "trainer.max_steps=4",
        f"run_dir={run}")], tmp_path, log), log)
    got = losses(run)
    for step in (1, 2, 3, 4):  # bf16 rounding, the same trajectory
        assert got[step] == pytest.approx(job.losses[step], rel=3e-2)
    saved = load_file(str(runs.latest_checkpoint(run) / "drafter.safetensors"))
    assert {v.dtype for k, v in saved.items() if k in job.weights} == {torch.bfloat16}
    from specdistill.target.model import load_target
    cfg = json.loads((run / "best" / "drafter.json").read_text())
    assert cfg["name"] == "eagle"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        tcfg = compose(config_name="train", overrides=["target=tiny"]).target
    assert load_drafter(run / "best", load_target(tcfg)) is not None
