"""Attention for the few-query forwards of decoding on CPUs (decode steps of one token, verify
blocks of k+1 tokens, draft steps) in bf16 / fp16, for the target and the drafters alike (the
drafters' training attention: drafters/parts/attention.py).

Why: on CPUs torch's fused SDPA kernel is slow at 16-bit for few queries over many keys, and
its time grows with the keys ~5x faster than plain ops'. Measured on the 2-core AVX512-BF16 EPYC,
torch 2.13, 2 threads, SmolLM2's shapes (9 query / 3 KV heads of 64), microseconds per call, SDPA
/ here (BENCHMARKS.md "Attention for few queries on CPUs"):

    | keys | q=1      | q=3      | q=6      |
    | 64   | 39 / 48  | 29 / 60  | 33 / 64  |
    | 300  | 131 / 55 | 66 / 74  | 74 / 90  |
    | 1000 | 461 / 71 | 176 / 112| 208 / 135|
    | 2000 | 907 / 94 | 335 / 146| 395 / 198|

At 30 layers that is a third of a one-token step at 1000 keys. Below ~128 keys per query SDPA is
the faster one, at fp32 it is as fast or faster for one query (27 us at 300 keys, one thread), and
for long query blocks (prefill, training) it is the right kernel.
At fp32 with 2-16 queries and a mask (a verify block over a KV cache), transformers' SDPA path
repeats K and V per query head first (a copy of the layer's cache; it passes `enable_gqa` only
without a mask), which costs more than the attention. Measured on the 2-core AVX2 EPYC, torch 2.13,
one thread, fp32, microseconds per call, SDPA / here: 300 keys q=2 306 / 155, q=3 320 / 179, q=8
364 / 262; 1000 keys q=3 3431 / 323; 64 keys q=4 107 / 137 (BENCHMARKS.md "Prepacked linear
layers"). So FEW_Q also takes masked fp32 forwards of 2-16 queries over at
least FP32_MIN_KEYS keys (`masked_few_query`).

What this does: `grouped_attention` computes attention with plain ops, all query rows of a KV head
in one matmul (no repeated K/V), an fp32 softmax, then p @ v. `few_query_attention`, registered with
transformers as FEW_Q, runs it for CPU 16-bit forwards of at most FEW_Q_MAX queries over at least
KEYS_PER_QUERY keys per query and masked fp32 forwards of 2..FEW_Q_MAX queries (above), and hands
everything else to SDPA unchanged; `use_few_query_attention(model)` switches an HF model to it.
The two round differently at bf16 (within ~1e-3 relative), so near-tie argmaxes can differ from an
SDPA run; every forward of one decode goes through the same dispatch.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

FEW_Q = "specdistill_few_q"  # the registered attention implementation name
FEW_Q_MAX = 16  # query rows up to which plain ops can beat SDPA at 16-bit on CPUs
KEYS_PER_QUERY = 128  # ... once the keys are at least this many per query (the crossover, above)
FP32_MIN_KEYS = 128  # masked fp32 forwards of >= 2 queries: plain ops from this many keys on


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: torch.Tensor | None, scaling: float | None = None,
                      causal: bool = True, two_rows: bool = False) -> torch.Tensor:
    """query (B, H, q, d), key / value (B, Hkv, L, d), mask (B | 1, 1, q, >= L) bool (True =
    attend) or additive, or None (then causal: query i sees keys <= L - q + i; or all keys when
    causal=False) -> (B, H, q, d). Scores in the inputs' dtype, softmax in fp32; a query row with
    every key masked gets uniform weights (finite), as padding rows need. two_rows: a lone query
    row per KV head (no GQA, one token) runs as two identical rows, so both matmuls are GEMMs, as
    exact verification needs (decode/exact.py)."""
    B, H, q, d = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    g = H // Hkv  # query heads per KV head
    rows = g * q  # query rows per KV head, in one matmul
    scale = scaling if scaling is not None else d ** -0.5
    qs = query.reshape(B, Hkv, rows, d)
    if two_rows and rows == 1:
        qs = torch.cat([qs, qs], dim=2)  # (B, Hkv, 2, d)
    R = qs.shape[2]
    scores = torch.matmul(qs, key.transpose(-1, -2))  # (B, Hkv, R, L)
    acc = torch.promote_types(scores.dtype, torch.float32)  # fp32 softmax (fp64 stays fp64)
    scores = scores.to(acc).mul_(scale).view(B, Hkv, R // q, q, L)
    low = torch.finfo(acc).min
    if mask is not None:
        m = mask[..., :L][:, :, None]  # (B | 1, 1, 1, q, L)
        scores = scores.masked_fill(~m, low) if m.dtype == torch.bool else scores + m.to(acc)
    elif causal and q > 1:
        keys = torch.arange(L, device=query.device)
        last = L - q + torch.arange(q, device=query.device)  # the last key each query sees
        scores = scores.masked_fill(keys[None, :] > last[:, None], low)
    probs = scores.softmax(-1).to(value.dtype).view(B, Hkv, R, L)
    return torch.matmul(probs, value)[:, :, :rows].reshape(B, H, q, d)


def few_query(query: torch.Tensor, keys: int) -> bool:
    """Whether `grouped_attention` is the faster kernel for a forward of `query` (B, H, q, d)
    over `keys` keys (see the module doc)."""
    q = query.shape[2]
    return (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)
            and q <= FEW_Q_MAX and keys >= KEYS_PER_QUERY * q)


def masked_few_query(query: torch.Tensor, keys: int, mask: torch.Tensor | None) -> bool:
    """Whether `grouped_attention` is the faster kernel for a masked fp32 CPU forward of 2 to
    FEW_Q_MAX queries over `keys` keys, where SDPA would first repeat K / V (see the module doc)."""
    q = query.shape[2]
    return (mask is not None and query.device.type == "cpu" and query.dtype == torch.float32
            and 2 <= q <= FEW_Q_MAX and keys >= FP32_MIN_KEYS)


def few_query_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: grouped_attention where `few_query` or
    `masked_few_query` says so (and no dropout), else SDPA as transformers runs it. Returns
    (B, q, H, d)."""
    fast = few_query(query, key.shape[2]) or masked_few_query(query, key.shape[2], attention_mask)
    if dropout or not fast or kwargs.get("softcap") is not None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask,
                                               dropout=dropout, scaling=scaling,
                                               is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = grouped_attention(query, key, value, attention_mask, scaling, causal)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FEW_Q, few_query_attention)
AttentionMaskInterface.register(FEW_Q, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks


def use_few_query_attention(model: nn.Module) -> bool:
    """Switch an HF model that runs SDPA to FEW_Q (the same masks; SDPA still runs every forward
    where it is the faster kernel). Other implementations (eager, flash, ours) stay. Returns
    whether it switched."""
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(FEW_Q)
    return True
