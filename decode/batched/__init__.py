"""Batched speculative decoding: B sequences share ONE target forward per round, each keeping its
own drafts, acceptance, KV length and drafter state; finished sequences leave the batch and waiting
prompts take their place (continuous batching, admitted at round boundaries). Each output is what
`decode.spec.generate` gives that prompt alone.

  spec.py      `generate_batch`: the rounds, every row through decode/spec.py's per-sequence steps
  kv_cache.py  the row-per-sequence KV cache (one DynamicCache, rows left-aligned)
  exact.py     exact verification per row: the batched twin of decode/exact.py
  cost.py      the target's measured (B, Q) verify-cost grid, cached per target and machine
  planner.py   budgeted mode: the round planner (depth before drafting, width after)
  evaluate.py  `python -m decode batch_size=B ...`: an eval set decoded B sequences at a time
  (its benchmark: benchmarks/batch_speed.py, `python -m benchmarks.decode_speed --batch`)

Modes: plain (no drafts), verify_all (every row verifies all its drafts), budgeted (planner.py:
before drafting, the draft depth of the round from past acceptance, the measured drafting time and
the target's measured (B, Q) cost grid, 0 = a plain round without drafter calls; after drafting,
the verify width from the drafts' confidences). tree=True: each row drafts the drafter's tree
(spec's tree step) and verifies it under its own tree mask in the same padded forward; the
accepted branch (non-contiguous block columns) is compacted per row; budgeted then chooses per
round between a plain round and the whole trees, from past rounds only. adaptive (chains):
budgeted with each row's survival (decode/survival.py: the product of its slot confidences, a
trained confidence head's) as the width scores; the padded forward costs by its widest row, so
per-row widths matter only through their maximum and the admitted (row, slot) pairs are every slot
up to the one width that gives the most expected tokens per measured second.
"""
