"""Run metrics: tau, per-position acceptance and the time split on hand-made rounds."""
import pytest
import torch

from specdistill.decode.metrics import RunMetrics
from specdistill.decode.spec import GenerationResult


def test_metrics_math():
    r1 = GenerationResult(tokens=torch.zeros(12, dtype=torch.long), drafted=[3, 3, 3],
                          accepted=[3, 0, 1], target_forwards=4, time_draft=1.0, time_verify=2.0,
                          time_total=4.0)
    r2 = GenerationResult(tokens=torch.zeros(4, dtype=torch.long), drafted=[2], accepted=[2],
                          target_forwards=2, time_draft=0.5, time_verify=1.0, time_total=4.0)
    m = RunMetrics.from_results([r1, r2])
    assert (m.rounds, m.new_tokens, m.target_forwards, m.prompts) == (4, 16, 6, 2)
    assert m.tau == pytest.approx(10 / 4) and m.tau_draft == pytest.approx(6 / 4)
    assert m.accept_hist == [1, 1, 1, 1]
    # position 1: accepted in 3 of 4 rounds; position 2: 2 of the 3 that reached it, 2 of 4 drafted;
    # position 3: drafted in 3 rounds, reached in 1, accepted in 1
    assert m.accept_cond == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert m.accept_uncond == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert m.tokens_per_s == pytest.approx(16 / 8)
    assert (m.time_draft, m.time_verify, m.time_other) == pytest.approx((1.5, 3.0, 3.5))
    table = m.to_markdown("toy")
    assert "| tau (tokens per target forward) | 2.500 |" in table and "0.667" in table

def test_nothing_measured_is_never_a_number():
    """Zero drafted tokens, zero rounds (max_new_tokens=1) or zero prompts once gave tau
    1.000 or 0.000; now None, with the reason, and "not measured" in the table."""
    no_draft = RunMetrics.from_results([GenerationResult(tokens=torch.zeros(5), drafted=[0] * 4,
                                                         accepted=[0] * 4, target_forwards=5)])
    one_token = RunMetrics.from_results([GenerationResult(tokens=torch.zeros(1), target_forwards=1,
                                                          time_total=0.1)])
    for m, why in ((no_draft, "proposed no draft token"), (one_token, "no decode rounds"),
                   (RunMetrics.from_results([]), "no prompts")):
        assert m.tau is None and m.tau_draft is None and why in m.not_measured()
        assert "| tau (tokens per target forward) | not measured (" in m.to_markdown()
    # a position no round reached is not measured; one that was proposed and rejected is 0
    m = RunMetrics.from_results([GenerationResult(tokens=torch.zeros(3), drafted=[2], accepted=[0])])
    assert m.accept_cond == [0.0, None] and m.accept_uncond == [0.0, 0.0] and m.tau == 1.0
