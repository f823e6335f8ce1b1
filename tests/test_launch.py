"""The launch scripts and launcher configs, without a cluster: the SLURM sbatch script's directives
and the command it renders (parsed by torchrun's own argument parser, its overrides composed by
Hydra), the single-node torchrun script, and the submitit launcher config for sweeps."""
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from torch.distributed.run import get_args_parser

import train.__main__  # noqa: F401  (stores the schemas)
from train.distributed import run_id

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "launch" / "slurm.sbatch"
TORCHRUN = ROOT / "launch" / "torchrun.sh"
JOB = ["drafter=eagle", "target=llama", "trainer=full", "trainer.backend=deepspeed",
       "deepspeed=zero3", "trainer.lr=2e-4"]


def render(script: Path, args: list[str], **env: str) -> list[str]:
    """The command the script would run (DRY_RUN=1), split as the shell would."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(DRY_RUN="1", **env)
    out = subprocess.run(["bash", str(script), *args], env=full, capture_output=True, text=True,
                         timeout=30, check=True)
    return shlex.split(out.stdout)


def torchrun_args(cmd: list[str]):
    """Parse the torchrun part of a command with torchrun's own parser."""
    return get_args_parser().parse_args(cmd[cmd.index("torchrun") + 1:])


def compose_job(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_sbatch_directives():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert directives["nodes"] == "2" and directives["gpus-per-node"] == "8"
    assert directives["ntasks-per-node"] == "1"  # one torchrun per node, it starts the ranks
    assert "requeue" in directives and directives["job-name"] == "specdistill"
    # directives count only before the first command
    first_command = min(i for i, line in enumerate(text.splitlines())
                        if line.strip() and not line.startswith("#"))
    last_directive = max(i for i, line in enumerate(text.splitlines())
                         if line.startswith("#SBATCH"))
    assert last_directive < first_command


def test_sbatch_renders_srun_torchrun_with_c10d_rendezvous_on_the_first_node(monkeypatch):
    cmd = render(SBATCH, JOB, SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
                 SLURM_JOB_NODELIST="gpu-a01,gpu-a02")
    assert cmd[0] == "srun"
    srun = cmd[:cmd.index("torchrun")]
    assert "--kill-on-bad-exit=1" in srun and "--ntasks-per-node=1" in srun and "--nodes=2" in srun
    args = torchrun_args(cmd)
    assert (args.nnodes, args.nproc_per_node) == ("2", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "gpu-a01:29500", "4242")
    assert args.max_restarts == 0
    assert args.module and args.training_script == "train" and args.training_script_args == JOB
    cfg = compose_job(args.training_script_args)  # the train command composes as given
    assert cfg.trainer.backend == "deepspeed" and cfg.deepspeed.zero_stage == 3
    assert cfg.target.path == "meta-llama/Llama-3.1-8B-Instruct" and cfg.trainer.lr == 2e-4
    # the rendezvous id is the job id, so every rank of every node names the run dir after it
    monkeypatch.delenv("RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", args.rdzv_id)
    assert run_id() == "4242"


def test_sbatch_requeued_job_resumes_and_nodes_follow_the_allocation():
    cmd = render(SBATCH, ["target=llama"], SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="4",
                 SLURM_JOB_NODELIST="n1,n2,n3,n4", SLURM_RESTART_COUNT="1", GPUS_PER_NODE="4",
                 RDZV_PORT="29555")
    args = torchrun_args(cmd)
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint) == ("4", "4", "n1:29555")
    assert args.training_script_args == ["target=llama", "resume=true"]
    assert compose_job(args.training_script_args).resume is True


def test_torchrun_script_single_node():
    cmd = render(TORCHRUN, ["target=tiny", "trainer=smoke"], NPROC="2")
    args = torchrun_args(cmd)
    assert args.standalone and (args.nnodes, args.nproc_per_node) == ("1", "2")
    assert args.module and args.training_script == "train"
    assert args.training_script_args == ["target=tiny", "trainer=smoke"]


def test_submitit_launcher_config_for_sweeps():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["hydra/launcher=slurm", *JOB],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.tasks_per_node, launcher.gpus_per_node) == (8, 8)  # one task per GPU
    assert launcher.nodes == 1 and launcher.timeout_min == 1440
    assert cfg.trainer.backend == "deepspeed"
