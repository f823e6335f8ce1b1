"""Decoder benchmark: plain decoding (ours), HF `generate` greedy, HF prompt lookup, our decoder with
the n-gram drafter and with any trained drafter given, in ONE process, interleaved prompt by prompt
so that load from other processes hits every mode alike.

    python -m decode.bench                                   # SmolLM2, MT-bench, 256 new tokens
    python -m decode.bench --limit 10 --max-new-tokens 128 --ckpt runs/train/<run>/best --tree
Prints a table and writes bench.json + bench.md to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from data.prompts import load_prompts
from decode.evaluate import render
from decode.metrics import RunMetrics
from decode.spec import GenerationResult, generate
from drafters.base import build_drafter, load_drafter
from drafters.ngram import NgramConfig
from drafters.target import TargetConfig, load_target


def hf_generate(target, ids: torch.Tensor, max_new_tokens: int, **kw) -> GenerationResult:
    """HF `generate`, timed and wrapped as a GenerationResult (no round statistics)."""
    t0 = time.perf_counter()
    out = target.model.generate(ids[None].to(target.device), max_new_tokens=max_new_tokens,
                                do_sample=False, **kw)
    dt = time.perf_counter() - t0
    return GenerationResult(tokens=out[0, len(ids):].cpu(), time_total=dt, time_verify=dt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="packaged:smollm2", help="target.path")
    ap.add_argument("--eval", default="mtbench")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=5, help="chain draft length of our decoder")
    ap.add_argument("--prompt-lookup", type=int, default=3, help="HF prompt_lookup_num_tokens")
    ap.add_argument("--ckpt", action="append", default=[], help="trained drafter folder(s)")
    ap.add_argument("--tree", action="store_true", help="also run trained drafters with their tree")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(TargetConfig(path=args.target))
    ngram = build_drafter(NgramConfig(), target)
    modes = {  # name -> fn(ids) -> GenerationResult
        "plain (ours)": lambda ids: generate(target, None, ids, max_new_tokens=args.max_new_tokens),
        "HF greedy": lambda ids: hf_generate(target, ids, args.max_new_tokens),
        f"HF prompt lookup {args.prompt_lookup}": lambda ids: hf_generate(
            target, ids, args.max_new_tokens, prompt_lookup_num_tokens=args.prompt_lookup),
        f"ngram k={args.k}": lambda ids: generate(target, ngram, ids,
                                                  max_new_tokens=args.max_new_tokens, k=args.k),
    }
    for path in args.ckpt:
        d = load_drafter(Path(path), target).eval()
        modes[f"{d.name} k={args.k}"] = (lambda d: lambda ids: generate(
            target, d, ids, max_new_tokens=args.max_new_tokens, k=args.k))(d)
        if args.tree and d.supports_tree:
            modes[f"{d.name} tree"] = (lambda d: lambda ids: generate(
                target, d, ids, max_new_tokens=args.max_new_tokens, tree=True))(d)

    prompts = load_prompts(args.eval, limit=args.limit)
    results: dict[str, list[GenerationResult]] = {m: [] for m in modes}
    mismatch = {m: 0 for m in modes}
    for i, p in enumerate(prompts):
        ids = render(target, p.turns[:1], [])
        for name, fn in modes.items():  # interleaved: every mode on this prompt, then the next
            r = fn(ids)
            results[name].append(r)
            ref = results["plain (ours)"][-1].tokens
            mismatch[name] += not torch.equal(r.tokens, ref)
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    metrics = {m: RunMetrics.from_results(rs) for m, rs in results.items()}
    base_ours = metrics["plain (ours)"].tokens_per_s
    base_hf = metrics["HF greedy"].tokens_per_s
    head = (f"{args.eval}, {len(prompts)} prompts, greedy, {args.max_new_tokens} new tokens, "
            f"target {args.target}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    lines = [f"Decoder benchmark ({date.today()}): {head}", "",
             "| mode | tau | tokens/s | vs plain (ours) | vs HF greedy | target fwd | draft s | verify s | other s | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for m, r in metrics.items():
        tau = f"{r.tau:.2f}" if r.rounds else "-"
        lines.append(f"| {m} | {tau} | {r.tokens_per_s:.1f} | {r.tokens_per_s / base_ours:.2f}x | "
                     f"{r.tokens_per_s / base_hf:.2f}x | {r.target_forwards or '-'} | "
                     f"{r.time_draft:.2f} | {r.time_verify:.2f} | {r.time_other:.2f} | "
                     f"{'yes' if mismatch[m] == 0 else f'NO ({mismatch[m]})'} |")
    plain = metrics["plain (ours)"]
    if plain.target_forwards:
        step = plain.time_verify / plain.target_forwards
        lines += ["", f"one plain target step: {1000 * step:.1f} ms; decoder overhead per round "
                      "(time outside target and drafter / rounds):"]
        for m, r in metrics.items():
            if r.rounds:
                per = r.time_other / max(1, r.target_forwards)
                lines.append(f"- {m}: {1000 * per:.2f} ms = {100 * per / step:.1f}% of a target step")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(table + "\n")
    (out / "bench.json").write_text(json.dumps({m: vars(r) for m, r in metrics.items()}, indent=1))


if __name__ == "__main__":
    main()
