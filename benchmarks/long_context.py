"""One long conversation end to end: peak memory of the capture and of training on it.

    python -m benchmarks.long_context --out runs/bench/long_context
    python -m benchmarks.long_context --tokens 16384 --windows 2048 1024 --steps 3 --out <dir>
    python -m benchmarks.long_context --tokens 4096 --windows none 1024 --out <dir>  # whole rows too

Each arm is the real job (`python -m train`'s recipe: target=tiny, data=jsonl) on ONE conversation
of --tokens tokens (a user turn and an answer cut at data.max_length = --tokens), the tiny target's
context raised to fit it: the offline capture of its features, then --steps optimizer steps of the
drafter (default the job's EAGLE-3) at batch 1, with trainer.window = the arm's window ("none":
whole rows). No evals (nothing is held out) and no final eval. Every arm runs in a fresh child
process, so its peak resident memory (ru_maxrss) is its own: read after the setup (the target,
the data, the capture) and after the steps. Prints a table and writes <out>/long_context.json; an
arm over --goal-gb is marked.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def peak_gb() -> float:
    """This process's peak resident memory so far, in GB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_conversation(path: Path, tokens: int) -> Path:
    """One ShareGPT conversation whose answer runs past `tokens` tokens (data.max_length cuts it)."""
    answer = " ".join(WORDS[(j * 7) % len(WORDS)] + str(j % 97) for j in range(tokens))
    path.write_text(json.dumps({"id": "long", "conversations": [
        {"from": "human", "value": "Count on, please."}, {"from": "gpt", "value": answer}]}) + "\n")
    return path


def arm(tokens: int, window: int | None, steps: int, drafter: str, work: Path) -> dict:
    """The job on one conversation of `tokens` tokens with trainer.window=`window` (in this process)."""
    import torch
    from hydra import compose, initialize_config_dir

    import specdistill.train.__main__  # noqa: F401  (stores the schemas)
    from specdistill.cli.paths import CONF_DIR
    from specdistill.train.recipe import DistillRecipe

    torch.set_num_threads(1)
    chats = write_conversation(work / "chat.jsonl", tokens)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "target=tiny", f"target.model_config.max_position_embeddings={max(tokens, 4096)}",
            "data=jsonl", f"data.path={chats}", f"data.max_length={tokens}", "data.eval_fraction=0",
            f"data.cache_dir={work / 'cache'}", f"drafter={drafter}", "trainer=smoke",
            f"trainer.max_steps={steps}", "trainer.batch_size=1", "trainer.features=offline",
            f"trainer.features_dir={work / 'features'}", "trainer.eval_every=0",
            "trainer.save_every=0", "trainer.final_eval=null",
            f"trainer.window={'null' if window is None else window}", f"run_dir={work / 'run'}",
            "logger.kinds=[jsonl]"])
    t0 = time.perf_counter()
    recipe = DistillRecipe(cfg)
    recipe.setup()
    row = len(recipe.train_ds[0]["input_ids"])
    setup_s, setup_gb = time.perf_counter() - t0, peak_gb()
    t1 = time.perf_counter()
    recipe.train()
    recipe.cleanup()
    return {"tokens": row, "window": window, "steps": steps, "drafter": drafter,
            "setup_s": setup_s, "train_s": time.perf_counter() - t1,
            "setup_peak_gb": setup_gb, "peak_gb": peak_gb()}


def run_child(tokens: int, window: int | None, steps: int, drafter: str, work: Path) -> dict:
    """`arm` in a fresh interpreter (its own peak memory); its result is the child's last line."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.long_context", "--child", "--tokens", str(tokens),
           "--windows", "none" if window is None else str(window), "--steps", str(steps),
           "--drafter", drafter, "--out", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"arm tokens={tokens} window={window} failed (exit {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def window_arg(s: str) -> int | None:
    return None if s.lower() in ("none", "null") else int(s)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_context", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the conversation")
    p.add_argument("--windows", type=window_arg, nargs="+", default=[2048],
                   help="trainer.window of each arm (none: whole rows)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps after the capture")
    p.add_argument("--drafter", default="eagle3")
    p.add_argument("--goal-gb", type=float, default=8.0, help="peak resident memory goal")
    p.add_argument("--out", type=Path, default=Path("runs/bench/long_context"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:  # one arm, in this process: its result as the last line of stdout
        res = arm(a.tokens, a.windows[0], a.steps, a.drafter, a.out)
        print(json.dumps(res), flush=True)
        return res
    a.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for w in a.windows:
        r = run_child(a.tokens, w, a.steps, a.drafter, a.out / f"window-{w or 'none'}")
        r["within_goal"] = r["peak_gb"] <= a.goal_gb
        runs.append(r)
    print(f"\n| drafter | row tokens | trainer.window | setup s | peak after setup GB | "
          f"{a.steps} steps s | peak GB | <= {a.goal_gb:g} GB |\n|---|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        print(f"| {r['drafter']} | {r['tokens']} | {r['window'] or 'whole rows'} | "
              f"{r['setup_s']:.1f} | {r['setup_peak_gb']:.2f} | {r['train_s']:.1f} | "
              f"{r['peak_gb']:.2f} | {'yes' if r['within_goal'] else '**no**'} |")
    result = {"tokens": a.tokens, "steps": a.steps, "goal_gb": a.goal_gb, "runs": runs}
    (a.out / "long_context.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
