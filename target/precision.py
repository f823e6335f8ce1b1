"""Which dtype and how many CPU threads the frozen target runs with.

`target.dtype=auto` picks the fastest dtype that the hardware runs natively, because "lossless"
speculative decoding is defined against plain decoding at the SAME dtype: bf16 is as lossless as
fp32 there, and on a CPU with native bf16 a verify forward of 6 tokens costs about one fp32 step.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# CPU flags (as /proc/cpuinfo names them) of native bf16 matmuls: with one of them a bf16 forward
# is faster than fp32 (SmolLM2 one-token step 0.76x, 6-token verify 1.08 steps vs 1.49:
# BENCHMARKS.md "Fast decoding on CPUs").
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass
class DtypeChoice:
    """The dtype a target runs at and why: recorded in logs and in decode's result.json, since
    "lossless" means identical to plain decoding with the same target AT THE SAME DTYPE."""

    requested: str  # the target.dtype setting ("auto", "bfloat16", ...)
    dtype: str  # the resolved torch dtype name ("bfloat16", "float32", ...)
    check: str  # what decided it, in words
    cpu_flags: list[str] = field(default_factory=list)  # the native-bf16 CPU flags found

    def as_dict(self) -> dict[str, Any]:
        return {"target_dtype": self.dtype, "target_dtype_requested": self.requested,
                "dtype_check": self.check, "cpu_bf16_flags": self.cpu_flags}


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (Linux); empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86: flags, arm64: Features
            return set(line.split(":", 1)[1].split())
    return set()


def resolve_dtype(requested: str, device: str, training: bool = False,
                  setting: str = "target.dtype") -> DtypeChoice:
    """The dtype a target runs at: `requested` itself, or for "auto" the fastest lossless one.

    auto -> bfloat16 on a CPU with native bf16 matmuls (NATIVE_BF16_FLAGS) or a CUDA device that
    supports bf16, float32 elsewhere. Training resolves auto to float32: the trainer reads the
    target's features and logits at its dtype and speeds them up with autocast
    (trainer.capture_autocast), so its numerics stay what they were before "auto" existed.
    `setting`: the key the user set it with, named in the error (data.selfgen.dtype, ...).
    """
    if requested != "auto" and requested not in DTYPES:
        raise ValueError(f"unknown {setting} {requested!r}; use auto or one of "
                         f"{sorted(DTYPES)}")
    if requested != "auto":
        name = str(DTYPES[requested]).removeprefix("torch.")
        return DtypeChoice(requested, name, "set explicitly")
    if training:
        return DtypeChoice(requested, "float32", "training: auto is float32 (autocast does the rest)")
    native, why, found = native_bf16(device)
    return DtypeChoice(requested, "bfloat16" if native else "float32", why, found)


def native_bf16(device: str) -> tuple[bool, str, list[str]]:
    """Does `device` run bf16 matmuls natively? (yes/no, what decided it in words, the CPU's
    native-bf16 flags found). Without them torch runs bf16 on a CPU 3-100x slower than fp32
    (an AVX2-only EPYC: BENCHMARKS.md "Training precision where bf16 is not native")."""
    if device.startswith("cuda"):
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, f"torch.cuda.is_bf16_supported() = {ok}", []
    if device != "cpu":
        return False, f"device {device}: no bf16 check, float32", []
    found = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags())
    return bool(found), (f"/proc/cpuinfo flags {' or '.join(NATIVE_BF16_FLAGS)}: "
                         f"{'found ' + ', '.join(found) if found else 'none found'}"), found


def available_cores() -> int:
    """CPU cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a
    container allowed 2 CPUs of a 64-core host would otherwise run 64 contending threads)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def idle_cores() -> int:
    """available_cores() minus the 1-minute load average of the machine (rounded up, at least 1).

    Why: torch's OpenMP threads meet at a barrier after every op, so one thread descheduled by
    another process stalls them all. On the shared 2-core machine at load ~8, a SmolLM2 bf16
    one-token step took 5.3 s with 2 threads and 0.26 s with 1 (BENCHMARKS.md "Fast decoding on CPUs")."""
    n = available_cores()
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return n
    return max(1, min(n, math.ceil(n - load)))


def set_threads(threads: int = 0) -> int:
    """Set torch's CPU threads to `threads`; with 0, lower them to idle_cores() when torch would
    run more (never raised: a caller that chose fewer, e.g. a test on tiny models, keeps its
    choice). Returns the number now in use."""
    n = threads or min(torch.get_num_threads(), idle_cores())
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def cast_floats(model: torch.nn.Module, dtype: torch.dtype,
                keep: set[int] | frozenset[int] = frozenset()) -> torch.nn.Module:
    """Cast `model`'s floating parameters and persistent buffers to `dtype` in place, leaving it as
    `from_pretrained(dtype=...)` does: non-persistent buffers stay as built. They are what the
    modules compute from the config, RoPE's `inv_freq` in fp32 above all: `model.to(bfloat16)`
    rounds the rotary frequencies to bf16, which shifts the angles of position p by up to p x 1.4e-3
    rad (SmolLM2: 0.71 rad at position 512), so a model cast that way is not the model a later
    `from_pretrained` load, an engine, or training ran. Tensors whose data_ptr is in `keep` (weights
    shared with another model) are left as they are. Returns `model`."""
    for mod in model.modules():
        transient = getattr(mod, "_non_persistent_buffers_set", set())
        for store, is_buffer in ((mod._parameters, False), (mod._buffers, True)):
            for name, t in store.items():
                if (t is None or not t.is_floating_point() or t.data_ptr() in keep
                        or (is_buffer and name in transient)):
                    continue
                t.data = t.data.to(dtype)
    return model


def model_at(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` itself when it runs at `dtype`, else a copy cast by `cast_floats` (e.g. a bf16
    generation copy of an fp32 training target: the same model, RoPE frequencies included)."""
    if next(model.parameters()).dtype == dtype:
        return model
    return cast_floats(copy.deepcopy(model), dtype)
