"""Step 4-5: every arm's drafter in our greedy replay (decode/replay.py) on the target's own
answers, tau +- its standard error over prompts and the paired gap to ours; the results file and
the table."""
from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.replaying import paired_gap, ratio_se, replay_answers

RESULTS = "peers.json"
LOSS_CHECK = "loss_check"  # peers.json's key of the shims' loss checks (losscheck.py), not an arm


def read_results(out: Path) -> dict:
    path = out / RESULTS
    return json.loads(path.read_text()) if path.is_file() else {}


def write_results(out: Path, results: dict) -> None:
    tmp = out / (RESULTS + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out / RESULTS)


def replay_drafter(target, drafter, answers: list[dict], k: int, tokens: int) -> dict:
    """Greedy replay tau of `drafter` on `answers`, with per-prompt [rounds, tokens] for pairing."""
    import torch

    from specdistill.decode.replay import replay_greedy

    per_prompt = []
    with torch.inference_mode():
        for row in answers:
            rep = replay_greedy(target, drafter, torch.tensor(row["prompt"]),
                                torch.tensor(row["answer"]), k=k, max_new_tokens=tokens)
            per_prompt.append([len(rep.accepted), sum(rep.accepted) + len(rep.accepted), 0, 0])
    tau, se = ratio_se([p[1] for p in per_prompt], [p[0] for p in per_prompt])
    return {"tau": tau, "tau_se": se, "rounds": sum(p[0] for p in per_prompt),
            "per_prompt": per_prompt}


def load_arm_drafter(name: str, res: dict, target, aux_layers):
    from specdistill.store.drafter import load_drafter

    from benchmarks.peers.imports import import_peer

    folder = res["train"].get("drafter")
    if not folder:
        raise FileNotFoundError(f"{name}: no drafter was saved ({res['train'].get('error')})")
    from benchmarks.peers.arms import ArmName

    return load_drafter(folder, target).eval() if ArmName.parse(name).peer is None else import_peer(
        folder, target, aux_layers)


def replay_all(args, results: dict, data: dict) -> None:
    """Each arm's replay on the MT-bench answers (res["replay"]) and, with args.humaneval, on
    the HumanEval answers (res["replay_humaneval"]); each arm's paired gap to ours on MT-bench
    (res["gap_to_ours"]) and over every replayed prompt (res["gap_to_ours_all"]), ours being our
    arm of the same algorithm (ArmName.reference: ours, or ours-dspark)."""
    from specdistill.target.model import load_target

    from benchmarks.peers.arms import ArmName
    from benchmarks.replaying import compose

    target = load_target(compose(list(args.set)).target, training=True)
    sets = {"replay": replay_answers(target, args.prompts, args.tokens, args.out)}
    if getattr(args, "humaneval", 0):
        sets["replay_humaneval"] = replay_answers(target, args.humaneval, args.tokens, args.out,
                                                  kind="humaneval")
    for name, res in arms(results).items():
        if name not in args.arms or not any(key not in res for key in sets):
            continue
        try:
            drafter = load_arm_drafter(name, res, target, data["aux_layers"])
            for key, answers in sets.items():
                if key not in res:
                    res[key] = replay_drafter(target, drafter, answers, args.k, args.tokens)
        except Exception as e:  # recorded in the table, the other arms go on
            res["replay_error"] = f"{type(e).__name__}: {e}"
    for name, res in arms(results).items():
        ref = ArmName.parse(name).reference
        ours = results.get(ref, {})
        if name == ref or not res.get("replay") or not ours.get("replay"):
            continue
        res["gap_to_ours"] = paired_gap(res["replay"], ours["replay"], "tau")
        if len(sets) > 1 and all(res.get(k) and ours.get(k) for k in sets):
            both = [{"per_prompt": [p for k in sets for p in r[k]["per_prompt"]]} for r in (res, ours)]
            res["gap_to_ours_all"] = paired_gap(both[0], both[1], "tau")


def arms(results: dict) -> dict:
    """The arms' entries of peers.json (the loss checks are not one)."""
    return {k: v for k, v in results.items() if k != LOSS_CHECK}


def _fmt(x, nd=2):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def table(results: dict, args) -> str:
    """peers.md: one row per arm (with the engine check's columns when any arm has one), then
    one line per peer's loss check."""
    from benchmarks.peers.engine import engine_cells
    from benchmarks.peers.losscheck import check_line

    engine = any("engine" in r for r in arms(results).values())
    he = next((r["replay_humaneval"] for r in arms(results).values() if r.get("replay_humaneval")),
              None)
    he_n = len(he["per_prompt"]) if he else 0
    lines = [f"| arm | set | training min | steps | target tokens/s | peak RSS (MB) | peak anonymous "
             f"(MB) | replay tau (k={args.k}, {args.prompts} MT-bench x {args.tokens}) | gap to ours "
             f"(paired; a DSpark arm's to ours-dspark) |"
             + (f" replay tau ({he_n} HumanEval) | gap to ours, all {args.prompts + he_n} prompts |"
                if he else "")
             + (" engine loads | engine spec == plain | tau engine / our replay on its text | "
                "engine tokens/s plain / spec |" if engine else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if he else "")
             + ("---|---:|---:|---:|" if engine else "")]

    def tau(r):
        return f"{r['tau']:.3f} +- {r['tau_se']:.3f}" if r else "—"

    def gap(g):
        return f"{g[0]:+.3f} +- {g[1]:.3f}" if g else "—"

    for name, res in arms(results).items():
        t, r = res.get("train", {}), res.get("replay")
        lines.append(f"| {name} | {t.get('what', '')} | {_fmt(t.get('train_minutes'))} | "
                     f"{t.get('steps', '—')} | {_fmt(t.get('tokens_per_s'), 0)} | "
                     f"{_fmt(t.get('peak_rss_mb'), 0)} | {_fmt(t.get('peak_anon_mb'), 0)} | "
                     f"{tau(r) if r else res.get('replay_error', '—')} | "
                     f"{gap(res.get('gap_to_ours'))} |"
                     + (f" {tau(res.get('replay_humaneval'))} | {gap(res.get('gap_to_ours_all'))} |"
                        if he else "")
                     + ("".join(f" {c} |" for c in engine_cells(res.get("engine"))) if engine else ""))
    checks = results.get(LOSS_CHECK) or {}
    if checks:
        lines += ["", *(check_line(peer, c) for peer, c in checks.items())]
    return "\n".join(lines) + "\n"
