"""The launch environment and backend plumbing, in one process: the run id all ranks share, rank-0
only Hydra outputs, SLURM task ranks, the DeepSpeed config built from the trainer config, disjoint
data shards, the clear error for a dead peer, and the run-dir checks made before training."""
import datetime
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import specdistill.train.__main__  # noqa: F401  (stores the schemas, registers the resolvers)
from specdistill.cli.errors import UserError
from specdistill.train import backends, distributed
from specdistill.train.batches import BatchIterator
from specdistill.train.deepspeed_backend import deepspeed_config
from specdistill.train.recipe import DistillRecipe

CONF = Path(__file__).resolve().parents[1] / "conf"
LAUNCH_VARS = ("RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "GROUP_WORLD_SIZE", "RANK",
               "SUBMITIT_EXECUTOR", "SLURM_PROCID", "SLURM_NTASKS", "WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables; whatever the test exports is undone afterwards."""
    saved = dict(os.environ)
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_run_id_prefers_the_jobs_own_id(clean_env):
    clean_env.setenv("SLURM_JOB_ID", "777")
    assert distributed.run_id() == "777"
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: not an id
    assert distributed.run_id() == "777"
    clean_env.setenv("TORCHELASTIC_RUN_ID", "rdzv-5")
    assert distributed.run_id() == "rdzv-5"
    clean_env.setenv("RUN_ID", "mine")
    assert distributed.run_id() == "mine"
    clean_env.setenv("RUN_ID", "../escape")
    with pytest.raises(ValueError, match="letters, digits"):
        distributed.run_id()


def test_run_id_under_torchrun_is_the_agents_start_time(clean_env):
    """Every local rank of one torchrun has the same parent: its start time is the shared id."""
    import psutil

    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    started = psutil.Process(os.getppid()).create_time()
    assert distributed.run_id() == datetime.datetime.fromtimestamp(started).strftime(
        "%Y-%m-%d_%H-%M-%S")
    clean_env.setenv("GROUP_WORLD_SIZE", "2")  # two nodes: their agents' clocks would disagree
    with pytest.raises(ValueError, match="rdzv-id"):
        distributed.run_id()


def test_composed_run_dir_and_rank_zero_hydra_outputs(clean_env):
    clean_env.setenv("RUN_ID", "job42")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["target=tiny"], return_hydra_config=True)
    assert cfg.run_dir == "runs/train/job42"
    assert cfg.hydra.output_subdir is None  # the job writes .hydra/ itself, on rank 0 (rundir.py)
    clean_env.setenv("RANK", "1")
    assert distributed.rank_zero_log("/x/train.log") == os.devnull
    clean_env.delenv("RANK")
    clean_env.setenv("SUBMITIT_EXECUTOR", "slurm")
    clean_env.setenv("SLURM_PROCID", "3")
    assert distributed.env_rank() == 3


def test_submitit_tasks_get_torch_ranks(clean_env):
    """Tasks of Hydra's submitit launcher carry SLURM variables only; the torch ones are derived."""
    pytest.importorskip("submitit")
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "99", "SLURM_PROCID": "5",
           "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "gpu-a01,gpu-a02", "SLURM_NODEID": "1"}
    for k, v in env.items():
        clean_env.setenv(k, v)
    for k in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        clean_env.delenv(k, raising=False)
    distributed.export_slurm_task_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert os.environ["MASTER_ADDR"] == "gpu-a01"


def _trainer(**kw):
    base = {"batch_size": 2, "grad_accum": 4, "grad_clip": 0.5, "precision": "bf16",
            "dist_timeout_s": 60}
    return OmegaConf.create({**base, **kw})


def test_deepspeed_config_comes_from_the_trainer_config():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        z2 = compose(config_name="train", overrides=["deepspeed=zero2"]).deepspeed
        z3 = compose(config_name="train", overrides=[
            "deepspeed=zero3", "+deepspeed.extra.zero_optimization.round_robin_gradients=true",
            "+deepspeed.extra.steps_per_print=5"]).deepspeed
    cfg = deepspeed_config(_trainer(), z2, world_size=4)
    assert cfg["train_batch_size"] == 2 * 4 * 4 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"]["enabled"] is True
    assert cfg["zero_optimization"]["stage"] == 2 and "optimizer" not in cfg  # the recipe's AdamW
    cfg = deepspeed_config(_trainer(precision="fp32"), z3, world_size=2)
    assert cfg["bf16"]["enabled"] is False and cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["round_robin_gradients"] is True  # extra merged, not replaced
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert cfg["steps_per_print"] == 5
    with pytest.raises(ValueError, match="zero_stage=1"):
        deepspeed_config(_trainer(), {"zero_stage": 1}, world_size=2)
    with pytest.raises(ValueError, match="fp16"):
        deepspeed_config(_trainer(precision="fp16"), z2, world_size=2)


def test_rank_shards_are_disjoint_and_make_up_the_single_process_batch():
    ds = [{"input_ids": [i, i + 1], "loss_mask": [0, 1]} for i in range(23)]
    single = BatchIterator(ds, 6, seed=3, pad_id=0)
    ranks = [BatchIterator(ds, 2, seed=3, pad_id=0, rank=r, world_size=3) for r in range(3)]
    seen = []
    for _ in range(7):  # crosses an epoch boundary (23 // 6 = 3 global batches per epoch)
        whole = next(single)["index"].tolist()
        parts = [next(it)["index"].tolist() for it in ranks]
        assert sum(parts, []) == whole
        assert len(set(sum(parts, []))) == 6
        seen.append(whole)
    epoch0 = sum(seen[:3], [])
    assert len(set(epoch0)) == len(epoch0) == 18  # no conversation twice within an epoch


def test_length_grouped_batches_pad_less_and_keep_each_epoch_a_partition():
    lengths = [int(x) for x in torch.randint(5, 200, (200,), generator=torch.Generator().manual_seed(0))]
    ds = [{"input_ids": list(range(n)), "loss_mask": [1] * n} for n in lengths]

    def epoch(it, batches=50):
        got = [next(it) for _ in range(batches)]
        pad = sum(int((1 - b["attention_mask"]).sum()) for b in got)
        return [i for b in got for i in b["index"].tolist()], pad

    plain, pad_plain = epoch(BatchIterator(ds, 4, seed=1, pad_id=0))
    grouped, pad_grouped = epoch(BatchIterator(ds, 4, seed=1, pad_id=0, group_by_length=10))
    assert sorted(grouped) == sorted(plain) == list(range(200))  # the same rows, once each
    assert pad_grouped < 0.2 * pad_plain, (pad_grouped, pad_plain)
    ranks = [BatchIterator(ds, 2, seed=1, pad_id=0, rank=r, world_size=2, group_by_length=10)
             for r in range(2)]
    again = BatchIterator(ds, 4, seed=1, pad_id=0, group_by_length=10)
    for _ in range(60):  # ranks split each global batch; a second epoch reshuffles the groups
        whole = next(again)["index"].tolist()
        assert sum((next(it)["index"].tolist() for it in ranks), []) == whole


def test_peer_failure_message_names_the_cause(monkeypatch):
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    err = RuntimeError("[gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for recv")
    msg = distributed.peer_failure_message(err, 5)
    assert "another rank died or hung" in msg and "dist_timeout_s=5" in msg and "Timed out" in msg
    dead = RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]")
    assert "another rank died or hung" in distributed.peer_failure_message(dead, 5)
    assert distributed.peer_failure_message(ValueError("bad config"), 5) is None
    assert distributed.peer_failure_message(RuntimeError("shape mismatch"), 5) is None


# ----------------------------------------------------------------------- run-dir checks (setup)
def _cfg(tmp_path, *overrides):
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(8):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"hi {i}"},
                                                  {"from": "gpt", "value": "alpha beta"}]}) + "\n")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=[
            "target=tiny", "data=jsonl", f"data.path={chats}", f"data.cache_dir={tmp_path / 'c'}",
            "trainer=smoke", "trainer.final_eval=null", "logger=jsonl",
            f"run_dir={tmp_path / 'run'}", *overrides])


def test_a_full_disk_is_refused_before_training(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    free = {"bytes": 10 * 2**20}  # 10 MiB: not even the logs fit
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(*real(p)[:2], free["bytes"]))
    r = DistillRecipe(_cfg(tmp_path))
    with pytest.raises(UserError, match="only 10 MiB free.*need about 64 MiB"):
        r.setup()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # room for the logs but not for this drafter's checkpoints: refused once its size is known
    free["bytes"] = 65 * 2**20
    r = DistillRecipe(_cfg(tmp_path, "trainer.keep_last=100"))
    with pytest.raises(UserError, match=r"keep_last=100 \+ best.*need about \d+ MiB"):
        r.setup()
    assert not hasattr(r, "batches")  # before the data iterator, let alone a training step


def test_another_runs_checkpoints_are_not_overwritten(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step-0000002").mkdir(parents=True)
    for f in ("COMPLETE", "trainer_state.pt"):
        (tmp_path / "run" / "checkpoints" / "step-0000002" / f).write_text("x")
    with pytest.raises(FileExistsError, match="resume=true"):
        DistillRecipe(_cfg(tmp_path)).setup()


def test_torch_backend_timeout_is_the_trainer_setting(monkeypatch):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, timeout: seen.update(backend=backend, timeout=timeout))
    backends.build_backend(OmegaConf.create({"backend": "torch", "dist_timeout_s": 7}), "cpu")
    assert seen["backend"] == "gloo" and seen["timeout"].total_seconds() == 7
    with pytest.raises(ValueError, match="unknown trainer.backend"):
        backends.build_backend(OmegaConf.create({"backend": "jax", "dist_timeout_s": 7}), "cpu")
