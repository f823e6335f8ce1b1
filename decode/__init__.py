"""The speculative decoder: the lossless loop and its public per-sequence steps (spec.py), its
acceptance rules (accept.py), tree verification (tree.py), exact verification (exact.py), run
metrics (metrics.py), the eval job (evaluate.py) and the batched decoder (batched/). Depends on
drafters/ only through the interface in drafters/base.py."""
