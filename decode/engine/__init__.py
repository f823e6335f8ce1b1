"""Real serving engines as the judge of our exports (`python -m decode.engine`).

    python -m decode.engine export=exports/e3-vllm engine=vllm eval.limit=20 max_new_tokens=128

check.py runs the check (engine outputs, acceptance and speed against our decoder on the same
text), envs.py installs vLLM into its own cached environment and llamacpp_build.py builds
llama.cpp (both through install.py), vllm_engine.py drives vLLM through vllm_worker.py (which runs
inside vLLM's virtualenv and imports nothing of ours).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def served_layouts(engine: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(drafter, format) -> `engine`'s entry, for every registered layout the engine serves (each
    drafter module says so in its layouts' `serving`: drafters/parts/layouts.py ExportLayout)."""
    from specdistill.drafters.base import DRAFTERS

    return {(name, fmt): layout.serving[engine] for name, cls in sorted(DRAFTERS.items())
            for fmt, layout in cls.layouts.items() if engine in layout.serving}  # the drafter's order


def served_entry(export_dir: Path, engine: str, refusal: str) -> dict[str, Any]:
    """`engine`'s entry for an export folder written by export/folder.py (its config.json
    `specdistill` block); ValueError (`refusal`, then what the engine serves) when it has none."""
    meta = json.loads((Path(export_dir) / "config.json").read_text()).get("specdistill") or {}
    key = ((meta.get("drafter") or {}).get("name"), meta.get("format"))
    table = served_layouts(engine)
    if key not in table:
        served = ", ".join(f"{d} as format={f}" for d, f in table)
        raise ValueError(f"{export_dir} is drafter {key[0]!r} in format {key[1]!r}, {refusal}: "
                         f"{served}")
    return table[key]
