"""Where a training step's time goes, and how far it is from what the CPU can do (MFU).

    python -m benchmarks.step_profile --features-dir /data/feats_e3 --arms e3_ttt1 eagle
    python -m benchmarks.step_profile --tiny --arms e3_ttt1 --steps 2     # seconds
    python -m benchmarks.step_profile --arms eagle_fp32 eagle_bf16 --set trainer.features=online

1. The machine's bf16 (and fp32) matmul peak on --threads threads: the best of a few large square
   matmuls (--peak-size), the ceiling no training step can pass.
2. Per arm (benchmarks/recipe_study.py ARMS: the default job plus the arm's overrides, on one
   shared capture), --steps optimizer steps timed phase by phase: the batch (offline features read
   and padded), the target's logits over the draft vocabulary (the loss's teacher), the drafter's
   forward, the loss, the backward, the optimizer step. Arms are interleaved step by step, so load
   from other processes hits them alike.
3. The FLOPs of a step, counted by torch's FlopCounterMode on the step's real shapes (matmuls and
   attention, forward and backward), and the tokens: real (attention mask) and padded. MFU = step
   FLOPs / step seconds / the peak of the dtype the arm trains in (bf16, or fp32 where
   trainer.precision resolves to it); "useful" counts the real tokens' share only.

Writes <out>/step_profile.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PHASES = ("batch", "teacher", "forward", "score", "loss", "backward", "optimizer")


def matmul_peak(dtype: torch.dtype, size: int, repeats: int = 5, budget_s: float = 1.0) -> float:
    """GFLOP/s of the best of `repeats` (n x n) @ (n x n) matmuls in `dtype`, n = `size` or
    smaller where one would take over `budget_s` (torch's bf16 on a CPU without native bf16 runs
    ~0.3 GFLOP/s: one 2048^3 matmul would take a minute)."""
    def best(n: int, times: int) -> float:
        a, b = (torch.randn(n, n).to(dtype) for _ in range(2))
        a @ b  # warm-up
        t = float("inf")
        for _ in range(times):
            t0 = time.perf_counter()
            a @ b
            t = min(t, time.perf_counter() - t0)
        return t

    probe = min(size, 256)
    est = best(probe, 2) * (size / probe) ** 3
    while size > probe and est > budget_s:
        size, est = size // 2, est / 8
    return 2 * size**3 / best(size, repeats) / 1e9


def timed_step(r) -> dict[str, float]:
    """One optimizer step of recipe r (grad_accum 1), timed phase by phase (CPU: synchronous)."""
    from specdistill.train.losses import distill_loss
    from specdistill.train.on_policy_heads import anchor_generator, own_drafts, score_own_drafts

    t, tcfg = {}, r.tcfg
    r.model.train()
    from specdistill.train.teacher import train_batch

    t0 = time.perf_counter()
    raw = next(r.batches)
    feats, final = r.target_outputs(raw)  # offline: read and padded; online: the target's forward
    t1 = time.perf_counter()
    batch = train_batch(raw, feats, r.target, final, getattr(r.drafter, "d2t", None), r.backend.device,
                        r.drafter)
    t2 = time.perf_counter()  # the teacher: the target's logits where the loss reads them
    own = r.own_depth(r.step)  # the recipe's schedule: > 0 in its on-policy phase
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tcfg.precision == "bf16"):
        if own:
            preds = own_drafts(r.model, batch, tcfg, own, anchor_generator(0, r.step, 0, 0))
            t3 = time.perf_counter()
            score_own_drafts(r.target, batch, preds, getattr(r.drafter, "d2t", None),
                             tcfg.capture_autocast)
        else:
            preds = r.model(batch)
            t3 = time.perf_counter()
        t3s = time.perf_counter()
        loss, _ = distill_loss(preds, batch, divergence=tcfg.loss,
                               temperature=tcfg.loss_temperature, feature_weight=tcfg.feature_weight)
    t4 = time.perf_counter()
    loss.backward()
    t5 = time.perf_counter()
    r.backend.step(r.optimizer, r.params, tcfg.grad_clip)
    r.schedule.advance(r.step + 1)
    r.scheduler.step()
    r.step += 1
    t6 = time.perf_counter()
    t.update(batch=t1 - t0, teacher=t2 - t1, forward=t3 - t2, score=t3s - t3, loss=t4 - t3s,
             backward=t5 - t4, optimizer=t6 - t5)
    t["real_tokens"] = int(raw["attention_mask"].sum())
    t["padded_tokens"] = int(raw["attention_mask"].numel())
    return t


def step_flops(r) -> tuple[int, int]:
    """(FLOPs, padded tokens) of one more step: teacher logits, forward, backward, optimizer."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        t = timed_step(r)
    return fc.get_total_flops(), t["padded_tokens"]


def main(argv=None) -> None:
    from specdistill.train.memory import large_tensors_in_huge_pages

    large_tensors_in_huge_pages()  # as the job does; THP_MEM_ALLOC_ENABLE=0 measures without
    from benchmarks.recipe_study import ARMS, arm_overrides
    from benchmarks.replaying import compose
    from specdistill.train.recipe import DistillRecipe

    p = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=["e3_ttt1"], choices=sorted(ARMS))
    p.add_argument("--features-dir", default=None, help="an EAGLE-3 capture (layers 2, L//2, L-3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per arm (after 2 warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peak-size", type=int, default=2048)
    p.add_argument("--tiny", action="store_true", help="the tiny target (a quick look)")
    p.add_argument("--out", default="runs/bench/step_profile")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides for every arm")
    args = p.parse_args(argv)
    if not args.tiny and not args.features_dir and "trainer.features=online" not in args.set:
        p.error("--features-dir is needed (a `python -m specdistill.data.capture` folder), or --tiny, "
                "or --set trainer.features=online (the target's forward then is the batch phase)")
    args.seed, args.save_every = 0, 10**6
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peak = {"bfloat16": matmul_peak(torch.bfloat16, args.peak_size),
            "float32": matmul_peak(torch.float32, args.peak_size)}
    recipes = {}
    for name in args.arms:
        cfg = compose(arm_overrides(f"{name}:{args.steps + 3}", args)
                      + [f"run_dir={out / 'runs' / name}", "logger=jsonl", "resume=false"])
        recipes[name] = DistillRecipe(cfg)
        recipes[name].setup()
    times = {n: [] for n in recipes}
    for i in range(args.steps + 2):  # 2 warm-up steps, arms interleaved
        for name, r in recipes.items():
            t = timed_step(r)
            if i >= 2:
                times[name].append(t)
    rows = {}
    for name, r in recipes.items():
        counted, counted_tokens = step_flops(r)  # one more batch, scaled to the mean tokens
        tok = statistics.mean(t["padded_tokens"] for t in times[name])
        flops = counted / counted_tokens * tok
        med = {ph: statistics.median(t[ph] for t in times[name]) for ph in PHASES}
        step_s = sum(med.values())
        real = statistics.mean(t["real_tokens"] for t in times[name])
        dtype = "bfloat16" if r.tcfg.precision == "bf16" else "float32"  # the arm's (auto resolved)
        rows[name] = {"phases_s": med, "step_s": step_s, "real_tokens": real, "padded_tokens": tok,
                      "padding_share": 1 - real / tok, "flops_per_step": flops,
                      "gflops_per_s": flops / step_s / 1e9, "mfu_dtype": dtype,
                      "mfu": flops / step_s / 1e9 / peak[dtype],
                      "useful_mfu": flops * real / tok / step_s / 1e9 / peak[dtype],
                      "real_tokens_per_s": real / step_s}
        r.cleanup()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
              "peak_gflops": peak, "arms": rows}
    (out / "step_profile.json").write_text(json.dumps(result, indent=1))
    print(f"matmul peak ({args.threads} threads, n <= {args.peak_size}): bf16 {peak['bfloat16']:.0f} "
          f"GFLOP/s, fp32 {peak['float32']:.0f} GFLOP/s")
    head = ("| arm | step s | " + " | ".join(PHASES)
            + " | padding | GFLOP/s | MFU (of the peak of its dtype) | useful MFU |")
    lines = [head, "|---" * (len(PHASES) + 6) + "|"]
    for n, x in rows.items():
        ph = " | ".join(f"{x['phases_s'][p]:.3f}" for p in PHASES)
        lines.append(f"| {n} | {x['step_s']:.2f} | {ph} | {100 * x['padding_share']:.0f}% | "
                     f"{x['gflops_per_s']:.0f} | {100 * x['mfu']:.0f}% ({x['mfu_dtype']}) | "
                     f"{100 * x['useful_mfu']:.0f}% |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
