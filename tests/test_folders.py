"""No command replaces a file it did not write: every CLI that writes into a folder,
pointed at a folder that holds another job's or the user's files. Real processes where the
behaviour is the process's (before Hydra writes anything, a local multirun sweep).

| command          | a folder holding other files                                  | test                 |
|------------------|---------------------------------------------------------------|----------------------|
| train            | refused before Hydra: a live lock, another kind of job's      | here                 |
|                  | files, another run's checkpoints without resume=true; a job   |                      |
|                  | that died before its first checkpoint is set aside (*.prev)   |                      |
| decode           | refused before Hydra unless run_dir is new or empty           | here                 |
| decode benchmark | --out holding an earlier benchmark's results: refused         | here                 |
| decode.engine    | out not empty: refused                                        | here                 |
| train.export     | out exists: refused; overwrite=true replaces only an export   | test_export.py       |
| data.capture     | not empty and no capture manifest: refused                    | test_identity.py     |
| data.regenerate  | a file it did not start (no <out>.regenerate.json): refused   | test_regenerate.py   |
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_chats
from hydra import compose, initialize_config_dir

import specdistill.train.__main__  # noqa: F401  (stores the schemas)
from specdistill.train.recipe import DistillRecipe
from specdistill.train.rundir import interrupt_hint

ROOT = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
pytestmark = pytest.mark.usefixtures("one_thread")


def _cli(*args, cwd=ROOT, **env):
    full = {**os.environ, "PYTHONPATH": PYTHONPATH, "HF_HUB_OFFLINE": "1", "CI": "1", **env}
    full.pop("SPECDISTILL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=600)


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes (None for a folder), by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def training_run(tmp_path) -> Path:
    """The files a finished training job leaves (the ones a later command could overwrite)."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints" / "step-0000003").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer:\n  max_steps: 3\ndrafter:\n  name: eagle\n")
    (run / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 3\n")
    (run / ".hydra" / "overrides.yaml").write_text("- trainer.max_steps=3\n")
    (run / "__main__.log").write_text("[train] step 3\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 1.0}) + "\n")
    return run


def test_decode_into_a_training_run_dir_is_refused_before_hydra(training_run):
    before = _snapshot(training_run)
    res = _cli("decode", "target=tiny", f"run_dir={training_run}")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().startswith(f"python -m decode: error: run_dir={training_run} already "
                                         f"holds files") and "Traceback" not in res.stderr
    assert _snapshot(training_run) == before  # config.yaml, .hydra/, the log: byte-identical


def test_a_second_train_on_a_locked_run_dir_is_refused_before_hydra(training_run):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (training_run / "run.lock").write_text(json.dumps(
            {"pid": holder.pid, "host": os.uname().nodename, "started": time.time()}))
        before = _snapshot(training_run)
        res = _cli("train", "target=tiny", f"run_dir={training_run}", "resume=true")
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"is in use by another job (pid {holder.pid}" in res.stderr
    assert _snapshot(training_run) == before  # .hydra/config.yaml and overrides.yaml untouched


def test_a_local_multirun_sweep_gives_every_job_its_own_run_dir(tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", 12, 6)
    res = _cli("train", "-m", "target=tiny", "data=jsonl", f"data.path={chats}", "data.max_length=64",
               "data.eval_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}", "trainer=smoke",
               "trainer.max_steps=1", "trainer.final_eval=null", "logger=jsonl",
               "drafter.draft_vocab_size=64", "trainer.lr=1e-3,2e-3",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, RUN_ID="sweep")
    assert res.returncode == 0, res.stderr[-3000:]
    runs = sorted((tmp_path / "runs" / "train").iterdir())
    assert [r.name for r in runs] == ["sweep_0", "sweep_1"]
    for run, lr in zip(runs, ("0.001", "0.002")):
        assert f"lr: {lr}" in (run / "config.yaml").read_text()
        assert f"trainer.lr={lr}" in (run / ".hydra" / "overrides.yaml").read_text()
        assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl") if '"loss"' in x] == [1]


def _train_cfg(tmp_path: Path, *extra):
    chats = tmp_path / "chats.jsonl"
    if not chats.exists():
        write_chats(chats, 12, 6)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=[
            "target=tiny", "data=jsonl", f"data.path={chats}", "data.max_length=64",
            "data.eval_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}", "trainer=smoke",
            "trainer.final_eval=null", f"run_dir={tmp_path / 'run'}", "logger=jsonl",
            "drafter.draft_vocab_size=64", "trainer.eval_every=0", *extra])


def test_a_fresh_job_sets_aside_a_job_that_died_before_its_first_checkpoint(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3))
    (run / "metrics.jsonl").write_text(dead)  # steps 1-3 of a job killed before step 4's checkpoint
    (run / "wandb_run_id").write_text("deadbeef\n")
    assert "resume=true" not in interrupt_hint(str(run)) and "nothing to resume" in interrupt_hint(str(run))
    r = DistillRecipe(_train_cfg(tmp_path, "trainer.max_steps=2", "trainer.save_every=2"))
    r.setup()
    r.train()
    r.cleanup()
    steps = [json.loads(x)["step"] for x in open(run / "metrics.jsonl") if '"loss"' in x]
    assert steps == [1, 2]  # this job's rows only, each once
    assert (run / "metrics.prev.jsonl").read_text() == dead
    assert (run / "wandb_run_id.prev").read_text() == "deadbeef\n"
    assert "resume=true" in interrupt_hint(str(run))  # now there is a checkpoint to resume


@pytest.mark.parametrize("files", [
    {"config.yaml": "run_dir: runs/decode/x\ndrafter:\n  name: ngram\n", "result.json": "{}"},
    {"report.md": "# my own notes\n", "config.yaml": "project: mine\n"}])
def test_train_never_writes_over_another_jobs_or_the_users_files(tmp_path, files):
    run = tmp_path / "run"
    run.mkdir()
    for name, text in files.items():
        (run / name).write_text(text)
    before = _snapshot(run)
    r = DistillRecipe(_train_cfg(tmp_path, "trainer.max_steps=1"))
    with pytest.raises(FileExistsError, match="holds files that are not a training run's"):
        try:
            r.setup()
        finally:
            r.release_lock()
    assert _snapshot(run) == before


def test_bench_and_engine_refuse_a_folder_of_earlier_results(tmp_path, capsys):
    import benchmarks.decode_speed as bench

    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.json").write_text('{"earlier": true}')
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", str(out)])
    assert e.value.code == 2 and "already holds bench.json" in capsys.readouterr().err
    assert (out / "bench.json").read_text() == '{"earlier": true}'
    res = _cli("decode.engine", f"export={tmp_path}", f"out={out}")
    assert res.returncode == 2 and f"out={out} already holds files" in res.stderr, res.stderr[-2000:]
    assert _snapshot(out) == {"bench.json": b'{"earlier": true}'}
