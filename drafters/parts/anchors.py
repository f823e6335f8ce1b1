"""Training anchors drawn per step, for drafters whose training predictions cost a block of
queries per anchor (P-EAGLE's mask positions, DFlash's blocks): scoring every anchor would cost
(anchors x block) queries, so each step trains a random share of them (P-EAGLE's COD sampling,
flat; DFlash's random anchors). A drafter setting holds the share: null or 1.0 = every anchor, a
fraction in (0, 1) = that share of a row's candidate anchors, a whole number > 1 = that many.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from specdistill.drafters.base import DraftPrediction, TrainBatch

log = logging.getLogger(__name__)
_WARNED: set[tuple[str, int]] = set()  # (setting, value) already warned about in this process


def check_anchor_share(drafter: str, setting: str, share: Optional[float]) -> None:
    """ValueError naming the setting unless share is null, a fraction in (0, 1] or a whole number > 1."""
    if share is not None and not (0 < share <= 1 or (share > 1 and float(share).is_integer())):
        raise ValueError(f"{drafter}: {setting} must be a fraction in (0, 1], a whole number of "
                         f"anchors > 1 or null (every anchor), got {share}")


def capped_steps(setting: str, steps: int, T: int) -> int:
    """Unrolled training steps of a batch of length T: `steps`, capped at T - 2 (step j predicts
    token t + j + 1 of the batch), at least 1. A cap is said once per process (a short batch is
    normal; a setting longer than data.max_length would never train its last steps)."""
    n = max(1, min(steps, T - 2))
    if n < steps and (setting, steps) not in _WARNED:
        _WARNED.add((setting, steps))
        log.warning("%s=%d is longer than a batch of %d tokens allows: %d steps trained there "
                    "(said once; longer batches train more, up to data.max_length - 2)",
                    setting, steps, T, n)
    return n


def counted(batch: TrainBatch, shift: int) -> torch.Tensor:
    """(B, T) bool: the anchors t where a prediction of `shift` is trained, i.e. whose predicted
    token t+1+shift exists and is a real assistant token (loss_mask and attention_mask). A drafter
    runs its head only there (DraftPrediction.at): the loss reads nothing else."""
    B, T = batch.input_ids.shape
    out = torch.zeros(B, T, dtype=torch.bool, device=batch.input_ids.device)
    n = max(0, T - 1 - shift)
    out[:, :n] = batch.loss_mask[:, 1 + shift:].bool() & batch.attention_mask[:, 1 + shift:].bool()
    return out


def dense_logits(pred: DraftPrediction) -> torch.Tensor:
    """A prediction's logits as (B, T, Vd): where its head ran only at `pred.at`, NaN at every
    other anchor (reading one it never computed fails loudly). For tests and inspection."""
    if pred.at is None:
        return pred.logits
    out = pred.logits.new_full((*pred.at.shape, pred.logits.shape[-1]), float("nan"))
    out[pred.at] = pred.logits.detach()
    return out


def draw_anchors(batch: TrainBatch, lo: int, hi: int, share: float) -> torch.Tensor:
    """Anchors (B, A), sorted per row: drawn uniformly without replacement (global torch RNG)
    among the row's anchors t where some token t+lo .. t+hi is scored (loss_mask and
    attention_mask), ceil(share x candidates) of them (share < 1) or min(share, candidates); the
    spare slots of shorter rows hold T-1, whose tokens never exist, so they are never scored."""
    B, T = batch.input_ids.shape
    counted = batch.loss_mask.bool() & batch.attention_mask.bool()  # (B, T): scored tokens
    cand = torch.zeros_like(counted)  # (B, T)
    for j in range(lo, min(hi, T - 1) + 1):
        cand[:, :T - j] |= counted[:, j:]
    n = cand.sum(1)  # (B,) candidates per row
    want = (n * share).ceil().long() if share < 1 else n.clamp(max=int(share))  # (B,)
    A = max(1, int(want.max()))
    score = torch.rand(B, T, device=cand.device).masked_fill(~cand, 2.0)  # candidates first
    pick = score.topk(A, dim=1, largest=False).indices  # (B, A): a random draw per row
    keep = torch.arange(A, device=cand.device)[None] < want[:, None]  # (B, A)
    return torch.where(keep, pick, T - 1).sort(dim=1).values
