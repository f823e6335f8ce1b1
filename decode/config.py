"""Config schemas of `python -m decode` (Hydra structured configs, stored in the ConfigStore), and
the numeric options of `python -m benchmarks.decode_speed` with their ranges.

conf/decode.yaml picks one YAML per group; every merge is checked against these dataclasses, so a
misspelt key or a wrong type fails at start with Hydra's message, and a value out of its field's
range with ours (cli/ranges.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from specdistill.cli.ranges import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_DRAFT,
    MAX_TEMPERATURE,
    MAX_THREADS,
    MAX_TOKENS,
    MAX_TREE,
    MAX_VOCAB,
    SEED,
    rng,
    sub,
)
from specdistill.drafters.base import drafter_schema, store_drafter_schemas
from specdistill.target.model import TargetConfig


@dataclass
class EvalConfig:
    """Which prompts the decoder runs."""

    kind: str = "mtbench"  # mtbench | humaneval | jsonl
    path: Optional[str] = None  # the JSONL file for kind=jsonl
    limit: Optional[int] = rng(None, 1, MAX_COUNT)  # only the first N prompts (None = all)
    # skip the first N prompts (a calibration fitted on prompts an eval of the first ones never sees)
    offset: int = rng(0, 0, MAX_COUNT)
    turns: int = rng(1, 1, 2)  # MT-bench: 1 = first turns only, 2 = both turns


@dataclass
class DecodeConfig:
    """`python -m decode`: run a drafter through the lossless decoder on an eval set."""

    target: TargetConfig = MISSING
    # the drafter's own schema (conf/drafter/<name>.yaml)
    drafter: Any = sub(MISSING, drafter_schema)
    eval: EvalConfig = MISSING
    ckpt: Optional[str] = None  # trained drafter: a run dir, checkpoint or export folder
    max_new_tokens: int = rng(256, 1, MAX_TOKENS)  # tokens generated at most per prompt (turn)
    temperature: float = rng(0.0, 0, MAX_TEMPERATURE)  # 0 = greedy
    top_k: int = rng(0, 0, MAX_VOCAB)  # sampling: keep the k most likely tokens (0 = off)
    top_p: float = rng(1.0, 0, 1, lo_open=True)  # sampling: nucleus mass (1.0 = off)
    k: int = rng(5, 0, MAX_DRAFT)  # chain draft length (0 = plain target decoding)
    tree: bool = False  # verify a draft tree (the drafter's static or dynamic tree) instead of a chain
    # adaptive draft length: stop drafting below this draft prob (0 = off)
    min_confidence: float = rng(0.0, 0, 1)
    # confidence-driven verification (decode/survival.py): cut each chain before the first slot
    # whose survival (product of the slot confidences) is below this (0 = off; at least 1 draft)
    verify_survival: float = rng(0.0, 0, 1)
    # slot confidences of a drafter without a trained confidence head: none (verify every draft;
    # verify_survival > 0 is then refused) | draft_prob (the draft's top probability)
    survival_fallback: str = "none"
    # fit the trained confidence head to this decode's observed acceptance (Platt scaling,
    # decode/survival.py fit_platt) and write the drafter with it folded into the head's weights to
    # <run_dir>/calibrated/ (a drafter folder: ckpt= it, export it); batch_size 1 chains only
    calibrate: bool = False
    compare_plain: bool = True  # also decode plainly: speedup and a token-identity check (greedy)
    seed: int = rng(0, *SEED)  # sampling seed
    # tokens of the first prompt (batched: of the first batch_size prompts, as one batch) decoded
    # once in each mode before timing, then discarded (first-use costs; on a GPU they dominated a
    # short eval); 0 = none
    warmup_tokens: int = rng(16, 0, MAX_TOKENS)
    # the drafter's dtype: target = the target's (bf16 drafting on native-bf16 CPUs), or a dtype
    # name; any dtype is lossless (the target verifies), it only changes drafting speed and tau
    drafter_dtype: str = "target"
    # verify with a one-token step's kernels (decode/exact.py): greedy chains bit-identical to
    # plain decoding at bf16 too, not only up to near-ties (~6% slower, BENCHMARKS.md). auto = on
    # for chains at a 16-bit target dtype, off in the batched decoder (batch_size > 1 or budgeted:
    # exact rows cost 12-35% of the batch's throughput there, decode/batched/exact.py); true | false
    exact_verify: str = "auto"
    # sequences decoded together, one target forward per round (1 = one at a time)
    batch_size: int = rng(1, 1, MAX_BATCH)
    # batch_size > 1: plain | verify_all | budgeted (decode/batched/planner.py) | adaptive (budgeted
    # with the rows' survivals, decode/survival.py, as the width scores); budgeted and adaptive also
    # at batch_size 1: each round's chain length up to k, from the machine's measured costs
    batch_mode: str = "verify_all"
    run_dir: str = "runs/decode/${now:%Y-%m-%d_%H-%M-%S}"  # outputs: result JSON, markdown table


def store_schemas(primary_name: str | None = None, primary: type | None = None) -> None:
    """Put the drafter schemas (drafters/base.py store_drafter_schemas) and a primary schema in the
    ConfigStore.
    Called by `python -m decode` before Hydra composes."""
    store_drafter_schemas()
    if primary is not None:
        ConfigStore.instance().store(name=primary_name, node=primary)


@dataclass
class BenchConfig:
    """The numeric options of `python -m benchmarks.decode_speed` (argparse,
    benchmarks/decode_speed.py: --limit is `limit`), their defaults and ranges; the other options
    are names and switches."""

    limit: int = rng(10, 1, MAX_COUNT)  # prompts of the eval set
    max_new_tokens: int = rng(256, 1, MAX_TOKENS)  # tokens generated at most per prompt
    k: int = rng(5, 1, MAX_DRAFT)  # chain draft length of our decoder
    prompt_lookup: int = rng(3, 1, MAX_DRAFT)  # HF prompt_lookup_num_tokens
    ks: Optional[list[int]] = rng(None, 1, MAX_DRAFT)  # chain draft lengths of trained drafters
    confidences: list[float] = rng([], 0, 1)  # min_confidence values of extra chain modes
    curve_rounds: int = rng(7, 0, 1000)  # verify-cost curve rounds (0 = skip)
    # new tokens per timed forward of the verify-cost curve
    curve_ns: list[int] = rng([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64], 1, MAX_TREE)
    curve_context: int = rng(300, 1, MAX_TOKENS)  # tokens in the KV cache of the curve
    threads: int = rng(0, 0, MAX_THREADS)  # torch threads (0 = the cores allowed)
    batch_sizes: list[int] = rng([1, 2, 4, 8, 16, 32], 1, MAX_BATCH)  # --batch: sequences together
    batch_repeats: int = rng(3, 1, 1000)  # --batch: interleaved repeats (medians)
