"""Our trainer and the field's (speculators, SpecForge) side by side: the same SmolLM2 target,
the same tokenised conversations and loss masks, the same captured target features, the same wall
minutes on the same cores, every drafter measured in our greedy replay.

    python -m benchmarks.peers --out runs/peers/bench --conversations 48 --minutes 3 --prompts 20
    python -m benchmarks.peers --arms ours speculators-close --minutes 1     # a subset
    python -m benchmarks.peers --engine ...   # and every arm's drafter in vLLM CPU (step 6)
    python -m benchmarks.peers --humaneval 20 ...   # the replay on HumanEval prompts too
    python -m benchmarks.peers --schedule-steps ours=166 speculators-close=161 ...  # fitted schedules
    python -m benchmarks.peers --arms ours-dspark speculators-dspark-close speculators-dspark-default
                               --engine ...   # DSpark side by side, checked in llama.cpp

Steps (each skipped when its output exists, so a rerun continues):
  1. install each peer in its own virtualenv under <cache>/peers/ (venvs.py);
  2. our data path's first --conversations ShareGPT conversations, our capture of them, and the
     same numbers in each peer's format (prepare.py, features.py); then, once per peer, the
     check that its shims do not change what it computes: the first batch's loss as the shimmed
     trainer computes it against its own loss function (losscheck.py);
  3. train each arm for --minutes of training-loop wall time, one after another, all under
     `nice -n 10` (arms.py; the peers through their CPU shims: speculators_cpu.py, specforge_cpu.py);
  4. rebuild each drafter from the layout it exported for vLLM (imports.py) and replay it greedily
     on the target's own answers to --prompts MT-bench prompts (k = --k): tau +- its standard error
     over prompts, and each arm's paired gap to ours (ours-dspark for the DSpark arms); with
     --humaneval N, also N HumanEval prompts: their tau, and the paired gap over all the replayed prompts;
  5. <out>/peers.json and <out>/peers.md: the table;
  6. with --engine: each arm's exported drafter in our engine check (engine.py): vLLM CPU for
     EAGLE-3, llama.cpp for DSpark (vLLM's CPU build refuses it); loads, speculative == plain,
     tau, tokens/s, in the same files.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from benchmarks.peers import arms as A
from benchmarks.peers import engine as E
from benchmarks.peers import losscheck as LC
from benchmarks.peers import replay as R
from benchmarks.peers.prepare import write_peer_data
from benchmarks.peers.venvs import PEERS, ensure_peer
from benchmarks.replaying import compose

log = logging.getLogger("benchmarks.peers")
ARMS = ("ours", "speculators-close", "specforge-close", "speculators-default", "specforge-default")
# DSpark side by side (on request: --arms ours-dspark speculators-dspark-close ...): SpecForge 0.2.0
# trains no DSpark; the engine check runs in llama.cpp (vLLM's CPU build refuses DSpark)
DSPARK_ARMS = ("ours-dspark", "speculators-dspark-close", "speculators-dspark-default")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/peers/bench"))
    ap.add_argument("--conversations", type=int, default=48, help="data.max_conversations")
    ap.add_argument("--minutes", type=float, default=3.0, help="training-loop wall minutes per arm")
    ap.add_argument("--prompts", type=int, default=20, help="MT-bench prompts of the replay")
    ap.add_argument("--humaneval", type=int, default=0,
                    help="HumanEval prompts replayed too (their tau, and the gap over all prompts)")
    ap.add_argument("--tokens", type=int, default=128, help="answer tokens per prompt")
    ap.add_argument("--k", type=int, default=2, help="draft length of the replay")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS + DSPARK_ARMS,
                    help="default: the EAGLE-3 arms; the DSpark arms by name")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides of our job (all arms' data)")
    ap.add_argument("--schedule-steps", nargs="*", default=[], metavar="ARM=STEPS",
                    help="an arm's schedule (ours: trainer.max_steps, so its on-policy phase and "
                         "LR decay fall inside the minutes; a peer's scheduler total steps) sized "
                         "to the steps it reaches in --minutes")
    ap.add_argument("--engine", action="store_true",
                    help="after the replay, every arm's drafter in the vLLM CPU engine check")
    ap.add_argument("--engine-prompts", type=int, default=20,
                    help="MT-bench prompts of the engine check (the first of the replay's)")
    args = ap.parse_args(argv)
    try:
        args.schedule_steps = {a: int(n) for a, n in (x.split("=") for x in args.schedule_steps)}
    except ValueError:
        ap.error(f"--schedule-steps takes ARM=STEPS pairs, got {args.schedule_steps}")
    bad = [a for a, n in args.schedule_steps.items() if a not in ARMS + DSPARK_ARMS or n < 1]
    if bad:
        ap.error(f"--schedule-steps: {bad} are not arms with >= 1 step; the arms: "
                 f"{', '.join(ARMS + DSPARK_ARMS)}")
    return args


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = [f"data.max_conversations={args.conversations}", *args.set]
    cfg = compose(overrides + A.OURS)
    peers = {arm.peer for arm in map(A.ArmName.parse, args.arms) if arm.peer}
    pythons = {p: ensure_peer(PEERS[p]) for p in sorted(peers)}  # 1.
    data = write_peer_data(cfg, args.out / "data", pythons)  # 2.
    log.info("data: %s", data)
    results = R.read_results(args.out)
    checks = results.setdefault(R.LOSS_CHECK, {})
    for peer, python in pythons.items():  # 2b.
        if peer not in checks:
            checks[peer] = LC.check_peer(peer, python, args.out, data["aux_layers"],
                                         A.target_folder(cfg))  # the verifier the arms read
            (log.info if checks[peer]["ok"] else log.error)("%s", LC.check_line(peer, checks[peer]))
            R.write_results(args.out, results)
    for name in args.arms:  # 3.
        if name in results and results[name].get("train"):
            continue
        results[name] = {"train": A.train_arm(name, args, overrides, data, pythons, cfg)}
        R.write_results(args.out, results)
    R.replay_all(args, results, data)  # 4.
    R.write_results(args.out, results)
    if args.engine:  # 6.
        E.engine_all(args, results, data)
        R.write_results(args.out, results)
    (args.out / "peers.md").write_text(R.table(results, args))  # 5.
    print(R.table(results, args))


if __name__ == "__main__":
    main()
