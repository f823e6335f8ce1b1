"""Benchmark of issue 5: small_lm drafters built from the target, by size, divergence and data.

    python -m train.benchmarks.small_lm --out runs/bench_small_lm            # the full grid (CPU: hours)
    python -m train.benchmarks.small_lm --tiny --steps 2 --out /tmp/bench    # seconds: checks the script

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
import json
import math
import os
import time
from itertools import product
from pathlib import Path

TINY = ["target=tiny", "data=sharegpt", "data.max_conversations=24", "data.max_length=128",
        "trainer=smoke", "trainer.eval_conversations=2"]  # seconds, random-init target


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    import train.__main__  # noqa: F401  (stores the train schemas)

    conf = Path(__file__).resolve().parents[2] / "conf"
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


def ratio_se(num: list[float], den: list[float]) -> tuple[float, float]:
    """sum(num) / sum(den) over prompts and its standard error with prompts as the independent
    units (rounds of one answer are not independent): the linearised cluster estimate."""
    n, total = len(num), sum(den)
    if n < 2 or total == 0:
        return (sum(num) / total if total else float("nan")), float("nan")
    r = sum(num) / total
    return r, math.sqrt(n / (n - 1) * sum((a - r * b) ** 2 for a, b in zip(num, den))) / total


def paired_gap(a: dict, b: dict, which: str) -> tuple[float, float]:
    """(a - b, its standard error) for which = "tau" | "alpha", paired prompt by prompt."""
    i, j = (1, 0) if which == "tau" else (2, 3)  # per_prompt rows: rounds, tokens, alpha sum, n
    pa, pb = a["per_prompt"], b["per_prompt"]
    n = min(len(pa), len(pb)) if which == "tau" else min(sum(1 for p in pa if p[3]), sum(
        1 for p in pb if p[3]))
    pa, pb = pa[:n], pb[:n]
    ra, rb = (sum(p[i] for p in x) / sum(p[j] for p in x) for x in (pa, pb))
    ta, tb = sum(p[j] for p in pa), sum(p[j] for p in pb)
    e = [(x[i] - ra * x[j]) / ta - (y[i] - rb * y[j]) / tb for x, y in zip(pa, pb)]
    return ra - rb, math.sqrt(n / (n - 1) * sum(v * v for v in e)) if n > 1 else float("nan")


def replay_answers(target, n_prompts: int, max_new_tokens: int, out: Path) -> list[dict]:
    """The target's greedy answers to the first n MT-bench prompts, generated once and kept."""
    from tqdm import tqdm

    from data.prompts import load_prompts
    from decode.evaluate import render
    from decode.spec import generate

    path = out / f"replay_answers_{n_prompts}x{max_new_tokens}.json"
    if path.is_file():
        kept = json.loads(path.read_text())
        if kept["target"] == target.source:
            return kept["rows"]
    rows = []
    for p in tqdm(load_prompts("mtbench", limit=n_prompts), desc="target answers"):
        ids = render(target, p.turns[:1], [])
        ans = generate(target, None, ids, max_new_tokens=max_new_tokens).tokens
        rows.append({"id": p.id, "prompt": ids.tolist(), "answer": ans.tolist()})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"target": target.source, "rows": rows}))
    os.replace(tmp, path)  # a crash never leaves half a file that a rerun would trust
    return rows


def target_and_answers(args, out: Path):
    """The benchmark's target (TINY or the --set overrides) and its kept replay answers."""
    from drafters.target import load_target

    target = load_target(compose((TINY if args.tiny else []) + args.set).target, training=True)
    return target, replay_answers(target, args.replay_prompts, args.replay_tokens, out)


def replay_run(target, name: str, folder: Path, answers: list[dict], args) -> dict:
    """Greedy replay tau (k = args.k) and mean per-draft acceptance at T=1 of the drafter saved in
    `folder` (a run's best/ or one of its checkpoints)."""
    import torch

    from decode.replay import draft_acceptance, replay_greedy
    from drafters.base import load_drafter
    from drafters.sampling import SamplingParams

    drafter = load_drafter(folder, target).eval()
    per_prompt = []  # [rounds, tokens committed in them (bonus included), sum alpha, positions]
    t1 = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(args.seed)
    for i, row in enumerate(answers):
        prompt, answer = torch.tensor(row["prompt"]), torch.tensor(row["answer"])
        rep = replay_greedy(target, drafter, prompt, answer, k=args.k,
                            max_new_tokens=args.replay_tokens)
        alpha = (draft_acceptance(target, drafter, prompt, answer, t1, gen)
                 if i < args.alpha_prompts else [])
        per_prompt.append([len(rep.accepted), sum(rep.accepted) + len(rep.accepted), sum(alpha),
                           len(alpha)])
    tau, tau_se = ratio_se([p[1] for p in per_prompt], [p[0] for p in per_prompt])
    a, a_se = ratio_se([p[2] for p in per_prompt if p[3]], [p[3] for p in per_prompt if p[3]])
    return {"run": name, "replay_prompts": len(answers), "replay_tokens": args.replay_tokens,
            "k": args.k, "rounds": sum(p[0] for p in per_prompt), "replay_tau": tau,
            "replay_tau_se": tau_se, "alpha_t1": a, "alpha_t1_se": a_se,
            "alpha_positions": sum(p[3] for p in per_prompt), "per_prompt": per_prompt}


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
        g = max(rows, key=lambda r: r["tau"])
        s = max(rows, key=lambda r: r["tau_t1"])
        met = g["tau"] >= 3.0 and (g["speedup"] or 0) > 1.3
        lines += ["", f"Best greedy (real decoder): {g['run']} (tau {g['tau']:.3f}, "
                  f"{f(g['speedup'], '.2f')}x); best at temperature 1: {s['run']} "
                  f"(tau {s['tau_t1']:.3f})."]
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


def read_rows(path: Path, args=None) -> dict[str, dict]:
    """run name -> row of a JSONL results file (empty when absent); with `args`, only rows made
    with the same replay settings (prompts, answer length, k)."""
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.is_file() else []
    if args is not None:
        key = (args.replay_prompts, args.replay_tokens, args.k)
        rows = [r for r in rows if (r["replay_prompts"], r["replay_tokens"], r["k"]) == key]
    return {r["run"]: r for r in rows}


def append_row(path: Path, row: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


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


def replay_checkpoints(run_dir: Path, args, out: Path) -> str:
    """Replay every complete checkpoint of one training run: acceptance against training steps.
    Appends to <out>/replay_checkpoints.jsonl (checkpoints replayed before with the same replay
    settings are skipped)."""
    from train.checkpoint import complete_checkpoints

    path = out / "replay_checkpoints.jsonl"
    done = read_rows(path, args)
    ckpts = complete_checkpoints(run_dir)
    if not ckpts:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint under checkpoints/")
    target, answers = None, None
    rows = []
    for ck in ckpts:
        name = f"{run_dir.name}@{ck.name}"
        if name not in done:
            if target is None:
                target, answers = target_and_answers(args, out)
            print(f"== replay {name}", flush=True)
            done[name] = replay_run(target, name, ck, answers, args)
            append_row(path, done[name])
        rows.append(done[name])
    lines = [f"| checkpoint | replay tau k={args.k} | alpha T=1 |", "|---|---:|---:|"]
    lines += [f"| {r['run']} | {r['replay_tau']:.3f} ± {r['replay_tau_se']:.3f} | "
              f"{r['alpha_t1']:.3f} ± {r['alpha_t1_se']:.3f} |" for r in rows]
    return "\n".join(lines)


def init_divergence(target, layer_sets: list[list[int]], answers: list[dict]) -> str:
    """How close untrained drafters built from chosen target layers start: forward KL(target ||
    drafter) and top-1 agreement at every answer position of `answers`, teacher-forced."""
    import torch

    from drafters.small_lm import SmallLm, SmallLmConfig
    from train.losses import forward_kl, greedy_accept

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
