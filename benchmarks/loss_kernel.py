"""The distillation loss alone: forward_kl through autograd on the plain formula vs its own backward
(train/losses.py `_ForwardKL`), forward + backward of one prediction, the two interleaved.

    python -m benchmarks.loss_kernel                         # 2,600 x 8,192 fp32, 2 threads
    python -m benchmarks.loss_kernel --rows 3300 --vocab 49152 --dtype bfloat16

Rows are the positions a step's loss counts (~3,200 on the default data), vocab the draft
vocabulary (8,192 pruned; 49,152 = SmolLM2's full head, the engines' layout). Prints a table and
writes <out>/loss_kernel.json (medians after --warmup rounds, and the largest differences between
the two in loss value and gradient).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def plain_forward_kl(draft_logits, target_logits, temperature=1.0):
    """KL(p || q) through autograd on the formula: what forward_kl computed before its backward."""
    from specdistill.train.losses import LOG_FLOOR

    log_q = F.log_softmax(draft_logits.float() / temperature, dim=-1).clamp_min(LOG_FLOOR)
    log_p = F.log_softmax(target_logits.float() / temperature, dim=-1).clamp_min(LOG_FLOOR)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def timed(fn, z0: torch.Tensor, target: torch.Tensor) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """(forward s, backward s, loss (N,), gradient) of fn on a fresh leaf copy of z0."""
    z = z0.clone().requires_grad_()
    t0 = time.perf_counter()
    loss = fn(z, target)
    t1 = time.perf_counter()
    (loss.sum() / len(loss)).backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, loss.detach(), z.grad


def main(argv=None) -> None:
    from specdistill.train.losses import forward_kl

    p = argparse.ArgumentParser(prog="python -m benchmarks.loss_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2600)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench/loss_kernel")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    z0 = (3 * torch.randn(a.rows, a.vocab, generator=g)).to(getattr(torch, a.dtype))
    target = 3 * torch.randn(a.rows, a.vocab, generator=g)
    modes = {"autograd": plain_forward_kl, "own_backward": forward_kl}
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    last = {}
    for r in range(a.rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))  # A B, then B A
        for m in order:
            fwd, bwd, loss, grad = timed(modes[m], z0, target)
            last[m] = (loss, grad)
            if r >= a.warmup:
                times[m].append((fwd, bwd))
    rows = {m: {"forward_s": statistics.median(f for f, _ in t),
                "backward_s": statistics.median(b for _, b in t),
                "total_s": statistics.median(f + b for f, b in t)} for m, t in times.items()}
    diff = {"loss": float((last["autograd"][0] - last["own_backward"][0]).abs().max()),
            "grad": float((last["autograd"][1].float() - last["own_backward"][1].float()).abs().max())}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": a.rows,
              "vocab": a.vocab, "dtype": a.dtype, "threads": a.threads, "modes": rows, "max_diff": diff}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_kernel.json").write_text(json.dumps(result, indent=1))
    print(f"forward_kl, {a.rows} x {a.vocab} {a.dtype}, {a.threads} threads, "
          f"medians of {a.rounds - a.warmup} interleaved rounds")
    print("| mode | forward s | backward s | total s |\n|---|---:|---:|---:|")
    for m, x in rows.items():
        print(f"| {m} | {x['forward_s']:.3f} | {x['backward_s']:.3f} | {x['total_s']:.3f} |")
    print(f"largest difference: loss {diff['loss']:.2e}, gradient {diff['grad']:.2e}")


if __name__ == "__main__":
    main()
