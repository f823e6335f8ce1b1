"""Benchmark: small_lm drafters built from the target, by size, divergence and data.

    python -m benchmarks.small_lm_study --out runs/bench_small_lm            # the full grid (CPU: hours)
    python -m benchmarks.small_lm_study --tiny --steps 2 --out /tmp/bench    # seconds: checks the script

Grid: drafter layers (2, 4) x divergence (forward_kl, reverse_kl, jsd, tv) x data (fixed
ShareGPT, or with on-policy drafter continuations mixed in at --on-policy-fraction), every run on
the same budget (optimizer steps x batch size; an on-policy micro-batch counts as one micro-batch).
Each run is `python -m train`'s recipe: training, the simulated eval, then its final eval, the real
decoder on MT-bench greedy with chain k=4 vs plain decoding interleaved prompt by prompt (tau and
wall-clock speedup); then the same best drafter at temperature 1 (speculative sampling).

The real-decoder evals above are small (their tau has a standard error of ~0.02 on 10 prompts),
so every run's best drafter is also scored by the greedy replay (decode/replay.py): the decoder's
exact rounds on the target's greedy answers to --replay-prompts MT-bench prompts (generated once,
kept in <out>/replay_answers_<N>x<M>.json), with no target verification, and the mean per-draft
acceptance sum_x min(p, q) at temperature 1 on the first --alpha-prompts of those answers.

Writes <out>/<run>/ (each run's dir), <out>/results.jsonl (one line per finished run; a rerun
skips finished runs and resumes unfinished ones from their checkpoints), <out>/replay.jsonl (one
line per replayed run) and <out>/table.md, which is also printed. Extra Hydra overrides for every
run: --set key=value (repeatable).
"""
from __future__ import annotations

import argparse
import time
from itertools import product
from pathlib import Path

from benchmarks.replaying import (
    TINY,
    append_row,
    compose,
    paired_gap,
    read_rows,
    replay_checkpoints,
    replay_run,
    target_and_answers,
)


def run_one(name: str, overrides: list[str], run_dir: Path, args) -> dict:
    """Train one drafter with the recipe, evaluate it greedy (final eval) and at temperature 1."""
    from specdistill.decode.evaluate import evaluate_drafter
    from specdistill.drafters.parts.sampling import SamplingParams
    from specdistill.store.drafter import load_drafter
    from specdistill.train.recipe import DistillRecipe

    resume = (run_dir / "checkpoints").is_dir()
    cfg = compose(overrides + [f"run_dir={run_dir}", f"resume={str(resume).lower()}"])
    t0 = time.perf_counter()
    recipe = DistillRecipe(cfg)
    recipe.setup()
    recipe.train()
    train_s = time.perf_counter() - t0
    greedy = recipe.final_eval()["summary"]
    best = run_dir / "best"
    drafter = (load_drafter(best, recipe.target) if best.is_dir() else recipe.drafter).eval()
    sampled = evaluate_drafter(recipe.target, drafter, eval_kind="mtbench", limit=args.limit,
                               max_new_tokens=args.max_new_tokens, k=args.k,
                               sampling=SamplingParams(temperature=1.0), seed=cfg.seed,
                               out_dir=run_dir / "final_eval_t1")["summary"]
    recipe.cleanup()
    sim = getattr(recipe, "last_eval", {}) or {}
    return {"run": name, "layers": cfg.drafter.num_layers, "loss": cfg.trainer.loss,
            "on_policy": cfg.trainer.on_policy_fraction, "steps": cfg.trainer.max_steps,
            "batch_size": cfg.trainer.batch_size, "train_s": train_s, "sim_tau": sim.get("sim_tau"),
            "tau": greedy["tau"], "speedup": greedy.get("speedup"),
            "identical": greedy.get("outputs_identical_to_plain"), "tau_t1": sampled["tau"],
            "speedup_t1": sampled.get("speedup"), "run_dir": str(run_dir)}


def table(rows: list[dict], k: int, replays: dict[str, dict] | None = None) -> str:
    """One markdown table over every run, then the winners and the issue's goal."""
    replays = replays or {}

    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    def rep(run, key):
        r = replays.get(run)
        return "-" if r is None else f"{r[key]:.3f} ± {r[key + '_se']:.3f}"

    lines = [f"| layers | divergence | data | steps x batch | sim tau | tau greedy k={k} | speedup "
             f"| identical | tau T=1 | speedup T=1 | replay tau k={k} | alpha T=1 | train min |",
             "|---:|---|---|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["layers"], r["loss"], r["on_policy"])):
        data = f"on-policy {r['on_policy']:g}" if r["on_policy"] else "fixed"
        lines.append(f"| {r['layers']} | {r['loss']} | {data} | {r['steps']} x {r['batch_size']} | "
                     f"{f(r['sim_tau'])} | {f(r['tau'])} | {f(r['speedup'], '.2f')}x | "
                     f"{r['identical']} | {f(r['tau_t1'])} | {f(r['speedup_t1'], '.2f')}x | "
                     f"{rep(r['run'], 'replay_tau')} | {rep(r['run'], 'alpha_t1')} | "
                     f"{r['train_s'] / 60:.1f} |")
    if rows:
        g = max(rows, key=lambda r: r["tau"] or 0.0)  # None: not measured
        s = max(rows, key=lambda r: r["tau_t1"] or 0.0)
        met = (g["tau"] or 0.0) >= 3.0 and (g["speedup"] or 0) > 1.3
        lines += ["", f"Best greedy (real decoder): {g['run']} (tau {f(g['tau'])}, "
                  f"{f(g['speedup'], '.2f')}x); best at temperature 1: {s['run']} "
                  f"(tau {f(s['tau_t1'])})."]
        if replays:
            rg = max(replays.values(), key=lambda r: r["replay_tau"])
            ra = max(replays.values(), key=lambda r: r["alpha_t1"])
            one = next(iter(replays.values()))
            lines.append(f"Best greedy replay ({one['replay_prompts']} prompts x "
                         f"{one['replay_tokens']} tokens, ± = standard error over prompts): "
                         f"{rg['run']} (tau {rg['replay_tau']:.3f} ± {rg['replay_tau_se']:.3f}); "
                         f"best per-draft acceptance at T=1: {ra['run']} "
                         f"({ra['alpha_t1']:.3f} ± {ra['alpha_t1_se']:.3f}).")
            for best, which in ((rg, "tau"), (ra, "alpha")):
                gaps = [(o["run"], *paired_gap(best, o, which)) for o in replays.values()
                        if o is not best]
                if gaps:
                    lines.append(f"Paired gaps of {best['run']} ({which}, same prompts): " + ", ".join(
                        f"{name} -{d:.3f} ± {se:.3f}" for name, d, se in sorted(gaps, key=lambda g: g[1])))
        lines.append(f"Goal tau >= 3.0 with k={k} and speedup > 1.3x: "
                     f"{'met' if met else 'not met'}.")
    return "\n".join(lines)


def replay_all(runs: list[dict], args, out: Path) -> dict[str, dict]:
    """Replay every finished run once (kept in <out>/replay.jsonl; a rerun replays only new runs
    or runs whose replay settings changed)."""
    path = out / "replay.jsonl"
    done = read_rows(path, args)
    todo = [r for r in runs if r["run"] not in done]
    if todo:
        target, answers = target_and_answers(args, out)
        for run in todo:
            print(f"== replay {run['run']}", flush=True)
            done[run["run"]] = replay_run(target, run["run"], Path(run["run_dir"]) / "best",
                                          answers, args)
            append_row(path, done[run["run"]])
    return {r["run"]: done[r["run"]] for r in runs if r["run"] in done}


def init_divergence(target, layer_sets: list[list[int]], answers: list[dict]) -> str:
    """How close untrained drafters built from chosen target layers start: forward KL(target ||
    drafter) and top-1 agreement at every answer position of `answers`, teacher-forced."""
    import torch

    from specdistill.drafters.small_lm import SmallLm, SmallLmConfig
    from specdistill.train.losses import forward_kl, greedy_accept

    lines = ["| target layers | forward KL (nats) | top-1 agreement |", "|---|---:|---:|"]
    for layers in layer_sets:
        drafter = SmallLm(SmallLmConfig(layers=layers), target).eval()
        kl = agree = n = 0.0
        with torch.inference_mode():
            for row in answers:
                P, ids = len(row["prompt"]), torch.tensor(row["prompt"] + row["answer"])
                sl = slice(P - 1, len(ids) - 1)  # positions whose next token is an answer token
                p = target.forward(ids[None]).logits[0, sl].float()  # (N, V)
                q = drafter.logits(ids[None].to(target.device))[0, sl].float()  # (N, V)
                kl += float(forward_kl(q, p).sum())
                agree += float(greedy_accept(q, p).sum())
                n += p.shape[0]
        lines.append(f"| {layers} | {kl / n:.2f} | {agree / n:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/bench_small_lm", help="folder of the runs and results")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4], help="drafter.num_layers")
    ap.add_argument("--losses", nargs="+", default=["forward_kl", "reverse_kl", "jsd", "tv"])
    ap.add_argument("--on-policy-fraction", type=float, default=0.5, help="the on-policy arm's share")
    ap.add_argument("--steps", type=int, default=1500, help="optimizer steps of every run")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--limit", type=int, default=20, help="MT-bench prompts of each eval")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="draft length (chain)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay-prompts", type=int, default=80,
                    help="MT-bench prompts of the greedy replay (0 = no replay)")
    ap.add_argument("--replay-tokens", type=int, default=128, help="answer length of the replay")
    ap.add_argument("--alpha-prompts", type=int, default=20,
                    help="replay answers on which the T=1 per-draft acceptance is measured")
    ap.add_argument("--only-replay", action="store_true",
                    help="train nothing: replay the finished runs of results.jsonl")
    ap.add_argument("--tiny", action="store_true", help="random-init tiny target: checks the script")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Hydra override for every run (repeatable)")
    ap.add_argument("--replay-checkpoints", metavar="RUN_DIR",
                    help="train nothing: replay every checkpoint of this training run")
    ap.add_argument("--init-layers", nargs="+", metavar="I,J,...",
                    help="train nothing: forward KL and top-1 agreement of untrained drafters "
                         "built from these target layer sets, on the replay answers")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.init_layers:
        target, answers = target_and_answers(args, out)
        md = init_divergence(target, [[int(i) for i in x.split(",")] for x in args.init_layers],
                             answers)
        print(md)
        return []
    if args.replay_checkpoints:
        md = replay_checkpoints(Path(args.replay_checkpoints), args, out)
        print(md)
        return []
    results = out / "results.jsonl"
    done = read_rows(results)
    grid = [] if args.only_replay else list(
        product(args.layers, args.losses, [0.0, args.on_policy_fraction]))
    for layers, loss, frac in grid:
        name = f"L{layers}-{loss}-{'onpolicy' if frac else 'fixed'}"
        if name in done:
            continue
        overrides = (TINY if args.tiny else []) + [
            "drafter=small_lm", f"drafter.num_layers={layers}", f"trainer.loss={loss}",
            f"trainer.on_policy_fraction={frac}", f"trainer.max_steps={args.steps}",
            f"trainer.batch_size={args.batch_size}", f"trainer.eval_k={args.k}",
            "trainer.final_eval=mtbench", f"trainer.final_eval_limit={args.limit}",
            f"trainer.final_eval_max_new_tokens={args.max_new_tokens}", f"seed={args.seed}",
            *args.set]
        print(f"== {name}", flush=True)
        done[name] = run_one(name, overrides, out / name, args)
        append_row(results, done[name])
    replays = replay_all(list(done.values()), args, out) if args.replay_prompts else {}
    md = table(list(done.values()), args.k, replays)
    (out / "table.md").write_text(md + "\n")
    print(md)
    return list(done.values())


if __name__ == "__main__":
    main()
