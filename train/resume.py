"""Resume compatibility: a run continues only with the settings its checkpoints were trained with.

Each checkpoint's trainer_state.pt records the run's resolved config. On `resume=true` the new
config is compared with it key by key; any difference outside train/config.py RESUMABLE_CHANGES
(architecture, data, target, optimisation) is refused with every conflicting key named, before
any heavy work and before config.yaml is rewritten. Checkpoints written before configs were
recorded are compared on the drafter's architecture (drafter.json) only.

The on-policy heads phase's settings (trainer.on_policy_heads_*) may change while the phase has
not begun under either config: a checkpoint at step N whose N steps were all teacher-forced with
the old start and would have been with the new one. That is how a study branches one run at its
last teacher-forced checkpoint into phases of different lengths (BENCHMARKS.md "The on-policy
phase's length").
"""
from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specdistill.cli.errors import UserError
from specdistill.store.drafter import CONFIG_FILE
from specdistill.train.checkpoint import load_trainer_state
from specdistill.train.config import RESUMABLE_CHANGES
from specdistill.train.schedule import phase_unbegun


def _flatten(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


ON_POLICY_HEADS = "trainer.on_policy_heads_"  # the phase's settings: start, depth, anchors, rows


def _may_change(key: str, phase_unused: bool = False) -> bool:
    return (any(key == k or key.startswith(k + ".") for k in RESUMABLE_CHANGES)
            or (phase_unused and key.startswith(ON_POLICY_HEADS)))


def config_conflicts(old: dict, new: dict, step: int | None = None,
                     schedule: dict | None = None) -> list[str]:
    """`key: checkpoint value -> new value` for every setting that differs and may not change;
    `step` (the checkpoint's) and its schedule state (train/schedule.py) let the on-policy heads
    settings change before their phase."""
    a, b = _flatten(old), _flatten(new)
    unused = (step is not None and phase_unbegun(a, step, schedule)
              and phase_unbegun(b, step, schedule))
    return [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not _may_change(k, unused)]


def check_resume_config(ckpt: Path, cfg: DictConfig) -> None:
    """Refuse to resume `ckpt` with a config that changes what its weights were trained with."""
    new = OmegaConf.to_container(cfg, resolve=True)
    state = load_trainer_state(ckpt)
    old = state.get("config")
    if old is None:  # an older checkpoint: only its drafter config is on record
        old_drafter = json.loads((Path(ckpt) / CONFIG_FILE).read_text())
        conflicts = config_conflicts({"drafter": old_drafter}, {"drafter": new["drafter"]})
    else:
        conflicts = config_conflicts(old, new, state.get("step"), state.get("schedule"))
    if conflicts:
        raise UserError(
            f"resume=true with settings that differ from the checkpoint {ckpt} was trained with:\n  "
            + "\n  ".join(conflicts) + "\nUse the run's own settings (see its config.yaml) or start "
            "a new run_dir=. Settings that may change on resume: " + ", ".join(RESUMABLE_CHANGES)
            + f", and {ON_POLICY_HEADS}* while every step so far was teacher-forced under both")
