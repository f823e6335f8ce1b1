"""Decoder benchmark, per target dtype, in ONE process, interleaved so that load from other
processes hits every mode alike:

1. the verify-cost curve: a forward of n new tokens over a KV cache of --curve-context real tokens
   (default 300), in one-token steps of the same dtype (n = 1..64), rounds interleaved over n and
   dtypes, medians;
2. a row per (dtype, mode) for plain decoding (ours), HF `generate` greedy, HF prompt lookup, our
   decoder with the n-gram drafter and with every trained drafter given, prompt by prompt;
3. numerics: every greedy output that differs from plain decoding at the same dtype, with the
   target's logit margin between the two tokens at the first difference (a near-tie or a bug).

    python -m benchmarks.decode_speed                                   # SmolLM2, MT-bench, fp32 + bf16
    python -m benchmarks.decode_speed --limit 10 --max-new-tokens 128 --ckpt runs/train/<run>/best --tree
    python -m benchmarks.decode_speed --dtypes bfloat16 --curve-only    # just the verify-cost curve
    python -m benchmarks.decode_speed --batch --ckpt <drafter> --batch-sizes 1 2 4 8 16 32   # batched
Prints the tables and writes bench.json + bench.md (--batch: batch.json, batch.md, batch.png;
benchmarks/batch_speed.py) to --out (default a new dated folder; one holding an earlier benchmark's
results is refused before the run).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.batch_speed import BENCH_MODES, batch_main
from specdistill.cli.paths import present
from specdistill.cli.ranges import check_ranges, range_problems
from specdistill.data.prompts import load_prompts
from specdistill.decode.batched.spec import MODES
from specdistill.decode.config import BenchConfig
from specdistill.decode.evaluate import is_near_tie, render
from specdistill.decode.metrics import RunMetrics
from specdistill.decode.spec import GenerationResult, generate
from specdistill.drafters.base import build_drafter
from specdistill.drafters.ngram import NgramConfig
from specdistill.drafters.parts.head import cast_drafter
from specdistill.export.folder import load_resolved
from specdistill.store.rundir import DrafterSource, resolve_drafter
from specdistill.target.model import TargetConfig, load_target
from specdistill.target.precision import NATIVE_BF16_FLAGS, cpu_flags

DEFAULTS = BenchConfig()  # the numeric options' defaults (and ranges: decode/config.py)
CURVE_NS = tuple(DEFAULTS.curve_ns)
PLAIN_EXACT = "plain (ours) exact"  # plain decoding with exact_verify: what " exact" modes match


def hf_generate(target, ids: torch.Tensor, max_new_tokens: int, **kw) -> GenerationResult:
    """HF `generate`, timed and wrapped as a GenerationResult (no round statistics)."""
    t0 = time.perf_counter()
    out = target.model.generate(ids[None].to(target.device), max_new_tokens=max_new_tokens,
                                do_sample=False, **kw)
    dt = time.perf_counter() - t0
    return GenerationResult(tokens=out[0, len(ids):].cpu(), time_total=dt, time_verify=dt)


@torch.inference_mode()
def verify_curve(targets: dict, context: torch.Tensor, ns=CURVE_NS, rounds: int = 7) -> dict:
    """Median seconds of a forward of n new tokens (logits at every new position, as verification
    reads them) over the KV cache of `context`, per dtype name -> {n: seconds}.

    1. prefill `context` (C,) once per target; 2. each round, for every target and every n in
    turn, time the forward of n tokens and crop them off again, so the cache is C tokens before
    every timed forward; 3. medians over rounds (round 0, the warm-up, is dropped).
    """
    caches = {}
    for name, target in targets.items():  # 1.
        caches[name] = DynamicCache()
        target.forward(context[None].to(target.device), cache=caches[name], logits_to_keep=1)
    times: dict = {name: {n: [] for n in ns} for name in targets}
    gen = torch.Generator().manual_seed(0)
    for r in range(rounds + 1):  # 2.
        for name, target in targets.items():
            for n in ns:
                ids = torch.randint(0, target.vocab_size, (1, n), generator=gen).to(target.device)
                t0 = time.perf_counter()
                out = target.forward(ids, cache=caches[name])  # (1, n, V)
                out.logits.argmax(-1).cpu()  # what a round reads; waits for the device
                if r:
                    times[name][n].append(time.perf_counter() - t0)
                caches[name].crop(-n)
    return {name: {n: statistics.median(v) for n, v in t.items()} for name, t in times.items()}  # 3.


def curve_markdown(curve: dict) -> list[str]:
    """The verify-cost curve as a table: cost in one-token steps of the same dtype, and ms."""
    names = list(curve)
    ns = list(curve[names[0]])
    lines = ["| n | " + " | ".join(str(n) for n in ns) + " |", "|---" * (len(ns) + 1) + "|"]
    for name in names:
        one = curve[name][ns[0]]
        lines.append(f"| {name} (steps) | " + " | ".join(f"{curve[name][n] / one:.2f}" for n in ns) + " |")
        lines.append(f"| {name} (ms) | " + " | ".join(f"{1000 * curve[name][n]:.0f}" for n in ns) + " |")
    if len(names) > 1:
        a, b = names[0], names[1]
        lines.append(f"\none-token step {b} / {a}: {curve[b][ns[0]] / curve[a][ns[0]]:.2f}")
    return lines


def build_modes(target, drafters: list, args) -> dict:
    """name -> fn(prompt ids) -> GenerationResult, for one target (dtype)."""
    n = args.max_new_tokens
    ngram = build_drafter(NgramConfig(), target)
    modes = {
        "plain (ours)": lambda ids: generate(target, None, ids, max_new_tokens=n),
        "HF greedy": lambda ids: hf_generate(target, ids, n),
        f"HF prompt lookup {args.prompt_lookup}": lambda ids: hf_generate(
            target, ids, n, prompt_lookup_num_tokens=args.prompt_lookup),
        f"ngram k={args.k}": lambda ids: generate(target, ngram, ids, max_new_tokens=n, k=args.k),
    }
    exacts = ("", " exact") if getattr(args, "exact", False) else ("",)
    if len(exacts) == 2:  # the reference of every " exact" mode (run_modes)
        modes[PLAIN_EXACT] = lambda ids: generate(target, None, ids, max_new_tokens=n,
                                                  exact_verify=True)

    def mode(d, **kw):
        return lambda ids: generate(target, d, ids, max_new_tokens=n, **kw)
    for label, d in drafters:
        for k in getattr(args, "ks", None) or [args.k]:
            for ex in exacts:
                modes[f"{label} k={k}{ex}"] = mode(d, k=k, exact_verify=bool(ex))
            for c in getattr(args, "confidences", None) or []:  # adaptive draft length
                modes[f"{label} k={k} conf={c:g}"] = mode(d, k=k, min_confidence=c)
        if args.tree and d.supports_tree:
            for ex in exacts:
                modes[f"{label} tree{ex}"] = mode(d, tree=True, exact_verify=bool(ex))
        for spec in getattr(args, "trees", None) or []:
            if d.supports_tree and hasattr(d.cfg, "tree_total_tokens"):
                modes[f"{label} tree {spec}"] = sized_tree(target, d, spec, n)
    return modes


def sized_tree(target, drafter, spec: str, n: int):
    """A tree mode of another size: spec "TOTAL/DEPTH/TOPK" sets the drafter's EAGLE-2 tree
    (tree_total_tokens, tree_depth, tree_top_k) for this mode's calls only."""
    try:
        total, depth, top_k = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--trees {spec!r}: give TOTAL/DEPTH/TOPK, e.g. 12/4/4") from None
    sized = dataclasses.replace(drafter.cfg, tree_total_tokens=total, tree_depth=depth,
                                tree_top_k=top_k)
    bad = range_problems(sized, type(sized))
    if bad:
        raise ValueError(f"--trees {spec!r}: {'; '.join(bad)}")

    def run(ids):
        saved, drafter.cfg = drafter.cfg, sized
        try:
            return generate(target, drafter, ids, max_new_tokens=n, tree=True)
        finally:
            drafter.cfg = saved
    return run


def load_drafters(target, ckpts: list[str], drafter_dtypes: list[str],
                  sources: dict[str, DrafterSource] | None = None) -> list:
    """(label, drafter) per checkpoint and drafter dtype ("target" = the target's dtype); each
    --ckpt resolved and verified as `python -m decode ckpt=` does (`sources`: already resolved).
    Where two checkpoints hold the same kind of drafter, the labels name the run folder too, so
    the modes stay apart (e.g. "eagle [eagle_v4k]")."""
    out = []
    for path in ckpts:
        source = (sources or {}).get(path) or resolve_drafter(path, setting="--ckpt")
        for dd in drafter_dtypes:
            d = load_resolved(source, target).eval()
            dtype = target.dtype if dd == "target" else getattr(torch, dd)
            cast_drafter(d, target, dtype)
            out.append((path, d, f"(drafter {str(dtype).removeprefix('torch.')})"))
    names = [d.name for _, d, _ in out]
    return [(f"{d.name} [{_run_name(path)}] {tail}" if names.count(d.name) > len(drafter_dtypes)
             else f"{d.name} {tail}", d) for path, d, tail in out]


def _run_name(path: str) -> str:
    """A checkpoint's run: the folder above `best` / `step-N` / `checkpoints`, else its own name."""
    parts = Path(path).resolve().parts
    keep = [x for x in parts if x != "best" and not x.startswith("step-") and x != "checkpoints"]
    return keep[-1] if keep else Path(path).name


def run_modes(targets: dict, modes: dict, prompts, target_any) -> tuple[dict, dict, dict]:
    """Every (dtype, mode) on every prompt, interleaved prompt by prompt. Returns results,
    mismatch counts and first-difference records, keyed by (dtype, mode)."""
    results = {(dn, m): [] for dn in modes for m in modes[dn]}
    mismatch = {key: 0 for key in results}
    diffs: dict = {key: [] for key in results}
    for i, p in enumerate(prompts):
        ids = render(target_any, p.turns[:1], [])
        for dn, dmodes in modes.items():
            for name, fn in dmodes.items():
                r = fn(ids)
                results[(dn, name)].append(r)
                ref = results[(dn, PLAIN_EXACT if name.endswith(" exact") else "plain (ours)")]
                ref = ref[-1].tokens
                if not torch.equal(r.tokens, ref):
                    mismatch[(dn, name)] += 1
                    diffs[(dn, name)].append({"prompt": i, **targets[dn].first_difference(
                        ids, ref, r.tokens)})
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    return results, mismatch, diffs


def modes_markdown(metrics: dict, mismatch: dict, base_dtype: str) -> list[str]:
    """One row per (dtype, mode), with speed relative to plain and HF at the same dtype and to
    plain decoding at `base_dtype` (float32)."""
    lines = ["| dtype | mode | tau | tokens/s | vs plain (ours) | vs HF greedy | "
             f"vs plain {base_dtype} | draft ms/round | identical to plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|:---:|"]
    base = metrics.get((base_dtype, "plain (ours)"))
    for (dn, m), r in metrics.items():
        plain, hf = metrics[(dn, "plain (ours)")], metrics.get((dn, "HF greedy"))
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"  # "-": not measured (no draft)
        draft = f"{1000 * r.time_draft / r.rounds:.1f}" if r.rounds and r.time_draft else "-"
        same = "yes" if mismatch[(dn, m)] == 0 else f"NO ({mismatch[(dn, m)]})"
        lines.append(f"| {dn} | {m} | {tau} | {r.tokens_per_s:.1f} | {_ratio(r, plain)} | "
                     f"{_ratio(r, hf)} | {_ratio(r, base)} | {draft} | {same} |")
    return lines


def _ratio(r: RunMetrics, ref: RunMetrics | None) -> str:
    """Speed of r over ref as "1.23x"; "-" without a reference or a measured speed."""
    return f"{r.tokens_per_s / ref.tokens_per_s:.2f}x" if ref and ref.tokens_per_s else "-"


def diffs_markdown(diffs: dict) -> list[str]:
    rows = [(key, d) for key, ds in diffs.items() for d in ds if d.get("margin") is not None]
    if not rows:
        return ["every output identical to plain decoding at its dtype (or a prefix cut at EOS)"]
    lines = ["| dtype | mode | prompt | position | plain token | other token | margin | "
             "dtype spacing at top logit | near-tie |", "|---|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for (dn, m), d in rows:
        lines.append(f"| {dn} | {m} | {d['prompt']} | {d['position']} | {d['ref_token']} | "
                     f"{d['got_token']} | {d['margin']:.4f} | {d['ulp']:.4f} | "
                     f"{'yes' if is_near_tie(d) else 'NO'} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="packaged:smollm2", help="target.path")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "auto"],
                    help="target dtypes to compare (auto = target.dtype's default resolution)")
    ap.add_argument("--attn", nargs="+", default=["few_q"], choices=["few_q", "sdpa"],
                    help="the target's attention: few_q (ours, target/attention.py: plain ops "
                         "for 16-bit CPU forwards of few queries) and / or sdpa (torch's fused "
                         "kernel everywhere), each a separate column set, interleaved")
    ap.add_argument("--prepack", nargs="+", default=["on"], choices=["on", "off"], help="fp32 CPU "
                    "linear layers: oneDNN, packed once (target/prepack.py) / F.linear; both: interleaved")
    ap.add_argument("--eval", default="mtbench")
    d = DEFAULTS
    ap.add_argument("--limit", type=int, default=d.limit)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--k", type=int, default=d.k, help="chain draft length of our decoder")
    ap.add_argument("--prompt-lookup", type=int, default=d.prompt_lookup,
                    help="HF prompt_lookup_num_tokens")
    ap.add_argument("--ckpt", action="append", default=[], help="trained drafter(s): a run dir, "
                    "checkpoint, drafter or export folder (as `python -m decode ckpt=`)")
    ap.add_argument("--drafter-dtypes", nargs="+", default=["float32", "target"],
                    help="dtypes trained drafters run at (target = the target's dtype)")
    ap.add_argument("--tree", action="store_true", help="also run trained drafters with their tree")
    ap.add_argument("--exact", action="store_true", help="also run plain decoding and every "
                    "drafter mode with exact_verify (decode/exact.py), checked against each other")
    ap.add_argument("--trees", nargs="+", default=[], metavar="TOTAL/DEPTH/TOPK",
                    help="also run trained drafters with EAGLE-2 trees of these sizes")
    ap.add_argument("--ks", type=int, nargs="+", default=d.ks,
                    help="chain draft lengths of trained drafters (default: --k)")
    ap.add_argument("--confidences", type=float, nargs="+", default=d.confidences,
                    help="also every chain of --ks with these min_confidence values (the drafter "
                         "stops a chain at a draft below it: adaptive draft length)")
    ap.add_argument("--curve-rounds", type=int, default=d.curve_rounds,
                    help="verify-cost curve rounds (0 = skip)")
    ap.add_argument("--curve-ns", type=int, nargs="+", default=d.curve_ns)
    ap.add_argument("--curve-context", type=int, default=d.curve_context,
                    help="tokens in the KV cache of the verify-cost curve (MT-bench turns joined)")
    ap.add_argument("--curve-only", action="store_true", help="only the verify-cost curve")
    ap.add_argument("--modes", nargs="+", default=None,
                    help="only modes whose name starts with one of these (plain always runs)")
    ap.add_argument("--threads", type=int, default=d.threads,
                    help="torch threads (0 = the cores allowed)")
    ap.add_argument("--batch", action="store_true", help="the batched benchmark instead: "
                    "throughput and latency per batch size x mode (first dtype, first --ckpt or ngram)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=d.batch_sizes)
    ap.add_argument("--batch-modes", nargs="+", choices=MODES, default=list(BENCH_MODES))
    ap.add_argument("--batch-repeats", type=int, default=d.batch_repeats,
                    help="interleaved repeats (medians)")
    ap.add_argument("--batch-tree", action="store_true",
                    help="--batch: the drafter's trees instead of chains of --k")
    ap.add_argument("--batch-one-by-one", action="store_true",
                    help="--batch: also every speculative mode with the rows drafting one after "
                         "another, interleaved (the A/B of batched drafting)")
    ap.add_argument("--batch-exact", action="store_true",
                    help="--batch: also every mode with exact_verify (decode/batched/exact.py), "
                         "interleaved, its outputs checked against unbatched exact decoding")
    ap.add_argument("--out", default=f"runs/bench/{datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}",
                    help="folder of the results (default: a new dated folder under runs/bench)")
    args = ap.parse_args(argv)
    names = ("batch.md", "batch.json", "batch.png") if args.batch else ("bench.md", "bench.json")
    clash = present(Path(args.out), names)
    if clash:  # before the (long) run: an earlier benchmark's results are never replaced
        ap.error(f"--out {args.out} already holds {', '.join(clash)} of an earlier benchmark; "
                 f"give a new --out")
    return args


def load_targets(args) -> dict:
    """One target per (dtype, attention, prepack) asked, the same weights: name -> Target. The
    attention A/B (--attn few_q sdpa) switches the target's attention only; drafters keep theirs;
    the prepack A/B (--prepack on off) the target's linear layers."""
    targets = {}
    for dn in args.dtypes:
        for attn in args.attn:
            for pack in args.prepack:
                t = load_target(TargetConfig(path=args.target, dtype=dn, threads=args.threads,
                                             prepack=pack == "on"))
                if attn == "sdpa":
                    t.model.set_attn_implementation("sdpa")
                name = (f"{t.dtype_choice.dtype}" + (" (auto)" if dn == "auto" else "")
                        + (f" {attn}" if len(args.attn) > 1 else "")
                        + (f" prepack {pack}" if len(args.prepack) > 1 else ""))
                targets[name] = t
    return targets


def main(argv: list[str] | None = None) -> None:
    """The command line: every user error in one line (cli/errors.py user_errors)."""
    from specdistill.cli.errors import user_errors

    args = parse_args(argv)
    with user_errors("python -m benchmarks.decode_speed"):
        check_ranges(vars(args), BenchConfig)  # before any work
        args.sources = {p: resolve_drafter(p, setting="--ckpt") for p in args.ckpt}  # verified
        run(args)


def run(args: argparse.Namespace) -> None:
    """The benchmark of parsed and checked arguments (args.sources: the --ckpt folders)."""
    # 1. one target per dtype (the same weights), and the machine facts that explain the numbers
    targets = load_targets(args)
    any_t = next(iter(targets.values()))
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2")))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [f"Decoder benchmark ({stamp}): target {args.target}, {torch.get_num_threads()} threads, "
            f"native-bf16 flags found: {sorted(set(NATIVE_BF16_FLAGS) & set(flags)) or 'none'}; "
            f"CPU flags: {' '.join(flags) or '-'}", ""]
    report: dict = {"machine": {"flags": flags, "threads": torch.get_num_threads()},
                    "dtype_choice": {n: vars(t.dtype_choice) for n, t in targets.items()}}
    prompts = load_prompts(args.eval, limit=args.limit)
    if args.batch:  # benchmarks/batch_speed.py: one drafter, the first --ckpt (else ngram)
        sources = getattr(args, "sources", None)
        drafter = (load_drafters(any_t, args.ckpt[:1], ["target"], sources)[0][1] if args.ckpt
                   else build_drafter(NgramConfig(), any_t))
        return batch_main(any_t, drafter, prompts, args, head)

    # 2. the verify-cost curve over a real context of --curve-context tokens
    lines = list(head)
    if args.curve_rounds:
        ctx = torch.cat([render(any_t, [p.turns[0]], [])
                         for p in load_prompts(args.eval)])[:args.curve_context]
        curve = verify_curve(targets, ctx, tuple(args.curve_ns), args.curve_rounds)
        report["verify_curve_s"] = curve
        lines += [f"Verify cost: forward of n new tokens over a {len(ctx)}-token cache, in one-token "
                  f"steps of the same dtype ({args.curve_rounds} interleaved rounds, medians)", ""]
        lines += curve_markdown(curve) + [""]
        print("\n".join(lines), flush=True)
    if not args.curve_only:
        # 3. every mode per dtype, interleaved prompt by prompt
        modes = {dn: build_modes(t, load_drafters(t, args.ckpt, args.drafter_dtypes, args.sources),
                                 args)
                 for dn, t in targets.items()}
        if args.modes:  # e.g. a numerics run: plain and one drafter on many prompts
            keep = ("plain (ours)", *args.modes)
            modes = {dn: {m: f for m, f in ms.items() if m.startswith(keep)}
                     for dn, ms in modes.items()}
        results, mismatch, diffs = run_modes(targets, modes, prompts, any_t)
        metrics = {key: RunMetrics.from_results(rs) for key, rs in results.items()}
        base = next((dn for dn in targets if dn.startswith("float32")), next(iter(targets)))
        lines += [f"{args.eval}, {len(prompts)} prompts, greedy, {args.max_new_tokens} new tokens, "
                  f"every (dtype, mode) interleaved prompt by prompt", ""]
        lines += modes_markdown(metrics, mismatch, base) + ["", "First differences from plain "
                  "decoding at the same dtype (margin = logit of plain's token - logit of the "
                  "other, from a fresh forward):", ""] + diffs_markdown(diffs)
        report["modes"] = {f"{dn} | {m}": {**vars(r), "mismatches": mismatch[(dn, m)],
                                           "first_differences": diffs[(dn, m)]}
                           for (dn, m), r in metrics.items()}
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(table + "\n")
    (out / "bench.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
