"""Training-time-test attention at a step j > 1 alone: an eager softmax over (Q x T) scores (what
drafters/parts/attention.py `ttt_attention` computed before) vs its fused form (one
scaled_dot_product_attention per chunk of anchors), forward + backward, the two interleaved.

    python -m benchmarks.ttt_attention                        # the shapes below, 1 thread
    python -m benchmarks.ttt_attention --threads 2 --rounds 9

Shapes (SmolLM2's drafter layer: 9 query heads, 3 key/value heads, head dim 64):
  on-policy  the on-policy phase's second draft: one row, its ~600 answer anchors over T = 1024
  ttt-2      EAGLE-3's training-time test, step 2 over a whole batch (4 x 1024)
  ttt-4      the same at step 4 (three own keys per anchor; ttt_length 7 runs steps 2..7)
Per shape and mode: the median forward + backward seconds and the peak anonymous memory over the
call's floor (/proc/self/status RssAnon sampled every 2 ms: the kept scores show there), and the
largest difference between the two in output and gradients. Writes <out>/ttt_attention.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.step_memory import PhasePeaks, rss_anon_mb

SHAPES = {"on-policy": (1, 600, 1024, 1), "ttt-2": (4, 1024, 1024, 1), "ttt-4": (4, 1024, 1024, 3)}
HEADS, KV, DIM = 9, 3, 64


def eager(q, k, v, steps, causal):
    """The eager step j > 1: softmax over [step 1's scores, masked; the own keys' dot products]."""
    steps.append((k, v))
    rep, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    k0, v0 = (t.repeat_interleave(rep, dim=1) for t in steps[0])
    s0 = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal, torch.finfo(q.dtype).min)
    kd = torch.stack([kj.repeat_interleave(rep, dim=1) for kj, _ in steps[1:]], dim=-2)
    vd = torch.stack([vj.repeat_interleave(rep, dim=1) for _, vj in steps[1:]], dim=-2)
    p = torch.cat([s0, (q.unsqueeze(-2) * kd).sum(-1) * scale], dim=-1).softmax(-1)
    T = s0.shape[-1]
    return p[..., :T] @ v0 + (p[..., T:, None] * vd).sum(-2)


def inputs(shape, seed: int = 0):
    B, Q, T, own = shape
    g = torch.Generator().manual_seed(seed)
    k0, v0 = (torch.randn(B, KV, T, DIM, generator=g) for _ in range(2))
    mine = [tuple(torch.randn(B, KV, Q, DIM, generator=g) for _ in range(2)) for _ in range(own)]
    q = torch.randn(B, HEADS, Q, DIM, generator=g)
    anchors = torch.sort(torch.randperm(T, generator=g)[:Q]).values  # (Q,) distinct anchors
    causal = (torch.arange(T)[None] <= anchors[:, None])[None, None].expand(B, 1, Q, T)
    return q, k0, v0, mine, causal


def run(fn, args, peaks: PhasePeaks):
    """(seconds, MB over the floor, output, gradients) of forward + backward on fresh leaves."""
    q, k0, v0, mine, causal = (x.clone().requires_grad_() if isinstance(x, torch.Tensor) and
                               x.dtype.is_floating_point else x for x in args)
    mine = [tuple(t.clone().requires_grad_() for t in kv) for kv in mine]
    leaves = [q, k0, v0, *(t for kv in mine for t in kv)]
    time.sleep(0.02)
    floor = rss_anon_mb()
    peaks.peaks, peaks.phase = {}, "call"
    t0 = time.perf_counter()
    out = fn(q, *mine[-1], [(k0, v0), *mine[:-1]], causal)
    grads = torch.autograd.grad(out.pow(2).sum(), leaves)
    seconds = time.perf_counter() - t0
    time.sleep(0.01)
    peaks.phase = "idle"
    return seconds, peaks.peaks.get("call", floor) - floor, out.detach(), grads


def main(argv=None) -> None:
    from specdistill.drafters.parts.attention import ttt_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/ttt_attention"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    peaks = PhasePeaks(every=0.002)
    modes = {"eager": eager, "fused": ttt_attention}
    rows = []
    for name, shape in SHAPES.items():
        data = inputs(shape)
        got = {m: {"s": [], "mb": []} for m in modes}
        outs = {}
        for r in range(args.rounds + 1):  # round 0 warms up; the modes alternate
            for m in (modes if r % 2 == 0 else reversed(list(modes))):
                s, mb, out, grads = run(modes[m], data, peaks)
                outs[m] = (out, grads)
                if r:
                    got[m]["s"].append(s)
                    got[m]["mb"].append(mb)
        diff = max(float((a - b).abs().max()) for a, b in zip((outs["eager"][0], *outs["eager"][1]),
                                                              (outs["fused"][0], *outs["fused"][1])))
        row = {"shape": name, "B, Q, T, own keys": shape, "max_abs_diff": diff,
               **{f"{m}_s": statistics.median(got[m]["s"]) for m in modes},
               **{f"{m}_mb": max(got[m]["mb"]) for m in modes}}
        rows.append(row)
    lines = ["| shape (B, Q, T, own keys) | eager s | fused s | fused / eager | eager MB | fused MB | "
             "largest difference |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} {tuple(r['B, Q, T, own keys'])} | {r['eager_s']:.3f} | "
                     f"{r['fused_s']:.3f} | {r['fused_s'] / r['eager_s']:.2f}x | +{r['eager_mb']:.0f} | "
                     f"+{r['fused_mb']:.0f} | {r['max_abs_diff']:.1e} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttt_attention.json").write_text(json.dumps(
        {"threads": args.threads, "rounds": args.rounds, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
