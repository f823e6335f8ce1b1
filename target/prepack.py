"""Linear layers of a frozen fp32 CPU model through oneDNN with weights packed once at load, for
the forwards of decoding (one-token steps, verify blocks of k+1 tokens, tree verifies, batched
steps, prefill).

Why: torch's fp32 `F.linear` on CPUs calls MKL's sgemm, which repacks the weight matrix on every
call; a matmul of 2-4 rows then costs 2-3.5x the one-row GEMV, though both just stream the weights
from memory, and the GEMV does not gain from a second thread. Measured on the 2-core AVX2 AMD EPYC,
torch 2.13 (MKL 2024.2, oneDNN 3.12), SmolLM2's head (49152 x 576 fp32, four copies so the weights
come from memory), 2 threads, ms per call (inline micro-benchmark; BENCHMARKS.md "Prepacked linear
layers"):

    | rows                  | 1    | 2    | 3    | 4    | 8    | 64   |
    | F.linear              | 10.1 | 22.6 | 34.8 | 17.5 | 16.5 | 40.8 |
    | oneDNN, packed once   |  5.2 |  4.7 |  6.6 |  6.7 |  7.1 | 24.6 |
    | MKL, packed once      |  5.2 |  9.4 | 18.0 | 15.7 | 16.7 | 37.9 |

(one thread: 1 row equal, 2-4 rows 2-4x faster). A 3-token verify of the whole target cost 2.05
one-token steps, so speculative decoding ran at 0.65x plain in fp32 on that CPU; packed, a verify of
2-8 tokens costs about one step.

What this does: `use_prepacked_linear(model)` packs every nn.Linear weight of an fp32 CPU model for
oneDNN once (`torch.ops.mkldnn._reorder_linear_weight`) and routes its forwards through
`torch.ops.mkldnn._linear_pointwise`. The original weights stay (they are parameters others read:
tied embeddings, drafters sharing the head, fingerprints, exports), so the packed copies cost one
more copy of the linear weights: packing is skipped (and logged) where that does not fit in a
quarter of the machine's available memory. Inert where it does not apply: 16-bit weights (bf16 CPUs
have their own fast path), a non-CPU device, a forward that needs a gradient (grad mode on and the
weight or the input requiring one), copies of the model (deepcopy, `.to`), torch without the ops, or
inside `disabled()` (exact verification keeps torch's kernels, decode/exact.py). The packed copy is
taken once: weights changed in place afterwards are not seen (targets are frozen). The outputs round
differently from F.linear's (~1e-4 absolute on SmolLM2's logits); greedy decoding then can differ
from an unpacked run at near-ties, as any kernel change does; plain and speculative decoding of one
target run the same kernels.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import types
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Linear -> its packed weight, outside the module: copies (deepcopy, `.to(dtype)` copies) carry no
# opaque oneDNN tensor and run F.linear; state_dict and checkpoints never see it
_PACKS: "weakref.WeakKeyDictionary[nn.Linear, torch.Tensor]" = weakref.WeakKeyDictionary()
MEMORY_SHARE = 0.25  # the packed copies may take at most this share of the available memory
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("specdistill_prepack_off", default=False)


def supported() -> bool:
    """Whether this torch has oneDNN and the packed-linear ops."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))


def _available_bytes() -> int | None:
    """Available memory (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through the packed weight where it applies (see the module doc)."""
    packed = _PACKS.get(self)
    if (packed is None or _OFF.get() or x.dtype != torch.float32 or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
        return F.linear(x, self.weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


def use_prepacked_linear(model: nn.Module, batch_hint: int = 4) -> int:
    """Pack the fp32 CPU nn.Linear weights of a frozen `model` (see the module doc; layers packed
    already, e.g. a target head a drafter shares, stay as they are); returns how many were packed
    (0: none applicable, logged). batch_hint: the rows oneDNN tunes the layout for (4
    measured as fast as packing per row count, for 1-300 rows)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m not in _PACKS
               and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    if not linears:
        return 0
    if not supported():
        log.info("prepacked linear layers: not in this torch build (oneDNN ops missing); F.linear")
        return 0
    need = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    avail = _available_bytes()
    if avail is not None and need > MEMORY_SHARE * avail:
        log.info("prepacked linear layers: skipped, %.2f GB of packed weights > %d%% of the %.2f GB "
                 "available", need / 1e9, int(100 * MEMORY_SHARE), avail / 1e9)
        return 0
    with torch.no_grad():
        for m in linears:
            _PACKS[m] = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), batch_hint)
            m.forward = types.MethodType(_packed_forward, m)
    log.info("prepacked linear layers: %d fp32 weights (%.2f GB) packed for oneDNN",
             len(linears), need / 1e9)
    return len(linears)


@contextlib.contextmanager
def prepacked(model: nn.Module) -> Iterator[int]:
    """`use_prepacked_linear(model)` inside the block only (e.g. a training target's generation
    phase): the layers packed here are unpacked at exit; yields how many were packed."""
    before = {m for m in model.modules() if m in _PACKS}
    n = use_prepacked_linear(model)
    try:
        yield n
    finally:
        for m in model.modules():
            if m in _PACKS and m not in before:
                del _PACKS[m]
                m.__dict__.pop("forward", None)  # back to nn.Linear.forward


def is_prepacked(model: nn.Module) -> bool:
    return any(m in _PACKS for m in model.modules() if isinstance(m, nn.Linear))


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Torch's own F.linear for every packed layer inside the block (this thread / task only)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)

