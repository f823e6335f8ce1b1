"""Parallel drafters (P-EAGLE, DFlash): the k draft distributions of a round come out of ONE
drafter forward, row i the distribution of draft i+1 whatever the drafts before it.

A parallel drafter gives `draft_logits(state, k) -> (k, Vd)`, `trained_positions()` and
`trained_setting` (the setting that fixes them, for the warning below); these functions give it
the chain (`propose`: each draft drawn from its own position's distribution, with the q it was
drawn from, cut where the confidence falls below min_confidence), the tree (`propose_tree`:
EAGLE-2's dynamic tree over the per-position distributions, drafters/parts/tree.py position_tree;
settings cfg.tree_top_k, tree_depth (capped at the positions trained), tree_total_tokens,
tree_sampled) and the cap of k at the positions trained (a larger k is said once per drafter,
never silently). `ParallelDrafting`, mixed in before the drafter's base class, makes them its
Drafter methods (and its batched `rows_round` its `propose_rows`).
"""
from __future__ import annotations

import logging

import torch

from specdistill.drafters.base import ChainDraw, ChainProposal, DecodeState, TreeProposal
from specdistill.drafters.parts.rows import propose_rows
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.drafters.parts.tree import in_target_vocab, position_tree


def trained_k(drafter, k: int) -> int:
    """k capped at the draft positions trained; a k above them is said once per drafter."""
    trained = drafter.trained_positions()
    if k > trained and not getattr(drafter, "k_warned", False):
        logging.getLogger(type(drafter).__module__).warning(
            "%s: k=%d but only %d draft positions were trained (%s): drafting %d per round",
            drafter.name, k, trained, drafter.trained_setting, trained)
        drafter.k_warned = True
    return min(k, trained)


def draw_chains(drafter, rows, ks, sampling, generators, min_confidence) -> list[ChainProposal]:
    """Each row's chain of up to ks[r] drafts (capped here), draft i drawn from rows[r][i - 1]
    (Vd,) with generators[r] and cut where its confidence < min_confidence: what propose draws,
    for one row or a batch of them."""
    ks = [trained_k(drafter, k) for k in ks]
    out = []
    for k, g, mine in zip(ks, generators, rows):
        chain = ChainDraw(drafter, k, sampling, g, min_confidence)
        while chain.draw(mine[chain.n]):  # draft i from position i + 1's distribution
            pass
        out.append(chain.proposal())
    return out


@torch.no_grad()
def propose(drafter, state: DecodeState, k: int, sampling: SamplingParams,
            generator: torch.Generator | None = None, min_confidence: float = 0.0) -> ChainProposal:
    """Up to k drafts (at most the positions trained) from one forward."""
    if k < 1:
        return ChainProposal(tokens=state.tokens.new_empty(0))
    k = trained_k(drafter, k)
    return draw_chains(drafter, [drafter.draft_logits(state, k)], [k], sampling, [generator],
                       min_confidence)[0]


@torch.no_grad()
def propose_tree(drafter, state: DecodeState, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> TreeProposal:
    """A dynamic tree from ONE forward (sampled children when sampling and tree_sampled)."""
    cfg = drafter.cfg
    depth = min(cfg.tree_depth, drafter.trained_positions())
    sampled = sampling if cfg.tree_sampled else None  # None: the top-k tree
    tree = position_tree(drafter.draft_logits(state, depth), cfg.tree_top_k,
                         cfg.tree_total_tokens, sampled, generator)
    return in_target_vocab(tree, drafter.d2t, drafter.vocab_size)


class ParallelDrafting:
    """The Drafter proposal methods of a parallel drafter (DFlash, DSpark, P-EAGLE): the chain and
    the tree from one forward (above), and every row's round in ONE batched forward (its own
    `rows_round`, drafters/parts/rows.py propose_rows). `class DFlash(ParallelDrafting, Drafter)`."""

    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        return propose(self, state, k, sampling, generator, min_confidence)

    def propose_tree(self, state: DecodeState, sampling: SamplingParams,
                     generator: torch.Generator | None = None) -> TreeProposal:
        return propose_tree(self, state, sampling, generator)

    def propose_rows(self, slots, states, ks, sampling, generators, min_confidence=0.0
                     ) -> list[ChainProposal]:
        """Every row's round in ONE forward (drafters/parts/rows.py propose_rows, rows_round)."""
        return propose_rows(self.rows_round, slots, states, ks, sampling, generators,
                            min_confidence)
