"""Two parts of the default job, before and after a change, interleaved on the same inputs.

    python -m benchmarks.job_parts --features-dir <the job's capture> --ckpt <run>/best

A trained drafter (--ckpt) on the default job's data. Writes <out>/job_parts.json, prints tables.

1. The on-policy phase's scoring. The drafter (the share of its drafts that equal the real tokens
   is what replaying saves, so an untrained one measures nothing) drafts on its own tokens over
   --batches of the job's micro-batches (arm e3_op0_r1: one scored row, every answer anchor). On
   each, train/on_policy_heads.py score_own_drafts runs twice, in alternating order:
     A  every scored anchor through the target's forward (the code before replaying),
     B  anchors whose drafts are the real tokens take the batch's teacher (`replayed`).
   Also how far A's and B's teachers are apart on the replayed rows (the scoring forward's bf16
   against the capture's stored features).
2. The held-out eval's target forward (decode/simulate.py), over the job's held-out conversations,
   --eval-rounds times, alternating: A the LM head at every position, B only at the 8 sampled
   ones; the accepted counts of the whole eval must not change.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def score(oph, r, batch, preds, replay: bool) -> tuple[float, list[torch.Tensor], torch.Tensor]:
    """(seconds, the teachers, the replayed anchors) of one score_own_drafts call."""
    for p in preds[1:]:
        p.teacher = None
    keep = oph.replayed
    if not replay:
        oph.replayed = lambda batch, drafted, at: torch.zeros_like(at.cpu())
    try:
        t0 = time.perf_counter()
        oph.score_own_drafts(r.target, batch, preds, getattr(r.drafter, "d2t", None),
                             r.tcfg.capture_autocast)
        dt = time.perf_counter() - t0
    finally:
        oph.replayed = keep
    drafted = torch.stack([p.inputs for p in preds[1:]], dim=-1).cpu()
    known = oph.replayed(batch, drafted, preds[1].scored.cpu())[preds[1].scored.cpu()] if replay \
        else None
    return dt, [p.teacher.clone() for p in preds[1:]], known


def scoring_ab(r, batches: int) -> dict:
    """Part 1 (module docstring): score_own_drafts without (A) and with (B) replayed anchors."""
    import specdistill.train.on_policy_heads as oph
    from specdistill.train.teacher import train_batch

    d2t = getattr(r.drafter, "d2t", None)
    rows = []
    for i in range(batches + 1):
        raw = next(r.batches)
        feats, final = r.target_outputs(raw)
        batch = train_batch(raw, feats, r.target, final, d2t, r.backend.device, r.drafter)
        gen = oph.anchor_generator(0, i, 0, 0)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                             enabled=r.tcfg.precision == "bf16"):
            preds = oph.own_drafts(r.model, batch, r.tcfg, r.tcfg.on_policy_heads_depth, gen)
            runs = {}
            for replay in ((False, True) if i % 2 == 0 else (True, False)):  # A B, then B A
                runs[replay] = score(oph, r, batch, preds, replay)
        if i == 0:
            continue  # warm-up
        (ta, teach_a, _), (tb, teach_b, known) = runs[False], runs[True]
        diff = max((float((a[known] - b[known]).abs().max()) if known.any() else 0.0)
                   for a, b in zip(teach_a, teach_b))
        same_top = min((float((a[known].argmax(-1) == b[known].argmax(-1)).float().mean())
                        if known.any() else 1.0) for a, b in zip(teach_a, teach_b))
        rows.append({"anchors": int(known.numel()), "replayed": int(known.sum()), "a_s": ta,
                     "b_s": tb, "max_abs_logit_diff": diff, "same_argmax": same_top})
        print(f"scoring, batch {i}: {rows[-1]}", flush=True)
    a, b = [x["a_s"] for x in rows], [x["b_s"] for x in rows]
    return {"batches": rows, "replayed_share": sum(x["replayed"] for x in rows) / max(
        1, sum(x["anchors"] for x in rows)), "median_a_s": statistics.median(a),
        "median_b_s": statistics.median(b), "sum_a_s": sum(a), "sum_b_s": sum(b)}


def full_head(target):
    """target.forward with the LM head at every position whatever logits_to_keep says (the eval
    before the change), handing back the kept positions' rows."""
    plain = target.forward

    def forward(ids, *, logits_to_keep=0, **kw):
        out = plain(ids, **kw)
        if torch.is_tensor(logits_to_keep):
            out.logits = out.logits[:, logits_to_keep.to(out.logits.device)]
        return out
    return forward


def eval_ab(r, rounds: int) -> dict:
    """Part 2 (module docstring): the held-out eval with the LM head everywhere (A) or only at
    the sampled positions (B); their results must be the same."""
    from specdistill.decode.simulate import simulate_acceptance

    convs = r.eval_ds.select(range(min(r.tcfg.eval_conversations, len(r.eval_ds))))
    times, results = {False: [], True: []}, {}
    for i in range(rounds):
        for picked in ((False, True) if i % 2 == 0 else (True, False)):
            if not picked:
                r.target.forward = full_head(r.target)
            try:
                t0 = time.perf_counter()
                results[picked] = simulate_acceptance(r.target, r.drafter, convs, k=r.tcfg.eval_k,
                                                      positions=8)
                times[picked].append(time.perf_counter() - t0)
            finally:
                vars(r.target).pop("forward", None)
            print(f"eval, round {i}, {'B' if picked else 'A'}: {times[picked][-1]:.1f} s, sim tau "
                  f"{results[picked]['sim_tau']}", flush=True)
    return {"conversations": len(convs), "a_s": times[False], "b_s": times[True],
            "sim_tau_a": results[False]["sim_tau"], "sim_tau_b": results[True]["sim_tau"],
            "same_result": results[False] == results[True]}


def main(argv=None) -> None:
    from specdistill.train.memory import large_tensors_in_huge_pages

    large_tensors_in_huge_pages()  # as the job does
    from benchmarks.recipe_study import arm_overrides
    from benchmarks.replaying import compose
    from specdistill.store.drafter import load_drafter
    from specdistill.train.recipe import DistillRecipe

    p = argparse.ArgumentParser(prog="python -m benchmarks.job_parts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features-dir", required=True, help="the default job's capture")
    p.add_argument("--ckpt", required=True, help="a trained EAGLE-3 drafter folder (a run's best/)")
    p.add_argument("--batches", type=int, default=20, help="scored micro-batches (after 1 warm-up)")
    p.add_argument("--eval-rounds", type=int, default=4, help="held-out evals of each kind")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/bench/job_parts")
    args = p.parse_args(argv)
    args.seed, args.save_every, args.tiny, args.set = 0, 10**6, False, []
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = compose(arm_overrides(f"e3_op0_r1:{args.batches + 2}", args)
                  + [f"run_dir={out / 'run'}", "logger=jsonl", "resume=false"])
    r = DistillRecipe(cfg)
    r.setup()
    r.drafter.load_state_dict(load_drafter(args.ckpt, r.target).state_dict())
    r.drafter.eval()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
              "ckpt": str(args.ckpt)}
    result["eval"] = ev = eval_ab(r, args.eval_rounds) if args.eval_rounds else None
    result["scoring"] = sc = scoring_ab(r, args.batches) if args.batches else None
    r.cleanup()
    (out / "job_parts.json").write_text(json.dumps(result, indent=1))
    print("| part | A | B | B / A | |\n|---|---:|---:|---:|---|")
    if sc:
        print(f"| on-policy scoring, s a batch (median of {len(sc['batches'])}) | "
              f"{sc['median_a_s']:.3f} | {sc['median_b_s']:.3f} | {sc['sum_b_s'] / sc['sum_a_s']:.2f}x "
              f"| {100 * sc['replayed_share']:.0f}% of the anchors replayed; replayed teachers: max "
              f"abs logit diff {max(x['max_abs_logit_diff'] for x in sc['batches']):.3g}, same "
              f"argmax >= {min(x['same_argmax'] for x in sc['batches']):.3f} |")
    if ev:
        a, b = statistics.median(ev["a_s"]), statistics.median(ev["b_s"])
        print(f"| held-out eval, s (median of {len(ev['a_s'])}) | {a:.1f} | {b:.1f} | {b / a:.2f}x | "
              f"{ev['conversations']} conversations; sim tau {ev['sim_tau_a']} / {ev['sim_tau_b']}, "
              f"same result: {ev['same_result']} |")


if __name__ == "__main__":
    main()
