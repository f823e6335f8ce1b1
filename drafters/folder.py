"""A drafter <-> a folder: what checkpoints, best/ and `python -m decode ckpt=` hold.

A saved drafter is a folder with
  drafter.safetensors  the drafter's own parameters and buffers (e.g. the draft-vocab maps), never
                       the frozen target's weights: drafters keep references to target modules
                       outside their module tree, so `state_dict()` cannot reach them;
  drafter.json         its config as a dict, including `name`.
Each file is replaced atomically (written next to it, then renamed); whole-folder commits (a
checkpoint, an export) go through drafters/atomic.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter.json"


def _atomic_write(path, write) -> None:
    """write(tmp_path) into a temporary file next to `path`, then rename it into place."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_drafter(drafter, cfg, folder) -> None:
    """Write drafter.safetensors + drafter.json into `folder` (created if missing), atomically."""
    from safetensors.torch import save_file

    from drafters.base import config_dict

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    meta = config_dict(cfg)
    meta.setdefault("name", drafter.name)

    def write_json(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")

    _atomic_write(folder / WEIGHTS_FILE, lambda tmp: save_file(state, tmp, metadata={"name": drafter.name}))
    _atomic_write(folder / CONFIG_FILE, write_json)


DECODE_TIME_PREFIX = "tree_"  # drafter settings that only shape decoding (tree size), not weights


def load_drafter(folder, target, decode_overrides: dict | None = None):
    """Rebuild a saved drafter on `target` and load its weights strictly. `decode_overrides`
    replaces decode-time settings (the `tree_*` keys) of the saved config; any other key is
    refused, since the weights were trained with it."""
    from safetensors.torch import load_file

    from drafters.base import build_drafter

    folder = Path(folder)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).is_file():
            raise FileNotFoundError(f"{folder} holds no {f}; a saved drafter folder has "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE} (written by save_drafter)")
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    for key, value in (decode_overrides or {}).items():
        if not key.startswith(DECODE_TIME_PREFIX) or key not in cfg:
            raise ValueError(f"drafter.{key} cannot change after training (only the decode-time "
                             f"{sorted(k for k in cfg if k.startswith(DECODE_TIME_PREFIX))} can)")
        cfg[key] = value
    drafter = build_drafter(cfg, target)
    state = load_file(str(folder / WEIGHTS_FILE), device=str(target.device))
    drafter.load_state_dict(state, strict=True)
    return drafter


