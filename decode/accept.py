"""The acceptance rules that make speculative decoding lossless, batched so tests can run them
100,000 times in one call.

Greedy: accept the longest prefix of drafts equal to the target's argmax; the next token is the
target's argmax after it (the correction on a mismatch, the bonus when all drafts match).

Sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from norm(max(0, p_i - q_i)); when all
drafts are accepted sample the bonus from p_{k+1}. The output is then distributed exactly as the
target's own sampling, whatever q is. p and q must be warped with the same SamplingParams.

Several drafts for one position (siblings in a draft tree; SpecInfer's multi-draft speculative
sampling, EAGLE's tree sampling), `multi_draft`: try the siblings in the order they were drawn;
accept c_i with probability min(1, p_i(c_i) / q_i(c_i)), else p_{i+1} = norm(max(0, p_i - q_i));
when all are rejected sample from the last residual. q_i is the distribution c_i was drawn from
given c_1 .. c_{i-1}: q for i.i.d. siblings, q without the earlier draws for sampling without
replacement, one-hot on c_i for deterministic candidates. Exact by induction on the number of
siblings: c_1 is accepted as token x with probability min(p_1, q_1)(x) and rejected with
probability sum(max(0, p_1 - q_1)), and whatever c_1 was, the rest outputs p_2 (induction), so
the output is min(p_1, q_1) + max(0, p_1 - q_1) = p_1.

The trainer's simulated acceptance on held-out conversations is decode/simulate.py.
"""
from __future__ import annotations

import torch

from specdistill.drafters.parts.sampling import SamplingParams, sample, warp

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


def multi_draft(
    p: torch.Tensor,  # (V,) the target's warped distribution at the parent
    tokens: torch.Tensor,  # (m,) long: the siblings, in the order they were drawn
    q: torch.Tensor | None,  # (m, V) the distribution each was drawn from; None = one-hot on it
) -> tuple[torch.Tensor, torch.Tensor]:
    """The multi-draft rule as exact probabilities rather than one sample, so tests can check it
    by enumeration: pick (m+1,), the probability that sibling i is the one accepted (the last
    entry: none is), and residual (V,), the distribution of the next token when none is."""
    m, V = len(tokens), p.shape[-1]
    if q is None:
        q = torch.nn.functional.one_hot(tokens, V).to(p.dtype)  # (m, V)
    q = q.to(device=p.device, dtype=p.dtype)
    pick = p.new_zeros(m + 1)  # (m+1,)
    alive = p.new_ones(())  # probability that every earlier sibling was rejected
    for i in range(m):
        t = tokens[i]
        # 1. accept c_i with probability min(1, p_i(c_i) / q_i(c_i)); q_i(c_i) = 0 cannot be drawn
        a = (p[t] / q[i, t].clamp_min(1e-30)).clamp(max=1.0)
        pick[i] = alive * a
        alive = alive * (1 - a)
        # 2. on rejection p_{i+1} = norm(max(0, p_i - q_i)); no mass left means p_i == q_i, where
        #    a rejection cannot happen (rounding aside): keep p_i
        r = (p - q[i]).clamp_min(0)  # (V,)
        mass = r.sum()
        p = torch.where(mass > 0, r / mass.clamp_min(1e-30), p)
    pick[m] = alive
    return pick, p
