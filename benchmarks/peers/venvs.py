"""The peers' own virtualenvs, made once and cached by version under <cache>/peers/<name>-<version>/.

Each peer pins its own transformers (speculators 0.9.0: 5.19.0; SpecForge 0.2.0 runs with 5.8.1)
and, left alone, a CUDA torch of several GB: torch stays at the CPU build on disk here
(PEER_TORCH, a constraints file) and what breaks transformers' import beside it (a CUDA
torchvision) is removed. An install is marked COMPLETE only at its end, under a file lock
(decode/engine/install.py, as the serving engines'), so an interrupted one is redone.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from specdistill.decode.engine.install import COMPLETE, EngineUnavailable, install_lock, run_step

PEER_TORCH = "torch==2.13.0"  # the CPU build pip finds on these machines; newer pulls CUDA


@dataclass(frozen=True)
class Peer:
    name: str  # the venv's folder stem and the arm prefix
    package: str
    version: str
    # pip arguments after the torch pin: the package, and for --no-deps installs its pure-Python needs
    installs: tuple[tuple[str, ...], ...]
    remove: tuple[str, ...] = ()  # uninstalled at the end (CUDA builds that break imports)


PEERS = {
    "speculators": Peer("speculators", "speculators", "0.9.0",
                        (("speculators==0.9.0",),), remove=("torchvision", "torchaudio", "torchcodec")),
    # its own pins (torch 2.11, sglang) would pull CUDA torch and ~25 nvidia wheels
    "specforge": Peer("specforge", "specforge", "0.2.0", (
        ("--no-deps", "specforge==0.2.0"),
        ("transformers==5.8.1", "datasets", "accelerate", "huggingface-hub", "numpy", "pydantic",
         "psutil", "pyyaml", "safetensors", "requests", "tqdm", "typing-extensions"))),
}


def peers_root() -> Path:
    return Path(os.environ.get("SPECDISTILL_CACHE", "~/.cache/specdistill")).expanduser() / "peers"


def venv_dir(peer: Peer, root: Path | None = None) -> Path:
    return (root or peers_root()) / f"{peer.name}-{peer.version}"


def peer_python(peer: Peer, root: Path | None = None) -> Path | None:
    """The peer's python when its install is complete, else None."""
    venv = venv_dir(peer, root)
    return venv / "bin" / "python" if (venv / COMPLETE).is_file() else None


def ensure_peer(peer: Peer, root: Path | None = None, timeout: float = 1800) -> Path:
    """The peer's python, installing its virtualenv first where it is not complete
    (EngineUnavailable naming the failed step otherwise)."""
    venv = venv_dir(peer, root)
    with install_lock(venv):
        if (venv / COMPLETE).is_file():
            return venv / "bin" / "python"
        py = venv / "bin" / "python"
        if not py.is_file():
            run_step([sys.executable, "-m", "venv", str(venv)], f"venv for {peer.name}", timeout)
        pins = venv.with_name(venv.name + ".constraints.txt")
        pins.write_text(PEER_TORCH + "\n")
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run_step(pip + [PEER_TORCH], f"{peer.name}: pip install {PEER_TORCH}", timeout)
        for args in peer.installs:
            run_step(pip + ["-c", str(pins), *args], f"{peer.name}: pip install {' '.join(args)}",
                     timeout)
        if peer.remove:
            subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *peer.remove],
                           capture_output=True, timeout=timeout)
        run_step([str(py), "-c", f"import {peer.package}"], f"{peer.name}: import", timeout)
        (venv / COMPLETE).write_text(f"{peer.package}=={peer.version} {PEER_TORCH}\n")
    return py


def require_peer(name: str) -> Path:
    if name not in PEERS:
        raise EngineUnavailable(f"unknown peer {name!r}; peers: {', '.join(PEERS)}")
    return ensure_peer(PEERS[name])
