"""Distillation losses: how far a drafter's distribution q is from the frozen target's p.

Every divergence is a pure function (draft_logits (N, Vd), target_logits (N, V), temperature, d2t)
-> per-row losses (N,), picked by name from DIVERGENCES. `distill_loss` aligns a drafter's
predictions with the target (DraftPrediction.shift), masks, weights and averages them.

Pruned draft vocabulary (d2t given): the target distribution is restricted to the draft ids and
renormalised, p' = p|Vd / p(Vd). The drafter cannot put mass outside Vd, so against the full p
every divergence carries a term it can never reduce; against p' each loss is 0 exactly when
q = p', which is also the best q for acceptance: with q = p' >= p on Vd, sum min(p, q) = p(Vd),
the highest acceptance any q restricted to Vd can reach. `greedy_accept` below compares with the
full p's argmax unless told to restrict: what the decoder will really accept.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from specdistill.drafters.base import DraftPrediction, SlotObjective, TrainBatch
from specdistill.drafters.parts.anchors import counted

LOG_FLOOR = -1e4  # log-probs are clamped here so 0 * log 0 never turns into NaN


def _checked(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float,
             d2t: torch.Tensor | None) -> torch.Tensor:
    """The target logits over the draft vocabulary (N, Vd), after checking the pair."""
    if temperature <= 0:
        raise ValueError(f"loss temperature must be > 0, got {temperature}")
    if d2t is not None:
        target_logits = target_logits.index_select(-1, d2t.to(target_logits.device))  # (N, Vd)
    if target_logits.shape[-1] != draft_logits.shape[-1]:
        raise ValueError(f"draft vocab {draft_logits.shape[-1]} != target vocab "
                         f"{target_logits.shape[-1]}; for a pruned draft vocabulary pass d2t or "
                         f"target logits already restricted to it")
    return target_logits


def _log_probs(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float,
               d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (log q, log p'), both (N, Vd) in fp32, p' restricted to the draft vocab and renormalised."""
    target_logits = _checked(draft_logits, target_logits, temperature, d2t)
    log_q = F.log_softmax(draft_logits.float() / temperature, dim=-1).clamp_min(LOG_FLOOR)
    log_p = F.log_softmax(target_logits.float() / temperature, dim=-1).clamp_min(LOG_FLOOR)
    return log_q, log_p


def forward_kl(draft_logits, target_logits, temperature=1.0, d2t=None) -> torch.Tensor:
    """KL(p || q) = sum p (log p - log q): mass-covering; the classic distillation loss."""
    target_logits = _checked(draft_logits, target_logits, temperature, d2t)
    if target_logits.requires_grad:  # a teacher that learns too: the formula through autograd
        log_q, log_p = _log_probs(draft_logits, target_logits, temperature, None)
        return (log_p.exp() * (log_p - log_q)).sum(-1)  # (N,)
    return _ForwardKL.apply(draft_logits, target_logits, temperature)  # (N,)


LOSS_CHUNK_ROWS = 1024  # rows of the (N, Vd) loss worked on at once: 32 MB fp32 at Vd = 8192


class _ForwardKL(torch.autograd.Function):
    """forward_kl at half the plain formula's price (BENCHMARKS.md "Head and teacher only where
    the loss reads them"). With x = z / temperature (the draft logits), lse = logsumexp(x) and p'
    the teacher's softmax: KL = sum p' log p' - sum p' x + lse sum p' (no log q tensor), the two
    sums as row-wise dot products; the gradient in one expression, d/dz = (q sum p' - p') /
    temperature with q = exp(x - lse) formed only in the backward (sum p' = 1 up to rounding: the
    exact gradient of the formula). Autograd through the plain formula (float copy, log_softmax,
    clamp, difference, product, sum) walks and keeps several more (N, Vd) tensors.

    Rows are worked on LOSS_CHUNK_ROWS at a time, and the backward keeps only its inputs and two
    numbers a row (lse, sum p'), recomputing p' and x from them: no (N, Vd) fp32 temporary at all,
    where the whole-tensor version made four at the step's memory peak (the fp32 copy of the
    draft logits, the teacher's log-softmax, its clamp, p') and kept two for the backward
    (BENCHMARKS.md "Our trainer's memory against the peers'"). Every row's arithmetic is the
    same as the whole-tensor version's."""

    @staticmethod
    def forward(ctx, draft_logits, target_logits, temperature):
        at_least_fp32 = torch.promote_types(draft_logits.dtype, torch.float32)  # fp64 stays fp64
        n = draft_logits.shape[0]
        loss = draft_logits.new_empty((n, 1), dtype=at_least_fp32)
        lse, mass = torch.empty_like(loss), torch.empty_like(loss)
        for a in range(0, n, LOSS_CHUNK_ROWS):
            b = min(a + LOSS_CHUNK_ROWS, n)
            x = _scaled(draft_logits[a:b], at_least_fp32, temperature)
            log_p = _teacher_log_probs(target_logits[a:b], at_least_fp32, temperature)
            p = log_p.exp()
            lse[a:b] = torch.logsumexp(x, -1, keepdim=True)  # (rows, 1)
            mass[a:b] = p.sum(-1, keepdim=True)  # (rows, 1)
            loss[a:b] = _rowdot(p, log_p) - _rowdot(p, x) + lse[a:b] * mass[a:b]
        ctx.save_for_backward(draft_logits, target_logits, lse, mass)
        ctx.temperature = temperature
        return loss.view(-1).clamp_min_(0.0)  # KL >= 0: rounding of the three terms can dip below

    @staticmethod
    def backward(ctx, grad):
        draft_logits, target_logits, lse, mass = ctx.saved_tensors
        at_least_fp32, temperature = lse.dtype, ctx.temperature
        out = torch.empty_like(draft_logits)
        for a in range(0, out.shape[0], LOSS_CHUNK_ROWS):
            b = min(a + LOSS_CHUNK_ROWS, out.shape[0])
            q = (_scaled(draft_logits[a:b], at_least_fp32, temperature) - lse[a:b]).exp_()
            p = _teacher_log_probs(target_logits[a:b], at_least_fp32, temperature).exp_()
            out[a:b] = q.mul_(mass[a:b]).sub_(p).mul_(grad[a:b, None] / temperature)
        return out, None, None


def _scaled(logits: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """logits / temperature in `dtype` (a new tensor, or `logits` itself: never written to)."""
    x = logits.to(dtype)
    return x / temperature if temperature != 1 else x


def _teacher_log_probs(logits: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) in `dtype`, clamped at LOG_FLOOR (0 * log 0 stays 0)."""
    return F.log_softmax(_scaled(logits, dtype, temperature), -1).clamp_min_(LOG_FLOOR)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N, V) x (N, V) -> (N, 1): each row's dot product, without an (N, V) product tensor; in
    the inputs' precision even under a bf16 autocast (which would lower bmm)."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.bmm(a[:, None, :], b[:, :, None]).view(-1, 1)


def reverse_kl(draft_logits, target_logits, temperature=1.0, d2t=None) -> torch.Tensor:
    """KL(q || p) = sum q (log q - log p): mode-seeking."""
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, d2t)
    return (log_q.exp() * (log_q - log_p)).sum(-1)  # (N,)


def jsd(draft_logits, target_logits, temperature=1.0, d2t=None) -> torch.Tensor:
    """Jensen-Shannon: (KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2; bounded by log 2."""
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, d2t)
    log_m = torch.logaddexp(log_p, log_q) - torch.log(torch.tensor(2.0))  # (N, Vd)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return 0.5 * (kl_pm + kl_qm)  # (N,)


def tv(draft_logits, target_logits, temperature=1.0, d2t=None) -> torch.Tensor:
    """Total variation = 1 - sum min(p, q): one minus the speculative acceptance rate of a token."""
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, d2t)
    return 1.0 - torch.minimum(log_p.exp(), log_q.exp()).sum(-1)  # (N,)


def hard_ce(draft_logits, target_logits, temperature=1.0, d2t=None) -> torch.Tensor:
    """Cross-entropy on the target's argmax (within the draft vocab): what greedy decoding accepts."""
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, d2t)
    return -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)  # (N,)


# -- LK losses: acceptance-aimed objectives with a usable gradient from a cold start ------------
# Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding"
# (arXiv 2602.23881). Read for reference (our own code): vllm-project/speculators
# src/speculators/losses/eager.py at c05b95b3 (2026-08-20; `nla`, `lk_hybrid`, eta = 3 per row) and
# SpecForge specforge/core/lk_loss.py at a6b6b023 (2026-08-08; `lk_loss_type` alpha / lambda, where
# the blend weight uses the batch-mean acceptance and kl_scale * exp(-kl_decay * alpha)).
# Differences here: the weight is per row (each row is one speculative position, and distill_loss
# averages rows), log alpha is a logsumexp (no epsilon), and with a pruned draft vocab alpha is the
# overlap with the renormalised p' (SpecForge uses p restricted without renormalising, whose TV
# optimum is any q >= p on Vd; against p' the optimum is unique, q = p', as for the other losses).
LK_ETA = 3.0  # lk_hybrid's blend temperature: the LK paper's best hybrid (speculators' default)


def _log_overlap(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """log alpha = log sum_v min(p_v, q_v), the log acceptance rate; (N, V) x2 -> (N,)."""
    return torch.logsumexp(torch.minimum(log_p, log_q), dim=-1)  # (N,)


def nla(draft_logits, target_logits, temperature=1.0, d2t=None) -> torch.Tensor:
    """Negative log-acceptance -log alpha, alpha = sum min(p, q): TV's optimum (0 iff q = p') with
    the gradient of TV divided by alpha, so it still pulls when the overlap is small (early
    training), where TV's gradient vanishes. For a one-hot p it is the cross-entropy."""
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, d2t)
    return -_log_overlap(log_q, log_p)  # (N,)


def lk_hybrid(draft_logits, target_logits, temperature=1.0, d2t=None,
              eta: float = LK_ETA) -> torch.Tensor:
    """LK hybrid lambda * KL(p || q) + (1 - lambda) * TV(p, q) with lambda = exp(-eta * alpha),
    alpha = sum min(p, q) held constant (no gradient through the weight). A row the drafter
    barely overlaps (alpha ~ 0) learns from KL's strong gradient; as alpha grows the row shifts to
    TV = 1 - alpha, the acceptance itself. 0 exactly when q = p' (both terms are)."""
    log_q, log_p = _log_probs(draft_logits, target_logits, temperature, d2t)
    alpha = _log_overlap(log_q, log_p).exp()  # (N,)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (N,) KL(p' || q)
    lam = torch.exp(-eta * alpha.detach())  # (N,) blend weight, constant for the gradient
    return lam * kl + (1.0 - lam) * (1.0 - alpha)  # (N,)


Divergence = Callable[..., torch.Tensor]
DIVERGENCES: dict[str, Divergence] = {"forward_kl": forward_kl, "reverse_kl": reverse_kl,
                                      "jsd": jsd, "tv": tv, "nla": nla, "lk_hybrid": lk_hybrid,
                                      "hard_ce": hard_ce}


def get_divergence(name: str) -> Divergence:
    if name not in DIVERGENCES:
        raise KeyError(f"unknown divergence {name!r}; choose one of {sorted(DIVERGENCES)}")
    return DIVERGENCES[name]


def feature_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """SmoothL1 between predicted and target features (N, F) -> (N,), mean over features."""
    return F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)  # (N,)


def aligned(pred: DraftPrediction, batch: TrainBatch):
    """Rows of one prediction that the loss counts, aligned with the target.

    logits[:, t] predicts token t+1+shift: it meets target_logits[:, t+shift] (and the target
    feature features[:, t+shift], the one that produced those logits), and counts where token
    t+1+shift is a real assistant token. Returns (draft logits (M, Vd), target logits (M, V),
    predicted features (M, F) or None, target features (M, F) or None) over the M counted rows.
    """
    if pred.anchors is not None:
        return _aligned_at(pred, batch)
    if pred.scored is not None:
        if pred.teacher is None:
            raise ValueError(f"on-policy step {pred.shift} was not scored: the trainer sets its "
                             f"teacher (train/on_policy_heads.py score_own_drafts) before the loss")
        return _aligned_own(pred, batch)
    s = pred.shift
    ok = counted(batch, s)  # (B, T)
    if pred.at is None:  # logits (B, T', Vd) at every anchor (T' <= T)
        ok = ok[:, :pred.logits.shape[1]]
        draft = pred.logits[ok]  # (M, Vd)
    else:  # logits (N, Vd) at pred.at (row-major), which must hold every counted anchor
        if (ok & ~pred.at).any():
            raise ValueError(f"prediction of shift {s}: its head ran at {int(pred.at.sum())} "
                             f"anchors that miss {int((ok & ~pred.at).sum())} the loss counts; "
                             f"run it at drafters/parts/anchors.py counted(batch, {s})")
        draft = pred.logits[ok[pred.at]]  # (M, Vd)
    b, t = ok.nonzero(as_tuple=True)  # (M,) each, row-major
    target = batch.target_logits[b, t + s]  # (M, V)
    if pred.features is None or batch.features is None:
        return draft, target, None, None
    return draft, target, pred.features[b, t], batch.features[b, t + s]


def _aligned_at(pred: DraftPrediction, batch: TrainBatch):
    """aligned() for a prediction computed at sampled anchors (pred.anchors (B, A)): the same
    rule per (row, anchor) pair, pairs in row-major order."""
    s, t = pred.shift, pred.anchors  # (B, A)
    b, a = counted(batch, s).gather(1, t).nonzero(as_tuple=True)  # (M,) each
    at = t[b, a] + s  # (M,) the position whose target logits predict that token
    draft, target = pred.logits[b, a], batch.target_logits[b, at]  # (M, Vd), (M, V)
    if pred.features is None or batch.features is None:
        return draft, target, None, None
    return draft, target, pred.features[b, a], batch.features[b, at]


def _aligned_own(pred: DraftPrediction, batch: TrainBatch):
    """aligned() for an on-policy step: its logits (M, Vd) at the scored anchors (pred.scored, row-
    major) meet pred.teacher (M, Vd | V), the target after the drafter's own tokens there, where
    token t+1+shift lies in an assistant turn (the draft continues one)."""
    keep = counted(batch, pred.shift)[pred.scored]  # (M,)
    return pred.logits[keep], pred.teacher[keep], None, None


def distill_loss(predictions: list[DraftPrediction], batch: TrainBatch, divergence: str = "forward_kl",
                 temperature: float = 1.0, feature_weight: float = 0.0,
                 d2t: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total loss = sum_j weight_j * (mean divergence_j + feature_weight * mean feature_loss_j),
    each mean over the positions prediction j counts (loss_mask and attention_mask at the
    predicted token). Weights are not renormalised (Medusa/EAGLE-3 convention). A batch with no
    counted position gives 0, still attached to the graph (never NaN).

    Pruned draft vocab: either batch.target_logits has all V columns and d2t is given, or it was
    already restricted to the d2t columns (data.capture.target_logits does that) and d2t is None.

    Returns (total scalar, components): detached tensors `div/s<shift>`, `feat/s<shift>`,
    `top1/s<shift>` (draft argmax == target argmax over the draft vocab) and `positions/s<shift>`
    (call .item() only when logging, to avoid a device sync every step).
    """
    div = get_divergence(divergence)
    total = None
    parts: dict[str, torch.Tensor] = {}
    for pred in predictions:
        draft, target, pf, tf = aligned(pred, batch)
        count = max(draft.shape[0], 1)
        term = div(draft, target, temperature, d2t).sum() / count
        parts[f"div/s{pred.shift}"] = term.detach()
        if pf is not None and feature_weight > 0:
            if pf.shape[-1] != tf.shape[-1]:
                raise ValueError(f"predicted features width {pf.shape[-1]} != target features "
                                 f"{tf.shape[-1]} (feature_layers mismatch)")
            feat = feature_loss(pf, tf).sum() / count
            parts[f"feat/s{pred.shift}"] = feat.detach()
            term = term + feature_weight * feat
        if draft.shape[0]:
            with torch.no_grad():
                hit = greedy_accept(draft, target, d2t=d2t, restrict=True)
                parts[f"top1/s{pred.shift}"] = hit.float().mean()
        parts[f"positions/s{pred.shift}"] = torch.tensor(float(draft.shape[0]))
        total = pred.weight * term if total is None else total + pred.weight * term
    if total is None:
        raise ValueError("distill_loss: no predictions")
    return total, parts


# -- greedy acceptance (the loss's top1 metric, and benchmarks) ---------------------------------
def greedy_accept(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                  d2t: torch.Tensor | None = None, restrict: bool = False) -> torch.Tensor:
    """(N,) bool: would greedy decoding accept the draft's argmax? The draft id is mapped to a
    target id and compared with the target's argmax over the full vocab (restrict=True: over the
    draft vocab only, the drafter's best achievable)."""
    d = draft_logits.argmax(-1)  # (N,) draft ids
    if d2t is None:
        return d == target_logits.argmax(-1)
    if restrict:
        return d == target_logits.index_select(-1, d2t).argmax(-1)
    return d2t[d] == target_logits.argmax(-1)


# -- a drafter's own objective over its block's slots (DSpark) -----------------------------------
def _slot_rows(pred: DraftPrediction, batch: TrainBatch, alive: torch.Tensor):
    """The rows of one slot prediction that `alive` (B, A) keeps (its (row, anchor) pairs in
    row-major order): draft logits (M, Vd), target logits (M, V | Vd), confidence logits (M,) | None."""
    b, a = alive.nonzero(as_tuple=True)  # (M,) each
    t = a if pred.anchors is None else pred.anchors[b, a]  # (M,) the anchor positions
    conf = None if pred.confidence is None else pred.confidence[b, a]
    return pred.logits[b, a], batch.target_logits[b, t + pred.shift], conf


def slot_loss(predictions: list[DraftPrediction], batch: TrainBatch, objective: SlotObjective,
              temperature: float = 1.0, d2t: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A drafter's SlotObjective (drafters/base.py): predictions are the slots of its blocks, one
    per shift j (0, 1, ...), at the same anchors. Slot j of a block counts while every slot up to
    j does (the block's first unsupervised token drops the rest); each term is a weighted mean
    over the kept (row, anchor, slot) with slot weight pred.weight:

        total = ce * CE(q, argmax p') + l1 * sum |q - p'| + confidence * BCE(c, acceptance)

    acceptance = 1 - TV(q, p') (objective.confidence_target tv) or argmax q == argmax p (greedy),
    detached. Components per slot (`ce/s<j>`, `l1/s<j>`, `bce/s<j>`, `accept/s<j>` its mean
    acceptance, `conf/s<j>` the head's mean prediction, `top1/s<j>`, `positions/s<j>`) and the
    whole terms (`ce`, `l1`, `bce`)."""
    if not predictions:
        raise ValueError("slot_loss: no predictions")
    num = {"ce": 0.0, "l1": 0.0, "bce": 0.0}
    den = 0.0
    parts: dict[str, torch.Tensor] = {}
    alive = None
    for pred in sorted(predictions, key=lambda p: p.shift):
        ok = counted(batch, pred.shift)  # (B, T)
        ok = ok[:, :pred.logits.shape[1]] if pred.anchors is None else ok.gather(1, pred.anchors)
        alive = ok if alive is None else alive & ok  # (B, A): the block is supervised up to here
        draft, target, conf = _slot_rows(pred, batch, alive)
        log_q, log_p = _log_probs(draft, target, temperature, d2t)  # (M, Vd) each
        q, p = log_q.exp(), log_p.exp()
        ce = -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)  # (M,)
        l1 = (q - p).abs().sum(-1)  # (M,) = 2 TV
        with torch.no_grad():
            hit = greedy_accept(draft, target, d2t=d2t)  # (M,) bool: greedy verification accepts
            accept = (1 - 0.5 * l1).clamp(0, 1) if objective.confidence_target == "tv" else hit.float()
        terms = {"ce": ce.sum(), "l1": l1.sum()}
        if conf is not None:
            terms["bce"] = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="sum")
        w = float(pred.weight)
        m = max(draft.shape[0], 1)
        for name, value in terms.items():
            num[name] = num[name] + w * value
            parts[f"{name}/s{pred.shift}"] = value.detach() / m
        den += w * draft.shape[0]
        parts[f"accept/s{pred.shift}"] = accept.sum() / m
        parts[f"top1/s{pred.shift}"] = hit.float().sum() / m
        if conf is not None:
            parts[f"conf/s{pred.shift}"] = torch.sigmoid(conf.detach().float()).sum() / m
        parts[f"positions/s{pred.shift}"] = torch.tensor(float(draft.shape[0]))
    weights = {"ce": objective.ce, "l1": objective.l1, "bce": objective.confidence}
    total = predictions[0].logits.sum() * 0.0  # attached to the graph even with nothing kept
    for name, value in num.items():
        if torch.is_tensor(value):
            mean = value / max(den, 1e-12)
            parts[name] = mean.detach()
            total = total + weights[name] * mean
    return total, parts


def drafter_loss(drafter, predictions: list[DraftPrediction], batch: TrainBatch, divergence: str,
                 temperature: float = 1.0, feature_weight: float = 0.0,
                 d2t: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss the recipe trains `drafter` on: its own objective (Drafter.objective) when it
    declares one, else distill_loss with the trainer's divergence (d2t: as distill_loss's)."""
    objective = getattr(drafter, "objective", None)
    if objective is not None:
        return slot_loss(predictions, batch, objective, temperature, d2t)
    return distill_loss(predictions, batch, divergence=divergence, temperature=temperature,
                        feature_weight=feature_weight, d2t=d2t)
