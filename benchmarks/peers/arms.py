"""Step 2: each arm trains for the same wall minutes, one after another, under the same `nice`.

An arm is a command line and where its drafter lands. The wall budget counts the training loop
only (ours: trainer.max_minutes; the peers: the `wall_clock_budget` shim), each stopping after the
step that crosses it with a checkpoint. Peak memory is the arm's process tree's peak RSS
(wait4's rusage of the child: the largest process, which is the trainer); tokens/s counts the
tokens of the training batches (ours: the batches' tokens, metrics.jsonl; the peers: the shims').
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.peers.procstat import vm_hwm_mb

HERE = Path(__file__).resolve().parent
# the default job at the benchmark's data size: its recipe (conf/budget/default_eagle3.yaml),
# offline features from the same capture, no evals or engine check inside the timed run
OURS = ["trainer.final_eval=null", "trainer.engine_check=null", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.log_every=5"]


@dataclass
class Arm:
    name: str
    peer: str | None  # None = ours
    what: str  # one line for the table: what is set
    args: list[str] = field(default_factory=list)


def speculators_args(data: Path, target_dir: Path, save: Path, close: bool,
                     total_steps: int | None = None) -> list[str]:
    """`speculators train` flags: its defaults (3 TTT steps, muon at lr 1e-3, full vocabulary,
    8192 packed tokens, its EAGLE-3 norms) or as close to our default recipe as it allows (1 TTT
    step, AdamW 1e-3 with 30 warm-up steps and a cosine, 8192-token draft vocabulary, our
    architecture: no extra norms; 4 conversations' worth of packed tokens). Both: the schedule
    over `total_steps` (train_arm: our default job's trainer.max_steps, or --schedule-steps fitted
    to the minutes; None: the peer's own, for a loss check), the features from files only, and
    4096 packed tokens a step: at its default 8192, its full-vocabulary logits of 3 TTT steps and
    their gradients pass 20 GB (measured by its loss check), more than this 24 GB machine can give."""
    if close and not total_steps:
        raise ValueError("the close arm warms up for min(30, total_steps // 10): give total_steps")
    base = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(target_dir),
            "--data-path", str(data), "--save-path", str(save), "--target-layer-ids", "2", "15",
            "27", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers",
            "0", "--on-missing", "raise", "--epochs", "1000", "--total-seq-len", "4096"]
    if total_steps is not None:
        base += ["--scheduler-total-steps", str(total_steps)]
    if not close:
        return base
    return base + ["--ttt-steps", "1", "--optimizer", "adamw", "--lr", "1e-3",
                   "--scheduler-type", "cosine", "--scheduler-warmup-steps",
                   str(min(30, total_steps // 10)),
                   "--draft-vocab-size", "8192",
                   "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"]


def tree_hwm_mb(pid: int) -> float:
    """Largest VmHWM (MB) of process `pid` and its descendants now (0 when gone): each process's
    own peak since its exec (procstat.py says why not getrusage)."""
    best, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        best = max(best, vm_hwm_mb(p) or 0.0)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return best


def run_arm(cmd: list[str], log_file: Path, env: dict | None = None, nice: int = 10,
            every: float = 0.5) -> dict:
    """Run `cmd` under `nice`; its wall seconds and its process tree's peak RSS (MB: the largest
    VmHWM seen, sampled every `every` s; tree_hwm_mb says why not getrusage)."""
    t0, peak = time.monotonic(), 0.0
    with open(log_file, "w") as fh:
        child = subprocess.Popen(["nice", "-n", str(nice), *cmd], stdout=fh, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
        while child.poll() is None:
            peak = max(peak, tree_hwm_mb(child.pid))
            time.sleep(every)
    return {"rc": child.returncode, "wall_s": time.monotonic() - t0, "peak_rss_mb": peak}


def ours_report(run_dir: Path) -> dict:
    """Steps, training minutes and target tokens/s of our arm from its metrics.jsonl."""
    rows = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if l.strip()]
    logged = [r for r in rows if "target_tokens_per_s" in r]
    steps, prev, tok, sec = 0, 0, 0.0, 0.0
    for r in logged:  # each row: the window since the previous log line
        n = r["step"] - prev
        tok += r["tokens_per_step"] * n
        sec += r["tokens_per_step"] * n / max(r["target_tokens_per_s"], 1e-9)
        prev, steps = r["step"], r["step"]
    stop = next((r for r in rows if "train_minutes" in r), None)
    return {"steps": steps, "tokens": tok, "tokens_per_s": tok / sec if sec else None,
            "train_minutes": stop["train_minutes"] if stop else sec / 60,
            "stopped_by_budget": stop is not None}


def ours_cmd(overrides: list[str], minutes: float, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "train", *overrides, *OURS, f"trainer.max_minutes={minutes}",
            f"run_dir={run_dir}"]


def train_arm(name: str, args, overrides: list[str], data: dict, pythons: dict, cfg) -> dict:
    """Train arm `name` for args.minutes; what the table needs and where its drafter is."""
    runs = args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir, log_file = runs / name, runs / f"{name}.log"
    env = {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}  # every arm: all cores, said the same way
    steps = (getattr(args, "schedule_steps", None) or {}).get(name)  # its schedule fitted to the minutes
    total = steps or int(cfg.trainer.max_steps)  # else our default job's length, for every arm
    fitted = f"; schedule over {steps} steps" if steps else ""
    if name == "ours":
        extra = [f"trainer.max_steps={steps}"] if steps else []
        got = run_arm(ours_cmd(overrides + extra, args.minutes, run_dir), log_file, env)
        out = {**got, **ours_report(run_dir),
               "what": "default recipe (conf/budget/default_eagle3.yaml)" + fitted}
        out["drafter"] = str(run_dir / "best") if (run_dir / "best").exists() else None
        return out
    peer, flavour = name.split("-")
    report = runs / f"{name}.report.json"
    if peer == "speculators":
        from benchmarks.peers.venvs import venv_dir  # noqa: F401  (pythons came from there)

        target_dir = target_folder(cfg)
        cmd = [str(pythons[peer]), str(HERE / "speculators_cpu.py"), "--minutes", str(args.minutes),
               "--report", str(report), "--", *speculators_args(
                   args.out / "data" / "speculators", target_dir, run_dir, flavour == "close",
                   total)]
        what = ("1 TTT step, AdamW 1e-3 cosine, vocab 8192, our norms, 4096 packed tokens"
                if flavour == "close" else "its defaults (3 TTT steps, muon 1e-3, full vocab, its norms) "
                "but 4096 packed tokens (8192 passes 20 GB)")
    else:
        from benchmarks.peers.specforge_cpu import specforge_command

        cmd, what = specforge_command(pythons[peer], args, run_dir, report, flavour == "close", cfg,
                                      total)
    got = run_arm(cmd, log_file, env)
    rep = json.loads(report.read_text()) if report.is_file() else {}
    out = {**got, "what": what + fitted, "steps": rep.get("steps"),
           "train_minutes": rep.get("train_s", 0) / 60, "tokens": rep.get("tokens"),
           "tokens_per_s": rep.get("tokens", 0) / rep["train_s"] if rep.get("train_s") else None,
           "stopped_by_budget": rep.get("stopped_by_budget", False),
           "peer_peak_rss_mb": rep.get("peak_rss_mb")}
    out["drafter"] = peer_export(peer, run_dir, rep)
    if got["rc"] != 0 and out["drafter"] is None:
        out["error"] = last_error(log_file)
    return out


def target_folder(cfg) -> Path:
    """Our cached HF folder of the target (config.json, model.safetensors, tokenizer): the
    verifier the peers read, the one vLLM loads."""
    from specdistill.target.model import load_target

    from specdistill.decode.engine.check import served_target

    target = load_target(cfg.target, training=True)
    return served_target(target, Path(cfg.run_dir).parent / "target")


def peer_export(peer: str, run_dir: Path, rep: dict) -> str | None:
    """The folder in a layout vLLM reads: speculators' checkpoints are its format already
    (`speculators_model_type: eagle3`); SpecForge's is written by `specforge export --to hf`
    (specforge_cpu.py) into <run>/export."""
    if peer == "speculators":
        for sub in ("interrupted", "checkpoint_best"):
            if (run_dir / sub / "config.json").is_file():
                return str(run_dir / sub)
        done = sorted((p for p in run_dir.glob("[0-9]*") if (p / "config.json").is_file()),
                      key=lambda p: int(p.name))
        return str(done[-1]) if done else None
    return rep.get("export")


def last_error(log_file: Path) -> str:
    lines = [l.strip() for l in log_file.read_text(errors="replace").splitlines() if l.strip()]
    return next((l for l in reversed(lines) if "Error" in l or "error" in l), lines[-1] if lines else "")[:300]
