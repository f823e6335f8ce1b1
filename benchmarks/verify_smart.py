"""Confidence-driven verification against fixed chain lengths (decode/survival.py): does cutting
each chain by its survival beat the best fixed k at batch 1, and does `batch_mode=adaptive` beat
verifying every draft at batch 8?

    python -m benchmarks.verify_smart --ckpt runs/train/<run> --ks 1 2 3 --max-k 4 \\
        --thresholds 0.3 0.5 --batch-sizes 1 8 --limit 8 --max-new-tokens 64 --repeats 2 \\
        --out runs/bench/verify_smart

Arms per batch size B (greedy, MT-bench first turns):
  B = 1: plain; fixed k (each of --ks); survival cut (k = --max-k, each of --thresholds).
  B > 1: plain; verify_all (k = --max-k: every draft verified); budgeted; adaptive (each threshold,
         the rows' survivals as the planner's width scores).
Slot confidences: the drafter's trained confidence head where it has one (`accept_prob_head`),
else --fallback (draft_prob: the draft's top probability). The arms run interleaved A/B/A/B
(repeat 1: every B, every arm; repeat 2: ...), so load from other processes hits each alike; the
table gives the median tokens/s over repeats, tau, and whether every output equals plain
decoding's at that B. budgeted / adaptive keep one planner per arm across repeats, as a server
would. Writes <out>/verify_smart.json and verify_smart.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

Arm = Callable[[list], tuple[list, float]]  # prompts -> (GenerationResults, wall seconds)


def single_arms(target: Any, drafter: Any, args) -> dict[str, Arm]:
    """B = 1: plain, fixed k, survival cut at --max-k (one `generate` per prompt)."""
    from specdistill.decode.spec import generate

    n, fb = args.max_new_tokens, args.fallback

    def arm(**kw) -> Arm:
        def run(prompts):
            t0 = time.perf_counter()
            out = [generate(target, kw.get("drafter"), p, max_new_tokens=n,
                            **{k: v for k, v in kw.items() if k != "drafter"}) for p in prompts]
            return out, time.perf_counter() - t0
        return run
    arms = {"plain": arm()}
    arms.update({f"k={k}": arm(drafter=drafter, k=k) for k in args.ks})
    arms.update({f"survival>={t} (k<={args.max_k})": arm(drafter=drafter, k=args.max_k,
                                                        verify_survival=t, survival_fallback=fb)
                 for t in args.thresholds})
    return arms


def batch_arms(target: Any, drafter: Any, B: int, args, cost) -> dict[str, Arm]:
    """B > 1: plain, verify_all, budgeted, adaptive per threshold (`generate_batch`)."""
    from specdistill.decode.batched.planner import new_planner
    from specdistill.decode.batched.spec import generate_batch

    def arm(mode: str, **kw) -> Arm:
        planner = new_planner(cost, args.max_k, drafter) if mode in ("budgeted", "adaptive") else None

        def run(prompts):
            out = generate_batch(target, drafter if mode != "plain" else None, prompts,
                                 max_new_tokens=args.max_new_tokens, batch_size=B, k=args.max_k,
                                 mode=mode, planner=planner, survival_fallback=args.fallback, **kw)
            return out.results, out.time_total
        return run
    arms = {"plain": arm("plain"), f"verify_all (k={args.max_k})": arm("verify_all"),
            f"budgeted (k<={args.max_k})": arm("budgeted")}
    arms.update({f"adaptive, survival>={t}": arm("adaptive", verify_survival=t)
                 for t in args.thresholds})
    arms[f"adaptive (k<={args.max_k})"] = arm("adaptive")
    return arms


def interleave(cells: dict[tuple[int, str], Arm], prompts: list, repeats: int, log=print) -> dict:
    """Run every (B, arm) once per repeat, in turn; (B, arm) -> {"tps": [...], "results": first}."""
    out: dict[tuple[int, str], dict] = {c: {"tps": [], "results": None} for c in cells}
    for r in range(repeats):
        for (B, name), run in cells.items():
            results, secs = run(prompts)
            tps = sum(len(x.tokens) for x in results) / secs if secs > 0 else None
            out[(B, name)]["tps"].append(tps)
            out[(B, name)]["results"] = out[(B, name)]["results"] or results
            log(f"repeat {r + 1}/{repeats} B={B} {name}: "
                f"{'-' if tps is None else f'{tps:.1f}'} tokens/s")
    return out


def summarize(runs: dict) -> list[dict]:
    """One row per (B, arm): median tokens/s, tau, mean drafts verified per round, the outputs'
    identity with plain decoding at that B, and the ratio to the arm to beat at that B (B = 1: the
    best fixed k; B > 1: verify_all)."""
    from specdistill.decode.metrics import RunMetrics

    rows = []
    for (B, name), r in runs.items():
        m = RunMetrics.from_results(r["results"])
        plain = runs[(B, "plain")]["results"]
        tps = [x for x in r["tps"] if x is not None]
        rows.append({"batch_size": B, "arm": name,
                     "tokens_per_s": statistics.median(tps) if tps else None, "tau": m.tau,
                     "verified_per_round": m.drafted / m.rounds if m.rounds else None,
                     "confidence_ece": m.confidence_ece,
                     "identical_to_plain": all(torch.equal(a.tokens, b.tokens)
                                               for a, b in zip(r["results"], plain))})
    for B in {row["batch_size"] for row in rows}:
        at = [x for x in rows if x["batch_size"] == B]
        base = ([x for x in at if x["arm"].startswith("k=")] if B == 1
                else [x for x in at if x["arm"].startswith("verify_all")])
        best = max((x["tokens_per_s"] for x in base if x["tokens_per_s"]), default=None)
        for x in at:
            x["vs_baseline"] = (x["tokens_per_s"] / best if best and x["tokens_per_s"]
                                else None)
    return rows


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict], header: str) -> str:
    """The table: None values shown as -."""
    lines = [header, "", "| B | arm | tokens/s | vs baseline | tau | verified / round | ECE | "
             "lossless |", "|---:|---|---:|---:|---:|---:|---:|:---:|"]
    for x in rows:
        lines.append(f"| {x['batch_size']} | {x['arm']} | {_f(x['tokens_per_s'], '.1f')} | "
                     f"{_f(x['vs_baseline'], '.3f')} | {_f(x['tau'], '.3f')} | "
                     f"{_f(x['verified_per_round'], '.2f')} | {_f(x['confidence_ece'], '.3f')} | "
                     f"{'yes' if x['identical_to_plain'] else 'NO'} |")
    lines.append("\nbaseline: B = 1 the best fixed k, B > 1 verify_all (every draft verified)")
    return "\n".join(lines)


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.verify_smart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a trained drafter: run dir, checkpoint or export")
    p.add_argument("--target", default="smollm2", help="conf/target/<name>.yaml (tiny: a smoke)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="B = 1: fixed chain lengths")
    p.add_argument("--max-k", type=int, default=4, help="drafts asked by the survival arms")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.5],
                   help="verify_survival values, each in [0, 1]")
    p.add_argument("--fallback", default="draft_prob", choices=["none", "draft_prob"],
                   help="slot confidences of a drafter without a trained head")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--limit", type=int, default=8, help="MT-bench prompts (first turns)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats (medians)")
    p.add_argument("--out", default="runs/bench/verify_smart")
    args = p.parse_args(argv)
    if not all(0 <= t <= 1 for t in args.thresholds) or args.max_k < 1 or min(args.ks) < 1:
        p.error("--thresholds must lie in [0, 1], --max-k and --ks be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from benchmarks.decode_speed import load_drafters
    from specdistill.cli.paths import CONF_DIR
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.batched.cost import cost_curve
    from specdistill.decode.evaluate import render
    from specdistill.target.model import TargetConfig, cache_root, load_target

    args = parse(argv)
    tcfg = OmegaConf.merge(OmegaConf.structured(TargetConfig),
                           OmegaConf.load(Path(CONF_DIR) / "target" / f"{args.target}.yaml"))
    target = load_target(tcfg)
    (_, drafter), = load_drafters(target, [args.ckpt], ["target"])
    prompts = [render(target, p.turns[:1], []) for p in load_prompts("mtbench", limit=args.limit)]
    cost = cost_curve(target, str(cache_root(tcfg))) if max(args.batch_sizes) > 1 else None
    cells: dict[tuple[int, str], Arm] = {}
    for B in args.batch_sizes:
        arms = (single_arms(target, drafter, args) if B == 1
                else batch_arms(target, drafter, B, args, cost))
        cells.update({(B, name): a for name, a in arms.items()})
    rows = summarize(interleave(cells, prompts, args.repeats))
    head = (f"{args.target}, {target.dtype}, {torch.get_num_threads()} threads, drafter "
            f"{drafter.name} (confidences: "
            f"{'trained head' if drafter.accept_prob_head else args.fallback}), {len(prompts)} "
            f"MT-bench prompts x {args.max_new_tokens} tokens, greedy, {args.repeats} repeats")
    text = markdown(rows, head)
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_smart.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / "verify_smart.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
