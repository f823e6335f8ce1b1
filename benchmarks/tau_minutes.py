"""Acceptance against training minutes for finished training runs, branches included.

    python -m benchmarks.tau_minutes --out runs/curves --prices runs/train/<job> \\
        --run A=runs/A --run B=runs/B --steps 250 500 750 800 900 1000 --k 2 --mark 21

A run is a `python -m train` folder with checkpoints/. A branch (a run resumed from a copy of
another run's checkpoint, the way a study varies the end of a job) is just another --run: its first
checkpoint is the copy, so its curve starts on its parent's point there.

Minutes are the run's steps priced by kind: teacher-forced and on-policy (trainer.
on_policy_heads_start, from each run's config.yaml) at the median seconds per step that the
--prices run measured for each kind, read from its metrics.jsonl (intervals that hold an eval or a
change of kind are left out). One uninterrupted run prices every curve, so runs that were trained
side by side or at other thread counts compare at one machine's prices. The capture, the evals and
the final decode are not in these minutes. Tokens: the target tokens the run's steps saw.

Each point is the greedy replay (decode/replay.py via benchmarks/replaying.py) of one
checkpoint: chain rounds at k = --k on the target's own greedy answers to --replay-prompts MT-bench
and --humaneval-prompts HumanEval first turns, tau with its standard error over prompts, and the
gap to --ref (NAME@STEP; default the first run's last point) paired prompt by prompt. Replays are
kept in <out>/replay.jsonl under the checkpoint's weights hash (its MANIFEST.json), so a branch's
copied checkpoint and a rerun replay nothing twice. Writes <out>/table.md and <out>/tau_minutes.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import yaml

from benchmarks.recipe_study import tokens_per_step
from benchmarks.replaying import TINY, append_row, compose, paired_gap, replay_answers, replay_run
from specdistill.train.schedule import in_phase

KINDS = ("mtbench", "humaneval")


def step_kinds(run_dir: Path):
    """0-based optimizer step -> "tf" | "op" under the run's own config."""
    t = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]
    if t.get("schedule", "steps") != "steps":  # its phase began where its minutes said
        raise SystemExit(f"{run_dir}: trained with trainer.schedule={t['schedule']}, whose on-policy "
                         f"steps follow the clock, not trainer.max_steps; this script prices runs of "
                         f"the step schedule (a minutes run's own minutes are in its metrics.jsonl)")
    return lambda step: "op" if in_phase(t.get("on_policy_heads_start"), t["max_steps"], step) else "tf"


def step_prices(run_dir: Path) -> dict[str, float]:
    """Median seconds per step of each kind in an uninterrupted run's metrics.jsonl: the intervals
    between two consecutive loss lines with no other line (an eval, a resume) between them and
    every step in them of one kind."""
    kind = step_kinds(run_dir)
    seen: dict[str, list[float]] = {"tf": [], "op": []}
    prev = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "loss" not in row:
            prev = None
            continue
        if prev is not None and row["step"] > prev["step"]:
            kinds = {kind(s) for s in range(prev["step"], row["step"])}
            if len(kinds) == 1:
                seen[kinds.pop()].append((row["time"] - prev["time"]) / (row["step"] - prev["step"]))
        prev = row
    if not seen["tf"]:
        raise SystemExit(f"--prices {run_dir}: no interval of teacher-forced steps in its metrics.jsonl")
    return {k: statistics.median(v) for k, v in seen.items() if v}


def minutes(run_dir: Path, step: int, prices: dict[str, float]) -> float:
    """Training minutes of the run's first `step` steps at `prices`."""
    kind = step_kinds(run_dir)
    kinds = [kind(s) for s in range(step)]
    missing = sorted(set(kinds) - set(prices))
    if missing:
        raise SystemExit(f"{run_dir} has {missing} steps but --prices measured none: price it with "
                         f"a run that has both kinds of step")
    return sum(prices[k] for k in kinds) / 60


def weights_key(ckpt: Path) -> str:
    """The checkpoint's drafter weights as its MANIFEST.json hashes them."""
    from specdistill.store.drafter import WEIGHTS_FILE
    from specdistill.store.manifest import MANIFEST

    return json.loads((ckpt / MANIFEST).read_text())[WEIGHTS_FILE]["sha256"]


def points(runs: dict[str, Path], steps: list[int] | None, prices: dict[str, float], args,
           out: Path) -> list[dict]:
    """Replay every chosen checkpoint of every run on each prompt set (kept replays reused)."""
    from specdistill.store.rundir import complete_checkpoints
    from specdistill.target.model import load_target

    path = out / "replay.jsonl"
    done = {}
    if path.is_file():
        done = {r["key"]: r for r in map(json.loads, path.read_text().splitlines()) if r}
    target = answers = None
    rows = []
    for name, run_dir in runs.items():
        ckpts = {int(c.name.split("-")[-1]): c for c in complete_checkpoints(run_dir)}
        chosen = sorted(ckpts if steps is None else set(steps) & set(ckpts))
        if not chosen:
            raise SystemExit(f"{run_dir}: no complete checkpoint at steps {steps}")
        per_step = tokens_per_step(run_dir)
        for step in chosen:
            for kind in KINDS[: 1 + bool(args.humaneval_prompts)]:
                n = args.replay_prompts if kind == "mtbench" else args.humaneval_prompts
                key = f"{weights_key(ckpts[step])}@{kind}@{n}x{args.replay_tokens}@k{args.k}"
                if key not in done:
                    if target is None:
                        target = load_target(compose((TINY if args.tiny else []) + args.set).target,
                                             training=True)
                        answers = {kd: replay_answers(target, m, args.replay_tokens, out, kind=kd)
                                   for kd, m in zip(KINDS, (args.replay_prompts, args.humaneval_prompts))
                                   if m}
                    print(f"== replay {name}@{step} {kind}", flush=True)
                    done[key] = dict(replay_run(target, f"{name}@{step}", ckpts[step], answers[kind],
                                                args), key=key)
                    append_row(path, done[key])
                rows.append(dict(done[key], arm=name, step=step, kind=kind, tokens=step * per_step,
                                 minutes=minutes(run_dir, step, prices)))
    return rows


def table(rows: list[dict], ref: str | None, prices: dict[str, float], k: int) -> str:
    mt = {(r["arm"], r["step"]): r for r in rows if r["kind"] == "mtbench"}
    he = {(r["arm"], r["step"]): r for r in rows if r["kind"] == "humaneval"}
    first = next(iter(mt))[0]
    ref_at = (ref.split("@")[0], int(ref.split("@")[1])) if ref else max(
        (a, s) for a, s in mt if a == first)
    if ref_at not in mt:
        raise SystemExit(f"--ref {ref}: no replayed point of that run at that step")
    lines = [f"| run | step | training min | target tokens (M) | MT-bench tau k={k} | HumanEval tau | "
             f"MT-bench - {ref_at[0]}@{ref_at[1]} | HumanEval - {ref_at[0]}@{ref_at[1]} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for at, r in mt.items():
        h = he.get(at)
        cells = [f"{x['replay_tau']:.3f} ± {x['replay_tau_se']:.3f}" if x else "-" for x in (r, h)]
        gaps = ["{:+.3f} ± {:.3f}".format(*paired_gap(x, base, "tau")) if x and base and at != ref_at
                else "-" for x, base in ((r, mt[ref_at]), (h, he.get(ref_at)))]
        lines.append(f"| {at[0]} | {at[1]} | {r['minutes']:.1f} | {r['tokens'] / 1e6:.2f} | "
                     f"{' | '.join(cells + gaps)} |")
    named = {"tf": "teacher-forced", "op": "on-policy"}
    lines.append("\nMinutes at " + ", ".join(f"{v:.2f} s per {named[kd]} step" for kd, v in prices.items())
                 + "; ± = standard error over prompts; gaps paired prompt by prompt.")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, k: int, mark: float | None, mark_label: str | None = None) -> None:
    """tau against training minutes, one line per run, one panel per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [kd for kd in KINDS if any(r["kind"] == kd for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for arm in dict.fromkeys(r["arm"] for r in rows):
            pts = sorted((r for r in rows if r["arm"] == arm and r["kind"] == kind), key=lambda r: r["step"])
            ax.errorbar([r["minutes"] for r in pts], [r["replay_tau"] for r in pts],
                        yerr=[r["replay_tau_se"] for r in pts], marker="o", capsize=3, label=arm)
        if mark is not None:
            ax.axvline(mark, color="grey", linestyle="--", label=mark_label or f"{mark:g} min")
        ax.set_title(f"{kind}: greedy replay, chain k={k}")
        ax.set_xlabel("training minutes (steps x measured s / step of their kind)")
        ax.set_ylabel("tau (tokens per target forward)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="NAME=DIR", help="a training run")
    ap.add_argument("--prices", help="the run whose metrics price a step of each kind (default: the first)")
    ap.add_argument("--steps", type=int, nargs="*", help="checkpoints to replay (default: all)")
    ap.add_argument("--out", default="runs/tau_minutes", help="results folder")
    ap.add_argument("--k", type=int, default=2, help="chain draft length of the replay")
    ap.add_argument("--replay-prompts", type=int, default=40, help="MT-bench prompts replayed")
    ap.add_argument("--humaneval-prompts", type=int, default=20, help="HumanEval prompts replayed")
    ap.add_argument("--replay-tokens", type=int, default=128, help="answer length of the replay")
    ap.add_argument("--ref", help="NAME@STEP the gaps are paired against")
    ap.add_argument("--mark", type=float, help="a vertical line at these training minutes")
    ap.add_argument("--mark-label", help="the legend of --mark (default: its minutes)")
    ap.add_argument("--tiny", action="store_true", help="random-init tiny target: checks the script")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="Hydra override of the target the runs were trained on (repeatable)")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.run:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not (Path(folder) / "config.yaml").is_file():
            raise SystemExit(f"--run {spec!r}: expected NAME=DIR with DIR a training run (config.yaml)")
        runs[name] = Path(folder)
    replay = SimpleNamespace(k=args.k, replay_tokens=args.replay_tokens, alpha_prompts=0, seed=0,
                             replay_prompts=args.replay_prompts, humaneval_prompts=args.humaneval_prompts,
                             tiny=args.tiny, set=args.set)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prices = step_prices(Path(args.prices) if args.prices else next(iter(runs.values())))
    rows = points(runs, args.steps, prices, replay, out)
    md = table(rows, args.ref, prices, args.k)
    (out / "table.md").write_text(md + "\n")
    plot(rows, out / "tau_minutes.png", args.k, args.mark, args.mark_label)
    print(md)
    return md


if __name__ == "__main__":
    main()
