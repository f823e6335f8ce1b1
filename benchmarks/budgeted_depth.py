"""Does the budgeted planner find this machine's best draft depth by itself? One sequence at a time
(B = 1), against the lone decoder at fixed k.

    python -m benchmarks.budgeted_depth --ckpt runs/study/r/e3_ttt1_op_r1 --ks 1 2 \
        --max-k 3 --limit 10 --max-new-tokens 128 --out runs/bench/budgeted_b1

Modes, interleaved prompt by prompt (A B C D A B C D ...), MT-bench first turns, greedy:
plain decoding; `decode.spec.generate` at each fixed --ks; `generate_batch(batch_size=1,
mode="budgeted", k=--max-k)` with ONE planner kept across the prompts (as a server keeps it), over
the target's cached cost grid (decode/batched/cost.py; measured first if absent). The best fixed k
differs by machine (k=1 on an AVX2 EPYC at fp32, k=2 on native-bf16 CPUs: BENCHMARKS.md), so the
question is whether budgeted matches the best of them without being told. Prints tokens/s and
speedup per mode, the depths budgeted chose, and what its planner learnt; writes
<out>/budgeted_depth.json. Every output is checked against plain decoding (lossless).
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.budgeted_depth", description=__doc__)
    p.add_argument("--ckpt", required=True, help="a trained drafter: run dir, checkpoint or export")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2], help="fixed chain lengths")
    p.add_argument("--max-k", type=int, default=3, help="budgeted: the deepest draft it may ask")
    p.add_argument("--limit", type=int, default=10, help="MT-bench prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="the target's dtype (auto: bf16 where native)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = the target policy: idle cores)")
    p.add_argument("--out", default="runs/bench/budgeted_depth")
    args = p.parse_args(argv)
    from benchmarks.decode_speed import load_drafters, modes_markdown, run_modes
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.batched.cost import cost_curve
    from specdistill.decode.batched.planner import new_planner
    from specdistill.decode.batched.spec import generate_batch
    from specdistill.decode.metrics import RunMetrics
    from specdistill.decode.spec import generate
    from specdistill.target.model import TargetConfig, load_target

    target = load_target(TargetConfig(path="packaged:smollm2", dtype=args.dtype,
                                      threads=args.threads))
    (_, drafter), = load_drafters(target, [args.ckpt], ["target"])
    planner = new_planner(cost_curve(target), args.max_k, drafter)
    n = args.max_new_tokens
    modes = {"plain (ours)": lambda ids: generate(target, None, ids, max_new_tokens=n)}
    for k in args.ks:
        modes[f"k={k}"] = lambda ids, k=k: generate(target, drafter, ids, max_new_tokens=n, k=k)
    depths: collections.Counter = collections.Counter()

    def budgeted(ids):
        out = generate_batch(target, drafter, [ids], max_new_tokens=n, batch_size=1,
                             k=args.max_k, mode="budgeted", planner=planner)
        depths.update(out.depths)
        return out.results[0]
    modes[f"budgeted (k <= {args.max_k})"] = budgeted
    prompts = load_prompts("mtbench", limit=args.limit)
    dn = str(target.dtype_choice.dtype)
    results, mismatch, _ = run_modes({dn: target}, {dn: modes}, prompts, target)
    metrics = {key: RunMetrics.from_results(rs) for key, rs in results.items()}
    table = modes_markdown(metrics, mismatch, dn)
    print(f"\n{dn}, {torch.get_num_threads()} threads, {len(prompts)} MT-bench prompts x {n} new "
          f"tokens, modes interleaved prompt by prompt\n\n" + "\n".join(table))
    learnt = {"depths": dict(sorted(depths.items())), "survival": planner.survival(),
              "verify_ratio": {f"{b}x{q}": v for (b, q), v in sorted(planner.verify_ratio.items())},
              "verify_n": {f"{b}x{q}": v for (b, q), v in sorted(planner.verify_n.items())}}
    print(f"\nbudgeted: rounds per depth {learnt['depths']}; S = "
          f"{[round(x, 3) for x in learnt['survival']]}; measured / grid per (B x Q) "
          f"{ {k: round(v, 3) for k, v in learnt['verify_ratio'].items()} }")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "budgeted_depth.json").write_text(json.dumps(
        {"args": vars(args), "table": table, "planner": learnt,
         "modes": {m: {**vars(r), "mismatches": mismatch[(d, m)]} for (d, m), r in metrics.items()}},
        indent=1))


if __name__ == "__main__":
    main()
