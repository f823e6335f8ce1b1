"""Benchmark of issue 5: small_lm drafters built from the target, by size, divergence and data.

    python -m train.bench_small_lm --out runs/bench_small_lm            # the full grid (CPU: hours)
    python -m train.bench_small_lm --tiny --steps 2 --out /tmp/bench    # seconds: checks the script

Grid: drafter layers (2, 4) x divergence (forward_kl, reverse_kl, jsd, tv) x data (fixed
ShareGPT, or with on-policy drafter continuations mixed in at --on-policy-fraction), every run on
the same budget (optimizer steps x batch size; an on-policy micro-batch counts as one micro-batch).
Each run is `python -m train`'s recipe: training, the simulated eval, then its final eval, the real
decoder on MT-bench greedy with chain k=4 vs plain decoding interleaved prompt by prompt (tau and
wall-clock speedup); then the same best drafter at temperature 1 (speculative sampling).

Writes <out>/<run>/ (each run's dir), <out>/results.jsonl (one line per finished run; a rerun
skips finished runs and resumes unfinished ones from their checkpoints) and <out>/table.md, which
is also printed. Extra Hydra overrides for every run: --set key=value (repeatable).
"""
from __future__ import annotations

import argparse
import json
import time
from itertools import product
from pathlib import Path

TINY = ["target=tiny", "data=sharegpt", "data.max_conversations=24", "data.max_length=128",
        "trainer=smoke", "trainer.eval_conversations=2"]  # seconds, random-init target


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    import train.__main__  # noqa: F401  (stores the train schemas)

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def run_one(name: str, overrides: list[str], run_dir: Path, args) -> dict:
    """Train one drafter with the recipe, evaluate it greedy (final eval) and at temperature 1."""
    from decode.evaluate import evaluate_drafter
    from drafters.base import load_drafter
    from drafters.sampling import SamplingParams
    from train.recipe import DistillRecipe

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


def table(rows: list[dict], k: int) -> str:
    """One markdown table over every run, then the winners and the issue's goal."""
    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    lines = [f"| layers | divergence | data | steps x batch | sim tau | tau greedy k={k} | speedup "
             f"| identical | tau T=1 | speedup T=1 | train min |",
             "|---:|---|---|---:|---:|---:|---:|:---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["layers"], r["loss"], r["on_policy"])):
        data = f"on-policy {r['on_policy']:g}" if r["on_policy"] else "fixed"
        lines.append(f"| {r['layers']} | {r['loss']} | {data} | {r['steps']} x {r['batch_size']} | "
                     f"{f(r['sim_tau'])} | {f(r['tau'])} | {f(r['speedup'], '.2f')}x | "
                     f"{r['identical']} | {f(r['tau_t1'])} | {f(r['speedup_t1'], '.2f')}x | "
                     f"{r['train_s'] / 60:.1f} |")
    if rows:
        g = max(rows, key=lambda r: r["tau"])
        s = max(rows, key=lambda r: r["tau_t1"])
        met = g["tau"] >= 3.0 and (g["speedup"] or 0) > 1.3
        lines += ["", f"Best greedy: {g['run']} (tau {g['tau']:.3f}, {f(g['speedup'], '.2f')}x); "
                  f"best at temperature 1: {s['run']} (tau {s['tau_t1']:.3f}).",
                  f"Goal tau >= 3.0 with k={k} and speedup > 1.3x: {'met' if met else 'not met'}."]
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
    ap.add_argument("--tiny", action="store_true", help="random-init tiny target: checks the script")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Hydra override for every run (repeatable)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {json.loads(l)["run"]: json.loads(l) for l in results.read_text().splitlines()
            if l.strip()} if results.is_file() else {}
    for layers, loss, frac in product(args.layers, args.losses, [0.0, args.on_policy_fraction]):
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
        with open(results, "a") as fh:
            fh.write(json.dumps(done[name]) + "\n")
    md = table(list(done.values()), args.k)
    (out / "table.md").write_text(md + "\n")
    print(md)
    return list(done.values())


if __name__ == "__main__":
    main()
