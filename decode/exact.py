"""Exact verification: every row of a verify forward computed with the same kernels, shapes and
reduction lengths as a one-token step, so speculative greedy output is bit-identical to plain
decoding at any dtype (`decode.exact_verify`).

Why it is needed: at bf16 a forward over n tokens and n one-token forwards round differently, and
greedy near-ties flip (BENCHMARKS.md: 31-35 of 40 MT-bench answers differed from plain bf16
decoding somewhere in 256 tokens, every first difference within 1-2 bf16 spacings). Measured on the
2-core AVX512-BF16 CPU, torch 2.13, oneDNN (2026-12-01), three things make a row depend on the
forward's shape:
  1. matmul of ONE row (a GEMV kernel) rounds differently from the same row inside a matmul of
     M >= 2 rows; GEMMs of M = 2..16 rows agree with each other row for row;
  2. attention over a KV cache of length L + i (a one-token step) and over L + n with the tail
     masked (row i of a verify) reduce over different lengths;
  3. SDPA's fused CPU kernel partitions its work by the number of (batch x head) items, so even at
     a fixed length a one-row call and a many-row call can differ.
What this module does, each piece removing one cause:
  1. every nn.Linear of the target runs one-row inputs as two identical rows (so all forwards use
     the GEMM family) and keeps the first: costs ~3% of a bf16 step, nothing else changes;
  2. the target's KV cache is a transformers StaticCache (capacity = prompt + max_new_tokens): every
     attention reduces over the same length, the unused tail masked; explicit masks are passed;
  3. attention is computed by plain ops: scores = q k^T (all query rows of a KV head in one matmul,
     M = heads-per-KV-head x rows >= 2), an fp32 softmax over the full length, then p v.
Every query row then sees exactly the arithmetic of a one-token step (tested bitwise on the tiny
target and on SmolLM2 at bf16: tests/test_exact_verify.py). The reliance on GEMM row-consistency
for M >= 2 is an observed property of the CPU kernels, not a guarantee of torch: the benchmark
counts flips, and `first_difference` still classifies any that remain.

Scope: the target's forwards inside `generate(..., exact_verify=True)` (plain and speculative, chain
and tree); outside `active()` the hooks and the attention function pass through to the target's own
attention implementation unchanged. Batched decoding: decode/batched/exact.py keeps each row as its
lone exact decode would, and `active(capacities)` reduces row r over its own capacity.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from transformers import AttentionInterface, StaticCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdistill.target import prepack
from specdistill.target.attention import grouped_attention

ATTN_NAME = "specdistill_exact"  # + "_<the target's own implementation>", registered at install
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("specdistill_exact", default=False)
# batched exact decoding (decode/batched/exact.py): each row's own capacity, None = one sequence
_ROWS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar(
    "specdistill_exact_rows", default=None)


def exact_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention whose row i is computed exactly as a one-token step's (inside `active()`).

    query (B, H, q, d); key / value (B, Hkv, L, d) (L = the static cache's capacity);
    attention_mask (B, 1, q, L) bool, True = attend. Returns (B, q, H, d), as transformers'
    attention functions do. Outside `active()`: the target's own implementation."""
    if not _ACTIVE.get():
        fallback = getattr(module.config, "_specdistill_attn", None) or "sdpa"
        return ALL_ATTENTION_FUNCTIONS[fallback](module, query, key, value, attention_mask,
                                                 scaling=scaling, dropout=dropout, **kwargs)
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise ValueError("exact verification passes explicit boolean attention masks; got "
                         f"{None if attention_mask is None else attention_mask.dtype}")
    # 1. scores of every query row of a KV head in one matmul (a single row runs twice, as the
    #    linears do: GEMM, never GEMV), 2. the mask over the whole capacity, an fp32 softmax, 3. p v
    caps = _ROWS.get()
    if caps is None:
        out = grouped_attention(query, key, value, attention_mask, scaling, two_rows=True)
    else:  # a batch: row r reduces over its own capacity, as its lone decode does
        if len(caps) != query.shape[0]:
            raise ValueError(f"exact batched attention: {len(caps)} row capacities for "
                             f"{query.shape[0]} rows")
        out = torch.cat([grouped_attention(query[r:r + 1], key[r:r + 1, :, :c],
                                           value[r:r + 1, :, :c], attention_mask[r:r + 1, ..., :c],
                                           scaling, two_rows=True)
                         for r, c in enumerate(caps)])  # (B, H, q, d)
    return out.transpose(1, 2).contiguous(), None  # (B, q, H, d)


def _pad_one_row(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: a one-row input (..., 1, K) runs as two identical rows (GEMM, not GEMV)."""
    x = args[0]
    module._specdistill_padded = _ACTIVE.get() and x.dim() >= 2 and x.numel() == x.shape[-1]
    if not module._specdistill_padded:
        return None
    return (torch.cat([x, x], dim=-2),) + tuple(args[1:])  # (..., 2, K)


def _first_row(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Forward hook: keep the first of the two rows `_pad_one_row` made."""
    if not getattr(module, "_specdistill_padded", False):
        return None
    module._specdistill_padded = False
    return out[..., :1, :]  # (..., 1, N)


def install(target: Any) -> None:
    """Make `target` (target.model.Target) able to verify exactly: the attention function and
    the linear hooks, both inert outside `active()`. Idempotent."""
    model = target.model
    if getattr(model, "_specdistill_exact", False):
        return
    own = model.config._attn_implementation  # the fallback, e.g. "sdpa"
    name = f"{ATTN_NAME}_{own}"
    # transformers builds the masks per implementation name: ours get the fallback's masks, so a
    # forward outside `active()` sees exactly what it saw before (the explicit masks pass through)
    AttentionInterface.register(name, exact_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[own])
    model.config._specdistill_attn = own
    model.set_attn_implementation(name)
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_pre_hook(_pad_one_row)
            mod.register_forward_hook(_first_row)
    model._specdistill_exact = True


@contextlib.contextmanager
def active(capacities: Sequence[int] | None = None) -> Iterator[None]:
    """Exact kernels for the target forwards inside the block (this thread / task only).
    capacities: a batched forward's row capacities (decode/batched/exact.py); row r's attention then
    reduces over its first capacities[r] cache columns only."""
    token = _ACTIVE.set(True)
    rows = _ROWS.set(tuple(int(c) for c in capacities) if capacities is not None else None)
    try:
        with prepack.disabled():  # torch's own linear kernels (target/prepack.py)
            yield
    finally:
        _ROWS.reset(rows)
        _ACTIVE.reset(token)


def resolve_exact(setting: bool | str, dtype: torch.dtype, tree: bool) -> bool:
    """decode's `exact_verify`: true / false, or auto = on for greedy-exact chains where it is
    needed and cheap: a 16-bit target (bf16 / fp16; at fp32 a one-row matmul run as two costs
    ~1.6x, and near-ties that flip are rare) decoding chains (trees keep near-tie flips anyway)."""
    forced = parse_exact(setting)
    return forced if forced is not None else dtype in (torch.bfloat16, torch.float16) and not tree


def parse_exact(setting: bool | str) -> bool | None:
    """`exact_verify` as given: True / False, or None for auto."""
    value = str(setting).strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    if value != "auto":
        raise ValueError(f"exact_verify={setting!r}: use auto, true or false")
    return None


VERIFY_ROOM = 128  # cache rows past max_new_tokens a verify may write (a tree of up to 127 nodes)


class ExactVerify:
    """The static KV cache of one generation and the explicit inputs its forwards need.

    Capacity = prompt + max_new_tokens + VERIFY_ROOM, whatever the drafter: every attention reduces
    over the capacity, so plain and speculative decoding of the same prompt and max_new_tokens must
    share it to round alike (a verify may write up to VERIFY_ROOM rows past the committed
    tokens)."""

    def __init__(self, target: Any, prompt_len: int, max_new_tokens: int) -> None:
        install(target)
        self.capacity = prompt_len + max_new_tokens + VERIFY_ROOM
        self.cache = StaticCache(config=target.model.config, max_cache_len=self.capacity)
        self._keys = torch.arange(self.capacity, device=target.device)  # (C,) key slots, made once

    def chain(self, cached: int, n: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Inputs of a forward of n consecutive tokens after `cached` ones: causal mask over the
        whole capacity (1, 1, n, C) and position ids (1, n)."""
        self._room(cached + n)
        pos = torch.arange(cached, cached + n, device=device)  # (n,)
        return {"attention_mask": (self._keys[None, :] <= pos[:, None])[None, None],
                "position_ids": pos[None]}

    def widen(self, mask: torch.Tensor) -> torch.Tensor:
        """A tree mask (1, 1, N+1, cached+N+1) padded with masked columns to (1, 1, N+1, C)."""
        self._room(mask.shape[-1])
        pad = mask.new_zeros(*mask.shape[:-1], self.capacity - mask.shape[-1])
        return torch.cat([mask, pad], dim=-1)

    def _room(self, needed: int) -> None:
        if needed > self.capacity:
            raise ValueError(f"exact verification: a verify forward needs {needed} cache "
                             f"positions, the static cache holds {self.capacity} (prompt + "
                             f"max_new_tokens + {VERIFY_ROOM}); draft trees of at most "
                             f"{VERIFY_ROOM - 1} nodes (lower drafter.tree_total_tokens) or set "
                             f"exact_verify=false")
