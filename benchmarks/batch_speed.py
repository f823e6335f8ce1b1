"""Batched decoding benchmark (`python -m benchmarks.decode_speed --batch`): throughput over the batch and
per-sequence latency for every batch size x mode (plain, verify_all, budgeted), one drafter.

Every (B, mode) decodes the same prompt list (as many prompts as the largest B, cycling the eval
set if it is shorter), so each B is a full batch until its queue drains. Runs are interleaved
round-robin (repeat 1: every B, every mode; repeat 2: ...), so load from other processes hits every
cell alike; the table gives medians over repeats. Greedy outputs are checked against plain batched
decoding at the same B (itself token-identical to decoding alone). tree=True: the speculative
modes verify the drafter's trees instead of chains. one_by_one=True adds every speculative mode
with the rows drafting one after another ("verify_all 1by1"), interleaved with the default where
the rows draft together (Drafter.propose_rows): the A/B of batched drafting. exact=True adds every
mode with exact verification ("verify_all exact", decode/batched/exact.py), interleaved: its cost,
and its outputs against unbatched exact decoding ("outputs differ from unbatched").
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch

from specdistill.decode.batched.cost import CostCurve, cost_curve
from specdistill.decode.batched.planner import new_planner
from specdistill.decode.batched.spec import MODES, PLANNED, BatchResult, generate_batch
from specdistill.decode.evaluate import render

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
ONE_BY_ONE = "1by1"  # label suffix of a speculative mode whose rows draft one after another
EXACT = "exact"  # label suffix of a mode run with exact_verify
# the modes measured by default; adaptive (confidence-driven widths) has its own A/B,
# benchmarks/verify_smart.py
BENCH_MODES = tuple(m for m in MODES if m != "adaptive")


def run_batch_bench(target: Any, drafter: Any, prompts: Sequence[torch.Tensor], *,
                    batch_sizes: Sequence[int] = BATCH_SIZES, modes: Sequence[str] = BENCH_MODES,
                    k: int = 5, max_new_tokens: int = 128, repeats: int = 1,
                    cost: CostCurve | None = None, cache_dir: str | None = None,
                    tree: bool = False, one_by_one: bool = False, exact: bool = False,
                    log=print) -> list[dict]:
    """One row per (B, mode): medians over `repeats` interleaved runs of tokens/s over the batch
    and of the mean / p90 per-sequence latency (seconds from the start to its last token), tau,
    the mean forward width, the share of rounds that drafted, and how many outputs differ from
    plain decoding at that B and from unbatched plain decoding (B = 1, exact cells: exact)."""
    work = [prompts[i % len(prompts)] for i in range(max(batch_sizes))]
    cells = [(m, m, True, False) for m in modes]  # (label, mode, rows draft together, exact)
    if one_by_one:
        cells += [(f"{m} {ONE_BY_ONE}", m, False, False) for m in modes if m != "plain"]
    if exact:
        cells += [(f"{m} {EXACT}", m, True, True) for m in modes]
    # budgeted keeps one planner across every call, as a serving process would (each call then
    # starts from the acceptance and drafting seconds the earlier ones measured); one per way of
    # drafting and of verifying (exact or not), whose seconds differ
    planners = {}
    if drafter is not None:  # budgeted and adaptive: one planner per mode and way
        planners = {(m, t, ex): new_planner(cost if cost is not None else cost_curve(
            target, cache_dir, exact=ex), k, drafter, tree)
            for m, t, ex in {(m, t, ex) for _, m, t, ex in cells if m in PLANNED}}
    runs: dict[tuple[int, str], list[BatchResult]] = {(b, c[0]): [] for b in batch_sizes
                                                      for c in cells}
    for r in range(repeats):
        for b in batch_sizes:
            for label, m, together, ex in cells:
                runs[(b, label)].append(generate_batch(
                    target, drafter if m != "plain" else None, work, max_new_tokens=max_new_tokens,
                    batch_size=b, k=k, mode=m, cache_dir=cache_dir, tree=tree,
                    batch_drafts=together, exact_verify=ex,
                    **({"planner": planners[(m, together, ex)]} if m in PLANNED
                       else {"cost": cost})))
                last = runs[(b, label)][-1]
                log(f"repeat {r + 1}/{repeats} B={b} {label}: {last.tokens_per_s:.1f} tokens/s")
    rows = []
    for (b, m), rs in runs.items():
        plain = f"plain {EXACT}" if m.endswith(EXACT) else "plain"
        differ = _differ(rs, runs.get((b, plain)))  # greedy: as plain batched decoding at this B
        alone = _differ(rs, runs.get((1, plain)))  # ... and as unbatched plain decoding
        rounds = [a for x in rs[0].results for a in x.accepted]
        drafted = sum(d for x in rs[0].results for d in x.drafted)
        measured = rounds and (drafted or m.startswith("plain"))  # plain: 1 token per forward
        rows.append({
            "batch_size": b, "mode": m,
            "tokens_per_s": statistics.median(x.tokens_per_s for x in rs),
            "runs_tokens_per_s": [x.tokens_per_s for x in rs],
            "latency_mean_s": statistics.median(statistics.mean(x.latency) for x in rs),
            "latency_p90_s": statistics.median(sorted(x.latency)[int(0.9 * (len(x.latency) - 1))]
                                               for x in rs),
            "tau": (sum(rounds) + len(rounds)) / len(rounds) if measured else None,
            "mean_width": statistics.mean(rs[0].widths) if rs[0].widths else 0.0,
            "draft_rounds": (sum(d > 0 for x in rs for d in x.depths)
                             / max(1, sum(len(x.depths) for x in rs))),
            "differ_from_plain": differ, "differ_from_unbatched": alone,
            "draft_ms_round": statistics.median(1e3 * x.time_draft / max(1, x.rounds)
                                                for x in rs)})
    return rows


def _differ(runs: list[BatchResult], ref: list[BatchResult] | None) -> int | None:
    """How many outputs of the first run differ from the reference's first run (None: no
    reference)."""
    if not ref:
        return None
    return sum(not torch.equal(x.tokens, y.tokens) for x, y in zip(runs[0].results, ref[0].results))


def _order(label: str) -> tuple[int, str]:
    """Table and plot order: by mode, each mode's one-by-one variant after it."""
    return MODES.index(label.split()[0]), label


def batch_markdown(rows: list[dict]) -> list[str]:
    """The table: per B and mode, throughput (and vs plain at that B), latency, tau, width."""
    plain = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    lines = ["| B | mode | tokens/s | vs plain | latency mean (s) | latency p90 (s) | tau | "
             "mean forward width | rounds drafting | draft ms / round | outputs differ from plain | "
             "outputs differ from unbatched |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["batch_size"], _order(r["mode"]))):
        base = plain.get(r["batch_size"])
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['batch_size']} | {r['mode']} | {r['tokens_per_s']:.1f} | {vs} | "
                     f"{r['latency_mean_s']:.2f} | {r['latency_p90_s']:.2f} | "
                     f"{'-' if r['tau'] is None else format(r['tau'], '.2f')} | "
                     f"{r['mean_width']:.2f} | {r.get('draft_rounds', 0.0):.0%} | "
                     f"{r.get('draft_ms_round', 0.0):.1f} | {_count(r['differ_from_plain'])} | "
                     f"{_count(r.get('differ_from_unbatched'))} |")
    return lines


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def batch_plot(rows: list[dict], path: Path, title: str = "") -> Path:
    """A PNG: tokens/s over the batch (left) and mean per-sequence latency (right) against B,
    one line per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for m in sorted({r["mode"] for r in rows}, key=_order):
        pts = sorted((r["batch_size"], r["tokens_per_s"], r["latency_mean_s"]) for r in rows
                     if r["mode"] == m)
        if pts:
            bs, tps, lat = zip(*pts)
            ax1.plot(bs, tps, marker="o", label=m)
            ax2.plot(bs, lat, marker="o", label=m)
    for ax, label in ((ax1, "tokens/s over the batch"), (ax2, "mean latency per sequence (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def batch_main(target: Any, drafter: Any, prompts: Sequence, args, head: list[str]) -> None:
    """`python -m benchmarks.decode_speed --batch` (benchmarks/decode_speed.py parses and checks the
    arguments): the table, plot and rows for one target and one drafter, printed and written to args.out."""
    ids = [render(target, p.turns[:1], []) for p in prompts]
    rows = run_batch_bench(target, drafter, ids, batch_sizes=args.batch_sizes,
                           modes=args.batch_modes, k=args.k, max_new_tokens=args.max_new_tokens,
                           repeats=args.batch_repeats, tree=args.batch_tree,
                           one_by_one=args.batch_one_by_one, exact=args.batch_exact)
    lines = head + [f"{args.eval}, {len(ids)} prompts cycled to {max(args.batch_sizes)} sequences, "
                    f"greedy, {args.max_new_tokens} new tokens, drafter {drafter.name} "
                    f"{'trees' if args.batch_tree else f'k={args.k}'}, "
                    f"{args.batch_repeats} interleaved repeats (medians)", ""] + batch_markdown(rows)
    out = Path(args.out)
    batch_plot(rows, out / "batch.png", f"{args.target}, {drafter.name} k={args.k}")
    (out / "batch.md").write_text("\n".join(lines) + "\n")
    (out / "batch.json").write_text(json.dumps({"rows": rows}, indent=1))
    print("\n".join(lines), flush=True)
