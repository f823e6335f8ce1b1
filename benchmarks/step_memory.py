"""Where a training step's memory goes: the peak anonymous resident memory (RssAnon) inside each
phase of a step of the job, over the floor the step starts from.

    python -m benchmarks.step_memory --set drafter=dspark          # DSpark on the default job
    python -m benchmarks.step_memory --steps 4                     # the default job (EAGLE-3)
    python -m benchmarks.step_memory --set trainer.on_policy_heads_start=0   # its on-policy steps

Builds the job's recipe (the default job at --conversations, its offline capture, plus --set), runs
--warmup steps (the optimizer's state appears at the first), then --steps steps each started from
a trimmed heap (train/memory.py release_free_memory) while a thread reads /proc/self/status every
few milliseconds and books the largest RssAnon under the phase running: the batch's features read
back (`features`), its teacher (`teacher`, train/teacher.py), the drafter's forward, the target
scoring the drafter's own drafts (`score`, the on-policy phase's), the loss, the backward, the
optimizer step. Per phase anonymous memory; the capture's and the target's mapped pages are
file-backed (the job unmaps the capture after each batch), booked apart as the step's peak RssFile
over its floor (`file`: the target's weights, paged in by an on-policy step). Linux only (/proc).
Memory is not a timing: a loaded machine gives the same numbers, only later.

Prints a table (MB over the step's floor, the floor itself absolute) and writes <out>/step_memory.json.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

from benchmarks.peers.procstat import status_mb, status_mbs

PHASES = ("features", "teacher", "forward", "score", "loss", "backward", "optimizer")


def rss_anon_mb() -> float:
    got = status_mb("RssAnon")
    if got is None:
        raise SystemExit("step_memory reads /proc/self/status (RssAnon): Linux only")
    return got


class PhasePeaks:
    """The largest RssAnon seen under each phase name, sampled by a daemon thread."""

    def __init__(self, every: float = 0.003) -> None:
        self.phase, self.peaks, self.file_peak, self.every = "floor", {}, 0.0, every
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            got, phase = status_mbs(("RssAnon", "RssFile")), self.phase  # one read of /proc
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), got["RssAnon"])
            self.file_peak = max(self.file_peak, got.get("RssFile", 0.0))
            time.sleep(self.every)

    def wrap(self, owner, name: str, phase: str) -> None:
        """owner.name runs under `phase` (the phase before it resumes afterwards)."""
        inner = getattr(owner, name)

        def run(*args, **kwargs):
            before, self.phase = self.phase, phase
            try:
                return inner(*args, **kwargs)
            finally:
                self.phase = before
        setattr(owner, name, run)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/step_memory"))
    ap.add_argument("--conversations", type=int, default=900, help="data.max_conversations")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides of the job")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from benchmarks.replaying import compose
    from specdistill.train import recipe as R
    from specdistill.train.memory import release_free_memory

    torch.set_num_threads(args.threads)
    cfg = compose([f"data.max_conversations={args.conversations}", "trainer.final_eval=null",
                   "trainer.engine_check=null", "trainer.eval_every=0", "trainer.save_every=0",
                   f"run_dir={args.out / 'run'}", *args.set])
    job = R.DistillRecipe(cfg)
    job.setup()
    for _ in range(args.warmup):
        job.train_step()
    peaks = PhasePeaks()
    peaks.wrap(job, "target_outputs", "features")
    peaks.wrap(R, "train_batch", "teacher")
    peaks.wrap(job.model, "forward", "forward")
    peaks.wrap(R, "score_own_drafts", "score")
    peaks.wrap(R, "drafter_loss", "loss")
    peaks.wrap(job.backend, "backward", "backward")
    peaks.wrap(job.backend, "step", "optimizer")
    rows = []
    for _ in range(args.steps):
        release_free_memory(job.offline, collect=True)
        time.sleep(0.05)
        peaks.peaks, peaks.phase, peaks.file_peak = {}, "step", 0.0
        floor, file_floor = rss_anon_mb(), status_mb("RssFile") or 0.0
        tokens = job.train_step()["tokens"]
        time.sleep(0.02)
        got = dict(peaks.peaks)
        rows.append({"floor_mb": floor, "tokens": tokens, "step_mb": max(got.values()) - floor,
                     **{p: got[p] - floor for p in PHASES if p in got},
                     "file_floor_mb": file_floor, "file_mb": peaks.file_peak - file_floor})
    header = ["step", "floor MB", "tokens", "peak over floor", *PHASES, "file floor MB", "file"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for i, r in enumerate(rows):
        cells = [str(i + 1), f"{r['floor_mb']:.0f}", str(r["tokens"]), f"+{r['step_mb']:.0f}",
                 *(f"+{r[p]:.0f}" if p in r else "-" for p in PHASES),
                 f"{r['file_floor_mb']:.0f}", f"+{r['file_mb']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_memory.json").write_text(json.dumps(
        {"overrides": args.set, "threads": args.threads, "steps": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
