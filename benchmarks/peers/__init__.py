"""Our trainer beside the field's (speculators, SpecForge) on the same target, data, features and
minutes: `python -m benchmarks.peers` (its __main__.py says how)."""
