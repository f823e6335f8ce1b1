"""A drafter <-> a folder: what checkpoints, best/ and `python -m decode ckpt=` hold
(`save_drafter`, `load_drafter`).

A saved drafter is a folder with
  drafter.safetensors  the drafter's own parameters and buffers (e.g. the draft-vocab maps), never
                       the frozen target's weights: drafters keep references to target modules
                       outside their module tree, so `state_dict()` cannot reach them;
  drafter.json         its config as a dict, including `name`.
The safetensors metadata also records the target it was trained on (`target_facts`), so loading it
on another target is refused with both named (`check_trained_target`).
Each file is replaced atomically (written next to it, then renamed); whole-folder commits (a
checkpoint, an export) go through store/atomic.py.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from specdistill.cli.errors import UserError
from specdistill.drafters.base import DECODE_TIME_PREFIX, Drafter, build_drafter, config_dict

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

    meta_st = {"name": drafter.name, **target_facts(getattr(drafter, "target", None))}
    _atomic_write(folder / WEIGHTS_FILE, lambda tmp: save_file(state, tmp, metadata=meta_st))
    _atomic_write(folder / CONFIG_FILE, write_json)


def target_facts(target) -> dict[str, str]:
    """What a saved drafter records of its target (strings: safetensors metadata): where it came
    from and the sizes its weights depend on. {} without a target."""
    if target is None:
        return {}
    return {"target": target.source.split(" (")[0], "target_hidden_size": str(target.hidden_size),
            "target_vocab_size": str(target.vocab_size), "target_num_layers": str(target.num_layers)}


def saved_target_facts(folder) -> dict[str, str]:
    """The target facts a saved drafter recorded ({} for a folder saved before they were)."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / WEIGHTS_FILE), framework="pt") as f:
        meta = f.metadata() or {}
    return {k: v for k, v in meta.items() if k.startswith("target")}


class TargetMismatch(UserError):
    """A saved drafter was trained for another target than the one given (sizes differ)."""


def check_trained_target(folder, target) -> None:
    """Refuse a saved drafter whose recorded target differs from `target` in a size its weights
    depend on (hidden size, vocabulary, layers), naming both; the same sizes under another name
    only warn (the same weights may come from a GGUF file or a hub id)."""
    saved, given = saved_target_facts(folder), target_facts(target)
    if not saved:
        return
    sizes = [k for k in ("target_hidden_size", "target_vocab_size", "target_num_layers")
             if k in saved and saved[k] != given[k]]
    if sizes:
        def desc(f):
            return (f"{f.get('target')} (hidden {f.get('target_hidden_size')}, vocab "
                    f"{f.get('target_vocab_size')}, {f.get('target_num_layers')} layers)")
        raise TargetMismatch(f"{folder} was trained for target {desc(saved)}; the given target is "
                             f"{desc(given)}: pass the target it was trained for (target=... / "
                             f"target.path=...), or a drafter trained for this one")
    # the same file name is the same target: a GGUF file may lie elsewhere on another machine
    if os.path.basename(saved.get("target", "")) != os.path.basename(given["target"]):
        logging.getLogger(__name__).warning(
            "%s was trained for target %s; decoding it with %s (same sizes): acceptance is only "
            "what it was trained for if these are the same weights", folder, saved.get("target"),
            given["target"])


def load_drafter(folder, target, decode_overrides: dict | None = None) -> Drafter:
    """Rebuild a saved drafter on `target` and load its weights strictly. `decode_overrides`
    replaces decode-time settings (the `tree_*` keys) of the saved config; any other key is
    refused, since the weights were trained with it. A drafter trained for another target is
    refused with both targets named (folder.py check_trained_target; by its weights' shapes for a folder
    saved before drafters recorded their target). Callers resolve and verify the folder first
    (store/rundir.py)."""
    from safetensors.torch import load_file

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
    check_trained_target(folder, target)
    drafter = build_drafter(cfg, target)
    state = load_file(str(folder / WEIGHTS_FILE), device=str(target.device))
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as e:  # e.g. "size mismatch for fc.weight: ... torch.Size([64, 128]) ..."
        detail = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), None)
        if detail is None:
            raise
        raise TargetMismatch(f"{folder} does not fit target {target.source} (hidden "
                             f"{target.hidden_size}, vocab {target.vocab_size}): {detail}; it was "
                             f"trained for another target: pass that one (target=...)") from e
    return drafter
