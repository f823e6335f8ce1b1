"""What a decode round costs where every op pays a fixed price (a GPU bound by kernel launches, a
slow host): aten ops dispatched per target forward and per draft call of a real greedy decode.

    python -m benchmarks.op_count --ckpt runs/train/<run> --k 3       # SmolLM2 + the drafter
    python -m benchmarks.op_count --tiny --drafter eagle3 --k 2        # seconds, random init

The ops are counted with a TorchDispatchMode around `SequenceState.forward` (the target's
verify and prefill forwards) and the drafter's `propose`, on the first prompts of MT-bench; the
first call of each is the prefill / the first round and is left out. Views and reshapes count too
(they launch no kernel but cost dispatch time on the host); `item` counts host syncs. At a
measured time per target forward, ops of a draft round x (forward time / forward ops) is what the
round costs if both are bound by per-op overhead.

Writes <out>/op_count.json and prints a table.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside the `with` block, by name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(target, drafter, prompts, k: int, max_new_tokens: int) -> dict:
    """{"forward": [Counter per call], "propose": [...]} over greedy decodes of `prompts` (token
    id tensors), first call of each decode left out."""
    from specdistill.decode import spec

    calls: dict[str, list] = {"forward": [], "propose": []}
    fwd, prop = spec.SequenceState.forward, type(drafter).propose

    def counted(name, fn):
        def wrapper(*a, **kw):
            with OpCounter() as c:
                out = fn(*a, **kw)
            calls[name].append(c.ops)
            return out
        return wrapper

    spec.SequenceState.forward = counted("forward", fwd)
    type(drafter).propose = counted("propose", prop)
    try:
        for ids in prompts:
            start = {n: len(v) for n, v in calls.items()}
            spec.generate(target, drafter, ids, max_new_tokens=max_new_tokens, k=k)
            for n, v in calls.items():  # the prefill / the first round of this decode: out
                if len(v) > start[n]:
                    del v[start[n]]
    finally:
        spec.SequenceState.forward, type(drafter).propose = fwd, prop
    return calls


def summary(calls: dict) -> dict:
    """Per call kind: calls, median ops and host syncs per call, the most frequent ops per call."""
    out = {}
    for name, rows in calls.items():
        if not rows:
            out[name] = {"calls": 0, "ops_median": None, "syncs_median": None, "top": {}}
            continue
        agg = sum(rows, collections.Counter())
        out[name] = {"calls": len(rows), "ops_median": statistics.median(sum(r.values()) for r in rows),
                     "syncs_median": statistics.median(r["item"] for r in rows),
                     "top": {o: round(n / len(rows), 1) for o, n in agg.most_common(12)}}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.op_count", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="a run dir, checkpoint or export folder (else a random drafter)")
    ap.add_argument("--drafter", default="eagle3", help="drafter name when no --ckpt")
    ap.add_argument("--k", type=int, default=2, help="chain draft length")
    ap.add_argument("--prompts", type=int, default=2, help="MT-bench first turns decoded")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--tiny", action="store_true", help="random-init tiny target: checks the script")
    ap.add_argument("--out", default="runs/op_count", help="folder of op_count.json")
    args = ap.parse_args(argv)
    import torch

    from benchmarks.replaying import TINY, compose
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.evaluate import render
    from specdistill.drafters.base import build_drafter
    from specdistill.export.folder import load_resolved
    from specdistill.store.rundir import resolve_drafter
    from specdistill.target.model import load_target

    torch.manual_seed(0)
    target = load_target(compose(TINY if args.tiny else []).target)
    drafter = (load_resolved(resolve_drafter(args.ckpt), target) if args.ckpt
               else build_drafter({"name": args.drafter}, target)).eval()
    prompts = [render(target, p.turns[:1], []) for p in load_prompts("mtbench", limit=args.prompts)]
    result = {"k": args.k, "drafter": drafter.name, "ckpt": args.ckpt, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens,
              **summary(count_ops(target, drafter, prompts, args.k, args.max_new_tokens))}
    f, p = result["forward"]["ops_median"], result["propose"]["ops_median"]
    result["round_over_forward"] = p / f if f and p is not None else None
    print(f"| call | calls | aten ops (median) | host syncs (median) |\n|---|---:|---:|---:|")
    for name in ("forward", "propose"):
        r = result[name]
        print(f"| {name} | {r['calls']} | {r['ops_median']} | {r['syncs_median']} |")
    print(f"draft round (k={args.k}) / target forward, in ops: {result['round_over_forward']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "op_count.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
