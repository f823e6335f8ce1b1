"""The drafter KV cache: a drafter's own attention cache kept in step with the committed tokens.

Between two rounds the decoder's committed tokens only grow by appending (accepted drafts + the
target's bonus token), so a cache built on an earlier round stays valid up to the longest prefix
it shares with the new tokens; everything after is cropped and recomputed (`sync_to`). During a
round the drafter appends draft positions; `forget_drafts` drops them again when they must be
redone (e.g. EAGLE's, made from predicted rather than real target features). For tree drafting
a level's frontier runs as one batch of queries: `tree_level` builds its mask (each node sees the
committed positions, its ancestors and itself) and positions, `add_level` records where the
nodes landed.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (..., Q, K) True = may attend -> additive float mask (..., 1, Q, K) for the layers.
    The finite minimum (not -inf) keeps a fully masked padding row from producing NaN."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, neg).unsqueeze(-3)


class DraftCache:
    """A DynamicCache plus what it holds: `tokens` (the tokens it was synced to) and `committed`
    (how many cache positions come from committed tokens; the rest are drafts)."""

    def __init__(self, config=None) -> None:
        self.config = config  # an HF config (per-layer cache kinds), or None for plain layers
        self.reset()

    def reset(self) -> None:
        self.kv = DynamicCache(config=self.config) if self.config is not None else DynamicCache()
        self.tokens = torch.empty(0, dtype=torch.long)  # tokens whose positions the cache holds
        self.committed = 0  # cache positions made from committed tokens
        self.slots: dict[int, int] = {}  # tree drafting: pool index -> its index in the cache

    def __len__(self) -> int:
        return self.kv.get_seq_length()

    def shared_prefix(self, tokens: torch.Tensor) -> int:
        """How many leading tokens of `tokens` (T,) equal the ones the cache was synced to."""
        prev = self.tokens.to(tokens.device)
        m = min(len(prev), tokens.shape[0])
        return int((prev[:m] == tokens[:m]).long().cumprod(0).sum())

    def crop(self, n: int) -> None:
        """Keep the first n cache positions."""
        if len(self) > n:
            self.kv.crop(n - len(self))

    def sync_to(self, tokens: torch.Tensor, keep: int, committed: int) -> None:
        """Crop to `keep` positions (the caller recomputes the rest from there) and remember the
        tokens the cache will hold once it has, `committed` positions of them."""
        self.crop(keep)
        self.tokens, self.committed = tokens.clone(), committed

    def forget_drafts(self) -> None:
        """Drop every position after the committed ones (drafts, tree nodes)."""
        self.crop(self.committed)
        self.slots = {}

    def tree_level(self, frontier: torch.Tensor, parents: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One tree level's attention: (allowed (F, K) bool, positions (1, F), base) for the F
        frontier nodes, K = base + F, base = the cache length before the level. Node positions
        continue the committed ones by depth (a child of the root sits at position `committed`)."""
        base, n_f = len(self), len(frontier)
        dev = frontier.device
        allowed = torch.zeros(n_f, base + n_f, dtype=torch.bool, device=dev)  # (F, K)
        allowed[:, :self.committed] = True  # 1. the committed prefix
        depth = []
        for i, f in enumerate(frontier.tolist()):  # 2. each node's ancestors (cached) and itself
            p, d = int(parents[f]), 1
            while p >= 0:
                allowed[i, self.slots[p]], p, d = True, int(parents[p]), d + 1
            allowed[i, base + i] = True
            depth.append(d)
        pos = (self.committed - 1 + torch.tensor(depth, device=dev))[None]  # (1, F)
        return allowed, pos, base

    def add_level(self, frontier: torch.Tensor, base: int) -> None:
        """Record the cache slots of a level's nodes (after running it)."""
        for i, f in enumerate(frontier.tolist()):
            self.slots[f] = base + i


class RowsKV:
    """Several sequences' drafter caches as ONE padded batch cache, for a round of batched drafting
    (an Eagle drafter's `propose_rows`). Row r's cached positions sit in columns [0, L_r) of a
    DynamicCache of max L_r columns (zeros after: never attended to); every forward then appends Q
    columns for all rows at once (`block`), and `allowed` (B, K) records which columns hold a
    real position of each row. `commit` appends each row's first n_r new columns (its committed
    positions) to its own cache; everything after (drafts) goes away with the batch cache, as a
    lone row's `forget_drafts` drops them."""

    def __init__(self, caches: list[DraftCache], device: torch.device) -> None:
        self.lengths = [len(c) for c in caches]
        full = next((c for c, n in zip(caches, self.lengths) if n), None)
        config = caches[0].config
        self.kv = DynamicCache(config=config) if config is not None else DynamicCache()
        B, L, dev = len(caches), max(self.lengths), device
        lengths = torch.tensor(self.lengths, device=dev)
        self.allowed = torch.arange(L, device=dev)[None, :] < lengths[:, None]  # (B, L)
        self.start = L  # first column of the round's new positions
        if full is None:
            return
        for i, layer in enumerate(full.kv.layers):
            keys, values = (torch.zeros((B, *t.shape[1:2], L, t.shape[-1]), dtype=t.dtype,
                                        device=t.device) for t in (layer.keys, layer.values))
            for r, (c, n) in enumerate(zip(caches, self.lengths)):
                if n:
                    keys[r, :, :n] = c.kv.layers[i].keys[0]
                    values[r, :, :n] = c.kv.layers[i].values[0]
            self.kv.update(keys, values, i)

    def block(self, valid: torch.Tensor) -> torch.Tensor:
        """The attention of the next Q queries of every row (valid (B, Q) bool: real queries),
        appended as the next Q columns: (B, Q, K + Q) bool over every column so far and the block,
        causal within it. A padding query sees itself only (finite, and nobody reads it)."""
        B, Q = valid.shape
        dev = valid.device
        old = self.allowed[:, None, :] & valid[:, :, None]  # (B, Q, K)
        causal = torch.ones(Q, Q, dtype=torch.bool, device=dev).tril()
        new = (causal & valid[:, None, :] & valid[:, :, None]) | torch.eye(Q, dtype=torch.bool,
                                                                          device=dev)  # (B, Q, Q)
        self.allowed = torch.cat([self.allowed, valid], dim=1)
        return torch.cat([old, new], dim=-1)

    def commit(self, caches: list[DraftCache], n: list[int]) -> None:
        """Append row r's first n[r] columns of the round (its committed positions) to caches[r]."""
        a = self.start
        for r, (c, m) in enumerate(zip(caches, n)):
            for i, layer in enumerate(self.kv.layers):
                c.kv.update(layer.keys[r:r + 1, :, a:a + m], layer.values[r:r + 1, :, a:a + m], i)
