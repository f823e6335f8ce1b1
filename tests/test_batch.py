"""Batched speculative decoding (decode/batched/spec.py, decode/batched/kv_cache.py,
decode/batched/planner.py) is lossless per sequence: greedy outputs are token-identical to decoding
each prompt alone, in every mode, at every batch size, with ragged acceptance, prompts of different
lengths, sequences ending at different times (EOS, budget, stop string) and waiting prompts admitted
as others finish; the batch KV cache equals a fresh forward's for every row after every round;
drafters see exactly what they see alone; sampling keeps the target's distribution (chi-square, with
wrong-rule and look-ahead-budget controls); the budget plans each round's draft depth before
drafting from past rounds and the (B, Q) cost grid (measured once and cached), falls back to plain
rounds without drafter calls where drafting cannot pay, and cuts the verify width from the drafts'
confidences.

The toys are tests/decode_toys.py's float64 Llamas (no near-ties between kernel shapes).
"""
import pytest
import torch
from decode_toys import (
    FixedQ,
    NoisyOracle,
    StubTokenizer,
    V,
    chi2_stat,
    jsonl_prompt_ids,
    make_target,
    pair_joint,
    wrong_rule,
)
from eagle3_engines import perturbed_drafter, tiny8_target
from transformers import DynamicCache

import specdistill.decode.batched.cost  # noqa: F401  (loads the submodule for decode.<name>)
import specdistill.decode.batched.planner  # noqa: F401  (loads the submodule for decode.<name>)
import specdistill.decode.batched.spec  # noqa: F401  (loads the submodule for decode.<name>)
from specdistill import decode
from specdistill.decode.batched.cost import BATCH_NS, WIDTH_NS, CostCurve, cost_curve, isotonic
from specdistill.decode.batched.planner import RoundPlanner, choose_widths, survival
from specdistill.decode.batched.spec import generate_batch, slot_drafter
from specdistill.decode.spec import generate
from specdistill.drafters.base import ChainProposal, DecodeState, build_drafter
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.target.model import Target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = [[3, 17, 5, 9, 41], list(range(20, 32)), [(7 * i) % V for i in range(30)], [1, 2],
           [5, 6, 7, 5, 6, 7, 5, 6, 7]]


def by_tokens(ns, secs, bs=(1, 2, 3, 4, 5, 8), qs=(1, 2, 3, 4, 5)):
    """A (B, Q) cost grid from a curve over forward tokens n = B * Q: linear between the given
    (ns, secs) points and beyond the last two, secs[0] below ns[0]."""
    def f(n):
        j = next((i for i in range(1, len(ns)) if n <= ns[i]), len(ns) - 1)
        slope = (secs[j] - secs[j - 1]) / (ns[j] - ns[j - 1])
        return max(secs[j - 1] + slope * (n - ns[j - 1]), secs[0])
    return CostCurve(list(bs), list(qs), [[f(b * q) for q in qs] for b in bs])


FLAT = CostCurve.per_token(1.0, free=10**6)  # verification is free: budgeted verifies everything
STEEP = CostCurve(list(BATCH_NS), list(WIDTH_NS), [[b * q * q for q in WIDTH_NS] for b in BATCH_NS])
# STEEP: every verified token costs more than a step: drafting can never pay


@pytest.fixture(scope="module")
def target():
    return make_target()


def alone(target, drafter, prompt, n, **kw):
    return generate(target, drafter, prompt, max_new_tokens=n, **kw)


# -- greedy: each output equals decoding that prompt alone -------------------------------------------
@pytest.mark.parametrize("B", [1, 2, 3, 5])
@pytest.mark.parametrize("mode", ["plain", "verify_all", "budgeted"])
def test_greedy_batch_equals_alone(target, B, mode):
    budgets = [25, 9, 31, 1, 17]  # sequences finish at different rounds; 5 prompts > B admit late
    refs = [alone(target, None, p, n).tokens.tolist() for p, n in zip(PROMPTS, budgets)]
    cost = by_tokens([1, 4, 8], [1.0, 1.2, 3.0])  # budgeted: a width between plain and all
    out = generate_batch(target, NoisyOracle(target, noise=0.3, seed=B), PROMPTS,
                         max_new_tokens=budgets, batch_size=B, k=4, mode=mode, cost=cost)
    assert [r.tokens.tolist() for r in out.results] == refs
    # the 1-token prompt ends at its prefill and never takes a row
    assert max(out.batch_sizes) == min(B, 4) and len(out.batch_sizes) == out.rounds
    assert all(r.stop_reason == "max_new_tokens" for r in out.results)
    accepted = sum(sum(r.accepted) for r in out.results)
    assert (accepted == 0) == (mode == "plain")  # drafts were accepted, raggedly
    if mode == "budgeted":  # NoisyOracle's drafts score 1: the widest forward that pays per row count
        best = {1: 4, 2: 2, 3: 2, 4: 1, 5: 1}  # e.g. 1 row: 4 tokens cost 1.2, 5 cost 1.65
        assert all(w <= best[b] for b, w in zip(out.batch_sizes, out.widths))
        assert max(out.widths) > 1  # at the latest when the batch thins out


def counting(drafter_cls, *args, **kw):
    """A drafter of drafter_cls that logs the k of every propose call into .asked."""
    class Counting(drafter_cls):
        def propose(self, state, k, *a, **kw):
            self.asked.append(k)
            return super().propose(state, k, *a, **kw)

    d = Counting(*args, **kw)
    d.asked = []  # shared by the per-slot shallow copies
    return d


@pytest.mark.parametrize("B", [1, 5])
def test_budgeted_falls_back_to_plain_without_calling_the_drafter(target, B):
    """Where no draft depth can pay, even were every draft accepted (each verified token costs a
    full step), budgeted decodes plainly from its first round: zero drafter calls, width-1
    forwards, and the lone decoder's outputs."""
    d = counting(NoisyOracle, target, noise=0.0)
    out = generate_batch(target, d, PROMPTS, max_new_tokens=12, batch_size=B, k=4,
                         mode="budgeted", cost=STEEP)
    assert d.asked == [] and set(out.widths) == {1} and set(out.depths) == {0}
    assert out.time_draft == 0.0 and all(r.drafted == [0] * len(r.drafted) for r in out.results)
    assert [r.tokens.tolist() for r in out.results] == [
        alone(target, None, p, 12).tokens.tolist() for p in PROMPTS]
    # the same batch with verification free drafts every round, at full depth
    d = counting(NoisyOracle, target, noise=0.0)
    out = generate_batch(target, d, PROMPTS, max_new_tokens=12, batch_size=B, k=4,
                         mode="budgeted", cost=FLAT)
    assert set(out.depths) == {4} and max(out.widths) == 5
    assert len(d.asked) == sum(m > 0 for r in out.results for m in r.drafted) > 0


def test_eos_and_stop_strings_end_rows_at_different_times(target):
    """Each prompt ends at its own EOS (inside an accepted block) or stop string; the batch
    outputs and stop reasons equal the lone decoder's."""
    eos = alone(target, None, PROMPTS[2], 20).tokens[6].item()
    eos_target = Target(target.model, StubTokenizer(eos=eos), "tiny+eos")
    stop = ["gA"]  # StubTokenizer: tokens 38, 7 decode to "Eg", "Ah": a stop across two tokens
    refs = [alone(eos_target, NoisyOracle(target, noise=0.0), p, 40, k=5, stop_strings=stop)
            for p in PROMPTS]
    out = generate_batch(eos_target, NoisyOracle(target, noise=0.0), PROMPTS, max_new_tokens=40,
                         batch_size=2, k=5, stop_strings=stop)
    assert [r.tokens.tolist() for r in out.results] == [r.tokens.tolist() for r in refs]
    assert [r.stop_reason for r in out.results] == [r.stop_reason for r in refs]
    assert {r.stop_reason for r in refs} == {"eos", "stop_string"}


def test_batch_cache_equals_a_fresh_forward_after_every_round(target, monkeypatch):
    """After each commit, every remaining row r holds the KV of its tokens[:T_r - 1] in columns
    [0, T_r - 1), and the cache is as long as its longest row."""
    checked = []
    commit = decode.batched.spec._Batch.commit

    def checked_commit(self, new, kept):
        finished = commit(self, new, kept)
        if self.seqs:
            lens = [s.state.T - 1 for s in self.seqs]
            assert self.cache.get_seq_length() == max(lens)
            for r, s in enumerate(self.seqs):
                fresh = DynamicCache()
                target.forward(s.state.buf[:lens[r]][None], cache=fresh)
                for got, ref in zip(self.cache.layers, fresh.layers):
                    torch.testing.assert_close(got.keys[r, :, :lens[r]], ref.keys[0])
                    torch.testing.assert_close(got.values[r, :, :lens[r]], ref.values[0])
            checked.append(len(self.seqs))
        return finished

    monkeypatch.setattr(decode.batched.spec._Batch, "commit", checked_commit)
    generate_batch(target, NoisyOracle(target, noise=0.4, seed=3), PROMPTS,
                   max_new_tokens=[12, 5, 20, 8, 15], batch_size=3, k=3)
    assert len(checked) > 5 and max(checked) == 3


# -- every registered drafter: per-slot state, the same proposals as alone ---------------------------
@pytest.fixture(scope="module")
def target8():
    return tiny8_target()


@pytest.mark.parametrize("name,B", [(n, b) for n in ("ngram", "eagle", "eagle3") for b in (1, 2, 3, 5)]
                         + [(n, 3) for n in ("medusa", "peagle", "dflash", "small_lm")])
def test_registered_drafters_see_what_they_see_alone(target8, name, B, monkeypatch):
    """Greedy outputs equal the lone decoder's, and each slot's drafter proposes exactly what the
    drafter proposes for that prompt alone (so its own cache and the target features it reads
    are the lone decoder's): the shallow per-slot copies share weights, never state; rows that
    draft together (EAGLE's propose_rows: one padded forward per draft step) draft the same."""
    cfg = {"draft_vocab_size": None} if name == "eagle" else {}
    d = (build_drafter({"name": name}, target8) if name == "ngram"
         else perturbed_drafter(target8, name, **cfg))
    log: dict = {}
    propose, propose_rows, inside = type(d).propose, type(d).propose_rows, []

    def record(state, prop):
        key = tuple(state.tokens[:4].tolist())  # the prompts differ in their first tokens
        log.setdefault(key, []).append(prop.tokens.tolist())

    def logged(self, state, k, *a, **kw):
        prop = propose(self, state, k, *a, **kw)
        if not inside:  # a row drafted by propose_rows is recorded there
            record(state, prop)
        return prop

    def logged_rows(self, slots, states, *a, **kw):  # rows drafting together (eagle, eagle3)
        inside.append(1)
        try:
            props = propose_rows(self, slots, states, *a, **kw)
        finally:
            inside.pop()
        for state, prop in zip(states, props):
            record(state, prop)
        return props

    monkeypatch.setattr(type(d), "propose", logged)
    monkeypatch.setattr(type(d), "propose_rows", logged_rows)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.cat([torch.tensor([i]), torch.randint(0, 128, (n,), generator=g)])
               for i, n in enumerate([5, 12, 8, 20, 3, 9])]
    budgets = [14, 6, 17, 9, 12, 4]  # rows end at different rounds; the queue refills them
    refs = [alone(target8, d, p, n, k=3).tokens.tolist() for p, n in zip(prompts, budgets)]
    ref_log, log = log, {}
    out = generate_batch(target8, d, prompts, max_new_tokens=budgets, batch_size=B, k=3)
    assert [r.tokens.tolist() for r in out.results] == refs
    assert log == ref_log


def _state(target, d, tokens):
    feats = target.forward(tokens[None, :-1], layers=d.feature_layers).features[0]  # (T-1, F)
    return DecodeState(tokens=tokens, features=feats)


@pytest.mark.parametrize("name", ["eagle", "eagle3", "peagle", "dflash"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=6)])
def test_rows_drafting_together_draft_what_each_drafts_alone(target8, name, sampling):
    """EAGLE's propose_rows (one padded forward per draft step for every row, RowsKV; P-EAGLE: one
    forward for the whole round) over rows of different lengths and cache lengths, ks of 0 / 1 /
    3 / 4 and confidence stops: every row's tokens, q and confidences are its own propose's
    (sampled with the same generator), and its cache afterwards holds what its own propose
    leaves, over two rounds."""
    torch.manual_seed(0)  # the drafter's init: the confidence thresholds below are set for it
    d = perturbed_drafter(target8, name, draft_vocab_size=64)  # a pruned head: q mapped back
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (9, 4, 40, 7, 11)]  # 40: synced
    ks = [3, 0, 4, 1, 3]  # alone first (rows.ROWS_SYNC_ALONE), then with the others
    minc = {"eagle": 0.95, "eagle3": 0.2 if sampling.greedy else 0.28,
            "peagle": 0.3 if sampling.greedy else 0.4,
            "dflash": 0.3 if sampling.greedy else 0.4}[name]  # some chains stop early
    together, alone_ = [slot_drafter(d) for _ in seqs], [slot_drafter(d) for _ in seqs]
    made = []  # (drafts, k) of every row and round
    for grow in (0, 3):  # round 2: each row committed a few more tokens (its cache is reused)
        seqs = [torch.cat([t, torch.randint(0, 128, (grow + i % 2,), generator=g)]) if grow else t
                for i, t in enumerate(seqs)]
        states = [_state(target8, d, t) for t in seqs]
        gens = [torch.Generator().manual_seed(10 + i) for i in range(len(seqs))]
        got = d.propose_rows(together, states, ks, sampling, gens, minc)
        gens = [torch.Generator().manual_seed(10 + i) for i in range(len(seqs))]
        ref = [a.propose(s, k, sampling, gn, minc) if k else None
               for a, s, k, gn in zip(alone_, states, ks, gens)]
        for p, r, k in zip(got, ref, ks):
            if not k:
                assert len(p.tokens) == 0
                continue
            assert p.tokens.tolist() == r.tokens.tolist()
            torch.testing.assert_close(p.confidence, r.confidence, rtol=1e-4, atol=1e-5)
            if not sampling.greedy:
                torch.testing.assert_close(p.probs, r.probs, rtol=1e-4, atol=1e-5)
        made += [(len(p.tokens), k) for p, k in zip(got, ks)]
        for a, b in zip(together, alone_):
            assert len(a.cache) == len(b.cache) == a.cache.committed
            for la, lb in zip(a.cache.kv.layers, b.cache.kv.layers):
                torch.testing.assert_close(la.keys, lb.keys, rtol=1e-4, atol=1e-5)
    assert any(n < k for n, k in made if n) and any(n == k > 2 for n, k in made)  # stops, whole


def test_a_failed_round_of_rows_leaves_no_half_synced_cache(target8, monkeypatch):
    d = perturbed_drafter(target8, "eagle", draft_vocab_size=64)
    rows = [slot_drafter(d) for _ in range(2)]
    states = [_state(target8, d, torch.arange(5 + i)) for i in range(2)]
    d.propose_rows(rows, states, [2, 2], SamplingParams(), [None, None])
    assert all(len(r.cache) for r in rows)
    monkeypatch.setattr(type(d), "head", lambda self, h: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        d.propose_rows(rows, states, [2, 2], SamplingParams(), [None, None])
    assert all(len(r.cache) == 0 for r in rows)  # reset: the next round rebuilds them


def test_slot_drafter_shares_weights_not_state(target8):
    d = perturbed_drafter(target8, "eagle3")
    a, b = slot_drafter(d), slot_drafter(lambda: d)
    assert a is not d and a.fc.weight is d.fc.weight and b is d
    assert a.cache is not d.cache


# -- sampling --------------------------------------------------------------------------------------
SP = SamplingParams(temperature=1.0, top_k=6)


def test_sampled_verify_all_draws_what_the_lone_decoder_draws():
    """verify_all keeps spec's order of draws, so with the same per-prompt generator each
    sequence gets the very tokens it gets alone."""
    tgt = make_target(vocab=8, seed=3, init=0.2)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 1, 1, 2, 3, 0, 4]]
    refs = [generate(tgt, FixedQ(8), p, max_new_tokens=12, k=3, sampling=SP,
                     generator=torch.Generator().manual_seed(50 + i)).tokens.tolist()
            for i, p in enumerate(prompts)]
    out = generate_batch(tgt, FixedQ(8), prompts, max_new_tokens=12, batch_size=2, k=3,
                         sampling=SP, seed=50)
    assert [r.tokens.tolist() for r in out.results] == refs


def lookahead_survival(prop, m):
    """A wrong budget score: reads each draft's own probability q_i(d_i) at its own depth, so
    whether d_i is verified depends on d_i itself."""
    own = prop.probs[:m].gather(-1, prop.tokens[:m, None]).squeeze(-1)
    return own.cumprod(0)


def even_q(vocab):
    """FixedQ with q(0) = 0.5 (the other tokens share the rest): a draft's own probability
    then says a lot about its value, so a budget that reads it is visibly biased."""
    d = FixedQ(vocab)
    d.logits[0] = -2.0 + float(torch.log(torch.tensor(vocab - 1.0)))
    return d


def batch_pair_counts(tgt, drafter, prompt, n, B, cost, one_call_each=False):
    """n sequences (budgeted, k=2, 4 tokens, batches of B): counts of (t2, t3) (V*V,) and the widths
    of the forwards. one_call_each: a generate_batch call per sequence, so no draft plan
    (decode/batched/spec.py's draft cap and skipped rounds) carries over from one sequence to the
    next."""
    Vs = tgt.vocab_size
    kw = dict(max_new_tokens=4, batch_size=B, k=2, mode="budgeted", sampling=SP, cost=cost)
    outs = ([generate_batch(tgt, drafter, [prompt], seed=i, **kw) for i in range(n)]
            if one_call_each else [generate_batch(tgt, drafter, [prompt] * n, **kw)])
    c = torch.zeros(Vs * Vs)
    for r in (r for out in outs for r in out.results):
        c[r.tokens[1] * Vs + r.tokens[2]] += 1
    return c, [w for out in outs for w in out.widths]


def always_draft(monkeypatch, depth=2):
    """Step 1 of the budget (the planner, which reads only past rounds) always asks `depth`, so a
    test isolates step 2 (the verify width cut from the drafts' confidences)."""
    monkeypatch.setattr(decode.batched.planner.RoundPlanner, "depth", lambda self, B: depth)


@pytest.mark.parametrize("B", [1, 4])
def test_budgeted_sampling_has_the_target_distribution(B, monkeypatch):
    """Budgeted widths vary with the drafts (FixedQ's q(0) = 0.93: the second depth pays only
    after a first draft 0, in every row when B = 4); the joint of tokens 2 and 3 still matches the
    target's exactly, and the same test catches the wrong acceptance rule."""
    tgt = make_target(vocab=8, seed=3, init=0.2)
    prompt = [1, 2, 3, 4]
    joint = pair_joint(tgt, prompt, SP)
    always_draft(monkeypatch)
    cost = (by_tokens([1, 2, 3], [1.0, 1.3, 1.6]) if B == 1
            else by_tokens([4, 8, 12], [1.0, 1.3, 1.75]))
    c, widths = batch_pair_counts(tgt, FixedQ(8), prompt, 2000, B, cost)
    assert {2, 3} <= set(widths)  # the budget cut depth 2, and not always
    stat, crit = chi2_stat(c, joint)
    assert stat < crit, (stat, crit)
    monkeypatch.setattr(decode.batched.spec, "accept_chain", wrong_rule("resample_from_p"))
    stat, crit = chi2_stat(batch_pair_counts(tgt, FixedQ(8), prompt, 1500, B, cost)[0], joint)
    assert stat > 2 * crit, (stat, crit)  # the wrong rule is far off, not borderline


def test_planned_depths_keep_the_target_distribution(monkeypatch):
    """Step 1 (the planner) with sampling: each round's depth (0, 1 or 2) follows the acceptance
    of earlier rounds, whose drafts were random; as it never reads this round's drafts nor the
    target's outputs, the joint of tokens 2 and 3 still matches the target's (and the same test
    catches the wrong acceptance rule)."""
    tgt = make_target(vocab=8, seed=3, init=0.2)
    prompt = [1, 2, 3, 4]
    joint = pair_joint(tgt, prompt, SP)
    cost = CostCurve([1, 4, 8], [1, 2, 3], [[1.0, 1.02, 1.04], [1.0, 1.4, 1.7], [2.0, 2.8, 3.4]])

    def counts():
        out = generate_batch(tgt, FixedQ(8), [prompt] * 1500, max_new_tokens=4, batch_size=4,
                             k=2, mode="budgeted", sampling=SP, cost=cost)
        c = torch.zeros(8 * 8)
        for r in out.results:
            c[r.tokens[1] * 8 + r.tokens[2]] += 1
        return c, set(out.depths)

    c, depths = counts()
    assert {0, 1, 2} <= depths  # the planner changed its mind along the way
    stat, crit = chi2_stat(c, joint)
    assert stat < crit, (stat, crit)
    monkeypatch.setattr(decode.batched.spec, "accept_chain", wrong_rule("always_accept"))
    stat, crit = chi2_stat(counts()[0], joint)
    assert stat > 2 * crit, (stat, crit)


def test_a_budget_that_reads_a_drafts_own_probability_is_lossy(monkeypatch):
    """The control of the budget's lossless design: ranking draft i by q_i(d_i) (its own value)
    instead of max q_i verifies d_1 only when it is token 0, which skews the output."""
    tgt = make_target(vocab=8, seed=3, init=0.2)
    prompt = [1, 2, 3, 4]
    joint = pair_joint(tgt, prompt, SP)
    always_draft(monkeypatch)
    cost = by_tokens([1, 2, 3], [1.0, 1.3, 1.45])  # depth 1 pays at score 0.5, not at 0.07
    c, widths = batch_pair_counts(tgt, even_q(8), prompt, 1500, 1, cost, one_call_each=True)
    assert chi2_stat(c, joint)[0] < chi2_stat(c, joint)[1]  # the right score: lossless
    monkeypatch.setattr(decode.batched.spec, "survival", lookahead_survival)
    stat, crit = chi2_stat(batch_pair_counts(tgt, even_q(8), prompt, 1500, 1, cost,
                                             one_call_each=True)[0], joint)
    assert stat > 3 * crit, (stat, crit)


# -- the budget ------------------------------------------------------------------------------------
def test_cost_grid_looks_up_interpolates_and_is_monotone():
    c = CostCurve([1, 2, 4], [1, 3], [[1.0, 2.0], [1.5, 1.2], [2.0, 4.0]])
    assert c(1, 1) == 1.0 and c(4, 3) == 4.0  # measured points
    # (2, 3) timed 1.2 < (2, 1)'s 1.5 and (1, 3)'s 2.0: noise, pooled to the means (isotonic
    # along Q: 1.35, 1.35; then along B at Q=3: 2.0 and 1.35 -> 1.675), not the minimum
    assert c(2, 1) == pytest.approx(1.35) and c(2, 3) == pytest.approx(1.675)
    assert c(1, 3) == pytest.approx(1.675)
    assert c(3, 1) == pytest.approx(1.675) and c(1, 2) == pytest.approx(1.3375)  # linear on an edge
    assert c(3, 2) == pytest.approx((1.5125 + 3.0) / 2)  # bilinear inside
    assert c(8, 1) == pytest.approx(3.3) and c(1, 5) == pytest.approx(2.35)  # extrapolated
    assert c(0.5, 1) == 1.0  # never below the cheapest measured forward
    rule = CostCurve.per_token(0.1, free=8)
    assert rule(1, 8) == pytest.approx(0.1) and rule(4, 4) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="ascending"):
        CostCurve([4, 2], [1, 2], [[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="one time per"):
        CostCurve([1, 2], [1, 2], [[1.0, 1.0]])


def test_cost_grid_fit_is_not_the_luckiest_timing():
    """One wide forward that timed fast (load dropped for a moment) must not make every narrower
    forward as cheap: the suffix minimum did (planning 3 drafts deep where 1 paid)."""
    assert isotonic([1.0, 1.0, 1.3, 0.9, 1.5]) == pytest.approx([1.0, 1.0, 1.1, 1.1, 1.5])
    assert isotonic([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    c = CostCurve([1, 2], [1, 2, 3, 4], [[0.050, 0.055, 0.062, 0.040], [0.1, 0.1, 0.1, 0.1]])
    assert c(1, 2) > c(1, 1) and c(1, 2) == pytest.approx((0.055 + 0.062 + 0.040) / 3)
    assert [c(2, q) for q in (1, 2, 3, 4)] == pytest.approx([0.1] * 4)


def test_planner_prices_forwards_by_what_it_measured():
    """The grid scaled by the planner's own forwards: a measured shape by its own measured /
    grid ratio, an unmeasured one by the median ratio; a grid that underprices deep drafts is
    corrected once they are measured, and exploration measures the depths it would not choose."""
    flat = CostCurve([1, 2], [1, 2, 3, 4], [[0.05] * 4, [0.05] * 4])  # drafting looks free
    assert not RoundPlanner(flat, k=3).learn_costs  # a grid given by hand is taken as it is
    p = RoundPlanner(flat, k=3, explore_every=4, learn_costs=True)
    for _ in range(10):
        p.observe([3], [3])  # every draft accepted
    assert p.verify(1, 4) == pytest.approx(0.05) and p.depth(1) == 3
    p.observe_verify(1, 4, 0.10)  # a 4-token forward really costs two steps
    assert p.verify(1, 4) == pytest.approx(0.10) and p.verify(1, 2) == pytest.approx(0.10)
    p.observe_verify(1, 2, 0.05)  # ... and a 2-token one one step: median ratio 1.5 elsewhere
    assert p.verify(1, 2) == pytest.approx(0.05) and p.verify(1, 3) == pytest.approx(0.075)
    p.observe_verify(1, 4, 0.10)
    assert p.verify_ratio[(1, 4)] == pytest.approx(2.0) and p.verify_n[(1, 4)] == 2
    for _ in range(10):  # the first draft is always right, the second never
        p.observe([3], [1])
    S = p.survival()
    assert p.rate(1, 1, S) > p.rate(1, 3, S)
    # every 4th drafting round measures the least-measured depth (here depth 2: Q = 3, unseen)
    picks = [p.depth(1) for _ in range(8)]
    assert picks.count(2) == 2 and picks.count(1) == 6, picks


def test_choose_widths():
    """Step 2 of the budget: the verify width from the drafts' scores against cost(B, w + 1)."""
    s = [torch.tensor([0.9, 0.8, 0.1]), torch.tensor([0.95, 0.5]), torch.tensor([])]
    assert choose_widths(s, FLAT, greedy=True) == [3, 2, 0]  # free: verify all
    assert choose_widths(s, STEEP, greedy=True) == [0, 0, 0]  # a step per token: plain
    bumpy = by_tokens([3, 6, 9, 12], [1.0, 1.7, 1.7, 3.0])  # depth 1 alone does not pay, 2 does
    assert choose_widths(s, bumpy, greedy=True) == [2, 2, 0]
    assert choose_widths(s, bumpy, greedy=False) == [0, 0, 0]  # sampling never looks ahead


def test_planner_drafts_only_where_it_pays():
    """Step 1 of the budget, before drafting: the depth maximising expected tokens / (verify +
    drafting + other seconds), from past rounds only; plain (no drafter call) where drafting
    cannot pay, plain with sparse probes where the estimates say it does not pay now."""
    cost = CostCurve.per_token(0.010, free=8)  # a (B, Q) forward: one 10 ms step up to 8 tokens
    p = RoundPlanner(cost, k=3)
    # 1. nothing known yet: optimistic where drafting can pay, plain where it cannot at all
    assert p.depth(1) == 3 and p.depth(16) == 0  # B = 16: every draft doubles the forward
    # 2. rows accept their 1st draft and reject the 2nd; depth 3 never reached keeps its prior
    for _ in range(10):
        p.observe([3, 3], [1, 1])
    S = p.survival()
    assert S[0] == pytest.approx(1.0) and S[1] < 0.1 and S[2] == pytest.approx(S[1])
    # 3. drafting measured at 2 ms per row and draft: one draft pays, deeper ones do not
    p.observe_times(depth=1, rows_drafted=2, draft_s=0.004, rows=2, other_s=0.0)
    assert p.draft_seconds(1, 2) == pytest.approx(0.004)
    assert p.draft_seconds(2, 2) == pytest.approx(0.008)
    assert p.draft_seconds(1, 1) == pytest.approx(0.002)  # unseen: scaled from the nearest
    assert p.depth(1) == 1 and p.depth(2) == 1
    # rows drafting together: 4 rows measured at 1.5x one row's time, not 4x
    p.observe_times(depth=1, rows_drafted=4, draft_s=0.003, rows=4, other_s=0.0)
    assert p.draft_seconds(1, 4) == pytest.approx(0.003)
    assert p.draft_seconds(1, 2) == pytest.approx(0.004)
    # 4. drafts now rejected: plain; a probe only once the evidence has faded (idle_decay per
    #    plain round) far enough that one more accepted draft would make depth 1 pay
    for _ in range(100):  # 200 rows: the counts fade per row (0.987 each)
        p.observe([1, 1], [0, 0])
    assert p._best(1, p.survival()) == 0 and p._best(1, p.survival(1.0)) == 0
    probes = []
    for _ in range(4000):
        probes.append(p.depth(1))
        if probes[-1]:
            p.observe([probes[-1]], [0])  # the probe's draft is rejected too
    at = [i for i, d in enumerate(probes) if d]
    assert len(at) == p.probes  # every drafting round here is a probe
    assert at[0] > 100 and 5 <= len(at) <= 100  # sparse: a few percent of the rounds
    # 5. accepted again: drafting every round, deeper than 1
    for _ in range(60):
        p.observe([1, 1], [1, 1])
    assert p.depth(1) > 1
    # 6. drafting so slow (0.5 s per row) that even accepted drafts cannot pay: plain, no probe
    p.observe_times(depth=1, rows_drafted=1, draft_s=0.5, rows=1, other_s=0.0)
    n = p.probes
    assert [p.depth(1) for _ in range(2000)] == [0] * 2000 and p.probes == n


def test_a_kept_planner_skips_the_blind_first_rounds(target):
    """A planner kept across generate_batch calls starts each call from what the earlier ones
    measured: where drafting does not pay (full rows: acceptance estimated low), the kept
    planner's rounds are plain from the first one, while a fresh planner drafts blind in its
    first round. (Once the batch thins out to <= 4 rows, drafts are free and both draft.)"""
    cost = by_tokens([1, 8, 16], [1.0, 1.0, 1.9])  # up to 8 tokens per forward are free
    prompts = PROMPTS * 2  # 10 sequences, 8 at a time: (8, 2) = 16 tokens nearly doubles the step
    kw = dict(max_new_tokens=10, batch_size=8, k=1, mode="budgeted")
    slow = counting(NoisyOracle, target, noise=0.9, seed=0)  # drafts mostly rejected
    fresh = generate_batch(target, slow, prompts, cost=cost, **kw)
    assert fresh.batch_sizes[0] == 8 and fresh.depths[0] == 1  # blind: the first round drafts
    planner = RoundPlanner(cost, k=1)
    generate_batch(target, slow, prompts, planner=planner, **kw)  # learns: drafts do not pay
    assert planner.draft_s and planner.survival()[0] < 0.5
    slow.asked.clear()
    kept = generate_batch(target, slow, prompts, planner=planner, **kw)
    full = [d for b, d in zip(kept.batch_sizes, kept.depths) if b >= 6]
    assert kept.batch_sizes[0] == 8 and len(full) >= 3 and set(full) == {0}
    assert len(slow.asked) < sum(len(r.drafted) for r in kept.results)  # fewer calls than rows
    assert [r.tokens.tolist() for r in kept.results] == [r.tokens.tolist() for r in fresh.results]
    with pytest.raises(ValueError, match="made for chains of k=1, this call drafts chains of k=2"):
        generate_batch(target, slow, prompts, planner=planner, **{**kw, "k": 2})
    with pytest.raises(ValueError, match="made for chains of k=1, this call drafts trees"):
        generate_batch(target, slow, prompts, planner=planner, tree=True, **kw)


def test_a_measured_grid_is_corrected_by_the_rounds_forwards(target):
    """With a measured grid (its key set), every round's (B, Q) forward is timed into the
    planner; the outputs stay the lone decoder's."""
    grid = by_tokens([1, 8, 16], [1.0, 1.0, 1.9])
    measured = CostCurve(grid.bs, grid.qs, grid.seconds, key="measured-here")
    planner = RoundPlanner(measured, k=2)
    out = generate_batch(target, NoisyOracle(target, noise=0.3, seed=0), PROMPTS,
                         max_new_tokens=10, batch_size=2, k=2, mode="budgeted", planner=planner)
    shapes = [(b, q) for b, q in zip(out.batch_sizes, out.widths)]
    assert planner.learn_costs and planner.verify_n == {s: shapes.count(s) for s in set(shapes)}
    assert all(0 < r < 1 for r in planner.verify_ratio.values())  # a tiny model: << 1 s a step
    assert [r.tokens.tolist() for r in out.results] == [
        alone(target, None, p, 10).tokens.tolist() for p in PROMPTS]


def test_survival_scores():
    q = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    prop = ChainProposal(tokens=torch.tensor([1, 1, 0]), probs=q)
    # prod_{j<i} q_j(d_j) * max q_i: 0.5, 0.3 * 0.6, 0.3 * 0.6 * 0.6
    torch.testing.assert_close(survival(prop, 3), torch.tensor([0.5, 0.18, 0.108]))
    greedy = ChainProposal(tokens=torch.tensor([0, 1]), confidence=torch.tensor([0.5, 0.6]))
    torch.testing.assert_close(survival(greedy, 2), torch.tensor([0.5, 0.3]))
    assert survival(ChainProposal(tokens=torch.tensor([4, 5])), 2).tolist() == [1.0, 1.0]


def test_draft_chain_reports_confidences(target8):
    d = perturbed_drafter(target8, "eagle3")
    tokens = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(0))
    feats = target8.forward(tokens[None, :-1], layers=d.feature_layers, logits=False).features[0]
    from specdistill.drafters.base import DecodeState
    prop = d.propose(DecodeState(tokens, feats), 3, SamplingParams())
    assert prop.confidence is not None and prop.confidence.shape == (3,)
    assert bool(((prop.confidence > 0) & (prop.confidence <= 1)).all())


def test_cost_curve_is_measured_once_per_target_and_cached(tmp_path, monkeypatch, target):
    calls = []

    def fake_measure(tgt, bs, qs, *a, **kw):
        calls.append(tgt)
        return [[0.01 * (1 + b * q / 64) for q in qs] for b in bs]

    monkeypatch.setattr(decode.batched.cost, "measure_cost", fake_measure)
    a = cost_curve(target, tmp_path)
    b = cost_curve(target, tmp_path)
    other = cost_curve(make_target(seed=1), tmp_path)
    assert len(calls) == 2 and a.key == b.key != other.key
    assert len(list((tmp_path / "cost_curves").glob("*.json"))) == 2
    assert a(1, 1) == pytest.approx(0.01 * (1 + 1 / 64)) and a(4, 3) == pytest.approx(0.01 * 1.1875)
    # a grid cached for other sizes (or in an older layout) is measured again
    c = cost_curve(target, tmp_path, bs=(1, 2), qs=(1, 2))
    assert len(calls) == 3 and (c.bs, c.qs) == ([1, 2], [1, 2])
    # another attention implementation costs differently: its own grid
    own = target.model.config._attn_implementation
    target.model.set_attn_implementation("eager")
    try:
        assert cost_curve(target, tmp_path).key != a.key and len(calls) == 4
    finally:
        target.model.set_attn_implementation(own)


def test_guards(target):
    with pytest.raises(ValueError, match="batch mode 'fast' is unknown"):
        generate_batch(target, None, PROMPTS, max_new_tokens=4, mode="fast")
    with pytest.raises(ValueError, match="does not propose trees"):
        generate_batch(target, FixedQ(V), PROMPTS, max_new_tokens=4, tree=True)
    with pytest.raises(ValueError, match="one per prompt"):
        generate_batch(target, None, PROMPTS, max_new_tokens=[4, 5])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate_batch(target, None, [[1], []], max_new_tokens=4)


# -- python -m decode batch_size=B ------------------------------------------------------------------
@pytest.mark.parametrize("tree,B,mode", [(False, 3, "verify_all"), (True, 3, "verify_all"),
                                         (False, 1, "budgeted")])
def test_decode_cli_batch(tmp_path, tiny_target_cfg, tree, B, mode):
    """`python -m decode batch_size=3 batch_mode=verify_all [tree=true]` on the tiny target: the
    result records the batch size, mode and tree, and every output equals plain decoding of that
    prompt alone (budgeted differs only in the widths: tested above with a given cost curve);
    `batch_size=1 batch_mode=budgeted` goes through the planner too (it picks the depth)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from specdistill.target.model import load_target

    root = Path(__file__).resolve().parents[1]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"Say {w} {w} {w}."})
                                 for i, w in enumerate(["one", "two", "three", "four"])) + "\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "decode", "target=tiny", "drafter=ngram",
                          "eval=jsonl", f"eval.path={prompts}", "max_new_tokens=10", "k=3",
                          f"batch_size={B}", f"batch_mode={mode}", f"tree={str(tree).lower()}",
                          f"run_dir={run_dir}"],
                         capture_output=True, text=True, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((run_dir / "result.json").read_text())
    s = res["summary"]
    assert (s["batch_size"], s["batch_mode"], s["tree"], s["lossless_check"]) == (
        B, mode, tree, "passed")
    target = load_target(tiny_target_cfg)
    ids_of = jsonl_prompt_ids(target, prompts)
    for row in res["prompts"]:
        plain = generate(target, None, ids_of[row["id"]], max_new_tokens=10)
        assert plain.tokens.tolist() == row["generated_ids"]


def test_measure_cost_times_every_size(target):
    from specdistill.decode.batched.cost import measure_cost

    secs = measure_cost(target, bs=(1, 3), qs=(1, 2, 4), context=8, rounds=1)
    assert len(secs) == 2 and all(len(row) == 3 and all(0 < x < 10 for x in row) for row in secs)


# -- the batched benchmark --------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [False, True])
def test_batch_bench_table_and_plot(target, tmp_path, tree):
    """Every (B, mode) cell is measured, interleaved; greedy outputs equal plain's at each B; the
    table and the PNG are written; with tree=True the speculative modes verify trees."""
    from benchmarks.batch_speed import batch_markdown, batch_plot, run_batch_bench
    from specdistill.drafters.ngram import Ngram

    prompts = [torch.tensor(p) for p in PROMPTS[:3]]
    order = []
    drafter = NoisyOracle(target, noise=0.3) if tree else Ngram(vocab_size=V)
    rows = run_batch_bench(target, drafter, prompts, batch_sizes=(1, 2, 4),
                           k=3, max_new_tokens=12, repeats=2, cost=FLAT, log=order.append,
                           tree=tree)
    assert len(rows) == 9 and all(r["differ_from_plain"] == 0 for r in rows)
    assert [o.split(":")[0] for o in order[:4]] == ["repeat 1/2 B=1 plain", "repeat 1/2 B=1 "
                                                    "verify_all", "repeat 1/2 B=1 budgeted",
                                                    "repeat 1/2 B=2 plain"]
    assert all(r["tokens_per_s"] > 0 and len(r["runs_tokens_per_s"]) == 2 for r in rows)
    assert {r["mean_width"] for r in rows if r["mode"] == "plain"} == {1.0}
    widest = max(r["mean_width"] for r in rows if r["mode"] == "verify_all")
    assert (widest > 4.0) == tree  # chains: at most k + 1 = 4 tokens per row; trees: ~20
    table = "\n".join(batch_markdown(rows))
    assert table.count("| plain |") == 3 and "| 4 | budgeted |" in table
    png = batch_plot(rows, tmp_path / "batch.png", "tiny")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_bench_one_by_one_is_the_drafting_a_b(target8):
    """one_by_one=True adds each speculative mode with its rows drafting one after another,
    interleaved with the together default; both decode what plain decoding does."""
    from benchmarks.batch_speed import batch_markdown, run_batch_bench

    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 9, 7)]
    order = []
    drafter = perturbed_drafter(target8, "eagle", draft_vocab_size=64)
    rows = run_batch_bench(target8, drafter, prompts,
                           batch_sizes=(3,), modes=("plain", "verify_all"), k=2,
                           max_new_tokens=8, repeats=1, cost=FLAT, log=order.append,
                           one_by_one=True)
    assert [o.split(":")[0] for o in order] == ["repeat 1/1 B=3 plain", "repeat 1/1 B=3 verify_all",
                                                "repeat 1/1 B=3 verify_all 1by1"]
    assert all(r["differ_from_plain"] == 0 for r in rows)
    spec = {r["mode"]: r for r in rows if r["mode"] != "plain"}
    assert spec["verify_all"]["tau"] == spec["verify_all 1by1"]["tau"]  # the same drafts
    assert all(r["draft_ms_round"] > 0 for r in spec.values())
    assert "| 3 | verify_all 1by1 |" in "\n".join(batch_markdown(rows))


def test_bench_batch_cli_writes_files(tiny_target_cfg, tmp_path):
    """`python -m benchmarks.decode_speed --batch` minus the target loading: batch.md / .json / .png."""
    import json

    import benchmarks.decode_speed as bench
    from benchmarks.batch_speed import batch_main
    from specdistill.data.prompts import load_prompts
    from specdistill.drafters.ngram import NgramConfig
    from specdistill.target.model import load_target

    tgt = load_target(tiny_target_cfg)
    args = bench.parse_args(["--batch", "--batch-sizes", "1", "2", "--batch-modes", "plain",
                             "verify_all", "--k", "2", "--max-new-tokens", "6",
                             "--batch-repeats", "1", "--target", "tiny", "--out", str(tmp_path)])
    batch_main(tgt, build_drafter(NgramConfig(), tgt), load_prompts("mtbench", limit=2), args,
               ["head", ""])
    rows = json.loads((tmp_path / "batch.json").read_text())["rows"]
    assert {(r["batch_size"], r["mode"]) for r in rows} == {(1, "plain"), (1, "verify_all"),
                                                            (2, "plain"), (2, "verify_all")}
    assert "| 2 | verify_all |" in (tmp_path / "batch.md").read_text()
    assert (tmp_path / "batch.png").stat().st_size > 1000


# -- batched trees ----------------------------------------------------------------------------------
@pytest.mark.parametrize("B", [1, 2, 3, 5])
@pytest.mark.parametrize("mode", ["verify_all", "budgeted"])
def test_greedy_batched_trees_equal_alone(target, B, mode):
    """Every row verifies its own tree under its own mask in the one padded forward; the branches
    kept (non-contiguous block columns) are compacted per row: outputs equal plain decoding alone,
    with drafts accepted, ragged budgets and late admissions."""
    budgets = [25, 9, 31, 1, 17]
    refs = [alone(target, None, p, n).tokens.tolist() for p, n in zip(PROMPTS, budgets)]
    d = counting(NoisyOracle, target, noise=0.3, seed=B)
    out = generate_batch(target, d, PROMPTS, max_new_tokens=budgets, batch_size=B, k=4,
                         mode=mode, tree=True, cost=FLAT if mode == "budgeted" else None)
    assert [r.tokens.tolist() for r in out.results] == refs
    assert sum(sum(r.accepted) for r in out.results) > 0 and max(out.widths) > 5  # trees ran
    assert d.asked == []  # never a chain proposal
    # nothing pays (every verified token costs a step): plain rounds, no drafter call
    out = generate_batch(target, d, PROMPTS, max_new_tokens=budgets, batch_size=B, k=4,
                         mode="budgeted", tree=True, cost=STEEP)
    assert set(out.depths) == {0} and set(out.widths) == {1} and out.time_draft == 0.0
    assert [r.tokens.tolist() for r in out.results] == refs


def test_batched_eagle_trees_equal_the_lone_tree_decoder(target8):
    """A real drafter (EAGLE-3, its own KV cache per row) drafting dynamic trees in a batch of
    3: each output and each round's accepted count equal the lone tree decoder's."""
    d = perturbed_drafter(target8, "eagle3", tree_top_k=3, tree_depth=3, tree_total_tokens=8)
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 9, 7, 12)]
    refs = [generate(target8, d, p, max_new_tokens=14, tree=True) for p in prompts]
    out = generate_batch(target8, d, prompts, max_new_tokens=14, batch_size=3, tree=True)
    assert [r.tokens.tolist() for r in out.results] == [r.tokens.tolist() for r in refs]
    assert [r.accepted for r in out.results] == [r.accepted for r in refs]
    assert [r.tokens.tolist() for r in out.results] == [
        generate(target8, None, p, max_new_tokens=14).tokens.tolist() for p in prompts]


def first_sibling_always(p, tokens, q):
    """Wrong: the first sibling is always accepted (trusting the drafter's sample)."""
    pick = p.new_zeros(len(tokens) + 1)
    pick[0 if len(tokens) else -1] = 1.0
    return pick, p


@pytest.mark.parametrize("B", [1, 4])
def test_batched_sampled_trees_have_the_target_distribution(B, monkeypatch):
    """Sampled trees (siblings drawn without replacement from a q far from p) verified in a
    batch: the joint of tokens 2 and 3 matches the target's; trusting the first sibling fails."""
    from decode_toys import SampledToyTree

    import specdistill.decode.tree  # noqa: F401  (loads the submodule for decode.<name>)
    from specdistill import decode

    tgt = make_target(vocab=8, seed=3, init=0.2)
    prompt = [1, 2, 3, 4]
    joint = pair_joint(tgt, prompt, SP)

    def counts():
        out = generate_batch(tgt, SampledToyTree(8, "without", width=3), [prompt] * 2000,
                             max_new_tokens=4, batch_size=B, mode="verify_all", sampling=SP,
                             tree=True)
        c = torch.zeros(64)
        for r in out.results:
            c[r.tokens[1] * 8 + r.tokens[2]] += 1
        first = torch.bincount(torch.tensor([r.accepted[0] for r in out.results]), minlength=3)
        return c, first

    c, first = counts()
    assert bool((first > 100).all()), first  # 0, 1 and 2 drafts accepted, often
    stat, crit = chi2_stat(c, joint)
    assert stat < crit, (stat, crit)
    monkeypatch.setattr(decode.tree, "multi_draft", first_sibling_always)
    stat, crit = chi2_stat(counts()[0], joint)
    assert stat > 2 * crit, (stat, crit)


@torch.inference_mode()
def test_tree_inputs_and_compact_of_a_tree_branch(target):
    """A two-row round, one chain and one tree: the tree row's mask is its ancestors and its
    positions its depths; compacting its kept branch (block columns 0, 2, 3) leaves exactly the
    KV a fresh forward over the committed tokens gives."""
    from specdistill.decode.batched import kv_cache
    from specdistill.decode.tree import ancestors
    chain = torch.tensor([5, 6, 7])
    tree = torch.tensor([9, 10, 11, 12])  # root 9; nodes 10, 11 (children of the root), 12 (of 11)
    anc = ancestors(torch.tensor([-1, -1, 1]))
    ids, mask, pos = kv_cache.inputs([chain, tree], [4, 2], 4, trees=[None, anc])
    m = mask[1, 0, :, 4:]  # (4, 4) the tree row's block
    assert m.tolist() == [[True, False, False, False], [True, True, False, False],
                          [True, False, True, False], [True, False, True, True]]
    assert mask[1, 0, :, :4].tolist() == [[True, True, False, False]] * 4  # its 2 cached columns
    assert pos.tolist() == [[4, 5, 6, 7], [2, 3, 3, 4]]
    # the real thing: a round over two cached rows, then compact
    cache = DynamicCache()
    target.forward(torch.tensor([[1, 2, 3, 4], [8, 0, 0, 0]]), cache=cache,
                   attention_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]).bool())
    # row 0 caches 1..4; row 1 caches 8, then 3 garbage columns
    ids, mask, pos = kv_cache.inputs([torch.tensor([5, 6, 7]), torch.tensor([9, 10, 11, 12])],
                                     [4, 1], 4, trees=[None, anc])
    target.forward(ids, cache=cache, attention_mask=mask, position_ids=pos)
    kv_cache.compact(cache, [4, 1], [2, torch.tensor([0, 2, 3])], 4)  # 5 6 | 9 11 12
    for r, toks in enumerate([[1, 2, 3, 4, 5, 6], [8, 9, 11, 12]]):
        fresh = DynamicCache()
        target.forward(torch.tensor([toks]), cache=fresh)
        n = len(toks)
        for a, b in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(a.keys[r:r + 1, :, :n], b.keys)
            torch.testing.assert_close(a.values[r:r + 1, :, :n], b.values)
