"""Logit warping and sampling shared by drafters and the decoder.

The speculative sampling rule is only lossless when the draft distribution q and the target
distribution p are warped by exactly the same settings, so both sides call `warp` from here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    """How the next token is chosen. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0  # 0 = greedy; > 0 = sample from softmax(logits / temperature)
    top_k: int = 0  # keep only the k most likely tokens (0 = off)
    top_p: float = 1.0  # keep the smallest set of tokens whose mass reaches top_p (1.0 = off)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits (..., V) into the probabilities (..., V) the sampler draws from.

    Greedy gives a one-hot distribution on the argmax, so greedy is the temperature -> 0 limit and
    the same acceptance rule covers both.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of probs (..., V) -> (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])


def draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """One drafted token from (V,) logits: (token, q, confidence). Greedy: the argmax, q None;
    sampling: a sample from the warped q. Confidence is the top draft probability (the adaptive
    draft length stops below min_confidence; batched verification budgets rank drafts by it)."""
    if params.greedy:
        return logits.argmax(), None, float(logits.float().softmax(-1).max())
    q = warp(logits, params)
    return sample(q, generator), q, float(q.max())
