"""Entry point of the multi-process tests: `python -m train` (same Hydra overrides) with test-only
instrumentation, launched as a real process by python or torchrun (tests/test_distributed.py).

Environment:
  SPECDISTILL_FAULT  "ckpt:<step>": rank 0 writes half of the step-<step> checkpoint's
                     trainer_state.pt, then stops there (the test kill -9s the job: a crash in
                     the middle of a checkpoint write).
                     "step:<step>" or "step:<step>:<rank>": every rank (or one rank) stops in
                     step <step> after the forward pass, before the backward (a kill -9 in the
                     middle of a step, or a hung rank that the others must time out on).
  SPECDISTILL_MARK   a folder: a stopped rank writes `paused-<rank>` there, so the test knows
                     when to act.
  SPECDISTILL_DUMP   "1": after training every rank writes the drafter weights it holds to
                     <run_dir>/weights-rank<r>.safetensors (nodes and ranks are compared).
"""
import io
import os
import runpy
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdistill.store import rundir as runs
from specdistill.train import recipe as recipe_mod

RANK = int(os.environ.get("RANK", "0"))


def stop_here(what: str) -> None:
    """Tell the test where this rank stopped, then wait (a kill -9 or a peer's timeout ends it)."""
    mark = Path(os.environ["SPECDISTILL_MARK"])
    mark.mkdir(parents=True, exist_ok=True)
    (mark / f"paused-{RANK}").write_text(what)
    while True:
        time.sleep(60)


def fault_in_checkpoint(step: int) -> None:
    real_save = torch.save
    staging = f".tmp-step-{step:07d}"

    def save(obj, f, *args, **kwargs):
        path = Path(f) if isinstance(f, (str, os.PathLike)) else None
        if path is not None and path.name == runs.STATE and path.parent.name == staging:
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            with open(path, "wb") as fh:  # half a file on disk, as a crash mid-write leaves it
                fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                fh.flush()
                os.fsync(fh.fileno())
            stop_here(f"ckpt:{step}")
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def fault_in_step(step: int, rank: int | None) -> None:
    current = {"step": 0}
    real_step, real_loss = recipe_mod.DistillRecipe.train_step, recipe_mod.drafter_loss

    def train_step(self):
        current["step"] = self.step + 1
        return real_step(self)

    def loss(*args, **kwargs):
        out = real_loss(*args, **kwargs)
        if current["step"] == step and rank in (None, RANK):
            stop_here(f"step:{step}")
        return out

    recipe_mod.DistillRecipe.train_step = train_step
    recipe_mod.drafter_loss = loss


def dump_weights() -> None:
    real_cleanup = recipe_mod.DistillRecipe.cleanup

    def cleanup(self):
        with self.backend.full_weights():  # collective: ZeRO-3 gathers on every rank
            state = {k: v.detach().float().cpu().contiguous()
                     for k, v in self.drafter.state_dict().items() if v.is_floating_point()}
            save_file(state, str(self.run_dir / f"weights-rank{RANK}.safetensors"))
        real_cleanup(self)

    recipe_mod.DistillRecipe.cleanup = cleanup


def main() -> None:
    fault = os.environ.get("SPECDISTILL_FAULT", "")
    if fault.startswith("ckpt:"):
        fault_in_checkpoint(int(fault.split(":")[1]))
    elif fault.startswith("step:"):
        parts = fault.split(":")
        fault_in_step(int(parts[1]), int(parts[2]) if len(parts) > 2 else None)
    if os.environ.get("SPECDISTILL_DUMP") == "1":
        dump_weights()
    # as `python -m specdistill.train` runs it (any folder: conf/ is found by absolute path)
    runpy.run_module("specdistill.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
