"""The speculative decoder: the lossless loop (spec.py), its acceptance rules (accept.py), tree
verification (tree.py) and run metrics (metrics.py). Depends on drafters/ only through the
interface in drafters/base.py."""
