"""Medusa (Medusa-1): K extra heads on the target's last hidden state, head k guessing the token
k+1 places past the target's own next token.

    head_k(f_t) = lm_head(ResBlock^L(f_t))      ResBlock(x) = x + SiLU(Linear(H -> H)(x))

f_t is the target's final-normed hidden state at position t (feature_layers=(-1,)); the target's
LM head on f_t gives token t+1, head k gives token t+2+k. Each ResBlock's Linear starts at zero
(weight and bias), so a fresh head is exactly the target's LM head: training starts from "guess
that the token repeats the target's next-token distribution" rather than from noise.

The vocab projection is the target's LM head, frozen and shared by all heads, or, with
draft_vocab_size, one trainable Linear(H -> Vd) shared by all heads and started from the target's
rows d2t (vocab.py). Heads do not see each other's drafts, so drafting costs no drafter recurrence
and the chain is just every head's argmax (or sample) at once; trees come from a static shape.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import (ChainProposal, DecodeState, Drafter, DrafterConfig, DraftPrediction,
                           TrainBatch, TreeProposal, parse_config, register)
from drafters.sampling import SamplingParams, draft_token
from drafters.tree import StaticTree, static_tree
from drafters.vocab import DraftVocab, head_from_target

# A 26-node Medusa tree (paths of per-depth top-k ranks), widest where heads are most accurate:
# 4 candidates at depth 1, 7 at depth 2, 7 at depth 3, 8 at depth 4.
DEFAULT_TREE = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0], [1, 0, 0], [1, 1, 0], [2, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0],
    [1, 1, 0, 0], [2, 0, 0, 0],
]


@dataclass
class MedusaConfig(DrafterConfig):
    """Medusa drafter settings."""

    name: str = "medusa"  # registry key
    num_heads: int = 4  # heads; head k predicts the token k+2 after the last processed position
    num_layers: int = 1  # residual blocks per head
    draft_vocab_size: Optional[int] = None  # pruned shared head size (None = target's head, frozen)
    head_decay: float = 0.8  # loss weight of head k is head_decay ** k (Medusa's 0.8)
    # static tree: list of rank paths, or that list as a string; paths deeper than num_heads or
    # with a rank >= tree_top_k are dropped (with their descendants)
    tree_choices: Any = field(default_factory=lambda: [list(c) for c in DEFAULT_TREE])
    tree_top_k: int = 10  # candidates taken per depth for the static tree


class MedusaResBlock(nn.Module):
    """x + SiLU(Linear(x)), with the Linear zero-initialised (identity at start)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))  # (..., H)


def parse_tree_choices(choices: Any, max_depth: int, top_k: int) -> StaticTree:
    """Config tree_choices (list or string) -> a StaticTree limited to max_depth and ranks < top_k."""
    if isinstance(choices, str):
        choices = ast.literal_eval(choices)
    paths = [[int(r) for r in c] for c in choices]
    # the kept set stays prefix-closed: a path's prefixes are no deeper and have no larger rank
    kept = [p for p in paths if len(p) <= max_depth and max(p, default=0) < top_k]
    if not kept:
        raise ValueError(f"medusa: no tree choice fits num_heads={max_depth}, tree_top_k={top_k}")
    return static_tree(kept)


@register("medusa", MedusaConfig)
class Medusa(Drafter):
    """Medusa drafter: independent residual heads over the target's final hidden state."""

    feature_layers = (-1,)

    def __init__(self, cfg: MedusaConfig, target) -> None:
        super().__init__(target.vocab_size)
        if cfg.num_heads < 1 or cfg.num_layers < 0:
            raise ValueError(f"medusa: num_heads ({cfg.num_heads}) must be >= 1 and num_layers "
                             f"({cfg.num_layers}) >= 0")
        self.cfg = cfg
        self.target = target  # plain attribute: not a submodule, never saved
        H = target.hidden_size
        self.heads = nn.ModuleList(nn.Sequential(*[MedusaResBlock(H) for _ in range(cfg.num_layers)])
                                   for _ in range(cfg.num_heads))
        self.draft_vocab = self.lm_head = None
        if cfg.draft_vocab_size is not None:  # placeholder map until set_draft_vocab
            self.draft_vocab = DraftVocab(torch.arange(cfg.draft_vocab_size), target.vocab_size)
            self.lm_head = head_from_target(target.lm_head(), self.draft_vocab.d2t, torch.float32)
        self.tree = parse_tree_choices(cfg.tree_choices, cfg.num_heads, cfg.tree_top_k)
        self.to(target.device)

    @classmethod
    def build(cls, cfg, target) -> "Medusa":
        return cls(parse_config(cfg, MedusaConfig), target)

    def head_logits(self, feats: torch.Tensor, k: int) -> torch.Tensor:
        """Target features (..., H) -> head k's logits (..., Vd)."""
        dtype = next(self.parameters(), torch.empty(0)).dtype
        feats = feats.clone() if feats.is_inference() else feats  # from Target.forward's inference mode
        h = self.heads[k](feats.to(dtype))  # (..., H)
        if self.lm_head is not None:
            return self.lm_head(h)
        lm = self.target.lm_head()  # frozen target head, shared by every head
        # h is cast to the head's dtype, not the (V x H) head to h's: no copy of the head per step
        return F.linear(h.to(lm.weight.dtype), lm.weight, lm.bias).to(h.dtype)

    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """Head k at position t predicts token t+2+k: shift k+1, weight head_decay**k."""
        if batch.features is None:
            raise ValueError("medusa: the batch has no target features (feature_layers=(-1,))")
        return [DraftPrediction(logits=self.head_logits(batch.features, k), shift=k + 1,  # (B, T, Vd)
                                weight=self.cfg.head_decay ** k)
                for k in range(self.cfg.num_heads)]

    @torch.no_grad()
    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        """The bonus token tokens[-1] came from the feature of position T-2 = features[-1]; head i
        on that same feature guesses the token i+1 places after the bonus token."""
        if k < 1:
            return ChainProposal(tokens=state.tokens.new_empty(0))
        if state.features is None or state.features.shape[0] < 1:
            raise ValueError("medusa: propose needs state.features for tokens[:-1]")
        f = state.features[-1]  # (H,)
        toks, qs = [], []
        for i in range(min(k, self.cfg.num_heads)):
            logits = self.head_logits(f, i).float()  # (Vd,)
            d, q, conf = draft_token(logits, sampling, generator, min_confidence)  # q: (Vd,) | None
            if i > 0 and conf < min_confidence:
                break
            toks.append(self.target_ids(d))
            qs.append(q)
        return self.chain_proposal(toks, qs, sampling)

    @torch.no_grad()
    def propose_tree(self, state: DecodeState, sampling: SamplingParams) -> TreeProposal:
        """The static tree filled with each head's top-k tokens (greedy only)."""
        if not sampling.greedy:
            raise ValueError("medusa: tree drafting supports greedy decoding only; use a chain")
        if state.features is None or state.features.shape[0] < 1:
            raise ValueError("medusa: propose_tree needs state.features for tokens[:-1]")
        f = state.features[-1]  # (H,)
        D, K = self.tree.max_depth, self.tree.max_rank
        logits = torch.stack([self.head_logits(f, d) for d in range(D)])  # (D, Vd)
        cand = self.target_ids(logits.topk(K, dim=-1).indices)  # (D, K) target ids
        return self.tree.instantiate(cand)
