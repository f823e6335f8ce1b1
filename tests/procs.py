"""Commands run as real processes, as a user runs them: this checkout's entry points, no debug
traceback, offline."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pythonpath() -> str:
    """This checkout first (its `train` / `decode` entry points), then the caller's own path (where
    a worktree's `specdistill` package may be)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def run_cli(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m <args>` with SPECDISTILL_DEBUG unset (user errors as one line), offline."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": "1"}
    env.pop("SPECDISTILL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def installed_vllm_cache() -> Path:
    """The specdistill cache with vLLM CPU installed in it (or SPECDISTILL_VLLM_PYTHON); a missing
    engine fails the test (CI must see it), it is not a skip."""
    import pytest

    from specdistill.decode.engine.envs import EngineUnavailable, vllm_python
    from specdistill.target.model import TargetConfig, cache_root

    cache = cache_root(TargetConfig(path="packaged:smollm2"))
    try:
        vllm_python(cache)
    except EngineUnavailable as e:
        pytest.fail(f"vLLM CPU could not be installed: {e}")
    return cache
