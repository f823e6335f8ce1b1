"""The model card (README.md) of an export: YAML metadata the Hub indexes, then what the folder is,
how to serve it (both from the drafter's ExportLayout), the acceptance measured in training,
train/serve parity and the training config.

It only formats what the caller hands over: the run's measurements arrive as `CardFacts`
(train/export.py reads them from the run dir), so drafters/ never reads run dirs or metrics files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import yaml


@dataclass
class CardFacts:
    """What the training run measured, as arguments of the card (all optional)."""

    # final decoder eval summary: eval, generations, k, max_new_tokens (train's final_eval)
    final: Optional[dict[str, Any]] = None
    final_table: Optional[str] = None  # that eval's markdown table
    # the latest simulated eval during training: {"step": int, "tau": float, "acceptance": [float]}
    simulated: Optional[dict[str, Any]] = None
    training_config: Optional[dict[str, Any]] = None  # the run's resolved config
    engine_table: Optional[str] = None  # the job's own serving-engine check (decode/engine/)
    # set when the exported drafter is NOT the one these measurements were taken with (the run's
    # best/ was damaged: store/rundir.py): which checkpoint it is and why
    fallback: Optional[str] = None
    # the longest sequence trained on (the run's data.max_length: its rows are cut there)
    trained_length: Optional[int] = None


def context_warning(trained: int | None, context: int) -> str | None:
    """The one line an export says when its target serves longer sequences than the drafter was
    trained on (None when it was trained to the target's context, or the length is unknown)."""
    if trained is None or trained >= context:
        return None
    return (f"trained on <= {trained} tokens; the target serves up to {context}; acceptance past "
            f"{trained} is unmeasured")


def card_tags(layout, drafter_cls) -> list[str]:
    """Hub tags: ours, the drafter's name and tags, the layout's tags (no repeats)."""
    tags = ["speculative-decoding", "draft-model", "specdistill", drafter_cls.name,
            *drafter_cls.tags, *layout.tags]
    return list(dict.fromkeys(tags))


def _measured(facts: CardFacts) -> list[str]:
    lines = ["## Measured acceptance", ""]
    if facts.fallback:
        lines += [f"**Warning: this export is not the drafter measured below.** {facts.fallback}. "
                  "The numbers below belong to the run's reference drafter; this one was not "
                  "measured.", ""]
    if facts.final_table:
        s = facts.final or {}
        lines += [f"The real decoder on {s.get('eval', 'mtbench')} at the end of training "
                  f"({s.get('generations', '?')} generations, greedy, k={s.get('k', '?')}, "
                  f"{s.get('max_new_tokens', '?')} new tokens). tau = tokens per target forward, "
                  "bonus token included.", "", facts.final_table, ""]
    if facts.engine_table:
        lines += ["The same drafter loaded in a real serving engine at the end of training "
                  "(engine tau against our decoder replayed on the engine's own text):", "",
                  facts.engine_table, ""]
    sim = facts.simulated
    if sim:
        acc = ", ".join("not measured" if a is None else f"{a:.3f}" for a in sim["acceptance"])
        lines += [f"Simulated acceptance on held-out conversations at step {sim['step']}: tau "
                  f"{sim['tau']:.3f}, per-position acceptance {acc}.", ""]
    if not facts.final_table and not sim and not facts.engine_table:
        lines += ["No evaluation was recorded with this drafter.", ""]
    return lines


def _context(meta: dict[str, Any]) -> list[str]:
    """The card's section on the sequence lengths trained and served (when the run recorded them)."""
    ctx = meta.get("context")
    if not ctx:
        return []
    trained, served = ctx["trained_max_length"], ctx["target_max_length"]
    lines = ["## Context length", "",
             f"Trained on sequences of at most {trained} tokens (the run's data.max_length); the "
             f"target serves up to {served}.", ""]
    warning = context_warning(trained, served)
    if warning:
        lines += [f"**Warning: {warning}.**", ""]
    return lines


def model_card(layout, drafter_cls, meta: dict[str, Any], facts: CardFacts | None,
               parity: dict[str, Any] | None, files: list[tuple[str, int]], license: str) -> str:
    """README.md text. layout: the ExportLayout written; drafter_cls: its drafter class; meta:
    config.json's `specdistill` section; parity: {"markdown": ...} or None; files: (name, bytes)."""
    facts = facts or CardFacts()
    drafter = meta["drafter"]["name"]
    base = meta.get("base_model")
    front = {"license": license, "tags": card_tags(layout, drafter_cls)}
    if base:
        front["base_model"] = base
    k = meta.get("speculative_tokens", 5)
    source = meta["target"]["source"]
    name = base or (source if len(source) <= 60 else source[:57] + "...")
    usage = layout.usage.format(path="<this folder or repo id>", base=base or "<target>", k=k,
                                k1=k + 1, drafter=meta["drafter"])
    lines = ["---", yaml.safe_dump(front, sort_keys=True).strip(), "---", "",
             f"# {drafter} drafter for {name}", "",
             f"A speculative-decoding drafter distilled from the frozen target `{name}` with "
             f"specdistill, exported as `{layout.format}`: {layout.summary} Speculative decoding "
             f"with it is lossless: greedy output is token-identical to the target's, sampling "
             f"keeps its distribution.", "",
             "```bash", usage, "```", ""]
    lines += _measured(facts) + _context(meta)
    if parity is not None:
        lines += ["## Train/serve parity", "", parity["markdown"], ""]
    if facts.training_config:
        lines += ["## Training configuration", "", "```yaml",
                  yaml.safe_dump(facts.training_config, sort_keys=False).strip(), "```", ""]
    lines += ["## Files", ""] + [f"- `{n}` ({b / 2**20:.2f} MiB)" for n, b in files] + [""]
    return "\n".join(lines)
