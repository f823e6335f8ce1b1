"""Batched chain drafting: the rows of a batch (decode/batched/spec.py) draft together, ONE drafter
forward per draft step for every row (P-EAGLE, DFlash: one per round), each row attending to its
own drafter cache through a padded batch cache (drafters/parts/cache.py RowsKV).

`propose_rows(round_fn, ...)` is Drafter.propose_rows for such drafters: it runs `round_fn` over the
rows that draft, falls back to each row's own propose when fewer than two do, and resets every
row's drafter when a round fails (a half-synced cache must not survive). `chain_round` is the
round of step-by-step drafters (drafters/parts/drafting.py CausalDrafter), `rows_forward` /
`rows_keep` the padded forward and its end that P-EAGLE's one-forward round shares. They reach a
drafter through its public decode interface only (`drafting`: sync_inputs, run_causal, cache;
`inputs`, `backbone`, `head`).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from specdistill.drafters.base import ChainDraw, ChainProposal
from specdistill.drafters.parts.cache import RowsKV, additive_mask

# a row with more new committed positions than this (a new prompt) runs all but the last of them
# alone first, so the padded forward stays as narrow as the rounds' blocks
ROWS_SYNC_ALONE = 16

# (slots, states, ks, sampling, generators, min_confidence) -> each row's chain
Round = Callable[..., list[ChainProposal]]


@torch.no_grad()
def propose_rows(round_fn: Round, slots, states, ks, sampling, generators, min_confidence=0.0
                 ) -> list[ChainProposal]:
    """Drafter.propose_rows with the rows together: `round_fn` over the rows with ks[r] >= 1, each
    row's chain what its own propose would draft (up to the padded forward's rounding)."""
    live = [r for r, k in enumerate(ks) if k >= 1]
    if len(live) < 2:  # nothing to batch: no padding
        return [d.propose(s, k, sampling, g, min_confidence)
                for d, s, k, g in zip(slots, states, ks, generators)]
    out = [ChainProposal(tokens=s.tokens.new_empty(0)) for s in states]
    pick = [slots[r] for r in live]
    try:
        got = round_fn(pick, [states[r] for r in live], [ks[r] for r in live], sampling,
                    [generators[r] for r in live], min_confidence)
    except BaseException:
        for d in pick:  # a half-synced cache must not survive: the next round rebuilds it
            d.reset()
        raise
    for r, p in zip(live, got):
        out[r] = p
    return out


def chain_round(slots, states, ks, sampling, generators, min_confidence) -> list[ChainProposal]:
    """A step-by-step drafter's round: 1. every row's new committed positions in one forward
    (padded); 2. each row's first draft from its last one; 3. one forward per further draft step
    over the rows still drafting; 4. each row's cache keeps its committed positions only."""
    net = slots[0]  # the rows' drafters share their weights
    h, rows, n = rows_forward(slots, states)  # 1. (B, Q, S)
    B = len(slots)
    h = h[torch.arange(B), torch.tensor(n) - 1][:, None]  # (B, 1, S)
    chains = [ChainDraw(net, k, sampling, g, min_confidence) for k, g in zip(ks, generators)]
    logits = net.head(h)[:, 0].float()  # (B, Vd)
    want = [c.draw(logits[b]) for b, c in enumerate(chains)]  # 2.
    T = [s.tokens.shape[0] for s in states]
    while any(want):  # 3. rows that stopped ride along, seeing only themselves
        tok = torch.stack([c.tokens[-1] for c in chains]).view(B, 1)
        pos = torch.tensor([[t - 2 + c.n] for t, c in zip(T, chains)], device=tok.device)
        live = torch.tensor(want, device=tok.device)[:, None]  # (B, 1)
        x = net.inputs(tok, h)  # (B, 1, X)
        h = net.backbone(x, pos, additive_mask(rows.block(live), x.dtype), rows.kv)
        logits = net.head(h)[:, 0].float()  # (B, Vd)
        want = [c.draw(logits[b]) for b, c in enumerate(chains)]  # a done chain draws no more
    rows_keep(slots, rows, n)  # 4.
    return [c.proposal() for c in chains]


def rows_forward(slots, states, tails=None) -> tuple[torch.Tensor, RowsKV, list[int]]:
    """ONE padded forward over every row's new committed positions (its cache synced first, as
    propose does) followed by tails[b] = (inputs (t_b, X), positions (t_b,)) if given, each row
    attending to its own cache (RowsKV) and causally within its block. Returns (states (B, Q, S),
    the RowsKV, n: each row's committed positions in the block)."""
    own = [d.drafting for d in slots]  # each row's drafters/parts/drafting.py CausalDrafting
    synced = [c.sync_inputs(s) for c, s in zip(own, states)]  # [(x (1, n, X), pos (n,))]
    for b, (c, (x, p)) in enumerate(zip(own, synced)):
        if len(p) > ROWS_SYNC_ALONE:  # e.g. a new row's prompt: not B padded copies of it
            c.run_causal(x[:, :-1], p[:-1])  # causal: its last position comes out the same
            synced[b] = x[:, -1:], p[-1:]
    n = [len(p) for _, p in synced]
    parts = [(x[0], p) for x, p in synced]
    if tails is not None:
        parts = [(torch.cat([x, tx]), torch.cat([p, tp]))
                 for (x, p), (tx, tp) in zip(parts, tails)]
    rows = RowsKV([c.cache for c in own], parts[0][1].device)
    width = [len(p) for _, p in parts]
    Q = max(width)
    x = torch.stack([F.pad(x, (0, 0, 0, Q - len(x))) for x, _ in parts])  # (B, Q, X)
    pos = torch.stack([torch.cat([p, p[-1:].expand(Q - len(p))]) for _, p in parts])  # (B, Q)
    valid = (torch.arange(Q)[None, :] < torch.tensor(width)[:, None]).to(pos.device)  # (B, Q)
    mask = additive_mask(rows.block(valid), x.dtype)
    return slots[0].backbone(x, pos, mask, rows.kv), rows, n


def rows_keep(slots, rows: RowsKV, n: list[int]) -> None:
    """The end of a together round: each row's cache gains its n[b] committed positions; the
    drafts stay behind in the batch cache."""
    caches = [d.drafting.cache for d in slots]
    rows.commit(caches, n)
    for c in caches:
        c.forget_drafts()
        assert len(c) == c.committed
