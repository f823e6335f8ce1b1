"""Distillation losses against hand-computed values, draft-vocab restriction, masks and shifts.

The running example: target p = [0.7, 0.2, 0.1], draft q = [0.4, 0.4, 0.2], m = (p + q) / 2 =
[0.55, 0.3, 0.15].
  KL(p||q) = 0.7 ln(7/4) + 0.2 ln(1/2) + 0.1 ln(1/2)        = 0.3917311 - 0.2079442 = 0.1837869
  KL(q||p) = 0.4 ln(4/7) + 0.4 ln 2 + 0.2 ln 2               = -0.2238463 + 0.4158883 = 0.1920420
  KL(p||m) = 0.7 ln(0.7/0.55) + 0.3 ln(2/3)                   = 0.1688135 - 0.1216395 = 0.0471740
  KL(q||m) = 0.4 ln(0.4/0.55) + 0.6 ln(4/3)                   = -0.1273815 + 0.1726092 = 0.0452277
  JSD      = (0.0471740 + 0.0452277) / 2                      = 0.0462009
  TV       = 1 - (min(.7,.4) + min(.2,.4) + min(.1,.2))       = 1 - 0.7 = 0.3
  hard CE  = -ln q[argmax p] = -ln 0.4                        = 0.9162907
  alpha    = sum min(p, q) = 0.7 (the acceptance rate)
  NLA      = -ln alpha = -ln 0.7                               = 0.3566749
  LK hybrid: lambda = exp(-3 alpha) = exp(-2.1) = 0.1224564;
           lambda KL(p||q) + (1 - lambda) TV = 0.1224564 * 0.1837869 + 0.8775436 * 0.3 = 0.2857690
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdistill.drafters.base import DraftPrediction, TrainBatch
from specdistill.train.losses import (
    DIVERGENCES,
    LOG_FLOOR,
    distill_loss,
    feature_loss,
    forward_kl,
    get_divergence,
    greedy_accept,
    lk_hybrid,
    nla,
    tv,
)

P = torch.tensor([[0.7, 0.2, 0.1]])
Q = torch.tensor([[0.4, 0.4, 0.2]])
EXPECTED = {"forward_kl": 0.1837869, "reverse_kl": 0.1920420, "jsd": 0.0462009, "tv": 0.3,
            "hard_ce": 0.9162907, "nla": 0.3566749, "lk_hybrid": 0.2857690}
ACCEPTANCE_AIMED = ["tv", "nla", "lk_hybrid"]


def test_registry_is_complete():
    assert set(DIVERGENCES) == set(EXPECTED)
    with pytest.raises(KeyError, match="forward_kl"):
        get_divergence("kl")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hand_computed_values(name):
    div = get_divergence(name)
    got = div(Q.log(), P.log(), 1.0)  # (1,)
    assert got.shape == (1,) and got.item() == pytest.approx(EXPECTED[name], abs=1e-6)
    # temperature divides both sides' logits: logits 2 ln p at T=2 are the same distributions
    assert div(2 * Q.log(), 2 * P.log(), 2.0).item() == pytest.approx(EXPECTED[name], abs=1e-6)
    # identical distributions: zero divergence (hard CE is then the entropy term -ln 0.7)
    same = div(P.log(), P.log(), 1.0).item()
    assert same == pytest.approx(-math.log(0.7) if name == "hard_ce" else 0.0, abs=1e-6)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_restriction_to_draft_vocab(name):
    """Full target p = [0.35, 0.1, 0.05, 0.5] on draft ids d2t = [0, 1, 2] renormalises to the
    running example's [0.7, 0.2, 0.1]; token 3 (p = 0.5) is out of the drafter's reach."""
    full = torch.tensor([[0.35, 0.1, 0.05, 0.5]]).log()  # (1, V=4)
    d2t = torch.tensor([0, 1, 2])
    got = get_divergence(name)(Q.log(), full, 1.0, d2t)
    assert got.item() == pytest.approx(EXPECTED[name], abs=1e-6)
    with pytest.raises(ValueError, match="d2t"):
        get_divergence(name)(Q.log(), full, 1.0)


def test_greedy_accept_uses_the_full_target_unless_restricted():
    full = torch.tensor([[0.35, 0.1, 0.05, 0.5]]).log()
    d2t = torch.tensor([0, 1, 2])
    q = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert not bool(greedy_accept(q, full, d2t))  # target argmax 3 is not a draft token
    assert bool(greedy_accept(q, full, d2t, restrict=True))  # best within the draft vocab
    assert bool(greedy_accept(torch.tensor([[0.0, 5.0]]), torch.tensor([[1.0, 2.0, 9.0]]),
                              torch.tensor([0, 2])))  # draft id 1 -> target id 2


def test_feature_loss_hand_value():
    # SmoothL1 (beta 1): |0.5| < 1 -> 0.5 * 0.5^2 = 0.125; |2| >= 1 -> 2 - 0.5 = 1.5; mean 0.8125
    got = feature_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.5, -2.0]]))
    assert got.shape == (1,) and got.item() == pytest.approx(0.8125)


def make_batch(B=2, T=6, V=5, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -2:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :2] = 0
    return TrainBatch(ids, attn, loss_mask, torch.randn(B, T, V, generator=g),
                      torch.randn(B, T, 3, generator=g))


def test_distill_loss_is_the_masked_mean():
    """shift 1: logits[:, t] meets target_logits[:, t+1] where token t+2 is counted."""
    batch = make_batch()
    draft = torch.randn(2, 6, 5)
    total, parts = distill_loss([DraftPrediction(draft, shift=1)], batch, "forward_kl")
    rows = [(b, t) for b in range(2) for t in range(4)
            if batch.loss_mask[b, t + 2] and batch.attention_mask[b, t + 2]]
    assert len(rows) == 4 + 2  # row 0: tokens 2..5; row 1: tokens 2..3 (4, 5 are padding)
    manual = torch.stack([get_divergence("forward_kl")(draft[b, t][None], batch.target_logits[b, t + 1][None])
                          for b, t in rows]).mean()
    assert total.item() == pytest.approx(manual.item(), rel=1e-6)
    assert parts["positions/s1"].item() == 6


@pytest.mark.parametrize("chunk", [1024, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_kl_gradient_in_one_expression_equals_autograd(dtype, chunk, monkeypatch):
    """forward_kl's own backward (train/losses.py _ForwardKL) == autograd through the formula,
    at a temperature and with a pruned vocabulary, its 9 rows in one piece or in pieces of 4 (4, 4
    and 1: the last one short); a teacher that needs gradients gets them."""
    import specdistill.train.losses as L

    monkeypatch.setattr(L, "LOSS_CHUNK_ROWS", chunk)
    g = torch.Generator().manual_seed(0)
    draft = (3 * torch.randn(9, 6, generator=g)).to(dtype).requires_grad_()
    target = 3 * torch.randn(9, 11, generator=g)
    d2t = torch.tensor([0, 2, 3, 5, 8, 10])
    weights = torch.rand(9, generator=g)  # a per-row upstream gradient, as distill_loss's mean gives

    def plain(z, t):
        log_q = F.log_softmax(z.float() / 0.7, -1).clamp_min(LOG_FLOOR)
        log_p = F.log_softmax(t[:, d2t].float() / 0.7, -1).clamp_min(LOG_FLOOR)
        return (log_p.exp() * (log_p - log_q)).sum(-1)

    (want,) = torch.autograd.grad((plain(draft, target) * weights).sum(), draft)
    got_loss = forward_kl(draft, target, 0.7, d2t)
    (got,) = torch.autograd.grad((got_loss * weights).sum(), draft)
    assert got.dtype == dtype and torch.allclose(got_loss, plain(draft, target).detach(), atol=1e-6)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6 if dtype == torch.float32 else 4e-3,
                               rtol=1e-5 if dtype == torch.float32 else 2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the training step's autocast: same value
        assert torch.allclose(forward_kl(draft, target, 0.7, d2t), got_loss, atol=1e-6)
    same = forward_kl(target[:, d2t], target, 0.7, d2t)  # q = p': 0 exactly, never a rounded -1e-7
    assert bool((same >= 0).all()) and float(same.max()) < 1e-5
    z = torch.randn(4, 6, dtype=torch.float64, generator=g).requires_grad_()
    t = torch.randn(4, 6, dtype=torch.float64, generator=g)
    assert torch.autograd.gradcheck(lambda z: forward_kl(z, t, 1.3), (z,))
    teacher = target.clone().requires_grad_()  # a teacher that learns too: gradients to both
    forward_kl(draft, teacher, 0.7, d2t).sum().backward()
    assert teacher.grad is not None and bool(teacher.grad[:, d2t].abs().sum() > 0)


def test_logits_at_the_counted_anchors_only():
    """A head run only at `at` (row-major (M, Vd)) gives the masked mean of the dense one; `at`
    may hold more anchors than the loss counts, never fewer."""
    from specdistill.drafters.parts.anchors import counted

    batch = make_batch()
    draft = torch.randn(2, 6, 5)
    want = distill_loss([DraftPrediction(draft, shift=1)], batch)[0]
    at = counted(batch, 1)
    assert int(at.sum()) == 6
    assert torch.equal(distill_loss([DraftPrediction(draft[at], at=at, shift=1)], batch)[0], want)
    wider = at.clone()
    wider[1, 5] = True  # an anchor the loss never reads: computed, ignored
    assert torch.equal(distill_loss([DraftPrediction(draft[wider], at=wider, shift=1)], batch)[0], want)
    short = at.clone()
    short[0, 2] = False
    with pytest.raises(ValueError, match="miss 1 the loss counts"):
        distill_loss([DraftPrediction(draft[short], at=short, shift=1)], batch)


def test_masked_positions_do_not_change_the_loss():
    batch = make_batch()
    batch.loss_mask[0, 3] = 0  # a user token inside row 0
    draft = torch.randn(2, 6, 5)
    base = distill_loss([DraftPrediction(draft.clone(), shift=1)], batch)[0].item()
    touched = draft.clone()
    touched[0, 0, 0] += 10.0  # anchor 0 predicts token 2, which is counted: must change
    assert distill_loss([DraftPrediction(touched, shift=1)], batch)[0].item() > base + 0.01
    masked = draft.clone()
    masked[0, 1, 0] += 10.0  # row 0 anchor 1 predicts token 3 (loss_mask 0)
    masked[1, 2:, 0] += 10.0  # row 1 anchors 2, 3 predict padded tokens 4, 5
    masked[:, 4:, 1] -= 7.0  # anchors past T-1-shift have no token to predict
    batch.target_logits[1, 3:, 2] += 3.0  # target rows only met by padded anchors
    batch.target_logits[:, 0, 3] += 3.0  # target row 0 is only met by shift 0
    assert distill_loss([DraftPrediction(masked, shift=1)], batch)[0].item() == pytest.approx(base)
    batch.loss_mask.fill_(1)  # loss_mask set on padding too: attention_mask still excludes it
    padded = distill_loss([DraftPrediction(draft, shift=1)], batch)[0].item()
    assert distill_loss([DraftPrediction(masked, shift=1)], batch)[0].item() != pytest.approx(padded)
    masked[0, 1, 0] -= 10.0  # back to counted rows only differing on padding
    assert distill_loss([DraftPrediction(masked, shift=1)], batch)[0].item() == pytest.approx(padded)


def test_no_counted_position_gives_zero_with_grad():
    batch = make_batch()
    batch.loss_mask.zero_()
    draft = torch.randn(2, 6, 5, requires_grad=True)
    feats = torch.randn(2, 6, 3, requires_grad=True)
    total, _ = distill_loss([DraftPrediction(draft, shift=1, features=feats)], batch, "jsd",
                            feature_weight=1.0)
    assert total.item() == 0.0 and total.requires_grad
    total.backward()
    assert torch.isfinite(draft.grad).all() and float(draft.grad.abs().sum()) == 0.0


def test_shift_alignment():
    """The draft copies the target one step ahead: shift=1 gives zero loss, shift=0 does not."""
    batch = make_batch(T=8)
    batch.loss_mask.fill_(1)
    batch.attention_mask.fill_(1)
    draft = torch.cat([batch.target_logits[:, 1:], torch.zeros(2, 1, 5)], dim=1)  # (B, T, V)
    right = distill_loss([DraftPrediction(draft, shift=1)], batch, "forward_kl")[0]
    wrong = distill_loss([DraftPrediction(draft, shift=0)], batch, "forward_kl")[0]
    assert right.item() == pytest.approx(0.0, abs=1e-6) and wrong.item() > 0.05
    # features: predicted feature at anchor t is compared with features[:, t + shift]
    feats = torch.cat([batch.features[:, 1:], torch.zeros(2, 1, 3)], dim=1)
    _, parts = distill_loss([DraftPrediction(draft, shift=1, features=feats)], batch,
                            feature_weight=1.0)
    assert parts["feat/s1"].item() == pytest.approx(0.0, abs=1e-7)


def test_predictions_are_weighted_and_summed():
    batch = make_batch()
    a, b = torch.randn(2, 6, 5), torch.randn(2, 6, 5)
    la = distill_loss([DraftPrediction(a, shift=1)], batch, "tv")[0]
    lb = distill_loss([DraftPrediction(b, shift=2)], batch, "tv")[0]
    both = distill_loss([DraftPrediction(a, shift=1), DraftPrediction(b, shift=2, weight=0.8)],
                        batch, "tv")[0]
    assert both.item() == pytest.approx(la.item() + 0.8 * lb.item(), rel=1e-6)


def test_pruned_vocab_in_distill_loss():
    """With d2t, draft logits (Vd) are compared with the target restricted to d2t."""
    batch = make_batch()
    d2t = torch.tensor([0, 2, 4])
    draft = batch.target_logits[:, 1:, d2t]  # exact restricted target one step ahead
    draft = torch.cat([draft, torch.zeros(2, 1, 3)], dim=1)
    loss = distill_loss([DraftPrediction(draft, shift=1)], batch, "reverse_kl", d2t=d2t)[0]
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert distill_loss([DraftPrediction(draft, shift=1)], batch, "reverse_kl",
                        d2t=torch.tensor([0, 1, 4]))[0].item() > 1e-3
    # the trainer may hand over target logits already restricted to d2t: same loss, d2t=None
    other = torch.randn(2, 6, 3)
    full = distill_loss([DraftPrediction(other, shift=1)], batch, "jsd", d2t=d2t)[0]
    batch.target_logits = batch.target_logits[..., d2t]
    shifted = distill_loss([DraftPrediction(other, shift=1)], batch, "jsd")[0]
    assert shifted.item() == pytest.approx(full.item())


# -- acceptance-aimed losses (tv, nla, lk_hybrid) ------------------------------------------------
def overlap(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """(N,) acceptance rate sum min(p, q), computed directly from the softmaxes."""
    return torch.minimum(draft_logits.softmax(-1), target_logits.softmax(-1)).sum(-1)


def random_rows(n=64, v=8, scale=2.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, v, generator=g), scale * torch.randn(n, v, generator=g)


def grad_of(fn, draft, target, **kw):
    z = draft.clone().requires_grad_(True)
    fn(z, target, **kw).sum().backward()
    return z.grad  # (N, V)


@pytest.mark.parametrize("name", ACCEPTANCE_AIMED)
def test_zero_only_at_the_target_and_minimal_there(name):
    div = get_divergence(name)
    draft, target = random_rows()
    assert div(target, target).abs().max().item() < 1e-6  # q = p: zero on every row
    assert div(target + 3.7, target).abs().max().item() < 1e-6  # a logit shift is the same q
    assert (div(draft, target) > 1e-3).all()  # any other q: strictly positive
    g = torch.Generator().manual_seed(2)
    for _ in range(5):  # small moves away from q = p only raise the loss
        nudged = target + 0.05 * torch.randn(target.shape, generator=g)
        assert (div(nudged, target) > 0).all()


@pytest.mark.parametrize("name", ACCEPTANCE_AIMED)
def test_a_gradient_step_raises_the_acceptance(name):
    draft, target = random_rows()
    before = overlap(draft, target)
    stepped = draft - 0.05 * grad_of(get_divergence(name), draft, target)
    gain = overlap(stepped, target) - before  # (N,)
    assert (gain > 0).all(), f"{name}: {int((gain <= 0).sum())} rows lost acceptance"


def test_nla_gradient_is_tv_gradient_over_alpha():
    """d(-log alpha) = d(1 - alpha) / alpha: the same direction as TV, boosted where overlap is low."""
    draft, target = random_rows()
    alpha = overlap(draft, target)[:, None]  # (N, 1)
    torch.testing.assert_close(grad_of(nla, draft, target), grad_of(tv, draft, target) / alpha,
                               rtol=1e-4, atol=1e-7)


def test_nla_trains_from_a_cold_start_where_tv_stalls():
    """Draft mass far from the target's mode (alpha ~ 0.02): TV's step barely moves the acceptance,
    NLA's (1 / alpha) larger one does."""
    target = torch.tensor([[6.0, 0.0, 0.0, 0.0, 0.0]])  # p ~ [0.97, ...]
    draft = torch.tensor([[0.0, 6.0, 6.0, 0.0, 0.0]])  # q on tokens 1, 2
    alpha = overlap(draft, target).item()
    assert alpha < 0.05
    gains = {}
    for fn in (tv, nla):
        stepped = draft - 0.5 * grad_of(fn, draft, target)
        gains[fn.__name__] = overlap(stepped, target).item() - alpha
    assert 0 < gains["tv"] < 0.01 and gains["nla"] > 5 * gains["tv"]


def test_lk_hybrid_blends_kl_and_tv_with_a_constant_weight():
    draft, target = random_rows()
    alpha = overlap(draft, target)  # (N,)
    # eta = 0: lambda = 1, pure KL; eta huge: lambda = 0, pure TV (values and gradients)
    torch.testing.assert_close(lk_hybrid(draft, target, eta=0.0), forward_kl(draft, target))
    torch.testing.assert_close(lk_hybrid(draft, target, eta=1e4), tv(draft, target))
    # the default eta = 3: value and gradient are the lambda-blend with lambda held constant
    lam = torch.exp(-3.0 * alpha)  # (N,)
    torch.testing.assert_close(lk_hybrid(draft, target),
                               lam * forward_kl(draft, target) + (1 - lam) * tv(draft, target))
    blended = (lam[:, None] * grad_of(forward_kl, draft, target)
               + (1 - lam[:, None]) * grad_of(tv, draft, target))
    torch.testing.assert_close(grad_of(lk_hybrid, draft, target), blended, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ACCEPTANCE_AIMED)
def test_acceptance_losses_on_a_pruned_vocab(name):
    """d2t restricts the target to the draft ids and renormalises, as for the other losses: the
    draft equal to the restricted target scores 0, the wrong id map does not, and logits already
    restricted with d2t=None give the same loss."""
    batch = make_batch()
    d2t = torch.tensor([0, 2, 4])
    exact = torch.cat([batch.target_logits[:, 1:, d2t], torch.zeros(2, 1, 3)], dim=1)  # (B, T, Vd)
    assert distill_loss([DraftPrediction(exact, shift=1)], batch, name, d2t=d2t)[0].item() \
        == pytest.approx(0.0, abs=1e-6)
    assert distill_loss([DraftPrediction(exact, shift=1)], batch, name,
                        d2t=torch.tensor([0, 1, 4]))[0].item() > 1e-3
    other = torch.randn(2, 6, 3)
    full = distill_loss([DraftPrediction(other, shift=1)], batch, name, d2t=d2t)[0]
    batch.target_logits = batch.target_logits[..., d2t]
    assert distill_loss([DraftPrediction(other, shift=1)], batch, name)[0].item() \
        == pytest.approx(full.item(), rel=1e-6)


def test_loss_kernel_benchmark_writes_both_modes(tmp_path):
    """python -m benchmarks.loss_kernel, tiny: both modes timed, and they agree."""
    import json

    from benchmarks.loss_kernel import main

    main(["--rows", "8", "--vocab", "16", "--rounds", "2", "--warmup", "0", "--threads", "1",
          "--out", str(tmp_path)])
    res = json.loads((tmp_path / "loss_kernel.json").read_text())
    assert set(res["modes"]) == {"autograd", "own_backward"}
    assert res["max_diff"]["loss"] < 1e-5 and res["max_diff"]["grad"] < 1e-6
