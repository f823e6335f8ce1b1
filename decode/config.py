"""Config schemas of `python -m decode` (Hydra structured configs, stored in the ConfigStore).

conf/decode.yaml picks one YAML per group; every merge is checked against these dataclasses, so a
misspelt key or a wrong type fails at start with Hydra's message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from specdistill.drafters.schemas import store_drafter_schemas
from specdistill.drafters.target import TargetConfig


@dataclass
class EvalConfig:
    """Which prompts the decoder runs."""

    kind: str = "mtbench"  # mtbench | humaneval | jsonl
    path: Optional[str] = None  # the JSONL file for kind=jsonl
    limit: Optional[int] = None  # only the first N prompts (None = all)
    turns: int = 1  # MT-bench: 1 = first turns only, 2 = both turns


@dataclass
class DecodeConfig:
    """`python -m decode`: run a drafter through the lossless decoder on an eval set."""

    target: TargetConfig = MISSING
    drafter: Any = MISSING  # the drafter's own schema (conf/drafter/<name>.yaml)
    eval: EvalConfig = MISSING
    ckpt: Optional[str] = None  # trained drafter: a run dir, checkpoint or export folder
    max_new_tokens: int = 256  # generation budget per prompt (turn)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # sampling: keep the k most likely tokens (0 = off)
    top_p: float = 1.0  # sampling: nucleus mass (1.0 = off)
    k: int = 5  # chain draft length (0 = plain target decoding)
    tree: bool = False  # verify a draft tree (the drafter's static or dynamic tree) instead of a chain
    min_confidence: float = 0.0  # adaptive draft length: stop drafting below this draft prob (0 = off)
    compare_plain: bool = True  # also decode plainly: speedup and a token-identity check (greedy)
    seed: int = 0  # sampling seed
    # the drafter's dtype: target = the target's (bf16 drafting on native-bf16 CPUs), or a dtype
    # name; any dtype is lossless (the target verifies), it only changes drafting speed and tau
    drafter_dtype: str = "target"
    # verify with a one-token step's kernels (decode/kernels.py): greedy chains bit-identical to
    # plain decoding at bf16 too, not only up to near-ties (~6% slower, BENCHMARKS.md). auto = on
    # for chains at a 16-bit target dtype, off when batch_size > 1 (exact rows cost 12-35% of the
    # batch's throughput there, decode/rows_exact.py); true | false
    exact_verify: str = "auto"
    batch_size: int = 1  # sequences decoded together, one target forward per round (1 = one at a time)
    batch_mode: str = "verify_all"  # batch_size > 1: plain | verify_all | budgeted (decode/budget.py)
    run_dir: str = "runs/decode/${now:%Y-%m-%d_%H-%M-%S}"  # outputs: result JSON, markdown table


def store_schemas(primary_name: str | None = None, primary: type | None = None) -> None:
    """Put the drafter schemas (drafters/schemas.py) and a primary schema in the ConfigStore.
    Called by `python -m decode` before Hydra composes."""
    store_drafter_schemas()
    if primary is not None:
        ConfigStore.instance().store(name=primary_name, node=primary)


# Allowed ranges of numeric settings, checked before any work (drafters/cli.py check_ranges).
DECODE_RULES = {
    "max_new_tokens": (1, None), "temperature": (0, None), "top_k": (0, None),
    "top_p": (0, 1, "open"), "k": (0, None), "min_confidence": (0, 1), "eval.limit": (1, None),
    "eval.turns": (1, 2), "batch_size": (1, None),
}
