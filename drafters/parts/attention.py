"""Training attention of the drafters: training-time test (EAGLE-3, P-EAGLE: `ttt_attention`) and
blocks of mask slots over a shared context (DFlash: `block_attention`). Decoding attention is the
target's few-query kernel (target/attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

def ttt_attention(q, k, v, steps: list, causal: torch.Tensor) -> torch.Tensor:
    """Training-time-test attention of one layer for one step; appends this step's (k, v) to steps.

    q (B, h, T, d); k, v (B, kv, T, d); causal (B, 1, T, T) bool over step 1's keys. Step 1 is
    causal attention; step j attends to step 1's keys causally and to steps 2..j's keys at its own
    anchor only, scored as a dot product per query. Returns (B, h, T, d)."""
    steps.append((k, v))
    if len(steps) == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    rep, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    k0, v0 = (t.repeat_interleave(rep, dim=1) for t in steps[0])  # (B, h, T, d)
    s0 = (q @ k0.transpose(-1, -2)) * scale  # (B, h, T, T)
    s0 = s0.masked_fill(~causal, torch.finfo(s0.dtype).min)
    kd = torch.stack([kj.repeat_interleave(rep, dim=1) for kj, _ in steps[1:]], dim=-2)  # (B, h, T, j-1, d)
    vd = torch.stack([vj.repeat_interleave(rep, dim=1) for _, vj in steps[1:]], dim=-2)
    sd = (q.unsqueeze(-2) * kd).sum(-1) * scale  # (B, h, T, j-1)
    p = torch.cat([s0, sd], dim=-1).softmax(-1)  # (B, h, T, T + j-1)
    T = s0.shape[-1]
    return p[..., :T] @ v0 + (p[..., T:, None] * vd).sum(-2)  # (B, h, T, d)


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
