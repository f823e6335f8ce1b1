"""Exact verification for batched decoding (`generate_batch(exact_verify=True)`): every row of a
batched forward rounds exactly as the same sequence's lone exact decode (decode/exact.py), so
each batched greedy output is bit-identical to decoding that prompt alone, at any dtype.

A lone exact decode reduces every attention over its static cache's capacity C = prompt +
max_new_tokens + VERIFY_ROOM, with the round's block written right after the committed tokens.
The dynamic batch cache (decode/batched/kv_cache.py) instead appends every row's block after the
longest row and reduces over the batch's length, which changes a row's rounding whenever the batch
changes. Here the batch keeps each row as its lone decode would:
  - one (B, H, W, d) tensor per layer, W = the largest capacity in the batch; row r holds its
    committed tokens at [0, L_r) and a round writes its block at [L_r, L_r + Q) (`_RowsLayer`);
    a chain's accepted drafts are then already in place, a tree's branch is moved down;
  - attention runs row by row over the row's own first C_r columns
    (`decode.exact.active(capacities)`), with the row's explicit mask and positions;
  - the linears run over all B x Q rows at once: a bf16 GEMM row rounds alike for any number of
    rows >= 2 (measured on the 2-core AVX512-BF16 CPU for M = 2..200 rows at SmolLM2's shapes,
    2026-12-01), and a lone row is run as two (kernels' hooks), as in a lone decode.
Admission prefills the prompt alone through its own `ExactVerify` (as a lone decode does) and
copies the committed columns into a new row. Cost: B small attention calls per layer instead of
one (BENCHMARKS.md "Exact batched greedy"). Measured and tested on CPUs; on a GPU the GEMM
row-consistency it relies on is unverified (`benchmarks.decode_speed --batch --batch-exact` counts the
outputs that differ from unbatched decoding).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdistill.decode.batched.kv_cache import block_layout, move_columns, pad_columns
from specdistill.decode.exact import ExactVerify, active


class _RowsLayer(CacheLayerMixin):
    """One layer of `ExactRows`: keys / values (B, H, W, d); a forward's (B, H, Q, d) block goes to
    each row's own columns [L_r, L_r + Q)."""

    def __init__(self, owner: "ExactRows") -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("ExactRows gets its rows from add_row, not from a forward")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = self.owner.write_index(key_states.shape[-2])  # (B, Q) each
        self.keys[rows, :, cols] = key_states.transpose(1, 2)  # (B, Q, H, d)
        self.values[rows, :, cols] = value_states.transpose(1, 2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        return self.owner.seq_length()

    def get_max_length(self) -> int:
        return self.keys.shape[-2] if self.keys is not None else -1


class ExactRows:
    """The batch's target KV cache for exact verification: rows as their lone exact decodes keep
    them (module doc). `cache` is what the target's forward takes; `caps[r]` is row r's capacity."""

    def __init__(self, target: Any) -> None:
        n_layers = target.model.config.get_text_config(decoder=True).num_hidden_layers
        self.cache = Cache(layers=[_RowsLayer(self) for _ in range(n_layers)])
        self.caps: list[int] = []
        self._at: torch.Tensor | None = None  # (B,) where this forward's block starts per row

    def add_row(self, row: ExactVerify, cached: int) -> None:
        """Append a sequence prefilled alone through its own `ExactVerify` (a lone exact decode's
        static cache) as the last row: its first `cached` columns, its capacity."""
        width = max([row.capacity] + self.caps)
        for layer, one in zip(self.cache.layers, row.cache.layers):
            for name in ("keys", "values"):
                src = getattr(one, name)[:, :, :cached]  # (1, H, cached, d)
                new = src.new_zeros(1, src.shape[1], width, src.shape[-1])
                new[:, :, :cached] = src
                have = getattr(layer, name)
                setattr(layer, name, new if have is None else torch.cat([pad_columns(have, width), new]))
            layer.is_initialized = True
        self.caps.append(row.capacity)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in that order (the batch width shrinks to their largest capacity)."""
        self.caps = [self.caps[r] for r in rows]
        width = max(self.caps, default=0)
        for layer in self.cache.layers:
            idx = torch.as_tensor(list(rows), dtype=torch.long, device=layer.keys.device)
            layer.keys, layer.values = layer.keys[idx, :, :width], layer.values[idx, :, :width]

    def inputs(self, rows: Sequence[torch.Tensor], lengths: Sequence[int],
               trees: Sequence[torch.Tensor | None] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """decode/kv_cache.inputs for this layout: ids (B, Q), attention_mask (B, 1, Q, W) bool
        (row r: its cached [0, L_r), and its block at [L_r, L_r + Q) as a chain or its tree) and
        position_ids (B, Q); the next forward writes row r's block at column L_r."""
        ids, block, offset = block_layout(rows, list(trees) if trees else [None] * len(rows))
        B, Q = ids.shape
        for r, (n, cap) in enumerate(zip(lengths, self.caps)):
            if n + Q > cap:
                raise ValueError(f"exact batched verification: row {r} needs {n + Q} cache "
                                 f"positions, its static capacity is {cap} (prompt + "
                                 f"max_new_tokens + VERIFY_ROOM); verify at most VERIFY_ROOM "
                                 f"tokens per row or set exact_verify=false")
        dev = ids.device
        L = torch.as_tensor(list(lengths), dtype=torch.long, device=dev)  # (B,)
        cols = torch.arange(self.cache.layers[0].keys.shape[-2], device=dev)  # (W,)
        rel = cols[None, :] - L[:, None]  # (B, W) column -> block position
        in_block = (rel >= 0) & (rel < Q)
        sees = block.gather(2, rel.clamp(0, Q - 1)[:, None, :].expand(B, Q, len(cols)))
        mask = (rel < 0)[:, None, :] | (in_block[:, None, :] & sees)  # (B, Q, W)
        self._at = L
        return ids, mask[:, None], L[:, None] + offset

    def context(self):
        """The exact kernels for the batched forward, each row over its own capacity."""
        return active(self.caps)

    def compact(self, lengths: Sequence[int], keep: Sequence[int | torch.Tensor]) -> None:
        """After a round: a chain's kept block (the first n) is already at [L_r, L_r + n); a tree's
        kept positions (ascending) move down to [L_r, L_r + n)."""
        moves = [(r, n + k, n + torch.arange(len(k))) for r, (n, k) in enumerate(zip(lengths, keep))
                 if not isinstance(k, int) and int(k[-1]) != len(k) - 1]
        if not moves:
            return
        dev = self.cache.layers[0].keys.device
        rows = torch.cat([torch.full((len(s),), r) for r, s, _ in moves]).to(dev)  # (M,)
        move_columns(self.cache, rows, torch.cat([s.to(dev) for _, s, _ in moves]),
                     torch.cat([d.to(dev) for _, _, d in moves]))

    def write_index(self, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) (B, q) each where a forward's block goes."""
        if self._at is None:
            raise RuntimeError("ExactRows.inputs() sets where a forward writes; call it first")
        t = torch.arange(q, device=self._at.device)
        rows = torch.arange(len(self._at), device=self._at.device)[:, None].expand(-1, q)
        return rows, self._at[:, None] + t[None, :]

    def seq_length(self) -> int:
        return int(self._at.min()) if self._at is not None and len(self._at) else 0

