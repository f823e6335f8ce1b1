"""Training attention of the drafters: training-time test (EAGLE-3, P-EAGLE: `ttt_attention`) and
blocks of mask slots over a shared context (DFlash: `block_attention`). Decoding attention is the
target's few-query kernel (target/attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SCORES_PER_CHUNK = 1 << 26  # attention scores (fp32: 256 MB) one chunk of blocks may hold


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


def block_attention(q, k, v, ctx_k, ctx_v, seen: torch.Tensor, b: int) -> torch.Tensor:
    """Training attention of A blocks of b queries per row: q (B, h, A*b, d); the blocks' own keys
    k, v (B, kv, A*b, d), each block seeing all of its own b (bidirectional) and no other block's;
    the context ctx_k, ctx_v (B, kv, T, d) where seen (B, A, T) says so -> (B, h, A*b, d). The
    blocks go in chunks of at most SCORES_PER_CHUNK scores, each recomputed in the backward pass
    (activation checkpointing), so memory stays bounded at long contexts and many anchors."""
    B, h, Q, d = q.shape
    A, T = Q // b, ctx_k.shape[2]
    step = max(1, SCORES_PER_CHUNK // (B * h * b * (T + b)))  # blocks per chunk
    if step >= A:
        return _blocks(q, k, v, ctx_k, ctx_v, seen, b)
    outs = []
    for a in range(0, A, step):
        rows = slice(a * b, min(A, a + step) * b)
        args = (q[:, :, rows], k[:, :, rows], v[:, :, rows], ctx_k, ctx_v, seen[:, a:a + step], b)
        outs.append(checkpoint(_blocks, *args, use_reentrant=False) if torch.is_grad_enabled()
                    else _blocks(*args))
    return torch.cat(outs, dim=2)


def _blocks(q, k, v, ctx_k, ctx_v, seen: torch.Tensor, b: int) -> torch.Tensor:
    """block_attention for one chunk: one softmax over both key sets, in fp32."""
    B, h, Q, d = q.shape
    kv, A = k.shape[1], Q // b
    g = h // kv
    qg = q.reshape(B, kv, g, A, b, d)
    own = torch.einsum("bkgaid,bkajd->bkgaij", qg, k.reshape(B, kv, A, b, d))  # (B, kv, g, A, b, b)
    ctx = torch.matmul(q.reshape(B, kv, g * Q, d), ctx_k.transpose(-1, -2))  # (B, kv, g*Q, T)
    ctx = ctx.view(B, kv, g, A, b, -1).float()
    low = torch.finfo(torch.float32).min
    ctx = ctx.masked_fill(~seen[:, None, None, :, None, :], low)
    p = torch.cat([ctx, own.float()], dim=-1).mul(d ** -0.5).softmax(-1).to(q.dtype)
    T = ctx_k.shape[2]
    out = torch.matmul(p[..., :T].reshape(B, kv, g * Q, T), ctx_v).view(B, kv, g, A, b, d)
    out = out + torch.einsum("bkgaij,bkajd->bkgaid", p[..., T:], v.reshape(B, kv, A, b, d))
    return out.reshape(B, h, Q, d)
