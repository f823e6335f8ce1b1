"""On-policy distillation of draft heads: the drafter drafts on its own tokens, the target scores them.

At decode time a chain drafter's step j > 1 continues its OWN draft of step j-1; teacher forcing
(EAGLE-3's training-time test included) feeds it the real token instead and trains it towards the
target's distribution after the real text. On-policy distillation (DistillSpec; for draft heads,
Draft-OPD) trains on what the drafter itself drafts. Here, in the job's on-policy phase
(trainer.on_policy_heads_start):

1. The drafter unrolls `depth` steps at every anchor t on its own greedy drafts
   (Drafter.forward_own): d_1(t) from the real token t+1 and the target's feature t, d_j(t) from
   d_{j-1}(t) and its own state, as its chain would draft them.
   Steps j > 1 run only at the anchors the target will score (drawn first:
   `scored_anchors`, trainer.on_policy_heads_rows rows of each micro-batch and
   trainer.on_policy_heads_anchors of their answer positions).
2. The target scores the drafts at those anchors: each scored row's real tokens up to its last
   anchor run causally into a KV cache, then for each anchor t its block d_1(t) .. d_{depth-1}(t)
   at positions t+2, ..., attending to the cached real tokens up to t+1 and causally within its
   block (a 4-D mask over the cache and the blocks): the target's logits after d_1 .. d_{j-1},
   which is what verification compares draft d_j with.
   An anchor whose drafts all equal the real tokens after it (about half of them in the phase)
   needs no forward: the target after d_1 .. d_j is then the batch's teacher at t+j+1, already
   computed (`replayed`); only the others are scored.
3. The loss trains step j > 1 at the scored anchors towards those logits (DraftPrediction.teacher);
   step 1 reads only real tokens, in every row, and keeps the batch's teacher.

On the target's own greedy text (data.selfgen) with greedy decoding, a draft that verification
counts follows accepted drafts, i.e. the target's own tokens: there teacher forcing on the real
text already is on-policy for every draft that can be accepted; the on-policy steps add the target's
verdict on the drafts after a wrong one, which matters for sampled decoding and for other data.

Cost: the target forward over ~T + A(depth-1) tokens per scored row (A = its scored anchors that
are not replayed), ~a capture forward of those rows, plus the drafter's depth steps; scoring fewer
rows at a larger share of their anchors buys the same number of scored drafts for less target compute
(BENCHMARKS.md "Training precision where bf16 is not native": 3.0x a teacher-forced step).
"""
from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from specdistill.data.capture import autocast, target_logits
from specdistill.drafters.base import Drafter, DraftPrediction, TrainBatch
from specdistill.drafters.parts.anchors import counted


def check_on_policy_heads(tcfg, drafter) -> None:
    """Refuse trainer.on_policy_heads_start for a drafter that never drafts on its own tokens."""
    if tcfg.on_policy_heads_start is not None and type(drafter).forward_own is Drafter.forward_own:
        raise ValueError(f"trainer.on_policy_heads_start: drafter {drafter.name!r} does not draft "
                         f"step by step on its own tokens (no forward_own); use eagle3, or set "
                         f"trainer.on_policy_heads_start=null")
    if tcfg.on_policy_heads_start is not None and getattr(tcfg, "window", None) is not None:
        raise ValueError(f"trainer.window={tcfg.window} with trainer.on_policy_heads_start: the "
                         f"target would score the drafts of a window without the row before it; "
                         f"set one of them to null")


def anchor_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """The scored anchors' draw, seeded by (seed, step, micro-batch, rank): a resume repeats it."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 997 + micro) * 101 + rank)


def own_drafts(model, batch: TrainBatch, tcfg, steps: int, generator: torch.Generator
               ) -> list[DraftPrediction]:
    """The drafter's `steps` steps on its own drafts (model = the backend-wrapped drafter), the
    later ones at the anchors the target will score (scored_anchors, drawn first); the trainer
    then sets their teacher with score_own_drafts."""
    at = scored_anchors(batch, tcfg.on_policy_heads_anchors, generator, tcfg.on_policy_heads_rows)
    return model(batch, steps, at)


def scored_anchors(batch: TrainBatch, share: float, generator: torch.Generator,
                   rows: int | None = None) -> torch.Tensor:
    """(B, T) bool: the anchors t whose drafts the target scores. An anchor qualifies where its
    first draft (token t+2) lies in an assistant turn; `rows` rows that have one (None = every
    row) are drawn, and in each a random `share` of its qualifying anchors (at least one)."""
    B, T = batch.input_ids.shape
    ok = counted(batch, 1).cpu()  # (B, T): the first draft (token t+2) is trained there
    have = ok.any(-1).nonzero().flatten()  # rows with a qualifying anchor
    if rows is not None and rows < len(have):
        have = have[torch.randperm(len(have), generator=generator)[:rows]]
    at = torch.zeros(B, T, dtype=torch.bool)
    for b in have.sort().values.tolist():
        cand = ok[b].nonzero().flatten()  # (n,)
        pick = torch.randperm(len(cand), generator=generator)[:max(1, math.ceil(share * len(cand)))]
        at[b, cand[pick]] = True
    return at.to(batch.input_ids.device)


def score_inputs(batch: TrainBatch, drafted: torch.Tensor, rows: list[int], anchors: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scoring forward's inputs over the batch rows `rows`, each with its scored anchors
    (ascending), in two parts. `real` (R, P): each row's real tokens up to its last anchor's t+1
    (the later ones are never attended to), right-padded: run causally into a KV cache. Then the
    drafts: per anchor t (in order) its block drafted[b, t] (D,) at positions t+2 .. t+D+1,
    seeing the real tokens 0..t+1 (the cache's first t+2 columns) and its own block causally:
    ids (R, N), bool mask (R, 1, N, P + N) over the cache's columns then the blocks', positions
    (R, N). Padding sees itself. The real tokens attend causally only, so they run on the plain
    causal path, and the masked part is N x (P + N) instead of (P + N)^2."""
    D = drafted.shape[-1]
    drafted, input_ids = drafted.cpu(), batch.input_ids.cpu()  # one copy each, not one per anchor
    prefix = [int(a[-1]) + 2 for a in anchors]  # real tokens 0..t+1 of the last anchor
    P = max(prefix, default=0)
    N = max((len(a) * D for a in anchors), default=0)
    R = len(rows)
    real = torch.zeros(R, P, dtype=torch.long)
    ids = torch.zeros(R, N, dtype=torch.long)
    pos = torch.zeros(R, N, dtype=torch.long)
    allow = torch.zeros(R, N, P + N, dtype=torch.bool)
    q, cols, step = torch.arange(N), torch.arange(P), torch.arange(D)
    in_block = (q[:, None] // D == q[None] // D) & (q[None] <= q[:, None])  # (N, N) causal blocks
    for r, (b, L, a) in enumerate(zip(rows, prefix, anchors)):
        a, end = a.cpu(), len(a) * D
        real[r, :L] = input_ids[b, :L]
        ids[r, :end] = drafted[b, a].reshape(-1)
        pos[r, :end] = (a[:, None] + 2 + step).reshape(-1)  # t+2 .. t+D+1
        allow[r, :end, :P] = (cols < a[:, None] + 2).repeat_interleave(D, 0)  # real tokens 0..t+1
        allow[r, :end, P:P + end] = in_block[:end, :end]
        allow[r, end:, P + end:] = torch.eye(N - end, dtype=torch.bool)  # padding: itself only
    return real, ids, allow[:, None], pos


def replayed(batch: TrainBatch, drafted: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the anchors of `at` whose drafts drafted[b, t] (D,) all equal the real tokens
    t+2 .. t+D+1 where the batch has the target's logits after each (drafters/parts/anchors.py
    counted(batch, 0) there): the target's verdict on those drafts is the batch's teacher at
    t+2 .. t+D+1, already computed."""
    B, T, D = drafted.shape
    ids, have = batch.input_ids.cpu(), counted(batch, 0).cpu()
    same = at.cpu().clone()
    for j in range(D):
        s = j + 2  # d_{j+1} at anchor t stands for token t+s; the teacher after it is at t+s
        n = max(0, T - s)  # the anchors with a token t+s in the batch
        same[:, n:] = False
        same[:, :n] &= (drafted[:, :n, j] == ids[:, s:s + n]) & have[:, s:s + n]
    return same


@torch.no_grad()
def score_own_drafts(target, batch: TrainBatch, preds: list[DraftPrediction],
                     d2t: torch.Tensor | None, autocast_dtype: str | None) -> int:
    """Set the teacher of every on-policy step j > 1 of `preds` (forward_own's with `at`: their
    logits are at the anchors `scored`): the target's logits after d_1 .. d_{j-1}, from its
    forward over the drafts at those anchors after the real tokens' (module docstring, 2.), or
    the batch's teacher where the drafts are the real tokens (`replayed`); returns the number of
    drafted tokens the target's forward scored."""
    D = len(preds) - 1  # drafts scored per anchor: d_1 .. d_{depth-1}
    if D < 1:
        return 0
    at = preds[1].scored
    if at is None:
        raise ValueError("score_own_drafts: the drafter's own steps were not drafted at scored "
                         "anchors; call forward_own(batch, steps, at=scored_anchors(...))")
    drafted = torch.stack([p.inputs for p in preds[1:]], dim=-1).cpu()  # (B, T, D) d_1..d_D at t
    at = at.cpu()
    reuse = replayed(batch, drafted, at)  # (B, T)
    todo = at & ~reuse
    rows = todo.any(-1).nonzero().flatten().tolist()
    anchors = [todo[b].nonzero().flatten() for b in rows]
    final = None
    if rows:
        real, ids, mask, pos = score_inputs(batch, drafted, rows, anchors)
        dev = target.device
        cache = DynamicCache()  # full layers: the mask, not a sliding window, says what a draft sees
        with autocast(target, autocast_dtype):
            target.forward(real.to(dev), logits=False, cache=cache)  # the real tokens, causal
            final = target.forward(ids.to(dev), layers=(-1,), logits=False, cache=cache,
                                   attention_mask=mask.to(dev), position_ids=pos.to(dev)).features
    counts = [len(a) for a in anchors]
    b, t = reuse.nonzero(as_tuple=True)  # row-major, as the teacher's rows
    known = reuse[at]  # (M,) which of the scored anchors' rows come from the batch
    held = batch.target_logits.device  # where the batch's teacher lies
    for j, pred in enumerate(preds[1:]):  # step j+2: the target after d_1 .. d_{j+1}
        width = pred.logits.shape[-1]  # the draft vocabulary (d2t) or the target's
        teacher = torch.empty(len(known), width, device=pred.logits.device)
        if final is not None:  # the scored anchors, row-major
            hidden = torch.cat([final[r, j:n * D:D] for r, n in enumerate(counts)])  # (M', H)
            teacher[~known] = target_logits(target, hidden, d2t).float().to(teacher.device)
        if len(b):  # the replayed ones: the batch's teacher at t+j+2
            given = batch.target_logits[b.to(held), (t + 2 + j).to(held)]  # (M - M', V | Vd)
            if given.shape[-1] != width:  # a full-vocabulary batch teacher: the d2t columns
                given = given[:, d2t.to(held)]
            teacher[known] = given.float().to(teacher.device)
        pred.teacher = teacher
    return int(sum(counts) * D)
