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
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.procstat import status_mbs
from specdistill.train.precision import training_precision

HERE = Path(__file__).resolve().parent
# the default job at the benchmark's data size: its recipe (conf/budget/default_eagle3.yaml),
# offline features from the same capture, no evals or engine check inside the timed run
OURS = ["trainer.final_eval=null", "trainer.engine_check=null", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.log_every=5"]


@dataclass(frozen=True)
class ArmName:
    """What an arm's name says: `ours`, `<peer>-<flavour>` (EAGLE-3) or `ours-dspark`,
    `<peer>-dspark-<flavour>` (DSpark). flavour: default (the peer's shipped settings) | close (as
    close to our recipe as the peer allows) | ours."""

    peer: str | None  # None = ours
    algo: str  # eagle3 | dspark
    flavour: str

    @classmethod
    def parse(cls, name: str) -> "ArmName":
        parts = name.split("-")
        algo = "dspark" if "dspark" in parts[1:] else "eagle3"
        rest = [p for p in parts[1:] if p != "dspark"]
        if parts[0] == "ours" and not rest:
            return cls(None, algo, "ours")
        if parts[0] != "ours" and len(rest) == 1 and rest[0] in ("default", "close"):
            return cls(parts[0], algo, rest[0])
        raise ValueError(f"arm {name!r}: not ours[-dspark] or <peer>[-dspark]-default|close")

    @property
    def reference(self) -> str:
        """The arm every arm of this algorithm is paired against: our own."""
        return "ours" if self.algo == "eagle3" else f"ours-{self.algo}"


# our trainer.precision -> the peers' dtype names (speculators' --hidden-states-dtype, SpecForge's
# model.torch_dtype)
PEER_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}


def speculators_args(data: Path, target_dir: Path, save: Path, close: bool,
                     total_steps: int | None = None, algo: str = "eagle3",
                     layers: tuple[int, ...] = (2, 15, 27), anchors: int | None = None,
                     precision: str = "bf16") -> list[str]:
    """`speculators train` flags for `algo`, its shipped defaults or as close to our default
    recipe as it allows; both: the schedule over `total_steps` (train_arm: our default job's
    trainer.max_steps, or --schedule-steps fitted to the minutes; None: the peer's own, for a loss
    check), the features of `layers` from files only, and 4096 packed tokens a step (at its default
    8192, EAGLE-3's full-vocabulary logits of 3 TTT steps and their gradients pass 20 GB, measured
    by its loss check: more than this 24 GB machine can give).

    eagle3: its defaults (3 TTT steps, muon at lr 1e-3, full vocabulary, its EAGLE-3 norms); close:
    1 TTT step, AdamW 1e-3 with 30 warm-up steps and a cosine, 8192-token draft vocabulary, our
    architecture (no extra norms).
    dspark: its defaults (5 layers, block 8, KL, full vocabulary, muon, 512 anchors); close: ours
    (conf/drafter/dspark.yaml): 1 layer, block 4, 8192-token vocabulary, CE 0.1 + TV 1.8 (our
    0.9 L1 = 0.9 sum |q - p| = 1.8 TV), `anchors` anchors a step (ours: 0.1 of the scored
    positions), AdamW 1e-3 cosine as above; the confidence head and exp(-k/4) slot weights are
    both peers' defaults.

    `precision` (close arms): our job's training precision on this machine (trainer.precision=auto:
    bf16 where the CPU runs it natively, else fp32), given to speculators as --hidden-states-dtype,
    its autocast dtype (bf16 unless told: on a CPU without native bf16, an AVX2 EPYC, its bf16
    autocast made 17 steps in 10 minutes where ours, at fp32, made 270); the default arms keep its
    bf16."""
    if close and not total_steps:
        raise ValueError("the close arm warms up for min(30, total_steps // 10): give total_steps")
    if algo not in ("eagle3", "dspark"):
        raise ValueError(f"algo={algo!r}: the arms train eagle3 or dspark")
    if precision not in PEER_DTYPE:
        raise ValueError(f"precision={precision!r}: our resolved trainer.precision is bf16 or fp32")
    if algo == "dspark" and close and not anchors:
        raise ValueError("the close DSpark arm trains our share of anchors: give anchors")
    base = ["--speculator-type", algo, "--verifier-name-or-path", str(target_dir),
            "--data-path", str(data), "--save-path", str(save), "--target-layer-ids",
            *map(str, layers), "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
            "--num-workers", "0", "--on-missing", "raise", "--epochs", "1000", "--total-seq-len", "4096"]
    if total_steps is not None:
        base += ["--scheduler-total-steps", str(total_steps)]
    if not close:
        return base
    schedule = ["--optimizer", "adamw", "--lr", "1e-3", "--scheduler-type", "cosine",
                "--scheduler-warmup-steps", str(min(30, total_steps // 10)), "--draft-vocab-size", "8192",
                "--hidden-states-dtype", PEER_DTYPE[precision]]
    if algo == "dspark":
        return base + schedule + ["--num-layers", "1", "--block-size", "4", "--max-anchors", str(anchors),
                                  "--loss-fn", json.dumps({"ce": 0.1, "tv": 1.8})]
    return base + schedule + ["--ttt-steps", "1", "--no-norm-before-residual", "--no-norm-before-fc",
                              "--no-norm-output"]


def close_anchors(data: dict, tokens: int = 4096, share: float = 0.1) -> int:
    """Anchors a step of `tokens` packed tokens at our DSpark's share of the scored positions
    (drafter.anchors = 0.1): share x tokens x the data's scored share."""
    return max(1, round(share * tokens * data["answer_tokens"] / data["tokens"]))


# one line for the table: what each speculators arm sets
SPECULATORS_WHAT = {
    ("eagle3", "close"): "1 TTT step, AdamW 1e-3 cosine, vocab 8192, our norms, 4096 packed tokens, "
                         "{precision} as ours",
    ("eagle3", "default"): "its defaults (3 TTT steps, muon 1e-3, full vocab, its norms) but 4096 "
                           "packed tokens (8192 passes 20 GB)",
    ("dspark", "close"): "DSpark as ours: 1 layer, block 4, vocab 8192, CE 0.1 + TV 1.8, {anchors} "
                         "anchors, AdamW 1e-3 cosine, 4096 packed tokens, {precision} as ours",
    ("dspark", "default"): "its DSpark defaults (5 layers, block 8, KL, full vocab, muon 1e-3, 512 "
                           "anchors), 4096 packed tokens",
}


def tree_peak_mb(pid: int, keys: tuple[str, ...] = ("VmHWM",)) -> dict[str, float]:
    """Largest /proc status field of each of `keys` (MB) over process `pid` and its descendants
    now (0 when gone), one walk of the tree. VmHWM: each process's own peak since its exec
    (procstat.py says why not getrusage); RssAnon: its anonymous resident memory now (heap,
    tensors: not the mapped weights and libraries the OS can drop and re-read)."""
    best, todo = dict.fromkeys(keys, 0.0), [pid]
    while todo:
        p = todo.pop()
        for key, mb in status_mbs(keys, p).items():
            best[key] = max(best[key], mb)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return best


def run_arm(cmd: list[str], log_file: Path, env: dict | None = None, nice: int = 10,
            every: float = 0.5) -> dict:
    """Run `cmd` under `nice`; its wall seconds, its process tree's peak RSS (MB: the largest
    VmHWM seen, sampled every `every` s; tree_peak_mb says why not getrusage) and its peak
    anonymous memory (the largest RssAnon sampled: a lower bound, between samples it may have
    been higher)."""
    t0, peak = time.monotonic(), {"VmHWM": 0.0, "RssAnon": 0.0}
    with open(log_file, "w") as fh:
        child = subprocess.Popen(["nice", "-n", str(nice), *cmd], stdout=fh, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
        while child.poll() is None:
            for key, mb in tree_peak_mb(child.pid, tuple(peak)).items():
                peak[key] = max(peak[key], mb)
            time.sleep(every)
    return {"rc": child.returncode, "wall_s": time.monotonic() - t0, "peak_rss_mb": peak["VmHWM"],
            "peak_anon_mb": peak["RssAnon"]}


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
    arm = ArmName.parse(name)
    if arm.algo == "dspark":  # our DSpark job's composed config: its own trainer.max_steps
        from benchmarks.replaying import compose

        cfg = compose(overrides + OURS + ["drafter=dspark"])
    total = steps or int(cfg.trainer.max_steps)  # else our job's length, for every arm of its algo
    fitted = f"; schedule over {steps} steps" if steps else ""
    if arm.peer is None:
        extra = ([f"trainer.max_steps={steps}"] if steps else []) + (
            ["drafter=dspark"] if arm.algo == "dspark" else [])
        got = run_arm(ours_cmd(overrides + extra, args.minutes, run_dir), log_file, env)
        recipe = ("conf/drafter/dspark.yaml on the default job" if arm.algo == "dspark"
                  else "default recipe (conf/budget/default_eagle3.yaml)")
        sets = "".join(f"; {o}" for o in getattr(args, "set", None) or [])  # --set: said in the table
        out = {**got, **ours_report(run_dir), "what": recipe + fitted + sets}
        out["drafter"] = str(run_dir / "best") if (run_dir / "best").exists() else None
        return out
    report = runs / f"{name}.report.json"
    close = arm.flavour == "close"
    precision = training_precision(cfg.trainer.precision, cfg.trainer.capture_autocast, "cpu")[0]
    if arm.peer == "speculators":
        target_dir = target_folder(cfg)
        anchors = close_anchors(data) if arm.algo == "dspark" and close else None
        cmd = [str(pythons[arm.peer]), str(HERE / "speculators_cpu.py"), "--minutes", str(args.minutes),
               "--report", str(report), "--", *speculators_args(
                   args.out / "data" / "speculators", target_dir, run_dir, close, total, arm.algo,
                   tuple(data["aux_layers"]), anchors, precision)]
        what = SPECULATORS_WHAT[arm.algo, arm.flavour].format(anchors=anchors, precision=precision)
    elif arm.algo == "eagle3":
        from benchmarks.peers.specforge_cpu import specforge_command

        cmd, what = specforge_command(pythons[arm.peer], args, run_dir, report, close, cfg, total,
                                      precision)
    else:
        raise ValueError(f"arm {name}: {arm.peer} has no {arm.algo} arm here (speculators has)")
    got = run_arm(cmd, log_file, env)
    rep = json.loads(report.read_text()) if report.is_file() else {}
    out = {**got, "what": what + fitted, "steps": rep.get("steps"),
           "train_minutes": rep.get("train_s", 0) / 60, "tokens": rep.get("tokens"),
           "tokens_per_s": rep.get("tokens", 0) / rep["train_s"] if rep.get("train_s") else None,
           "stopped_by_budget": rep.get("stopped_by_budget", False),
           "peer_peak_rss_mb": rep.get("peak_rss_mb")}
    out["drafter"] = peer_export(arm.peer, run_dir, rep)
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
    errors = (l for l in reversed(lines) if "Error" in l or "error" in l)
    return next(errors, lines[-1] if lines else "")[:300]
