"""Benchmark scripts, kept apart from the recipe's modules: each runs training jobs (and the
decoder) and writes a results table; nothing in train/ imports them.

    python -m benchmarks.throughput ...   # training throughput: single / DDP / ZeRO-2
    python -m benchmarks.small_lm_study ...     # small_lm drafters by size, divergence and data
"""
