"""A drafter <-> a folder: what checkpoints, best/ and `python -m decode ckpt=` hold (saving here,
loading in drafters/base.py load_drafter, which needs the registry).

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

DECODE_TIME_PREFIX = "tree_"  # drafter settings that only shape decoding (tree size), not weights
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


def config_dict(cfg) -> dict:
    """A drafter config (dataclass, OmegaConf node or dict) as a plain, JSON-ready dict."""
    from omegaconf import OmegaConf

    if isinstance(cfg, dict):
        return dict(cfg)
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def parse_config(cfg, schema):
    """Any config form -> an instance of `schema`, type-checked by OmegaConf (typos fail here)."""
    from omegaconf import OmegaConf

    if isinstance(cfg, schema):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(schema), config_dict(cfg))
    return OmegaConf.to_object(merged)
