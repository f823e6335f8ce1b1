"""The greedy replay as a benchmark tool: the target's greedy answers to eval prompts (generated
once and kept), a saved drafter's replayed tau on them with its standard error over prompts, and
paired gaps between drafters on the same prompts. Shared by the small_lm and recipe studies.

Standard errors treat prompts as the independent units (the rounds of one answer are not
independent): tau = sum(tokens) / sum(rounds) with the linearised cluster estimate.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

TINY = ["target=tiny", "data=sharegpt", "data.max_conversations=24", "data.max_length=128",
        "trainer=smoke", "trainer.eval_conversations=2"]  # seconds, random-init target


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import specdistill.train.__main__  # noqa: F401  (stores the train schemas)
    from specdistill.cli.paths import CONF_DIR

    conf = Path(CONF_DIR)
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


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


def replay_answers(target, n_prompts: int, max_new_tokens: int, out: Path,
                   kind: str = "mtbench") -> list[dict]:
    """The target's greedy answers to the first n prompts of eval set `kind` (mtbench |
    humaneval), generated once and kept."""
    from tqdm import tqdm

    from specdistill.data.prompts import load_prompts
    from specdistill.decode.evaluate import render
    from specdistill.decode.spec import generate

    tag = "" if kind == "mtbench" else f"{kind}_"
    path = out / f"replay_answers_{tag}{n_prompts}x{max_new_tokens}.json"
    if path.is_file():
        kept = json.loads(path.read_text())
        if kept["target"] == target.identity:
            return kept["rows"]
    rows = []
    for p in tqdm(load_prompts(kind, limit=n_prompts), desc="target answers"):
        ids = render(target, p.turns[:1], [])
        ans = generate(target, None, ids, max_new_tokens=max_new_tokens).tokens
        rows.append({"id": p.id, "prompt": ids.tolist(), "answer": ans.tolist()})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"target": target.identity, "rows": rows}))
    os.replace(tmp, path)  # a crash never leaves half a file that a rerun would trust
    return rows


def target_and_answers(args, out: Path):
    """The benchmark's target (TINY or the --set overrides) and its kept replay answers."""
    from specdistill.target.model import load_target

    target = load_target(compose((TINY if args.tiny else []) + args.set).target, training=True)
    return target, replay_answers(target, args.replay_prompts, args.replay_tokens, out)


def replay_run(target, name: str, folder: Path, answers: list[dict], args) -> dict:
    """Greedy replay tau (k = args.k) and mean per-draft acceptance at T=1 of the drafter saved in
    `folder` (a run's best/ or one of its checkpoints)."""
    import torch

    from specdistill.decode.replay import draft_acceptance, replay_greedy
    from specdistill.drafters.parts.sampling import SamplingParams
    from specdistill.store.drafter import load_drafter

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


def replay_checkpoints(run_dir: Path, args, out: Path) -> str:
    """Replay every complete checkpoint of one training run: acceptance against training steps.
    Appends to <out>/replay_checkpoints.jsonl (checkpoints replayed before with the same replay
    settings are skipped)."""
    from specdistill.store.rundir import complete_checkpoints

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
