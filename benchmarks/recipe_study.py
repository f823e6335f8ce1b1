"""Recipe study: which drafter and training recipe gives the most acceptance per minute
of the default job's budget on the embedded default (SmolLM2, ShareGPT, 2 CPU cores).

    python -m benchmarks.recipe_study --features-dir /data/feats_e3 --out runs/recipe \\
        --arms eagle e3_ttt1 e3_ttt2 --jobs 2 --threads 1       # train the arms, 2 at a time
    python -m benchmarks.recipe_study --out runs/recipe --curves e3_ttt2   # + a learning curve
    python -m benchmarks.recipe_study --tiny --out /tmp/recipe --arms eagle e3_ttt2   # seconds

Every arm is `python -m train` with the default job's settings plus the arm's overrides, run as
its own process (OMP threads = --threads), on ONE offline capture shared by every arm
(`--features-dir`: an EAGLE-3 capture of layers (2, L//2, L-3); its final hidden state also serves
EAGLE-1 and small LMs), so arms differ only in what they name. The capture's cost is the same
for every arm and not counted in their minutes. Every arm saves a checkpoint every --save-every
steps. Minutes: wall time from the arm's launch to the metrics line of that step ("wall min",
load-dependent: concurrent arms and other jobs share the machine), and, once `--step-costs` has
measured the arms' seconds per step interleaved in one process, "min @ cost" = steps x that
price: the comparison at equal minutes that the load cannot bias.

Each arm's last checkpoint is scored by the greedy replay (decode/replay.py, benchmarks/
replaying.py): the decoder's exact greedy chain rounds (k = --k) on the target's own greedy
answers to --replay-prompts MT-bench prompts and --humaneval-prompts HumanEval prompts (prompts
the job never trains on), tau with its standard error over prompts, and the paired gap of every
arm to the best on the same prompts. --curves replays every checkpoint of the named arms: tau
against training minutes and tokens, plotted to <out>/curves.png.

Writes <out>/<arm>/ (the run), <out>/arms.jsonl (one line per finished arm), <out>/replay.jsonl
(one line per replayed checkpoint), <out>/table.md (printed) and <out>/curves.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.arms import ARMS
from benchmarks.replaying import TINY, append_row, paired_gap, read_rows, replay_answers, replay_run


def split_arm(spec: str, args) -> tuple[str, int]:
    """"name" or "name:steps" (an arm of another length, e.g. a cheaper recipe run for as many
    minutes as a costlier one) -> (name, steps)."""
    name, _, steps = spec.partition(":")
    if name not in ARMS:
        raise SystemExit(f"unknown arm {name!r}; known: {', '.join(ARMS)}")
    if steps and not steps.isdigit():
        raise SystemExit(f"arm {spec!r}: the steps after ':' must be a positive integer")
    return name, int(steps) if steps else args.steps


def arm_overrides(spec: str, args) -> list[str]:
    """The arm's full override list: the default job, the arm's own keys, the study's settings."""
    name, steps = split_arm(spec, args)
    base = TINY if args.tiny else []
    feats = [f"trainer.features_dir={args.features_dir}"] if args.features_dir and not args.tiny \
        and "data=sharegpt_selfgen" not in ARMS[name][1] else []  # selfgen: the store's own
    return ["~budget", *base, *ARMS[name][1], *feats, f"trainer.max_steps={steps}",
            f"trainer.save_every={args.save_every}",
            f"trainer.keep_last={steps // max(args.save_every, 1) + 1}",  # every curve point
            "trainer.eval_every=0", "trainer.final_eval=null", f"seed={args.seed}", *args.set]


def launch(spec: str, args, out: Path) -> subprocess.Popen:
    name = split_arm(spec, args)[0]
    run_dir = out / name
    resume = (run_dir / "checkpoints").is_dir()
    cmd = [sys.executable, "-m", "specdistill.train", *arm_overrides(spec, args), f"run_dir={run_dir}",
           f"resume={str(resume).lower()}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "launch.json").write_text(json.dumps({"time": time.time(), "cmd": cmd}))
    print(f"== train {name}: {' '.join(cmd[2:])}", flush=True)
    return subprocess.Popen(cmd, env=env, stdout=open(run_dir / "stdout.log", "a"),
                            stderr=subprocess.STDOUT)


def train_arms(names: list[str], args, out: Path) -> None:
    """Train the arms not finished yet, --jobs at a time; one line per finished arm."""
    done = read_rows(out / "arms.jsonl")
    todo = [s for s in names if split_arm(s, args)[0] not in done]
    running: dict[str, subprocess.Popen] = {}
    while todo or running:
        while todo and len(running) < args.jobs:
            s = todo.pop(0)
            running[s] = launch(s, args, out)
        time.sleep(2)
        for s, p in list(running.items()):
            if p.poll() is None:
                continue
            del running[s]
            n, steps = split_arm(s, args)
            if p.returncode != 0:
                raise SystemExit(f"arm {n} failed (exit {p.returncode}): see {out / n}/stdout.log")
            append_row(out / "arms.jsonl", {"run": n, "what": ARMS[n][0], "overrides": ARMS[n][1],
                                            "steps": steps, "concurrent": args.jobs,
                                            "threads": args.threads, "run_dir": str(out / n)})


def step_costs(names: list[str], args, out: Path) -> str:
    """Seconds per optimizer step of each arm's recipe, measured in ONE process with the arms
    interleaved (round r: --cost-steps steps of every arm in turn, after one warm-up round), on
    the same batches (same seed, same capture): the price of a recipe, free of the load that
    concurrent arms and other jobs put on a shared machine."""
    import statistics
    import tempfile

    import torch

    from benchmarks.replaying import compose
    from specdistill.train.recipe import DistillRecipe

    torch.set_num_threads(args.threads)
    recipes = {}
    tmp = Path(tempfile.mkdtemp(prefix="step_costs_"))
    for spec in names:
        name = split_arm(spec, args)[0]
        cfg = compose(arm_overrides(spec, args) + [f"run_dir={tmp / name}", "logger=jsonl"])
        recipes[name] = DistillRecipe(cfg)
        recipes[name].setup()
    times: dict[str, list[float]] = {n: [] for n in recipes}
    for rnd in range(args.cost_rounds + 1):  # round 0 warms up
        for name, r in recipes.items():
            t0 = time.perf_counter()
            for _ in range(args.cost_steps):
                r.train_step()
            if rnd:
                times[name].append((time.perf_counter() - t0) / args.cost_steps)
    for r in recipes.values():
        r.cleanup()
    ref = statistics.median(times[next(iter(times))])
    rows = {n: {"s_per_step": statistics.median(t), "rounds": t,
                "vs_first": statistics.median(t) / ref} for n, t in times.items()}
    (out / "step_costs.json").write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))
    first = next(iter(rows))
    lines = [f"| arm | s / step (median) | per round | vs {first} |", "|---|---:|---|---:|"]
    lines += [f"| {n} | {r['s_per_step']:.2f} | {', '.join(f'{x:.2f}' for x in r['rounds'])} | "
              f"{r['vs_first']:.2f}x |" for n, r in rows.items()]
    return "\n".join(lines)


def checkpoint_clock(run_dir: Path) -> dict[int, float]:
    """step -> minutes from the arm's launch to its metrics line of that step."""
    t0 = json.loads((run_dir / "launch.json").read_text())["time"]
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: (r["time"] - t0) / 60 for r in rows if "loss" in r}


def tokens_per_step(run_dir: Path) -> float:
    """Mean target tokens per optimizer step: what the run logged (tokens_per_step), else batch x
    the mean train conversation length (counted from the capture's offsets)."""
    import yaml
    from safetensors import safe_open

    logged = [json.loads(line).get("tokens_per_step") for line in
              (run_dir / "metrics.jsonl").read_text().splitlines() if "tokens_per_step" in line]
    if logged:
        return sum(logged) / len(logged)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    total = n = 0
    for f in sorted(Path(cfg["trainer"]["features_dir"]).glob("shard-*.safetensors")):
        with safe_open(str(f), framework="pt") as sh:
            off = sh.get_tensor("offsets")
            total, n = total + int(off[-1]), n + len(off) - 1
    return cfg["trainer"]["batch_size"] * cfg["trainer"].get("grad_accum", 1) * total / max(n, 1)


def replay_arm(target, name: str, args, out: Path, answers: dict, every: bool) -> list[dict]:
    """Replay the arm's last checkpoint (every checkpoint with `every`) on each prompt set."""
    from specdistill.store.rundir import complete_checkpoints

    run_dir = out / name
    done = read_rows(out / "replay.jsonl")
    ckpts = complete_checkpoints(run_dir)
    if not ckpts:
        raise SystemExit(f"{run_dir} has no complete checkpoint")
    clock = checkpoint_clock(run_dir)
    per_tok = None if args.tiny else tokens_per_step(run_dir)
    rows = []
    for ck in ckpts if every else ckpts[-1:]:
        step = int(ck.name.split("-")[-1])
        for kind, ans in answers.items():
            key = f"{name}@{step}@{kind}@{len(ans)}x{args.replay_tokens}@k{args.k}"
            if key not in done:
                print(f"== replay {key}", flush=True)
                row = replay_run(target, key, ck, ans, args)
                row.update(arm=name, step=step, kind=kind, wall_minutes=clock.get(step),
                           tokens=None if per_tok is None else step * per_tok)
                append_row(out / "replay.jsonl", row)
                done[key] = row
            rows.append(done[key])
    return rows


def price_minutes(replays: list[dict], out: Path) -> None:
    """Set r["minutes"] = steps x the arm's measured seconds per step (<out>/step_costs.json) where
    measured, else the wall minutes."""
    path = out / "step_costs.json"
    cost = json.loads(path.read_text())["rows"] if path.is_file() else {}
    for r in replays:
        wall = r.get("wall_minutes", r.get("minutes"))
        r["wall_minutes"] = wall
        r["minutes"] = (r["step"] * cost[r["arm"]]["s_per_step"] / 60 if r["arm"] in cost
                        else wall)


def table(arms: list[dict], replays: list[dict], k: int) -> str:
    """The last checkpoint of every arm: tau on each prompt set, paired gaps to the best arm."""
    last = {}
    for r in replays:
        cur = last.get((r["arm"], r["kind"]))
        if cur is None or r["step"] > cur["step"]:
            last[(r["arm"], r["kind"])] = r
    kinds = sorted({kd for _, kd in last}, key=lambda kd: kd != "mtbench")
    mt = {a: r for (a, kd), r in last.items() if kd == "mtbench"}
    best = max(mt.values(), key=lambda r: r["replay_tau"]) if mt else None
    head = " | ".join(f"replay tau k={k} {kd}" for kd in kinds)
    lines = [f"| arm | what | steps | min @ cost | wall min | {head} | gap to best (MT-bench) |",
             "|---|---|---:|---:|---:|" + "---:|" * len(kinds) + "---:|"]
    for a in sorted(arms, key=lambda a: -(mt[a["run"]]["replay_tau"] if a["run"] in mt else 0)):
        n = a["run"]
        cells = [f"{last[(n, kd)]['replay_tau']:.3f} ± {last[(n, kd)]['replay_tau_se']:.3f}"
                 if (n, kd) in last else "-" for kd in kinds]
        m = mt.get(n)
        gap = "-" if m is None or m is best else "{:+.3f} ± {:.3f}".format(
            *(-x if i == 0 else x for i, x in enumerate(paired_gap(best, m, "tau"))))
        mins = "-" if m is None or m["minutes"] is None else f"{m['minutes']:.1f}"
        wall = "-" if m is None or m["wall_minutes"] is None else f"{m['wall_minutes']:.1f}"
        lines.append(f"| {n} | {a['what']} | {m['step'] if m else '-'} | {mins} | {wall} | "
                     f"{' | '.join(cells)} | {gap} |")
    if mt:
        one = next(iter(mt.values()))
        lines.append(f"\n{one['replay_prompts']} MT-bench prompts x {one['replay_tokens']} tokens "
                     f"of the target's greedy answers; ± = standard error over prompts; gaps "
                     f"paired prompt by prompt. Best: {best['arm']}.")
    return "\n".join(lines)


def plot(replays: list[dict], arms: list[str], path: Path) -> None:
    """tau (MT-bench replay) against training minutes and tokens, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for arm in arms:
        pts = sorted((r for r in replays if r["arm"] == arm and r["kind"] == "mtbench"),
                     key=lambda r: r["step"])
        if not pts:
            continue
        for ax, key, scale in ((axes[0], "minutes", 1.0), (axes[1], "tokens", 1e-6)):
            xs = [r[key] * scale for r in pts if r[key] is not None]
            ys = [r["replay_tau"] for r in pts if r[key] is not None]
            es = [r["replay_tau_se"] for r in pts if r[key] is not None]
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=arm)
    axes[0].set_xlabel("training minutes (steps x measured s/step; capture excluded)")
    axes[1].set_xlabel("target tokens seen (millions)")
    for ax in axes:
        ax.set_ylabel("greedy replay tau (MT-bench, chain)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/recipe", help="folder of the arms and the results")
    ap.add_argument("--arms", nargs="*", default=[],
                    help=f"arms to train, each NAME or NAME:STEPS: {', '.join(ARMS)}")
    ap.add_argument("--features-dir", help="the shared offline capture (an EAGLE-3 layer set)")
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps of every arm")
    ap.add_argument("--save-every", type=int, default=250, help="checkpoint (curve point) interval")
    ap.add_argument("--jobs", type=int, default=1, help="arms trained at once")
    ap.add_argument("--threads", type=int, default=2, help="OMP threads per arm")
    ap.add_argument("--k", type=int, default=5, help="chain draft length of the replay")
    ap.add_argument("--replay-prompts", type=int, default=40, help="MT-bench prompts replayed")
    ap.add_argument("--humaneval-prompts", type=int, default=20, help="HumanEval prompts replayed")
    ap.add_argument("--replay-tokens", type=int, default=128, help="answer length of the replay")
    ap.add_argument("--curves", nargs="*", default=[], help="arms whose every checkpoint is replayed")
    ap.add_argument("--no-replay", action="store_true", help="train only")
    ap.add_argument("--step-costs", nargs="*", metavar="ARM",
                    help="train nothing: seconds per step of these arms, interleaved in one process")
    ap.add_argument("--cost-rounds", type=int, default=3, help="--step-costs: measured rounds")
    ap.add_argument("--cost-steps", type=int, default=4, help="--step-costs: steps per arm and round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="random-init tiny target: checks the script")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Hydra override for every arm (repeatable)")
    args = ap.parse_args(argv)
    args.alpha_prompts = 0  # replay_run: no temperature-1 acceptance here
    plain = [s for s in (args.arms or []) + (args.step_costs or [])
             if "data=sharegpt_selfgen" not in ARMS[split_arm(s, args)[0]][1]]
    if plain and not args.tiny and not args.features_dir:
        print(f"note: no --features-dir: arms {plain} capture their features into the cache "
              f"(capture once and share it: `python -m specdistill.data.capture out=<dir> "
              f"layers=[2,15,27] autocast=bfloat16`)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.step_costs:
        md = step_costs(args.step_costs, args, out)
        print(md)
        return md
    train_arms(args.arms, args, out)
    arms = list(read_rows(out / "arms.jsonl").values())
    replays = [r for r in read_rows(out / "replay.jsonl").values()
               if (r["replay_tokens"], r["k"]) == (args.replay_tokens, args.k)]
    if not args.no_replay and arms:
        from benchmarks.replaying import compose
        from specdistill.target.model import load_target

        target = load_target(compose((TINY if args.tiny else []) + args.set).target, training=True)
        answers = {"mtbench": replay_answers(target, args.replay_prompts, args.replay_tokens, out)}
        if args.humaneval_prompts:
            answers["humaneval"] = replay_answers(target, args.humaneval_prompts,
                                                  args.replay_tokens, out, kind="humaneval")
        replays = [r for a in arms for r in replay_arm(target, a["run"], args, out, answers,
                                                         every=a["run"] in args.curves)]
    price_minutes(replays, out)
    md = table(arms, replays, args.k)
    (out / "table.md").write_text(md + "\n")
    if args.curves:
        plot(replays, args.curves, out / "curves.png")
    print(md)
    return md


if __name__ == "__main__":
    main()
