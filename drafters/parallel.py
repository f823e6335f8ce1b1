"""Parallel drafters (P-EAGLE, DFlash): the k draft distributions of a round come out of ONE
drafter forward, row i the distribution of draft i+1 whatever the drafts before it. A drafter
gives `draft_logits(state, k) -> (k, Vd)` and `trained_positions()`; this mixin gives the chain
(`propose`: each draft drawn from its own position's distribution, with the q it was drawn from,
cut where the confidence falls below min_confidence), the tree (`propose_tree`: EAGLE-2's dynamic
tree over the per-position distributions, drafters/tree.py position_tree) and the cap of k at
the positions trained (a larger k is said once, never silently).
"""
from __future__ import annotations

import logging

import torch

from specdistill.drafters.proposals import ChainDraw, ChainProposal, DecodeState, TreeProposal
from specdistill.drafters.sampling import SamplingParams
from specdistill.drafters.tree import in_target_vocab, position_tree


class ParallelDrafts:
    """Mixin, listed before the drafter's base class. Tree settings: cfg.tree_top_k, tree_depth
    (capped at the positions trained), tree_total_tokens, tree_sampled."""

    trained_setting = "?"  # the drafter setting that fixes the positions trained (for the warning)

    def trained_positions(self) -> int:
        raise NotImplementedError

    def draft_logits(self, state: DecodeState, k: int) -> torch.Tensor:
        raise NotImplementedError

    def _trained_k(self, k: int) -> int:
        """k capped at the draft positions trained; a k above them is said once per drafter."""
        trained = self.trained_positions()
        if k > trained and not getattr(self, "_warned_k", False):
            logging.getLogger(type(self).__module__).warning(
                "%s: k=%d but only %d draft positions were trained (%s): drafting %d per round",
                self.name, k, trained, self.trained_setting, trained)
            self._warned_k = True
        return min(k, trained)

    def draw_chains(self, rows, ks, sampling, generators, min_confidence) -> list[ChainProposal]:
        """Each row's chain of up to ks[r] drafts (capped here), draft i drawn from rows[r][i - 1]
        (Vd,) with generators[r] and cut where its confidence < min_confidence: what propose
        draws, for one row or a batch of them."""
        ks = [self._trained_k(k) for k in ks]
        out = []
        for k, g, mine in zip(ks, generators, rows):
            chain = ChainDraw(self, k, sampling, g, min_confidence)
            while chain.draw(mine[chain.n]):  # draft i from position i + 1's distribution
                pass
            out.append(chain.proposal())
        return out

    @torch.no_grad()
    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        """Up to k drafts (at most the positions trained) from one forward."""
        if k < 1:
            return ChainProposal(tokens=state.tokens.new_empty(0))
        k = self._trained_k(k)
        return self.draw_chains([self.draft_logits(state, k)], [k], sampling, [generator],
                                min_confidence)[0]

    @torch.no_grad()
    def propose_tree(self, state: DecodeState, sampling: SamplingParams,
                     generator: torch.Generator | None = None) -> TreeProposal:
        """A dynamic tree from ONE forward (sampled children when sampling and tree_sampled)."""
        depth = min(self.cfg.tree_depth, self.trained_positions())
        sampled = sampling if self.cfg.tree_sampled else None  # None: the top-k tree
        tree = position_tree(self.draft_logits(state, depth), self.cfg.tree_top_k,
                             self.cfg.tree_total_tokens, sampled, generator)
        return in_target_vocab(tree, self.d2t, self.vocab_size)
