"""Confidence-driven verification: how much of a drafted chain is worth the target's forward, from
each slot's confidence, and how well those confidences are calibrated.

A drafter with a trained confidence head (`Drafter.accept_prob_head`, e.g. DSpark's) fills
`ChainProposal.accept_prob[i]`: its estimate of P(draft i is accepted | drafts < i were). The
survival of slot i is the chance the chain is still alive there:

    S_i = c_1 * c_2 * ... * c_i        (c_i the slot confidences, S non-increasing in i)

and the expected drafts a verify of width w commits is S_1 + .. + S_w (the bonus token aside).

* One sequence (decode/spec.py): `verify_survival` = t > 0 cuts the chain before the first slot
  with S_i < t, verifying at least one draft (a chain cut to nothing is a plain round that still
  paid for its drafting).
* A batch (decode/batched/, mode `adaptive`): the rows' survivals are the scores the planner's
  width choice trades against the measured cost of the padded forward (planner.choose_widths).

Drafters without a head: `survival_fallback` = `none` verifies every draft (a threshold is then
refused: it would silently do nothing), `draft_prob` uses the draft's top probability max_x q_i(x)
(`ChainProposal.confidence`) as c_i.

Lossless: whether slot i is verified depends on c_1 .. c_i, never on draft i's own value. A head's
c_i is computed before d_i is drawn (from the slot's hidden state and the previous token), and the
fallback's max_x q_i(x) does not depend on which x was drawn; so the verified drafts are a prefix
chosen from what precedes each draft, and the acceptance rule keeps the target's distribution (a
drafter that stops early does the same). Greedy outputs are the target's whatever is verified.

Calibration (`calibration`): every verified slot the chain reached (all earlier drafts accepted)
is one (predicted c_i, accepted or not) pair. Per slot: the mean prediction and the observed rate;
over all pairs: the expected calibration error with equal-width bins,
ECE = sum_b (n_b / N) |mean predicted_b - observed rate_b|.

Recalibration (`fit_platt`, the decode job's `calibrate=true`): a head trained on one signal
(DSpark's: 1 - TV(q, p), the acceptance probability of sampling at temperature 1) is served under
another (greedy decoding accepts on argmax agreement), and a short training leaves it off. Platt
scaling fits c' = sigmoid(a * logit(c) + b) to the observed acceptance of a decode's pairs
(maximum likelihood, Newton's method on the two parameters) and the drafter folds (a, b) into its
head's weights (`Drafter.rescale_confidence`), so every reader of the head, engines included,
gets the calibrated confidences. Monotone in c: it changes which slots a threshold keeps, never
the order of the slots' scores, and losslessness is untouched (module docstring above).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specdistill.drafters.base import ChainProposal

FALLBACKS = ("none", "draft_prob")  # survival_fallback values, see the module docstring
ECE_BINS = 10  # equal-width bins of [0, 1] for the expected calibration error


@dataclass(frozen=True)
class SurvivalRule:
    """How a chain's verified length follows its slot confidences (module docstring)."""

    threshold: float = 0.0  # verify_survival: cut before the first slot with S_i < threshold (0 = off)
    fallback: str = "none"  # survival_fallback for a drafter without a head: none | draft_prob

    def confidences(self, prop: ChainProposal, m: int) -> torch.Tensor | None:
        """(m,) c_1 .. c_m of the first m drafts: the head's accept_prob, else with the draft_prob
        fallback the drafts' top probabilities, else None (no confidence: verify every draft)."""
        if prop.accept_prob is not None:
            return prop.accept_prob[:m].detach().float().cpu()
        if self.fallback == "draft_prob" and prop.confidence is not None:
            return prop.confidence[:m].detach().float().cpu()
        return None

    def cut(self, conf: torch.Tensor | None, m: int) -> int:
        """Drafts to verify of the m drafted: m without a threshold or confidences, else the
        slots before the first S_i < threshold, at least one."""
        if self.threshold <= 0 or conf is None or m == 0:
            return m
        return cut_length(survival(conf[:m]), self.threshold)


def survival(conf: torch.Tensor) -> torch.Tensor:
    """(m,) S_i = prod_{j <= i} c_j from slot confidences (m,), each clamped to [0, 1]."""
    return conf.float().clamp(0, 1).cumprod(0)


def cut_length(surv: torch.Tensor, threshold: float) -> int:
    """Slots before the first survival below threshold, at least 1 (of len(surv) > 0)."""
    below = (surv < threshold).nonzero()
    return max(1, int(below[0, 0])) if len(below) else len(surv)


def check_survival(drafter: Any, threshold: float, fallback: str, tree: bool = False) -> None:
    """Refuse settings that cannot work, with the keys to change (ValueError: one line, exit 2)."""
    if fallback not in FALLBACKS:
        raise ValueError(f"survival_fallback={fallback!r} is unknown; use one of {', '.join(FALLBACKS)}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"verify_survival={threshold} is outside [0, 1]; give a survival "
                         f"probability (0 = off)")
    if threshold > 0 and tree:
        raise ValueError(f"verify_survival={threshold} cuts chains; a tree verifies every node: "
                         f"use tree=false or verify_survival=0")
    if threshold > 0 and drafter is not None and fallback == "none" and not getattr(
            drafter, "accept_prob_head", False):
        raise ValueError(f"verify_survival={threshold} needs slot confidences, but drafter "
                         f"{drafter.name!r} has no trained confidence head and "
                         f"survival_fallback=none; set survival_fallback=draft_prob or "
                         f"verify_survival=0")


def calibration_pairs(rounds: Sequence[tuple[Sequence[float], int]]
                      ) -> list[tuple[int, float, bool]]:
    """(slot from 0, predicted c, accepted) of every verified slot a chain reached, from rounds of
    (the verified slots' confidences, drafts accepted)."""
    out = []
    for pred, n in rounds:
        for i, c in enumerate(pred[:n + 1]):  # slots 0..n were reached (all before accepted)
            out.append((i, float(c), i < n))
    return out


def ece(pred: Sequence[float], hit: Sequence[bool], bins: int = ECE_BINS) -> float | None:
    """Expected calibration error over equal-width bins of [0, 1] (None without pairs)."""
    if not pred:
        return None
    total, sums = len(pred), {}
    for c, h in zip(pred, hit):
        b = min(int(c * bins), bins - 1)
        p, o, n = sums.get(b, (0.0, 0.0, 0))
        sums[b] = (p + c, o + float(h), n + 1)
    return sum(abs(p - o) / total for p, o, n in sums.values())


MIN_CALIBRATION_PAIRS = 50  # fewer: (a, b) would follow the noise


def fit_platt(pred: Sequence[float], hit: Sequence[bool], iters: int = 50,
              ridge: float = 1e-6) -> tuple[float, float]:
    """(a, b) maximising the likelihood of hit under sigmoid(a * logit(pred) + b) (Newton's
    method, float64; pred clamped into (1e-6, 1 - 1e-6)). Refuses too few pairs or pairs of one
    outcome only (ValueError, what to do in it)."""
    n, ones = len(pred), int(sum(bool(h) for h in hit))
    if n < MIN_CALIBRATION_PAIRS or ones in (0, n):
        raise ValueError(f"a confidence calibration needs >= {MIN_CALIBRATION_PAIRS} verified "
                         f"slots with both outcomes; this decode has {n} ({ones} accepted): "
                         f"decode more prompts (eval.limit) or longer answers (max_new_tokens)")
    z = torch.logit(torch.tensor(pred, dtype=torch.float64), eps=1e-6)
    x = torch.stack([z, torch.ones_like(z)], 1)  # (n, 2): logit, 1
    y = torch.tensor([float(h) for h in hit], dtype=torch.float64)
    w = torch.tensor([1.0, 0.0], dtype=torch.float64)  # the identity: a = 1, b = 0
    for _ in range(iters):
        p = torch.sigmoid(x @ w)
        grad = x.T @ (p - y)
        hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * torch.eye(2, dtype=torch.float64)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if float(step.abs().max()) < 1e-10:
            break
    return float(w[0]), float(w[1])


def platt(pred: Sequence[float], a: float, b: float) -> list[float]:
    """The calibrated confidences sigmoid(a * logit(c) + b) of pred."""
    return torch.sigmoid(a * torch.logit(torch.tensor(pred, dtype=torch.float64), eps=1e-6)
                         + b).tolist()


def calibration(rounds: Sequence[tuple[Sequence[float], int]], source: str,
                bins: int = ECE_BINS) -> dict | None:
    """Predicted vs observed acceptance per slot and the ECE (module docstring), or None when no
    round recorded confidences. source: where the confidences came from (head | draft_prob)."""
    pairs = calibration_pairs(rounds)
    if not pairs:
        return None
    slots = []
    for s in range(max(i for i, _, _ in pairs) + 1):
        at = [(c, h) for i, c, h in pairs if i == s]
        slots.append({"slot": s + 1, "count": len(at),
                      "predicted": sum(c for c, _ in at) / len(at) if at else None,
                      "observed": sum(h for _, h in at) / len(at) if at else None})
    return {"source": source, "pairs": len(pairs), "bins": bins,
            "ece": ece([c for _, c, _ in pairs], [h for _, _, h in pairs], bins), "slots": slots}
