"""The row-per-sequence KV cache of batched decoding (decode/batch.py), on a transformers
DynamicCache whose layers hold keys and values (B, H, L, D).

Rows are left-aligned: row r holds its L_r committed positions in columns [0, L_r); columns
[L_r, L) hold garbage from earlier rounds (or zeros) that the attention mask hides. A round
appends a (B, Q) block at columns [L, L + Q) (`inputs` builds its ids, mask and positions);
`compact` then moves each row's kept block columns to [L_r, L_r + n_r) and crops the cache to the
longest row, so every row's cache equals the one a lone decoder of that sequence would hold.
Only the tail from the shortest row on is rewritten.
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


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    """x (B, H, L, D) with zero columns appended up to `length`."""
    extra = length - x.shape[-2]
    return x if extra <= 0 else torch.cat([x, x.new_zeros(*x.shape[:2], extra, x.shape[-1])], -2)


def add_row(cache: Any, row: Any) -> None:
    """Append the single-sequence cache `row` (1, H, P, D) as a new last row of `cache`, padding
    whichever is shorter with zero columns (hidden by the mask)."""
    for (layer, k, v), (_, rk, rv) in zip(_pairs(cache), _pairs(row)):
        n = max(k.shape[-2], rk.shape[-2])
        layer.keys = torch.cat([_pad_to(k, n), _pad_to(rk, n)], 0)  # (B+1, H, n, D)
        layer.values = torch.cat([_pad_to(v, n), _pad_to(rv, n)], 0)  # (B+1, H, n, D)


def select_rows(cache: Any, rows: Sequence[int], length: int) -> None:
    """Keep only `rows` of the cache, in that order, and its first `length` columns (the longest
    kept row)."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    for layer, k, v in _pairs(cache):
        idx = idx.to(k.device)
        layer.keys, layer.values = k[idx, :, :length], v[idx, :, :length]  # (B', H, length, D)


def inputs(rows: Sequence[torch.Tensor], lengths: Sequence[int], cache_len: int,
           plain_mask: bool = True) -> tuple[torch.Tensor, torch.Tensor | None,
                                             torch.Tensor | None]:
    """The padded verification forward over rows[r] (m_r+1,) = [last committed, drafts] of each
    sequence: input_ids (B, Q), attention_mask (B, 1, Q, cache_len + Q) bool (True = attend) and
    position_ids (B, Q). Row r's token t sits at position L_r + t and sees its own L_r cached
    positions and block tokens 0..t; padding tokens (t > m_r) repeat the last token and are
    ignored. When every row fills the cache (L_r = cache_len, e.g. B = 1) and plain_mask, the
    mask and positions are the model's default causal ones: (ids, None, None), the lone
    decoder's forward."""
    B, Q, dev = len(rows), max(len(r) for r in rows), rows[0].device
    ids = torch.stack([torch.cat([r, r[-1:].expand(Q - len(r))]) for r in rows])  # (B, Q)
    if plain_mask and min(lengths) == cache_len:
        return ids, None, None
    L = torch.as_tensor(list(lengths), dtype=torch.long, device=dev)  # (B,)
    t = torch.arange(Q, device=dev)  # (Q,)
    cached = torch.arange(cache_len, device=dev)[None, :] < L[:, None]  # (B, cache_len)
    causal = t[None, :] <= t[:, None]  # (Q, Q)
    mask = torch.cat([cached[:, None, :].expand(B, Q, cache_len),
                      causal[None].expand(B, Q, Q)], dim=-1)  # (B, Q, cache_len + Q)
    return ids, mask[:, None], L[:, None] + t[None, :]  # (B, Q), (B, 1, Q, K), (B, Q)


def compact(cache: Any, lengths: Sequence[int], keep: Sequence[int], cache_len: int) -> None:
    """After a round's forward: row r keeps the first keep[r] block columns (last committed token
    + accepted drafts), moved from [cache_len, cache_len + keep[r]) to [L_r, L_r + keep[r]);
    then the cache is cropped to max_r (L_r + keep[r]) columns."""
    if min(lengths) == cache_len:  # every kept block already sits at [L_r, L_r + keep[r])
        cache.crop(max(keep) - (cache.get_seq_length() - cache_len))
        return
    dev = cache.layers[0].keys.device
    L = torch.as_tensor(list(lengths), dtype=torch.long, device=dev)  # (B,)
    n = torch.as_tensor(list(keep), dtype=torch.long, device=dev)  # (B,)
    lo, new_len = int(L.min()), int((L + n).max())
    a = torch.arange(lo, new_len, device=dev)[None, :].expand(len(L), -1)  # (B, W) absolute column
    # source column: a row's own prefix stays, its kept block moves down, the rest is garbage
    src = torch.where((a >= L[:, None]) & (a < (L + n)[:, None]), cache_len + a - L[:, None], a)
    for layer, k, v in _pairs(cache):
        B, H, _, D = k.shape
        idx = src[:, None, :, None].expand(B, H, src.shape[1], D)  # (B, H, W, D)
        # gather copies first, so overlapping source and destination columns are safe
        k[:, :, lo:new_len] = k.gather(2, idx)
        v[:, :, lo:new_len] = v.gather(2, idx)
        layer.keys, layer.values = k[:, :, :new_len], v[:, :, :new_len]  # (B, H, new_len, D)
