"""Target feature capture: what the frozen target says about a batch of conversations.

Online (inside the training loop) and offline (`python -m data.capture`, sharded to disk) capture
both go through `capture` and `target_logits`, so they produce the same batches.

Only the features a drafter reads and the final-normed hidden state are kept; the target's logits
are recomputed from the final hidden state with the LM head when needed (restricted to the draft
vocabulary when the drafter has one), so nothing of size T x V is ever stored.
"""
from __future__ import annotations

from typing import Sequence

import torch


@torch.inference_mode()
def capture(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            layers: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Return (features (B, T, F) of `layers` or None, final hidden (B, T, H))."""
    layers = tuple(layers)
    out = target.forward(input_ids.to(target.device), layers=(*layers, -1), logits=False,
                         attention_mask=attention_mask.to(target.device))
    H = target.hidden_size
    feats = out.features[..., :-H] if layers else None  # (B, T, F)
    return feats, out.features[..., -H:]  # (B, T, H)


@torch.inference_mode()
def target_logits(target, final_hidden: torch.Tensor, d2t: torch.Tensor | None = None) -> torch.Tensor:
    """Target logits (B, T, V) from the final hidden state, or (B, T, Vd) over the draft vocabulary
    (the rows d2t of the LM head): softmax of those equals the target distribution restricted to
    the draft vocabulary and renormalised."""
    head = target.lm_head()
    weight = head.weight if d2t is None else head.weight[d2t.to(head.weight.device)]  # (V|Vd, H)
    bias = getattr(head, "bias", None)
    if bias is not None and d2t is not None:
        bias = bias[d2t]
    return torch.nn.functional.linear(final_hidden.to(weight.dtype), weight, bias)
