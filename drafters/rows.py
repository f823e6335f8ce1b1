"""Batched chain drafting for EAGLE-family drafters (Eagle, Eagle3, Peagle) and DFlash: the rows
of a batch (decode/batch.py) draft together, ONE drafter forward per draft step for every row,
each row attending to its own drafter cache through a padded batch cache (drafters/cache.py
RowsKV).

`RowsTogether` is a mixin in front of `Drafter`. Its default round needs the EAGLE-family decode
pieces (`_sync_inputs`, `_run_causal`, `_inputs`, `_layers`, `head`, `_cache`). A drafter whose
round is one forward (P-EAGLE, DFlash) overrides `_propose_together`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdistill.drafters.cache import RowsKV, additive_mask
from specdistill.drafters.proposals import ChainDraw, ChainProposal


class RowsTogether:
    """Drafter.propose_rows with the rows together (see the module docstring)."""

    @torch.no_grad()
    def propose_rows(self, slots, states, ks, sampling, generators, min_confidence=0.0):
        """Drafter.propose_rows with ONE drafter forward per draft step for all rows (and one for
        their new committed positions), each row attending to its own cache only (RowsKV), so each
        row's chain is what its own propose would draft (up to the padded forward's rounding)."""
        live = [r for r, k in enumerate(ks) if k >= 1]
        if len(live) < 2:  # nothing to batch: no padding
            return super().propose_rows(slots, states, ks, sampling, generators, min_confidence)
        out = [ChainProposal(tokens=s.tokens.new_empty(0)) for s in states]
        pick = [slots[r] for r in live]
        try:
            got = self._propose_together(pick, [states[r] for r in live], [ks[r] for r in live],
                                         sampling, [generators[r] for r in live], min_confidence)
        except BaseException:
            for d in pick:  # a half-synced cache must not survive: the next round rebuilds it
                d.reset()
            raise
        for r, p in zip(live, got):
            out[r] = p
        return out

    def _propose_together(self, slots, states, ks, sampling, generators, min_confidence
                          ) -> list[ChainProposal]:
        """propose_rows' round: 1. every row's new committed positions in one forward (padded);
        2. each row's first draft from its last one; 3. one forward per further draft step over
        the rows still drafting; 4. each row's cache keeps its committed positions only."""
        h, rows, n = self._rows_forward(slots, states)  # 1. (B, Q, H)
        B = len(slots)
        h = h[torch.arange(B), torch.tensor(n) - 1][:, None]  # (B, 1, H)
        chains = [ChainDraw(self, k, sampling, g, min_confidence) for k, g in zip(ks, generators)]
        logits = self.head(h)[:, 0].float()  # (B, Vd)
        want = [c.draw(logits[b]) for b, c in enumerate(chains)]  # 2.
        T = [s.tokens.shape[0] for s in states]
        while any(want):  # 3. rows that stopped ride along, seeing only themselves
            tok = torch.stack([c.tokens[-1] for c in chains]).view(B, 1)
            pos = torch.tensor([[t - 2 + c.n] for t, c in zip(T, chains)], device=tok.device)
            live = torch.tensor(want, device=tok.device)[:, None]  # (B, 1)
            x = self._inputs(tok, h)  # (B, 1, .)
            h = self._layers(x, pos, additive_mask(rows.block(live), x.dtype), rows.kv)
            logits = self.head(h)[:, 0].float()  # (B, Vd)
            want = [c.draw(logits[b]) for b, c in enumerate(chains)]  # a done chain draws no more
        self._rows_keep(slots, rows, n)  # 4.
        return [c.proposal() for c in chains]

    # propose_rows: a row with more new committed positions than this (a new prompt) runs all but
    # the last of them alone first, so the padded forward stays as narrow as the rounds' blocks
    rows_sync_alone: int = 16

    def _rows_forward(self, slots, states, tails=None) -> tuple[torch.Tensor, RowsKV, list[int]]:
        """ONE padded forward over every row's new committed positions (its cache synced first,
        as propose does) followed by tails[b] = (inputs (t_b, .), positions (t_b,)) if given,
        each row attending to its own cache (RowsKV) and causally within its block. Returns
        (h (B, Q, H), the RowsKV, n: each row's committed positions in the block)."""
        synced = [d._sync_inputs(s) for d, s in zip(slots, states)]  # [(x (1, n, .), pos (n,))]
        for b, (d, (x, p)) in enumerate(zip(slots, synced)):
            if len(p) > self.rows_sync_alone:  # e.g. a new row's prompt: not B padded copies of it
                d._run_causal(x[:, :-1], p[:-1])  # causal: its last position comes out the same
                synced[b] = x[:, -1:], p[-1:]
        n = [len(p) for _, p in synced]
        parts = [(x[0], p) for x, p in synced]
        if tails is not None:
            parts = [(torch.cat([x, tx]), torch.cat([p, tp]))
                     for (x, p), (tx, tp) in zip(parts, tails)]
        rows = RowsKV([d._cache for d in slots], parts[0][1].device)
        width = [len(p) for _, p in parts]
        Q = max(width)
        x = torch.stack([F.pad(x, (0, 0, 0, Q - len(x))) for x, _ in parts])  # (B, Q, .)
        pos = torch.stack([torch.cat([p, p[-1:].expand(Q - len(p))]) for _, p in parts])  # (B, Q)
        valid = (torch.arange(Q)[None, :] < torch.tensor(width)[:, None]).to(pos.device)  # (B, Q)
        return self._layers(x, pos, additive_mask(rows.block(valid), x.dtype), rows.kv), rows, n

    @staticmethod
    def _rows_keep(slots, rows: RowsKV, n: list[int]) -> None:
        """The end of a together round: each row's cache gains its n[b] committed positions; the
        drafts stay behind in the batch cache."""
        rows.commit([d._cache for d in slots], n)
        for d in slots:
            d._cache.forget_drafts()
            assert len(d._cache) == d._cache.committed
