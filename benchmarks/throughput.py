"""Training throughput benchmark: target tokens/s and peak memory of one training job run single-
process, as torch DDP over N ranks and as DeepSpeed ZeRO-2 over N ranks, on each target.

    python -m benchmarks.throughput                # tiny + smollm2; single, ddp, zero2
    python -m benchmarks.throughput --targets tiny --rounds 1 --steps 3      # a quick look
    python -m benchmarks.throughput --ranks 8 --device cuda --targets llama  # on a GPU node

Every run is `python -m train` (under torchrun for N ranks) on ShareGPT with features captured
online, so a step is what training costs: the target's forward on the batch plus the drafter's
forward and backward. All modes train the same global batch (--global-batch conversations per step,
split over the ranks). A run takes 2 x --steps steps, logged in two windows: the first is warm-up,
the second is measured (the recipe's own `target_tokens_per_s`: tokens through the target per
second, all ranks together). Peak memory is the largest sum of resident memory over the job's
processes (launcher included), sampled every 0.1 s. Rounds interleave the modes (round 1: every
(target, mode), then round 2, ...), so load from other processes spreads over all of them; the
table shows the median over rounds. Results: <out>/results.json and <out>/results.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

MODES = {  # name -> (uses N ranks, trainer overrides)
    "single": (False, ["trainer.backend=torch"]),
    "ddp": (True, ["trainer.backend=torch"]),
    "zero2": (True, ["trainer.backend=deepspeed", "deepspeed=zero2"]),
}


def job_overrides(target: str, world: int, run_dir: Path, args) -> list[str]:
    """The benchmarked training job: identical in every mode but for the per-rank batch size."""
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {world} ranks")
    return [f"target={target}", f"target.device={args.device}", "data=sharegpt",
            f"data.max_conversations={args.conversations}", f"data.max_length={args.max_length}",
            "drafter=eagle", "trainer=smoke", "trainer.features=online",
            f"trainer.batch_size={args.global_batch // world}", f"trainer.max_steps={2 * args.steps}",
            f"trainer.log_every={args.steps}", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.eval_conversations=1", "trainer.final_eval=null", "logger=jsonl",
            f"run_dir={run_dir}"]


def command(mode: str, ranks: int, overrides: list[str]) -> tuple[list[str], int]:
    distributed, extra = MODES[mode]
    if not distributed:
        return [sys.executable, "-m", "specdistill.train", *extra, *overrides], 1
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "-m", "specdistill.train", *extra, *overrides], ranks


class PeakMemory:
    """Samples the summed RSS of a process and all its descendants in a background thread."""

    def __init__(self, pid: int, every_s: float = 0.1) -> None:
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                self.peak = max(self.peak, sum(_rss(p) for p in procs))
            except psutil.NoSuchProcess:
                return
            time.sleep(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def run_one(target: str, mode: str, round_: int, args, out: Path) -> dict:
    run_dir = out / "runs" / f"{target}-{mode}-r{round_}"
    cmd, world = command(mode, args.ranks, job_overrides(target, args.ranks if MODES[mode][0] else 1,
                                                         run_dir, args))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("RUN_ID", None)
    if args.threads:  # else as launched: all cores for one process, 1 per rank under torchrun
        env["OMP_NUM_THREADS"] = str(args.threads)
    log = out / "logs" / f"{target}-{mode}-r{round_}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        mem = PeakMemory(proc.pid)
        rc = proc.wait(timeout=args.timeout)
        peak = mem.stop()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{target}/{mode} failed (rc {rc}); see {log}")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    windows = [r["target_tokens_per_s"] for r in rows if "target_tokens_per_s" in r]
    if len(windows) < 2:
        raise RuntimeError(f"{target}/{mode}: expected a warm-up and a measured window in "
                           f"{run_dir / 'metrics.jsonl'}, got {len(windows)}")
    return {"target": target, "mode": mode, "ranks": world, "round": round_,
            "tokens_per_s": windows[1], "warmup_tokens_per_s": windows[0],
            "peak_mem_gib": peak / 2**30, "wall_s": wall}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def summarize(results: list[dict]) -> list[dict]:
    """Median over rounds of each (target, mode), in run order."""
    keys = list(dict.fromkeys((r["target"], r["mode"]) for r in results))
    rows = []
    for target, mode in keys:
        rs = [r for r in results if (r["target"], r["mode"]) == (target, mode)]
        base = [r for r in results if (r["target"], r["mode"]) == (target, "single")]
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        rows.append({"target": target, "mode": mode, "ranks": rs[0]["ranks"], "rounds": len(rs),
                     "tokens_per_s": tps, "all_tokens_per_s": [r["tokens_per_s"] for r in rs],
                     "vs_single": tps / statistics.median(r["tokens_per_s"] for r in base)
                     if base else None,
                     "peak_mem_gib": statistics.median(r["peak_mem_gib"] for r in rs)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| target | mode | ranks | target tokens/s (median) | per round | vs single | "
             "peak memory (GiB, all processes) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{v:.0f}" for v in r["all_tokens_per_s"])
        vs = f"{r['vs_single']:.2f}x" if r["vs_single"] is not None else "-"
        lines.append(f"| {r['target']} | {r['mode']} | {r['ranks']} | {r['tokens_per_s']:.0f} | "
                     f"{per} | {vs} | {r['peak_mem_gib']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--ranks", type=int, default=2, help="ranks of the ddp and zero2 modes")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every run")
    p.add_argument("--steps", type=int, default=4, help="steps per window (warm-up, measured)")
    p.add_argument("--global-batch", type=int, default=4, help="conversations per step, all ranks")
    p.add_argument("--max-length", type=int, default=512, help="tokens per conversation (cut)")
    p.add_argument("--conversations", type=int, default=200, help="ShareGPT conversations used")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="OpenMP threads per process (0: torch's defaults)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path,
                   default=Path("runs/bench") / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results, load_before = [], os.getloadavg()[0]
    for round_ in range(1, args.rounds + 1):
        for target in args.targets:
            for mode in args.modes:
                res = run_one(target, mode, round_, args, args.out)
                print(f"round {round_} {target:>8} {mode:>6} x{res['ranks']}: "
                      f"{res['tokens_per_s']:8.0f} target tokens/s, peak {res['peak_mem_gib']:.2f} "
                      f"GiB ({res['wall_s']:.0f} s)", flush=True)
                results.append(res)
    rows = summarize(results)
    table = markdown(rows)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{_cpu_name()}, {psutil.cpu_count()} cores, "
                       f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {_gpu_name()}",
            "command": "python -m benchmarks.throughput "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "load_average_1min": [load_before, os.getloadavg()[0]],  # other processes' load
            "settings": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "results.json").write_text(json.dumps({**meta, "runs": results, "summary": rows},
                                                      indent=2))
    (args.out / "results.md").write_text(
        f"{meta['date']}, {meta['machine']}, load average {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f}\n\n`{meta['command']}`\n\n{table}\n")
    print(table)
    print(f"results: {args.out / 'results.json'}, {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
