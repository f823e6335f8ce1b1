"""The acceptance rules that make speculative decoding lossless, batched so tests can run them
100,000 times in one call.

Greedy: accept the longest prefix of drafts equal to the target's argmax; the next token is the
target's argmax after it (the correction on a mismatch, the bonus when all drafts match).

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from norm(max(0, p_i - q_i)); when all
drafts are accepted sample the bonus from p_{k+1}. The output is then distributed exactly as the
target's own sampling, whatever q is. p and q must be warped with the same SamplingParams.

The trainer's simulated acceptance on held-out conversations is decode/simulate.py.
"""
from __future__ import annotations

import torch

from drafters.sampling import SamplingParams, sample, warp

GREEDY = SamplingParams()  # temperature 0: the argmax rule


def accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row: ok (B, m) bool -> (B,) long."""
    return ok.long().cumprod(-1).sum(-1)  # (B,)


def accept_chain(
    draft: torch.Tensor,  # (B, m) long: drafted tokens
    q: torch.Tensor | None,  # (B, m, V) warped draft probabilities, None = one-hot on draft
    logits: torch.Tensor,  # (B, m+1, V) target logits at [last committed, d_1 .. d_m]
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a chain of drafts. Returns (n, next): n (B,) accepted drafts, next (B,) the token
    that follows them (correction or bonus). The committed tokens are draft[:n] + [next]."""
    B, m = draft.shape
    if sampling.greedy:  # exact argmax match; q plays no part
        best = logits.argmax(-1)  # (B, m+1)
        n = accepted_prefix(draft == best[:, :m])  # (B,)
        return n, best.gather(1, n[:, None]).squeeze(1)
    p = warp(logits, sampling)  # (B, m+1, V)
    V = p.shape[-1]
    if q is None:
        q = torch.nn.functional.one_hot(draft, V).to(p.dtype)  # (B, m, V)
    q = q.to(device=p.device, dtype=p.dtype)
    # 1. accept d_i with probability min(1, p/q), written without a division: u * q < p
    p_d = p[:, :m].gather(-1, draft[..., None]).squeeze(-1)  # (B, m)
    q_d = q.gather(-1, draft[..., None]).squeeze(-1)  # (B, m)
    u = torch.rand(B, m, generator=generator, device=p.device, dtype=p.dtype)  # (B, m)
    n = accepted_prefix(u * q_d < p_d)  # (B,)
    # 2. the next token comes from norm(max(0, p_n - q_n)); padding q with a zero row at position m
    #    makes the same formula give p_{m+1} for the bonus after a full acceptance
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)  # (B, m+1, V)
    idx = n[:, None, None].expand(B, 1, V)  # (B, 1, V)
    p_n = p.gather(1, idx).squeeze(1)  # (B, V)
    residual = (p_n - q_pad.gather(1, idx).squeeze(1)).clamp_min(0)  # (B, V)
    mass = residual.sum(-1, keepdim=True)  # (B, 1)
    # mass == 0 means p_n == q_n, where a rejection cannot happen (rounding aside): fall back to p_n
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_n)  # (B, V)
    return n, sample(residual, generator)
