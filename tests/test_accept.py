"""The acceptance rules, run directly and vectorised: 200,000 rounds in one call.

Greedy takes the exact argmax prefix. Sampling must reproduce the target's distribution at every
position whatever the draft distribution q is; three plausible wrong rules must fail the same test.
"""
import pytest
import torch
from decode_toys import chi2_stat, wrong_rule

from specdistill.decode.accept import accept_chain, accepted_prefix
from specdistill.drafters.parts.sampling import SamplingParams, sample, warp

V, M, B = 8, 2, 200_000  # vocabulary, drafts per round, rounds


def test_accepted_prefix():
    ok = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert accepted_prefix(ok).tolist() == [2, 0, 4]
    assert accepted_prefix(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]


def test_greedy_takes_the_argmax_prefix_and_ignores_q():
    best = torch.tensor([4, 1, 6, 2])  # the target's argmax at [last, d1, d2, d3]
    logits = torch.nn.functional.one_hot(best, V).float()[None].repeat(4, 1, 1)  # (4, 4, V)
    draft = torch.tensor([[4, 1, 6], [4, 1, 0], [4, 0, 6], [0, 1, 6]])  # (4, 3)
    q = torch.full((4, 3, V), 1.0 / V)  # any q: greedy does not look at it
    n, nxt = accept_chain(draft, q, logits, SamplingParams())
    assert n.tolist() == [3, 2, 1, 0] and nxt.tolist() == [2, 6, 1, 4]


def _rounds(rule, sp, deterministic, seed=0):
    """B independent rounds with fixed p (3 positions) and q (2 positions) far from p.

    Returns the exact p (M+1, V) and the empirical outputs: x1 over all rounds, x2 over rounds
    that accepted d1, and the bonus over rounds that accepted both drafts."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(M + 1, V, generator=g, dtype=torch.float64) * 1.5  # (M+1, V)
    p = warp(logits, sp)
    q_logits = torch.full((M, V), -2.0, dtype=torch.float64)
    # q puts most of its mass on p's second choice: some of it is accepted, much rejected
    q_logits[torch.arange(M), p[:M].argsort(-1, descending=True)[:, 1]] = 2.0
    q = warp(q_logits, sp)  # (M, V)
    if deterministic:  # q = None: one-hot on a fixed draft (p's least and most likely tokens)
        draft = torch.stack([p[0].argmin(), p[1].argmax()]).expand(B, M)
        qb = None
    else:
        draft = sample(q.expand(B, M, V), g)  # (B, M)
        qb = q.expand(B, M, V)
    n, nxt = rule(draft, qb, logits.expand(B, M + 1, V), sp, g)
    x1 = torch.where(n >= 1, draft[:, 0], nxt)
    x2 = torch.where(n >= 2, draft[:, 1], nxt)[n >= 1]
    bonus = nxt[n == 2]
    return p, [x1, x2, bonus], n


def _worst(p, outs):
    """max over positions of statistic / critical value (< 1 passes)."""
    ratios = []
    for i, x in enumerate(outs):
        if len(x) > 200:
            stat, crit = chi2_stat(torch.bincount(x, minlength=V), p[i])
            ratios.append(stat / crit)
    return max(ratios)


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.3, top_p=0.8)]


@pytest.mark.parametrize("sp", SETTINGS, ids=["t1", "topk", "topp"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["q", "onehot"])
def test_sampling_rule_reproduces_p(sp, deterministic):
    p, outs, n = _rounds(accept_chain, sp, deterministic)
    assert _worst(p, outs) < 1.0
    if not deterministic:  # teeth: rejections and full acceptances both happen often
        assert int((n == 0).sum()) > 1000 and int((n == 2).sum()) > 1000


@pytest.mark.parametrize("kind", ["resample_from_p", "inverted_ratio", "always_accept"])
@pytest.mark.parametrize("sp", SETTINGS, ids=["t1", "topk", "topp"])
def test_wrong_rules_fail_the_same_check(kind, sp):
    p, outs, _ = _rounds(wrong_rule(kind), sp, deterministic=False)
    assert _worst(p, outs) > 5.0
