"""On-policy distillation of draft heads: the drafter drafts on its own tokens, the target scores them.

At decode time a chain drafter's step j > 1 continues its OWN draft of step j-1; teacher forcing
(EAGLE-3's training-time test included) feeds it the real token instead and trains it towards the
target's distribution after the real text. On-policy distillation (DistillSpec; for draft heads,
Draft-OPD) trains on what the drafter itself drafts. Here, in the job's on-policy phase
(trainer.on_policy_heads_start):

1. The drafter unrolls `depth` steps at every anchor t on its own greedy drafts
   (Drafter.forward_own): d_1(t) from the real token t+1 and the target's feature t, d_j(t) from
   d_{j-1}(t) and its own state, as its chain would draft them.
2. ONE target forward scores the drafts at a sampled share of the anchors: each row's real tokens,
   then for each scored anchor t its block d_1(t) .. d_{depth-1}(t) at positions t+2, ...,
   attending to the real tokens up to t+1 and causally within its block (a 4-D mask): the target's
   logits after d_1 .. d_{j-1}, which is what verification compares draft d_j with.
3. The loss trains step j > 1 at the scored anchors towards those logits (DraftPrediction.teacher);
   step 1 reads only real tokens and keeps the batch's teacher.

On the target's own greedy text (data.selfgen) with greedy decoding, a draft that verification
counts follows accepted drafts, i.e. the target's own tokens: there teacher forcing on the real
text already is on-policy for every draft that can be accepted; the on-policy steps add the target's
verdict on the drafts after a wrong one, which matters for sampled decoding and for other data.

Cost: the target forward over T + A(depth-1) tokens per row (A = scored anchors), ~one capture
forward, plus the drafter's depth steps (BENCHMARKS.md "Acceptance per minute").
"""
from __future__ import annotations

import math

import torch

from specdistill.data.capture import autocast, target_logits
from specdistill.drafters.base import DraftPrediction, Drafter, TrainBatch


def check_on_policy_heads(tcfg, drafter) -> None:
    """Refuse trainer.on_policy_heads_start for a drafter that never drafts on its own tokens."""
    if tcfg.on_policy_heads_start is not None and type(drafter).forward_own is Drafter.forward_own:
        raise ValueError(f"trainer.on_policy_heads_start: drafter {drafter.name!r} does not draft "
                         f"step by step on its own tokens (no forward_own); use eagle3, or set "
                         f"trainer.on_policy_heads_start=null")


def own_steps(tcfg, step: int) -> int:
    """The on-policy draft depth at optimizer step `step` (trainer.on_policy_heads_start), else 0."""
    start = tcfg.on_policy_heads_start
    return 0 if start is None or step < start * tcfg.max_steps else tcfg.on_policy_heads_depth


def anchor_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """The scored anchors' draw, seeded by (seed, step, micro-batch, rank): a resume repeats it."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 997 + micro) * 101 + rank)


def scored_anchors(batch: TrainBatch, depth: int, share: float, generator: torch.Generator
                   ) -> list[torch.Tensor]:
    """Per row, the anchors t whose first draft (token t+2) lies in an assistant turn, a random
    `share` of them (at least one where any exists), sorted."""
    B, T = batch.input_ids.shape
    ok = torch.zeros(B, T, dtype=torch.bool)
    ok[:, :T - 2] = (batch.loss_mask[:, 2:].bool() & batch.attention_mask[:, 2:].bool()).cpu()
    out = []
    for b in range(B):
        cand = ok[b].nonzero().flatten()  # (n,)
        n = len(cand) and max(1, math.ceil(share * len(cand)))
        pick = torch.randperm(len(cand), generator=generator)[:n]
        out.append(cand[pick].sort().values)
    return out


def score_inputs(batch: TrainBatch, drafted: torch.Tensor, anchors: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scoring forward's ids (B, Q), bool mask (B, 1, Q, Q) and positions (B, Q): each row's
    real tokens (its length L_b), then per anchor t the block drafted[b, t] (D,) at positions
    t+2 .. t+D+1, seeing the real tokens 0..t+1 and its block causally. Padding sees itself."""
    B, T, D = drafted.shape
    lens = batch.attention_mask.sum(-1).tolist()
    Q = max(L + len(a) * D for L, a in zip(lens, anchors))
    ids = torch.zeros(B, Q, dtype=torch.long)
    pos = torch.zeros(B, Q, dtype=torch.long)
    allow = torch.zeros(B, Q, Q, dtype=torch.bool)
    causal = torch.ones(D, D, dtype=torch.bool).tril()  # (D, D)
    for b, (L, a) in enumerate(zip(lens, anchors)):
        ids[b, :L] = batch.input_ids[b, :L].cpu()
        pos[b, :L] = torch.arange(L)
        allow[b, :L, :L] = torch.ones(L, L, dtype=torch.bool).tril()
        for i, t in enumerate(a.tolist()):
            s = L + i * D  # the block's first column
            ids[b, s:s + D] = drafted[b, t].cpu()
            pos[b, s:s + D] = torch.arange(t + 2, t + 2 + D)
            allow[b, s:s + D, :t + 2] = True  # the real tokens up to t+1
            allow[b, s:s + D, s:s + D] = causal
        end = L + len(a) * D
        allow[b, end:, end:] = torch.eye(Q - end, dtype=torch.bool)  # padding: itself only
    return ids, allow[:, None], pos


@torch.no_grad()
def score_own_drafts(target, batch: TrainBatch, preds: list[DraftPrediction], share: float,
                     generator: torch.Generator, d2t: torch.Tensor | None,
                     autocast_dtype: str | None) -> int:
    """Set the teacher of every on-policy step j > 1 of `preds` (forward_own's) from one target
    forward over the drafts at a `share` of the anchors (module docstring, 2.); returns the
    number of drafted tokens the target scored."""
    D = len(preds) - 1  # drafts scored per anchor: d_1 .. d_{depth-1}
    if D < 1:
        return 0
    drafted = torch.stack([p.inputs for p in preds[1:]], dim=-1)  # (B, T, D) d_1..d_D at t
    anchors = scored_anchors(batch, D + 1, share, generator)
    ids, mask, pos = score_inputs(batch, drafted, anchors)
    dev = target.device
    with autocast(target, autocast_dtype):
        final = target.forward(ids.to(dev), layers=(-1,), logits=False,
                               attention_mask=mask.to(dev), position_ids=pos.to(dev)).features
    lens = batch.attention_mask.sum(-1).tolist()
    B, T = batch.input_ids.shape
    for j, pred in enumerate(preds[1:]):  # step j+2: the target after d_1 .. d_{j+1}
        rows = [L + torch.arange(len(a)) * D + j for L, a in zip(lens, anchors)]  # block cols
        logits = target_logits(target, torch.cat([final[b, r.to(dev)] for b, r in enumerate(rows)]),
                               d2t).float()  # (sum A, Vd)
        teacher = torch.zeros(B, T, logits.shape[-1], device=pred.logits.device)
        scored = torch.zeros(B, T, dtype=torch.bool, device=pred.logits.device)
        b_idx = torch.cat([torch.full((len(a),), b) for b, a in enumerate(anchors)])
        t_idx = torch.cat(anchors)
        teacher[b_idx, t_idx] = logits.to(teacher.device)
        scored[b_idx, t_idx] = True
        pred.teacher, pred.scored = teacher, scored
    return int(sum(len(a) for a in anchors) * D)
