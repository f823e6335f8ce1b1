"""The row-per-sequence KV cache of batched decoding (decode/batched/spec.py), on a transformers
DynamicCache whose layers hold keys and values (B, H, L, D).

Rows are left-aligned: row r holds its L_r committed positions in columns [0, L_r); columns [L_r, L)
hold garbage from earlier rounds (or zeros) that the attention mask hides. A round appends a (B, Q)
block at columns [L, L + Q) (`inputs` builds its ids, mask and positions); `compact` then moves each
row's kept block columns (a chain's first n_r, a tree's accepted branch) to [L_r, L_r + n_r) and
crops the cache to the longest row, so every row's cache equals the one a lone decoder of that
sequence would hold. Only the kept columns are written (one indexed copy per layer).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def _pairs(cache: Any):
    """Each layer's (layer, keys, values); keys and values (B, H, L, D)."""
    if not hasattr(cache, "layers"):
        raise TypeError(f"batched decoding needs a transformers DynamicCache, got "
                        f"{type(cache).__name__}")
    return [(layer, layer.keys, layer.values) for layer in cache.layers]


def pad_columns(x: torch.Tensor, length: int) -> torch.Tensor:
    """x (B, H, L, D) with zero columns appended up to `length`."""
    extra = length - x.shape[-2]
    return x if extra <= 0 else torch.cat([x, x.new_zeros(*x.shape[:2], extra, x.shape[-1])], -2)


def add_row(cache: Any, row: Any) -> None:
    """Append the single-sequence cache `row` (1, H, P, D) as a new last row of `cache`, padding
    whichever is shorter with zero columns (hidden by the mask)."""
    for (layer, k, v), (_, rk, rv) in zip(_pairs(cache), _pairs(row)):
        n = max(k.shape[-2], rk.shape[-2])
        layer.keys = torch.cat([pad_columns(k, n), pad_columns(rk, n)], 0)  # (B+1, H, n, D)
        layer.values = torch.cat([pad_columns(v, n), pad_columns(rv, n)], 0)  # (B+1, H, n, D)


def select_rows(cache: Any, rows: Sequence[int], length: int) -> None:
    """Keep only `rows` of the cache, in that order, and its first `length` columns (the longest
    kept row)."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    for layer, k, v in _pairs(cache):
        idx = idx.to(k.device)
        layer.keys, layer.values = k[idx, :, :length], v[idx, :, :length]  # (B', H, length, D)


def inputs(rows: Sequence[torch.Tensor], lengths: Sequence[int], cache_len: int,
           plain_mask: bool = True, trees: Sequence[torch.Tensor | None] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The padded verification forward over rows[r] (m_r+1,) = [last committed, drafts] of each
    sequence: input_ids (B, Q), attention_mask (B, 1, Q, cache_len + Q) bool (True = attend) and
    position_ids (B, Q). Row r's block sees its own L_r cached positions and, within the block,
    a chain: tokens 0..t, at position L_r + t; a tree (trees[r] = the ancestor matrix (m_r, m_r)
    of its nodes, decode/tree.py): the root (the last committed token) sees itself, node i the
    root, its ancestors and itself, at position L_r + depth(i). Padding tokens (t > m_r) repeat
    the last token, see the block causally and are ignored. When every row is a chain that fills
    the cache (L_r = cache_len, e.g. B = 1) and plain_mask, the mask and positions are the
    model's default causal ones: (ids, None, None), the lone decoder's forward."""
    trees = list(trees) if trees is not None else [None] * len(rows)
    if plain_mask and min(lengths) == cache_len and all(a is None for a in trees):
        return padded_ids(rows), None, None
    ids, block, offset = block_layout(rows, trees)
    B, Q = ids.shape
    L = torch.as_tensor(list(lengths), dtype=torch.long, device=ids.device)  # (B,)
    cached = torch.arange(cache_len, device=ids.device)[None, :] < L[:, None]  # (B, cache_len)
    mask = torch.cat([cached[:, None, :].expand(B, Q, cache_len), block], dim=-1)  # (B, Q, K)
    return ids, mask[:, None], L[:, None] + offset  # (B, Q), (B, 1, Q, K), (B, Q)


def padded_ids(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """rows[r] (m_r+1,) padded to (B, Q) by repeating each row's last token."""
    Q = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r[-1:].expand(Q - len(r))]) for r in rows])  # (B, Q)


def block_layout(rows: Sequence[torch.Tensor], trees: Sequence[torch.Tensor | None]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new block of a round, whatever the cache layout: ids (B, Q) (`padded_ids`), which
    block position each block position sees, block (B, Q, Q) bool (a chain: causal; a tree: the
    root itself, node i the root, its ancestors and itself), and each position's offset from the
    row's cached length, offset (B, Q) (a chain: t; a tree node: its depth below the root)."""
    ids = padded_ids(rows)
    B, Q = ids.shape
    t = torch.arange(Q, device=ids.device)  # (Q,)
    block = (t[None, :] <= t[:, None])[None].repeat(B, 1, 1)  # (B, Q, Q) causal
    offset = t[None, :].repeat(B, 1)  # (B, Q) position offsets within the block
    for r, anc in enumerate(trees):
        if anc is not None and len(anc):
            n = len(anc)
            block[r, :n + 1, :n + 1] = False
            block[r, 0, 0] = True  # the root sees itself (and the cache)
            block[r, 1:n + 1, 0] = True  # every node sees the root ...
            block[r, 1:n + 1, 1:n + 1] = anc  # ... its ancestors and itself
            offset[r, 1:n + 1] = anc.sum(-1)  # depth below the root
    return ids, block, offset


def compact(cache: Any, lengths: Sequence[int], keep: Sequence[int | torch.Tensor],
            cache_len: int) -> None:
    """After a round's forward: row r keeps keep[r] block columns, an int n (the first n: last
    committed token + accepted chain drafts) or the ascending block positions (n,) of a tree's
    root and accepted branch, moved from cache_len + those positions to [L_r, L_r + n); then the
    cache is cropped to max_r (L_r + n_r) columns."""
    n = [k if isinstance(k, int) else len(k) for k in keep]
    # every kept block a prefix (a chain's, or a branch that is one) ...
    in_place = all(isinstance(k, int) or int(k[-1]) == len(k) - 1 for k in keep)
    if min(lengths) == cache_len and in_place:  # ... already at [L_r, L_r + n_r)
        cache.crop(max(n) - (cache.get_seq_length() - cache_len))
        return
    dev = _pairs(cache)[0][1].device
    cols = [torch.arange(k, device=dev) if isinstance(k, int) else k.to(dev) for k in keep]
    new_len = max(l + m for l, m in zip(lengths, n))
    # only the kept columns move: row r's i-th kept block column goes to column L_r + i
    rows = torch.repeat_interleave(torch.arange(len(cols), device=dev),
                                   torch.tensor(n, device=dev))  # (M,) M = sum n_r
    src = cache_len + torch.cat(cols)  # (M,)
    dst = torch.cat([torch.arange(l, l + len(c), device=dev) for l, c in zip(lengths, cols)])
    move_columns(cache, rows, src, dst)
    for layer, k, v in _pairs(cache):
        layer.keys, layer.values = k[:, :, :new_len], v[:, :, :new_len]  # (B, H, new_len, D)


def move_columns(cache: Any, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every layer, copy column src[i] of row rows[i] to column dst[i] (all (M,)); the sources
    are read first, so overlapping columns are safe."""
    for _, k, v in _pairs(cache):
        k[rows, :, dst] = k[rows, :, src]  # (M, H, D)
        v[rows, :, dst] = v[rows, :, src]
