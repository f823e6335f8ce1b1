"""Confidence-driven verification (decode/survival.py): the survival math, the cut rule, that a
survival-cut decoder stays lossless (greedy identical to plain decoding, sampled outputs keep the
target's distribution), the calibration numbers against a hand computation, and the settings'
checks."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from decode_toys import FixedQ, NoisyOracle, chi2_stat, make_target, pair_joint

from specdistill.decode.batched.cost import CostCurve
from specdistill.decode.batched.spec import generate_batch
from specdistill.decode.metrics import RunMetrics
from specdistill.decode.spec import GenerationResult, generate
from specdistill.decode.survival import (
    SurvivalRule,
    calibration,
    check_survival,
    cut_length,
    ece,
    survival,
)
from specdistill.drafters.base import ChainProposal
from specdistill.drafters.parts.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class HeadOracle(NoisyOracle):
    """NoisyOracle with a 'trained' confidence head: slot i's accept_prob is `conf[i]` (the
    chain's survival then falls slot by slot), so a threshold cuts at a known slot."""

    accept_prob_head = True

    def __init__(self, target, conf, **kw):
        super().__init__(target, **kw)
        self.conf = conf

    def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
        prop = super().propose(state, k, sampling, generator, min_confidence)
        m = len(prop.tokens)
        prop.accept_prob = torch.tensor(self.conf[:m] + [self.conf[-1]] * (m - len(self.conf)))
        return prop


class FixedQHead(FixedQ):
    """FixedQ (token 0 less dominant) with a confidence for slot 2 that reads the previous draft
    only, as a head reads the previous token: high after token 0, low otherwise."""

    accept_prob_head = True

    def __init__(self, vocab):
        super().__init__(vocab)
        self.logits[0] = 1.5  # q(0) ~ 0.87 at top-k 6: both verify widths happen often

    def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
        prop = super().propose(state, k, sampling, generator, min_confidence)
        slot2 = 0.9 if int(prop.tokens[0]) == 0 else 0.2
        prop.accept_prob = torch.tensor([0.9, slot2])[:len(prop.tokens)]
        return prop


# -- the math ---------------------------------------------------------------------------------------
def test_survival_is_the_cumulative_product_and_the_cut_keeps_at_least_one():
    s = survival(torch.tensor([0.9, 0.5, 0.8, 1.2]))  # a value over 1 is clamped
    assert torch.allclose(s, torch.tensor([0.9, 0.45, 0.36, 0.36]))
    assert cut_length(s, 0.4) == 2  # S_3 = 0.36 < 0.4: slots 1, 2
    assert cut_length(s, 0.3) == 4  # nothing below
    assert cut_length(s, 0.95) == 1  # even S_1 < t: one draft is still verified
    rule = SurvivalRule(0.4, "none")
    assert rule.cut(torch.tensor([0.9, 0.5, 0.8]), 3) == 2
    assert rule.cut(None, 3) == 3  # no confidences: everything verified
    assert SurvivalRule(0.0).cut(torch.tensor([0.1, 0.1]), 2) == 2  # off


def test_confidences_come_from_the_head_then_the_fallback():
    prop = ChainProposal(tokens=torch.tensor([1, 2]), confidence=torch.tensor([0.7, 0.6]))
    assert SurvivalRule(0.5, "none").confidences(prop, 2) is None
    assert SurvivalRule(0.5, "draft_prob").confidences(prop, 2).tolist() == pytest.approx([0.7, 0.6])
    prop.accept_prob = torch.tensor([0.2, 0.3])
    assert SurvivalRule(0.5, "draft_prob").confidences(prop, 1).tolist() == pytest.approx([0.2])


def test_ece_and_calibration_match_a_hand_computation():
    """Rounds of (verified slot confidences, accepted): the reached slots are (0.9 hit, 0.8 hit),
    (0.9 miss; slot 2 never reached), (0.6 hit). Bins of 0.1: {0.9, 0.9} predicted 0.9 observed
    0.5, {0.8} 0.8 vs 1, {0.6} 0.6 vs 1: ECE = 2/4*0.4 + 1/4*0.2 + 1/4*0.4 = 0.35."""
    rounds = [([0.9, 0.8], 2), ([0.9, 0.3], 0), ([0.6], 1)]
    assert ece([0.9, 0.8, 0.9, 0.6], [True, True, False, True]) == pytest.approx(0.35)
    cal = calibration(rounds, "head")
    assert cal["pairs"] == 4 and cal["ece"] == pytest.approx(0.35) and cal["source"] == "head"
    s1, s2 = cal["slots"]
    assert (s1["count"], s1["predicted"], s1["observed"]) == (3, pytest.approx(0.8),
                                                              pytest.approx(2 / 3))
    assert (s2["count"], s2["predicted"], s2["observed"]) == (1, pytest.approx(0.8), 1.0)
    assert ece([0.25, 0.25, 0.25, 0.25], [True, False, False, False]) == pytest.approx(0.0)
    assert calibration([], "head") is None and ece([], []) is None
    # the decode summary carries it (spec_calibration, spec_confidence_ece)
    res = GenerationResult(tokens=torch.tensor([1, 2, 3]), drafted=[2, 2, 1], accepted=[2, 0, 1],
                           slot_confidence=rounds, confidence_source="head", time_total=1.0)
    m = RunMetrics.from_results([res])
    assert m.confidence_ece == pytest.approx(0.35) and m.calibration["slots"][0]["count"] == 3
    assert "ECE 0.350" in m.to_markdown()
    assert RunMetrics.from_results([GenerationResult(tokens=torch.tensor([1]))]).calibration is None


def test_settings_are_checked():
    target = make_target()
    no_head = NoisyOracle(target)
    with pytest.raises(ValueError, match="outside"):
        check_survival(no_head, 1.5, "draft_prob")
    with pytest.raises(ValueError, match="survival_fallback='x' is unknown"):
        check_survival(no_head, 0.5, "x")
    with pytest.raises(ValueError, match="verify_survival=0.5.*survival_fallback=none"):
        generate(target, no_head, [1, 2, 3], max_new_tokens=4, verify_survival=0.5)
    with pytest.raises(ValueError, match="verify_survival=0.5 cuts chains.*tree=false"):
        check_survival(no_head, 0.5, "draft_prob", tree=True)
    check_survival(no_head, 0.5, "draft_prob")  # the fallback gives confidences
    check_survival(HeadOracle(target, [0.5]), 0.5, "none")  # a head gives them
    check_survival(no_head, 0.0, "none")  # off


# -- lossless ---------------------------------------------------------------------------------------
def test_greedy_survival_cut_is_lossless_and_cuts_where_told():
    target = make_target()
    drafter = HeadOracle(target, [0.95, 0.9, 0.5, 0.9], noise=0.2)  # S = .95 .855 .43 .38
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(100 + seed))
        plain = generate(target, None, prompt, max_new_tokens=30)
        spec = generate(target, drafter, prompt, max_new_tokens=30, k=4, verify_survival=0.5)
        assert spec.tokens.tolist() == plain.tokens.tolist()
        assert max(spec.drafted) == 2  # S_3 = 0.43 < 0.5: two drafts verified, never more
        assert spec.confidence_source == "head"
        assert len(spec.slot_confidence) == sum(m > 0 for m in spec.drafted)  # rounds that drafted
        accepted += sum(spec.accepted)
        full = generate(target, drafter, prompt, max_new_tokens=30, k=4)  # no threshold: k drafts
        assert max(full.drafted) == 4 and full.tokens.tolist() == plain.tokens.tolist()
    assert accepted > 10  # acceptance was exercised


def test_batched_adaptive_is_lossless_per_row():
    target = make_target()
    prompts = [[3, 17, 5, 9, 41], list(range(20, 32)), [1, 2]]
    drafter = HeadOracle(target, [0.9, 0.8, 0.3], noise=0.2)
    cost = CostCurve.per_token(1.0, free=8)  # 8 tokens per forward for the price of one
    out = generate_batch(target, drafter, prompts, max_new_tokens=16, batch_size=3, k=4,
                         mode="adaptive", cost=cost, verify_survival=0.5)
    for p, res in zip(prompts, out.results):
        assert res.tokens.tolist() == generate(target, None, p, max_new_tokens=16).tokens.tolist()
        assert max(res.drafted) <= 2  # S_3 = 0.216 < 0.5
        assert res.slot_confidence and res.confidence_source == "head"


def _pair_counts(target, drafter, n, threshold):
    """n generations of 4 tokens after [1, 2, 3, 4] (k=2, survival cut): counts of (t2, t3)."""
    Vs, sp = target.vocab_size, SamplingParams(temperature=1.0, top_k=6)
    gen = torch.Generator().manual_seed(0)
    c, cut = torch.zeros(Vs * Vs), 0
    for _ in range(n):
        res = generate(target, drafter, [1, 2, 3, 4], max_new_tokens=4, k=2, sampling=sp,
                       generator=gen, verify_survival=threshold)
        c[res.tokens[1] * Vs + res.tokens[2]] += 1
        cut += res.drafted[0] == 1
    return c, cut


@pytest.mark.slow  # ~30 s on 2 loaded cores: 1,600 sampled generations
def test_sampled_survival_cut_keeps_the_target_distribution(monkeypatch):
    """Slot 2 is verified only after a first draft of token 0 (a cut from the previous draft, as a
    head's): tokens 2-3 still follow the target's joint (chi-square), and the same test catches a
    wrong acceptance rule (resampling from p), far off."""
    import specdistill.decode.spec as spec
    from decode_toys import wrong_rule

    Vs = 8
    target = make_target(vocab=Vs, seed=3, init=0.2)
    joint = pair_joint(target, [1, 2, 3, 4], SamplingParams(temperature=1.0, top_k=6))
    c, cut = _pair_counts(target, FixedQHead(Vs), 1000, 0.5)
    assert 50 < cut < 950  # both widths happened
    stat, crit = chi2_stat(c, joint)
    assert stat < crit, (stat, crit)
    monkeypatch.setattr(spec, "accept_chain", wrong_rule("resample_from_p"))
    stat, crit = chi2_stat(_pair_counts(target, FixedQHead(Vs), 600, 0.5)[0], joint)
    assert stat > 2 * crit, (stat, crit)


def test_cli_refuses_bad_survival_settings(tmp_path):
    """One line, exit 2: a threshold for a drafter without a head and survival_fallback=none (both
    keys named); a threshold outside [0, 1] by its field's range, before any work."""
    from specdistill.cli.errors import UserError
    from specdistill.cli.ranges import check_ranges
    from specdistill.decode.config import DecodeConfig

    with pytest.raises(UserError, match=r"verify_survival=1.5 is outside \[0, 1\]"):
        check_ranges({"verify_survival": 1.5}, DecodeConfig)
    out = subprocess.run([sys.executable, "-m", "decode", "target=tiny", "drafter=ngram",
                          "eval.limit=1", f"run_dir={tmp_path / 'run'}", "verify_survival=0.5"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    err = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(err) == 1 and "verify_survival=0.5" in err[0], out.stderr[-2000:]
    assert "survival_fallback=none" in err[0], out.stderr[-2000:]


def test_batched_sampled_survival_cut_draws_as_alone():
    """Sampling, verify_all with a survival cut: each row draws exactly what `generate` draws for
    that prompt alone with the same generator seed (the same cut, the same rule)."""
    Vs = 8
    target = make_target(vocab=Vs, seed=3, init=0.2)
    sp = SamplingParams(temperature=1.0, top_k=6)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [2, 2, 2, 2, 2]]
    out = generate_batch(target, FixedQHead(Vs), prompts, max_new_tokens=12, batch_size=3, k=2,
                         sampling=sp, seed=7, verify_survival=0.5)
    for i, (p, res) in enumerate(zip(prompts, out.results)):
        alone = generate(target, FixedQHead(Vs), p, max_new_tokens=12, k=2, sampling=sp,
                         generator=torch.Generator().manual_seed(7 + i), verify_survival=0.5)
        assert res.tokens.tolist() == alone.tokens.tolist() and res.drafted == alone.drafted
    assert any(m == 1 for r in out.results for m in r.drafted)  # the cut happened


# -- recalibration (fit_platt, the decode job's calibrate=true) -------------------------------------
def test_platt_scaling_recovers_a_known_miscalibration_and_refuses_too_little():
    """Pairs drawn from sigmoid(0.6 z - 0.8) while the head says sigmoid(z): the fit finds (0.6,
    -0.8), and the refitted confidences' ECE falls from ~0.16 to the sampling noise."""
    from specdistill.decode.survival import fit_platt, platt

    g = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(20000, generator=g)
    hit = (torch.rand(20000, generator=g) < torch.sigmoid(0.6 * z - 0.8)).tolist()
    pred = torch.sigmoid(z).tolist()
    a, b = fit_platt(pred, hit)
    assert abs(a - 0.6) < 0.05 and abs(b + 0.8) < 0.05, (a, b)
    assert ece(pred, hit) > 0.1 and ece(platt(pred, a, b), hit) < 0.02
    a, b = fit_platt(torch.sigmoid(0.6 * z - 0.8).tolist(), hit)  # calibrated already: identity
    assert abs(a - 1) < 0.05 and abs(b) < 0.05, (a, b)
    with pytest.raises(ValueError, match="both outcomes.*eval.limit"):
        fit_platt(pred[:100], [False] * 100)
    with pytest.raises(ValueError, match=">= 50 verified slots"):
        fit_platt(pred[:10], hit[:10])


def test_calibrate_folds_the_fit_into_a_drafter_folder_that_reloads_calibrated(tmp_path):
    """write_calibrated: the pairs of a decode -> (a, b) -> a copy of the saved DSpark whose head
    gives sigmoid(a z + b) where the saved one gave sigmoid(z), written as a verified drafter
    folder (ckpt= it) with calibration.json; the saved drafter itself is untouched."""
    from eagle3_engines import perturbed_drafter, tiny8_target
    from omegaconf import OmegaConf

    from specdistill.decode.evaluate import calibration_markdown, write_calibrated
    from specdistill.export.folder import load_resolved
    from specdistill.store.drafter import save_drafter
    from specdistill.store.rundir import resolve_drafter, write_atomic

    target = tiny8_target()
    d = perturbed_drafter(target, "dspark", 1, markov_rank=8)
    cfg = {"name": "dspark", "markov_rank": 8}
    write_atomic(tmp_path / "ckpt", lambda tmp: save_drafter(d, cfg, tmp))
    g = torch.Generator().manual_seed(1)
    rounds = []  # confidences too high: acceptance follows sigmoid(0.5 z - 1)
    for _ in range(400):
        z = 2 * torch.randn(3, generator=g)
        n = 0
        while n < 3 and float(torch.rand(1, generator=g)) < float(torch.sigmoid(0.5 * z[n] - 1)):
            n += 1
        rounds.append((torch.sigmoid(z).tolist(), n))
    run = OmegaConf.create({"temperature": 0.0, "k": 3, "eval": {"kind": "mtbench", "offset": 20}})
    source = resolve_drafter(tmp_path / "ckpt")
    info = write_calibrated(run, target, source, {"slot_confidence": rounds,
                                                   "summary": {"prompts": 40}}, tmp_path / "run")
    assert abs(info["a"] - 0.5) < 0.15 and abs(info["b"] + 1) < 0.3, info
    assert info["ece_after_in_sample"] < info["ece_before"]
    assert "calibrated" in calibration_markdown(info) and info["offset"] == 20
    again = load_resolved(resolve_drafter(tmp_path / "run" / "calibrated"), target)
    saved = load_resolved(resolve_drafter(tmp_path / "ckpt"), target)
    h, e = torch.randn(5, target.hidden_size), torch.randn(5, 8)
    with torch.no_grad():
        z0, z1 = saved.confidence_head(h, e), again.confidence_head(h, e)
    assert torch.allclose(z1, info["a"] * z0 + info["b"], atol=1e-5)
    assert json.loads((tmp_path / "run" / "calibrated" / "calibration.json").read_text())["a"] == info["a"]
    assert torch.equal(saved.confidence_head.proj.weight, d.confidence_head.proj.weight)


def test_calibrate_is_refused_where_it_cannot_fit(tmp_path):
    """One line, exit 2, before any work: no checkpoint; and a drafter without a confidence head."""
    out = subprocess.run([sys.executable, "-m", "decode", "target=tiny", "drafter=ngram",
                          "eval.limit=1", f"run_dir={tmp_path / 'run'}", "calibrate=true"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    err = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(err) == 1 and "calibrate=true" in err[0] and "ckpt=" in err[0], out.stderr[-2000:]
    from specdistill.drafters.base import Drafter

    with pytest.raises(NotImplementedError, match="no trained confidence head"):
        Drafter(10).rescale_confidence(1.0, 0.0)
