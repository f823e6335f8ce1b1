"""A pruned draft vocabulary: the drafter's LM head only scores the Vd most frequent target tokens.

Why: the LM head is a large share of a small drafter's cost (SmolLM2: 49152 x 576 = 28 M weights,
21% of the whole target), and most of its rows are tokens a chat model almost never emits. The
drafter predicts over Vd << V tokens; every proposal is mapped back to target ids, so the decoder
and the lossless acceptance rule never see draft ids.

Two equivalent forms of the map:
  * d2t (Vd,) long: the target id of each draft id, sorted ascending, and t2d (V,) bool: which
    target ids are in the draft vocab (draft id i is the i-th True entry of t2d).
  * offsets (Vd,) long, what EAGLE-3 serving engines load: target_id = i + offsets[i].
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def select_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int,
                       always_include: Iterable[int] = ()) -> torch.Tensor:
    """The d2t map (Vd,) of the `draft_vocab_size` most frequent target tokens, sorted by id.

    token_counts (V,) counts each target token in the training data. Ties are broken by the lower
    id, and `always_include` (special/EOS ids, which a drafter must be able to propose to stop a
    turn) is kept whatever its count.
    """
    V = token_counts.shape[0]
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {draft_vocab_size}")
    forced = sorted({int(i) for i in always_include})
    if any(not 0 <= i < V for i in forced):
        raise ValueError(f"always_include ids {forced} must lie in [0, {V})")
    if len(forced) > draft_vocab_size:
        raise ValueError(f"{len(forced)} always-included ids do not fit a draft vocab of "
                         f"{draft_vocab_size}")
    score = token_counts.double().clone()  # (V,)
    score[forced] = float("inf")
    # a stable sort keeps equal counts in id order, so ties go to the lower id
    order = torch.sort(-score, stable=True).indices  # (V,)
    return order[:draft_vocab_size].sort().values.long()  # (Vd,)


def t2d_mask(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) bool mask of the target ids that are in the draft vocab."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    mask[d2t] = True
    return mask


def d2t_to_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 export form: offsets[i] = d2t[i] - i, so target_id = i + offsets[i]."""
    return d2t - torch.arange(d2t.shape[0], device=d2t.device)  # (Vd,)


def offsets_to_d2t(offsets: torch.Tensor) -> torch.Tensor:
    """Inverse of d2t_to_offsets."""
    return offsets + torch.arange(offsets.shape[0], device=offsets.device)  # (Vd,)


def expand_probs(probs: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft-vocab probabilities (..., Vd) -> target-vocab probabilities (..., V), 0 outside the draft
    vocab (the q the lossless sampling rule needs is over target ids)."""
    if d2t is None:
        return probs
    out = probs.new_zeros(*probs.shape[:-1], vocab_size)  # (..., V)
    return out.index_copy(-1, d2t, probs)


class DraftVocab(nn.Module):
    """Holds the maps as buffers so they are saved with the drafter's weights."""

    def __init__(self, d2t: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.register_buffer("d2t", d2t.long().clone())  # (Vd,)
        self.register_buffer("t2d", t2d_mask(self.d2t, vocab_size))  # (V,)

    @property
    def size(self) -> int:
        return self.d2t.shape[0]

    def set(self, d2t: torch.Tensor) -> None:
        """Replace the map in place (same Vd), e.g. with the one counted on the training data."""
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"d2t must have shape {tuple(self.d2t.shape)}, got {tuple(d2t.shape)}")
        if not bool((d2t[1:] > d2t[:-1]).all()):
            raise ValueError("d2t must be strictly increasing target ids")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d_mask(self.d2t, self.t2d.shape[0]))
