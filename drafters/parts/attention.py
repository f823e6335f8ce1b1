"""Training attention of the drafters: training-time test (EAGLE-3, P-EAGLE: `ttt_attention`) and
blocks of mask slots over a shared context (DFlash: `block_attention`). Decoding attention is the
target's few-query kernel (target/attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

def ttt_attention(q, k, v, steps: list, causal: torch.Tensor) -> torch.Tensor:
    """Training-time-test attention of one layer for one step; appends this step's (k, v) to steps.

    q (B, h, Q, d); k, v (B, kv, Q, d): step j's queries and keys, one per anchor; causal
    (B, 1, Q, T) bool over step 1's T keys. Step 1 (Q = T) is causal attention; step j attends to
    step 1's keys where `causal` says and to steps 2..j's keys at its own anchor only
    (own_key_attention: no (Q x T) score tensor kept for the backward, where an eager softmax held
    several; BENCHMARKS.md "EAGLE-3 side by side on the AVX2 EPYC"). Returns (B, h, Q, d)."""
    steps.append((k, v))
    if len(steps) == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    (k0, v0), J = steps[0], len(steps) - 1  # step 1's keys (B, kv, T, d); J own keys per anchor
    own_k, own_v = (torch.stack(kv, dim=3).flatten(2, 3) for kv in zip(*steps[1:]))  # (B, kv, Q*J, d)
    return own_key_attention(q, k0, v0, own_k, own_v, causal, 1, J)


def blocks_per_chunk(T: int, b: int) -> int:
    """Groups with b own keys each that one own_key_attention call attends together: their own
    keys, which every query of the chunk is scored against (masked), stay at most half the
    context's T."""
    return max(1, T // (2 * b))


def block_attention(q, k, v, ctx_k, ctx_v, seen: torch.Tensor, b: int) -> torch.Tensor:
    """Training attention of A blocks of b queries per row: q (B, h, A*b, d); the blocks' own keys
    k, v (B, kv, A*b, d), each block seeing all of its own b (bidirectional) and no other block's;
    the context ctx_k, ctx_v (B, kv, T, d) where seen (B, A, T) says so -> (B, h, A*b, d)
    (own_key_attention: DSpark's default step +50 MB instead of an eager softmax's +250 MB, 0.5x
    the time; BENCHMARKS.md "DSpark's memory")."""
    return own_key_attention(q, ctx_k, ctx_v, k, v, seen.repeat_interleave(b, dim=1)[:, None], b, b)


def own_key_attention(q, ctx_k, ctx_v, own_k, own_v, seen: torch.Tensor, per_q: int,
                      per_k: int) -> torch.Tensor:
    """Queries in G groups of per_q, q (B, h, G*per_q, d), each group with per_k keys of its own,
    own_k, own_v (B, kv, G*per_k, d): a query sees the context ctx_k, ctx_v (B, kv, T, d) where
    seen (B, 1, G*per_q, T) says and all of its group's own keys, no other group's ->
    (B, h, G*per_q, d). One fused scaled_dot_product_attention per chunk of groups
    (blocks_per_chunk) over the context's keys followed by the chunk's own keys, under a boolean
    mask: the kernel keeps no (queries x keys) score tensor for the backward."""
    G, T = q.shape[2] // per_q, ctx_k.shape[2]
    step = blocks_per_chunk(T, per_k)
    outs = []
    for a in range(0, G, step):
        n = min(G, a + step) - a
        qs, ks = slice(a * per_q, (a + n) * per_q), slice(a * per_k, (a + n) * per_k)
        group_q = torch.arange(n * per_q, device=q.device) // per_q
        group_k = torch.arange(n * per_k, device=q.device) // per_k
        own = (group_q[:, None] == group_k[None, :]).expand(seen.shape[0], 1, -1, -1)
        mask = torch.cat([seen[:, :, qs], own], dim=-1)  # (B, 1, n*per_q, T + n*per_k)
        keys, values = (torch.cat([c, x[:, :, ks]], dim=2) for c, x in ((ctx_k, own_k), (ctx_v, own_v)))
        outs.append(F.scaled_dot_product_attention(q[:, :, qs], keys, values, attn_mask=mask,
                                                   enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
