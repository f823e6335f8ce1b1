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
    step 1's keys where `causal` says and to steps 2..j's keys at its own anchor only. One fused
    scaled_dot_product_attention per chunk of anchors (ttt_chunk) over step 1's keys followed by
    the chunk's own keys of steps 2..j, under a boolean mask: no (Q x T) score tensor is kept for
    the backward, where an eager softmax held several (the on-policy phase's second draft:
    BENCHMARKS.md "EAGLE-3's memory"). Returns (B, h, Q, d)."""
    steps.append((k, v))
    if len(steps) == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    (k0, v0), J = steps[0], len(steps) - 1  # step 1's keys (B, kv, T, d); J own keys per anchor
    own_k = torch.stack([kj for kj, _ in steps[1:]], dim=3)  # (B, kv, Q, J, d)
    own_v = torch.stack([vj for _, vj in steps[1:]], dim=3)
    Q, T, n = q.shape[2], k0.shape[2], ttt_chunk(k0.shape[2], J)
    outs = []
    for a in range(0, Q, n):
        m = min(Q, a + n) - a
        rows = slice(a, a + m)
        mine = torch.arange(m, device=q.device)[:, None] == torch.arange(m * J, device=q.device)[None] // J
        mask = torch.cat([causal[:, :, rows], mine.expand(causal.shape[0], 1, m, m * J)], dim=-1)
        keys = torch.cat([k0, own_k[:, :, rows].flatten(2, 3)], dim=2)  # (B, kv, T + m*J, d)
        values = torch.cat([v0, own_v[:, :, rows].flatten(2, 3)], dim=2)
        outs.append(F.scaled_dot_product_attention(q[:, :, rows], keys, values, attn_mask=mask,
                                                   enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def ttt_chunk(T: int, own: int) -> int:
    """Anchors one ttt_attention call attends together at a step with `own` keys per anchor:
    their own keys, which every query of the chunk is scored against (masked), stay at most half
    of step 1's T."""
    return max(1, T // (2 * own))


def blocks_per_chunk(T: int, b: int) -> int:
    """Blocks of b queries one block_attention call attends together: their own keys, which every
    query of the chunk is scored against (masked), stay at most half the context's T."""
    return max(1, T // (2 * b))


def block_attention(q, k, v, ctx_k, ctx_v, seen: torch.Tensor, b: int) -> torch.Tensor:
    """Training attention of A blocks of b queries per row: q (B, h, A*b, d); the blocks' own keys
    k, v (B, kv, A*b, d), each block seeing all of its own b (bidirectional) and no other block's;
    the context ctx_k, ctx_v (B, kv, T, d) where seen (B, A, T) says so -> (B, h, A*b, d).

    One fused scaled_dot_product_attention per chunk of blocks (blocks_per_chunk) over the
    context's keys followed by the chunk's own keys, under a boolean mask: the kernel keeps no
    (queries x keys) score tensor for the backward, where an eager softmax over both key sets held
    several (DSpark's default step: +50 MB instead of +250 MB, 0.5x the time; BENCHMARKS.md "DSpark's
    memory")."""
    B, h, Q, d = q.shape
    A, T = Q // b, ctx_k.shape[2]
    step = blocks_per_chunk(T, b)
    outs = []
    for a in range(0, A, step):
        n = min(A, a + step) - a
        rows = slice(a * b, (a + n) * b)
        block = torch.arange(n * b, device=q.device) // b
        own = (block[:, None] == block[None, :]).expand(B, -1, -1)  # (B, n*b, n*b)
        mask = torch.cat([seen[:, a:a + n].repeat_interleave(b, dim=1), own], dim=-1)
        keys, values = (torch.cat([c, x[:, :, rows]], dim=2) for c, x in ((ctx_k, k), (ctx_v, v)))
        outs.append(F.scaled_dot_product_attention(q[:, :, rows], keys, values,
                                                   attn_mask=mask[:, None], enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
