"""The decode component of step-by-step drafters (EAGLE, EAGLE-3, P-EAGLE): one sequence's
drafter KV cache kept in step with the committed tokens, and the rounds drafted through it.

`CausalDrafting` holds the drafter and drives it through four public methods of its network, as
SpecForge's OnlineEagle3Model drives its draft model, and nothing else of it:

    project(features)        the target's features (B, Q, F) of `feature_layers` -> drafter
                             states (B, Q, S) (EAGLE: the features as they are; EAGLE-3: fused)
    inputs(tokens, states)   target ids (B, Q) and states (B, Q, S) -> backbone inputs (B, Q, X)
    backbone(x, positions, mask, cache)
                             (B, Q, X) at positions (B, Q), an additive mask (B, 1, Q, K) or None
                             (= attend to the whole cache), through `cache` (a DynamicCache whose
                             keys the queries append to) -> next states (B, Q, S)
    head(states)             (..., S) -> logits (..., Vd) over the draft vocabulary

plus what every Drafter has (`draft_chain`, `target_ids`, `d2t`, `vocab_size`, `name`) and the
tree settings cfg.tree_top_k / tree_depth / tree_total_tokens / tree_sampled.

Cache position t reads token t+1 and the state of position t (the target's feature, projected,
for a committed position; the drafter's own predicted state for a draft) and gives the state of
position t+1, whose head is the distribution of token t+2. Committed positions come from real
features and stay cached; drafts come from predicted states and are dropped after each round.

`CausalDrafter` is the Drafter whose reset / propose / propose_tree / propose_rows are this
component's: a new step-by-step drafter subclasses it and gives the four methods above (see
drafters/eagle.py). Batched rounds: drafters/parts/rows.py.
"""
from __future__ import annotations

from typing import Sequence

import torch

from specdistill.drafters.base import ChainProposal, DecodeState, Drafter, TreeProposal
from specdistill.drafters.parts.cache import DraftCache, additive_mask
from specdistill.drafters.parts.rows import chain_round, propose_rows
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.drafters.parts.tree import dynamic_tree, in_target_vocab


class CausalDrafting:
    """One sequence's decode state (`cache`) for `net`, and its rounds (module docstring)."""

    def __init__(self, net: "CausalDrafter") -> None:
        self.net = net  # the drafter: project / inputs / backbone / head
        self.cache = DraftCache()  # positions 0..committed-1 from real target features

    def sync_inputs(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """Crop the cache to what it still shares with the committed tokens and return the inputs
        (1, n_new, X) and positions (n_new,) of the committed positions it lacks, built from the
        real target features (at least the last position is redone, so its output is at hand)."""
        tokens, feats = state.tokens, state.features  # (T,), (T-1, F)
        T = tokens.shape[0]
        if feats is None or T < 2 or feats.shape[0] != T - 1:
            raise ValueError(f"{self.net.name}: propose needs >= 2 tokens and state.features for "
                             f"tokens[:-1]")
        # 1. position t needs tokens[: t + 2] unchanged; crop to the shared prefix
        cache = self.cache
        keep = max(0, min(cache.committed, cache.shared_prefix(tokens) - 1, T - 2))
        cache.sync_to(tokens, keep, committed=T - 1)
        # 2. the new committed positions keep .. T-2, from real target features
        x = self.net.inputs(tokens[keep + 1:][None], self.net.project(feats[keep:][None]))
        return x, torch.arange(keep, T - 1, device=tokens.device)  # (1, n_new, X), (n_new,)

    def run_causal(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x (1, n, X) at positions pos (n,), the last ones of the sequence: causal attention over
        the cache and themselves -> states (1, n, S)."""
        keys = torch.arange(int(pos[-1]) + 1, device=pos.device)
        allowed = keys[None, :] <= pos[:, None]  # (n, K)
        return self.net.backbone(x, pos[None], additive_mask(allowed[None], x.dtype), self.cache.kv)

    @torch.no_grad()
    def sync(self, state: DecodeState) -> torch.Tensor:
        """Bring the cache up to date with the committed tokens; return the predicted state of
        the position after the last processed one (1, 1, S): the input of the first draft."""
        h = self.run_causal(*self.sync_inputs(state))  # (1, n_new, S)
        assert len(self.cache) == self.cache.committed
        return h[:, -1:]  # (1, 1, S)

    @torch.no_grad()
    def after(self, state: DecodeState, tail: torch.Tensor) -> torch.Tensor:
        """ONE forward over the new committed positions and m tail inputs (1, m, X) at the
        positions after them -> the states (1, 1 + m, S) of the last committed position and the
        tail (P-EAGLE's mask positions); the cache keeps the committed positions only."""
        real, pos = self.sync_inputs(state)  # 1. (1, n_new, X) at the new committed positions
        x = torch.cat([real, tail], dim=1)  # 2. the tail after them: (1, n_new + m, X)
        pos = torch.cat([pos, pos[-1] + 1 + torch.arange(tail.shape[1], device=pos.device)])
        try:
            return self.run_causal(x, pos)[:, real.shape[1] - 1:]  # 3. (1, 1 + m, S)
        finally:
            self.cache.forget_drafts()  # the tail is per round: keep the committed positions

    @torch.no_grad()
    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        """Draft up to k tokens autoregressively, feeding the drafter's own predicted states."""
        if k < 1:
            return ChainProposal(tokens=state.tokens.new_empty(0))
        net, h = self.net, self.sync(state)  # (1, 1, S)
        T = state.tokens.shape[0]

        def step(i: int, token: torch.Tensor) -> torch.Tensor:
            """The next draft reads the drafted token and this predicted state."""
            nonlocal h
            x = net.inputs(token.view(1, 1), h)  # (1, 1, X)
            pos = torch.full((1, 1), T - 1 + i, device=x.device)
            h = net.backbone(x, pos, None, self.cache.kv)  # no mask: attends to the whole cache
            return net.head(h)[0, 0].float()  # (Vd,)

        try:
            return net.draft_chain(net.head(h)[0, 0].float(), step, k, sampling, generator,
                                   min_confidence)
        finally:  # drafts came from predicted states: redo them from real features next round
            self.cache.forget_drafts()

    @torch.no_grad()
    def propose_tree(self, state: DecodeState, sampling: SamplingParams,
                     generator: torch.Generator | None = None) -> TreeProposal:
        """EAGLE-2 dynamic tree (sampling: children drawn from q, drafters/parts/tree.py sampled_tree).
        Each level's frontier runs as one batch of queries through the cache with a tree mask: a
        node sees the committed prefix, its ancestors and itself, so a level costs one drafter
        step whatever its width."""
        net, cache = self.net, self.cache
        h_root = self.sync(state)[0, 0]  # (S,)
        out = {}  # pool index -> predicted state (S,) of that node's position

        def expand(tokens: torch.Tensor, parents: torch.Tensor, frontier: torch.Tensor):
            feats = torch.stack([out[int(parents[f])] if parents[f] >= 0 else h_root
                                 for f in frontier.tolist()])  # (F, S)
            x = net.inputs(net.target_ids(tokens[frontier])[None], feats[None])  # (1, F, X)
            allowed, pos, base = cache.tree_level(frontier, parents)  # (F, K), (1, F)
            h = net.backbone(x, pos, additive_mask(allowed[None], x.dtype), cache.kv)[0]
            cache.add_level(frontier, base)
            for i, f in enumerate(frontier.tolist()):
                out[f] = h[i]  # (S,)
            return net.head(h).float().log_softmax(-1)  # (F, Vd)

        root = net.head(h_root).float().log_softmax(-1)  # (Vd,)
        cfg = net.cfg
        sampled = sampling if cfg.tree_sampled else None  # None: the top-k tree
        try:
            tree = dynamic_tree(expand, root, cfg.tree_top_k, cfg.tree_depth,
                                cfg.tree_total_tokens, sampled, generator)
        finally:
            cache.forget_drafts()
        return in_target_vocab(tree, net.d2t, net.vocab_size)


class CausalDrafter(Drafter):
    """A Drafter decoded by CausalDrafting (module docstring): subclasses give `inputs`,
    `backbone`, `head` and, when their states are not the target's features, `project`."""

    drafting: CausalDrafting  # this sequence's decode state, renewed by reset()

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, Q, F) -> drafter states (B, Q, S); by default the same."""
        return features

    def inputs(self, tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Target ids (B, Q) and states (B, Q, S) -> backbone inputs (B, Q, X)."""
        raise NotImplementedError

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache=None) -> torch.Tensor:
        """Inputs (B, Q, X) at positions (B, Q) through `cache` under `mask` -> states (B, Q, S)."""
        raise NotImplementedError

    def head(self, states: torch.Tensor) -> torch.Tensor:
        """States (..., S) -> logits (..., Vd) over the draft vocabulary."""
        raise NotImplementedError

    @property
    def cache(self) -> DraftCache:
        """This sequence's drafter KV cache (committed positions only between rounds)."""
        return self.drafting.cache

    def reset(self) -> None:
        self.drafting = CausalDrafting(self)

    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        return self.drafting.propose(state, k, sampling, generator, min_confidence)

    def propose_tree(self, state: DecodeState, sampling: SamplingParams,
                     generator: torch.Generator | None = None) -> TreeProposal:
        return self.drafting.propose_tree(state, sampling, generator)

    def propose_rows(self, slots: Sequence[Drafter], states: Sequence[DecodeState],
                     ks: Sequence[int], sampling: SamplingParams,
                     generators: Sequence[torch.Generator | None],
                     min_confidence: float = 0.0) -> list[ChainProposal]:
        """Every row's chain together, one forward per draft step for all (drafters/parts/rows.py)."""
        return propose_rows(chain_round, slots, states, ks, sampling, generators, min_confidence)
