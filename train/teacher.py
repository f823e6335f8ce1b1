"""The training batch and its teacher: the frozen target's logits, computed only where a loss reads
them (drafters/parts/anchors.py counted(batch, 0): the next token is a real assistant token).

The trainer (online or offline features), the step profiler and the engine matrix all build their
micro-batches with `train_batch`, so they train on the same teacher.
"""
from __future__ import annotations

import torch

from specdistill.data.capture import target_logits
from specdistill.drafters.base import TeacherRows, TrainBatch
from specdistill.drafters.parts.anchors import counted


@torch.no_grad()  # not inference_mode: the loss keeps the teacher's rows for its backward
def teacher_logits(target, final_hidden: torch.Tensor, d2t: torch.Tensor | None,
                   at: torch.Tensor) -> TeacherRows:
    """target_logits (B, T, V | Vd) computed only at the (B, T) bool anchors `at`, the ones a loss
    reads (drafters/parts/anchors.py counted(batch, 0): the next token is a real assistant token),
    kept compact (TeacherRows: those rows, NaN at every other position, so a read of any other
    anchor shows up as a non-finite loss instead of a quiet wrong teacher). A batch's prompts and
    padding cost no LM-head work and no memory."""
    at = at.to(final_hidden.device)
    hidden = final_hidden[at]  # (M, H), then a NaN row: its logits are the NaN row
    hidden = torch.cat([hidden, hidden.new_full((1, hidden.shape[-1]), float("nan"))])
    return TeacherRows(target_logits(target, hidden, d2t), at)  # (M + 1, V | Vd)


def train_batch(raw: dict[str, torch.Tensor], feats: torch.Tensor | None, target,
                final_hidden: torch.Tensor, d2t: torch.Tensor | None, device, drafter=None) -> TrainBatch:
    """A training micro-batch on `device` from collated rows `raw` (input_ids, attention_mask,
    loss_mask) and the target's outputs on them (features of the drafter's layers, final hidden
    state): the teacher's logits only where a loss reads them (teacher_logits): the scored
    positions, and of those only the ones `drafter`'s loss will read when it says so
    (Drafter.teacher_rows: a block drafter's drawn anchors' blocks, drawn here)."""
    batch = TrainBatch(*(raw[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask")),
                       target_logits=torch.empty(0),
                       features=None if feats is None else feats.to(device).clone())
    at = counted(batch, 0)  # (B, T)
    rows = None if drafter is None else drafter.teacher_rows(batch)
    if rows is not None:
        at = at & rows
    at = at.to(final_hidden.device)
    batch.target_logits = teacher_logits(target, final_hidden, d2t, at).to(device)  # no copy on CPU
    return batch
