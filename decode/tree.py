"""Tree verification: one target forward checks every branch of a draft tree at once.

The target sees [root, node_1 .. node_N] where the root is the last committed token. Each row may
attend to the committed KV cache, its ancestors and itself (`tree_inputs`), and sits at position
base + depth, so every branch is computed exactly as if it were the only continuation.
`accept_path` then finds the longest branch the target agrees with (greedy; when sampling,
`sample_path` walks the tree with the multi-draft rule) and `compact_cache` keeps only that branch
in the KV cache, so the next round starts from a cache that equals the one a plain decoder would
have built.
"""
from __future__ import annotations

from typing import Any

import torch

from specdistill.decode.accept import multi_draft
from specdistill.drafters.parts.sampling import sample


def check_tree(tokens: torch.Tensor, parents: torch.Tensor) -> None:
    """Raise ValueError unless (tokens, parents) is a topologically ordered tree."""
    if tokens.dim() != 1 or parents.shape != tokens.shape:
        raise ValueError(f"tree tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} "
                         f"must be 1-D of the same length")
    idx = torch.arange(len(parents), device=parents.device)  # (N,)
    if bool(((parents < -1) | (parents >= idx)).any()):
        raise ValueError("tree parents must satisfy -1 <= parents[i] < i (topological order): "
                         f"{parents.tolist()}")


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """anc (N, N) bool: anc[i, j] is True when node j is node i or one of its ancestors.

    Vectorised as repeated steps along the parent matrix: one matmul per tree level.
    """
    N = len(parents)
    up = torch.zeros(N, N, device=parents.device)  # (N, N) up[i, parents[i]] = 1
    has = parents >= 0  # (N,)
    up[has.nonzero().squeeze(-1), parents[has]] = 1.0
    anc = torch.eye(N, device=parents.device)  # (N, N)
    cur = anc
    for _ in range(N):
        cur = cur @ up  # (N, N) cur[i, j] = 1 when j is the ancestor one level further up
        if not bool(cur.any()):
            break
        anc = anc + cur
    return anc > 0


def prune_depth(tokens: torch.Tensor, parents: torch.Tensor, anc: torch.Tensor, max_depth: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop nodes deeper than max_depth (the room: drafts that can still commit), renumbering
    parents. Returns the pruned tokens (N',), parents (N',) and ancestor matrix (N', N')."""
    keep = anc.sum(-1) <= max_depth  # (N,) ancestors of kept nodes are shallower, so also kept
    if bool(keep.all()):
        return tokens, parents, anc
    new_index = keep.long().cumsum(0) - 1  # (N,) position of each kept node in the pruned tree
    kept_parents = parents[keep]  # (N',)
    remapped = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], kept_parents)
    return tokens[keep], remapped, anc[keep][:, keep]


def tree_inputs(
    root: torch.Tensor,  # (1,) long: the last committed token
    tokens: torch.Tensor,  # (N,) long
    anc: torch.Tensor,  # (N, N) bool from `ancestors`
    cache_len: int,  # committed tokens already in the KV cache
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of the tree verification forward: input_ids (1, N+1), attention_mask
    (1, 1, N+1, cache_len+N+1) bool (True = attend) and position_ids (1, N+1)."""
    N = len(tokens)
    mask = torch.ones(N + 1, cache_len + N + 1, dtype=torch.bool, device=tokens.device)
    mask[0, cache_len + 1:] = False  # the root sees only the cache and itself
    mask[1:, cache_len + 1:] = anc  # nodes see their ancestors and themselves (and the root)
    depth = anc.sum(-1)  # (N,) 1 for children of the root
    position_ids = cache_len + torch.cat([depth.new_zeros(1), depth])  # (N+1,)
    input_ids = torch.cat([root, tokens])  # (N+1,)
    return input_ids[None], mask[None, None], position_ids[None]


def accept_path(
    tokens: torch.Tensor,  # (N,) long
    parents: torch.Tensor,  # (N,) long
    anc: torch.Tensor,  # (N, N) bool from `ancestors`
    best: torch.Tensor,  # (N+1,) long: the target's argmax at [root, node_1 .. node_N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy walk: the deepest branch whose every token equals the target's argmax at its parent.

    Returns keep (n+1,) long: input positions of the root and the accepted nodes (ascending), and
    next (1,) long: the target's token after the accepted branch (the bonus).
    Equivalent to walking down from the root taking the child that matches, vectorised.
    """
    good = tokens == best[parents + 1]  # (N,) node token == target's choice at its parent
    on_good_path = ~(anc & ~good[None, :]).any(-1)  # (N,) node and all its ancestors match
    depth = anc.sum(-1)  # (N,)
    N = len(tokens)
    # deepest matching node; among equals the first one (what a walk taking the first match finds)
    score = torch.where(on_good_path, depth * (N + 1) - torch.arange(N, device=tokens.device), -1)
    if N == 0 or int(score.max()) < 0:
        return torch.zeros(1, dtype=torch.long, device=tokens.device), best[:1]
    leaf = int(score.argmax())
    path = anc[leaf].nonzero().squeeze(-1) + 1  # (n,) input positions, ascending (topological)
    keep = torch.cat([path.new_zeros(1), path])  # (n+1,)
    return keep, best[leaf + 1: leaf + 2]


def sample_path(
    tokens: torch.Tensor,  # (N,) long
    parents: torch.Tensor,  # (N,) long
    probs: torch.Tensor | None,  # (N, V) the q each node was drawn from; None = deterministic tree
    p: torch.Tensor,  # (N+1, V) the target's warped distributions at [root, node_1 .. node_N]
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling walk, lossless: from the root, the multi-draft rule (decode/accept.py) over the
    current node's children picks one to descend into, or ends the branch with a token from the
    residual. Each level's output then follows the target's p given the path above it, whatever
    the drafter's q. Returns keep (n+1,) and next (1,) as `accept_path` does."""
    kids: dict[int, list[int]] = {}  # node -> its children in index (= draw) order; -1 = the root
    for i, par in enumerate(parents.tolist()):
        kids.setdefault(par, []).append(i)
    node, path = -1, []
    while True:
        children = torch.tensor(kids.get(node, []), dtype=torch.long, device=tokens.device)  # (m,)
        q = None if probs is None else probs[children]  # (m, V)
        pick, residual = multi_draft(p[node + 1], tokens[children], q)  # (m+1,), (V,)
        i = int(torch.multinomial(pick, 1, generator=generator))
        if i == len(children):  # every child rejected (or none): the residual's token ends it
            keep = torch.tensor([0] + [n + 1 for n in path], dtype=torch.long, device=tokens.device)
            return keep, sample(residual, generator)[None]
        node = int(children[i])
        path.append(node)


def compact_cache(cache: Any, start: int, keep: torch.Tensor) -> None:
    """Keep only positions start + keep of the tree forward in every layer's KV cache.

    The cache holds start committed tokens followed by the N+1 tree rows; afterwards it holds the
    committed tokens followed by the accepted branch, contiguous, and nothing else.
    """
    if not hasattr(cache, "layers"):
        raise TypeError("tree decoding needs a transformers DynamicCache or StaticCache, "
                        f"got {type(cache).__name__}")
    total = int(cache.get_seq_length())  # a StaticCache returns a tensor
    L = len(keep)
    if int(keep[-1]) != L - 1:  # keep rises from 0, so this means the branch is not in place yet
        _gather(cache, start, keep)
    cache.crop(-(total - start - L))


def _gather(cache: Any, start: int, keep: torch.Tensor) -> None:
    L = len(keep)
    idx = start + keep  # (L,) positions along the sequence axis
    for layer in cache.layers:
        # advanced indexing copies first, so overlapping source and destination are safe
        layer.keys[:, :, start:start + L] = layer.keys[:, :, idx]  # (B, H, L, D)
        layer.values[:, :, start:start + L] = layer.values[:, :, idx]  # (B, H, L, D)
