"""Benchmark scripts, kept apart from the recipe's modules: each runs training jobs (and the
decoder) and writes a results table; nothing in train/ imports them.

    python -m train.benchmarks.throughput ...   # training throughput: single / DDP / ZeRO-2
    python -m train.benchmarks.small_lm ...     # small_lm drafters by size, divergence and data
"""
