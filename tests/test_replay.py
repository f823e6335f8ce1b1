"""The greedy replay gives the decoder's own rounds: same prefixes (and features) shown to the
drafter, same accepted counts, from the target's greedy answer alone; the per-draft acceptance is
sum min(p, q)."""
import pytest
import torch
from decode_toys import FixedQ, NoisyOracle, StubTokenizer, V, make_target

from specdistill.decode.replay import draft_acceptance, replay_greedy
from specdistill.decode.spec import generate
from specdistill.drafters.base import ChainProposal, Drafter
from specdistill.drafters.parts.sampling import SamplingParams, warp
from specdistill.target.model import Target

PROMPTS = [[3, 17, 5, 9, 41], list(range(20, 32))]


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k,n", [(1, 30), (3, 30), (5, 30), (5, 7), (4, 2)])
def test_replay_gives_the_decoders_rounds(target, prompt, k, n):
    prompt = torch.tensor(prompt)
    # the decoder with a drafter that is right ~70% of the time, then the replay with a fresh copy
    # of the same drafter: both must show it the same prefixes and count the same acceptances
    live = NoisyOracle(target, noise=0.3, seed=k + n, feature_layers=(1, -1))
    res = generate(target, live, prompt, max_new_tokens=n, k=k)
    again = NoisyOracle(target, noise=0.3, seed=k + n, feature_layers=(1, -1))
    rep = replay_greedy(target, again, prompt, res.tokens, k=k, max_new_tokens=n)
    assert rep.accepted == res.accepted and rep.drafted == res.drafted
    assert len(again.states) == len(live.states)
    for (tok_a, feat_a), (tok_b, feat_b) in zip(live.states, again.states):
        assert torch.equal(tok_a, tok_b)
        torch.testing.assert_close(feat_a, feat_b)  # cached rounds vs one forward
    if n > 2:  # teeth: the replay had both accepted and rejected drafts to count
        assert any(a > 0 for a in rep.accepted) and any(a < d for a, d in zip(rep.accepted,
                                                                               rep.drafted))


def test_replay_stops_at_eos(target):
    prompt = torch.tensor(PROMPTS[0])
    out = generate(target, None, prompt, max_new_tokens=12).tokens
    j = next(j for j in range(2, 10) if int(out[j]) not in out[:j].tolist())
    eos_target = Target(target.model, StubTokenizer(eos=int(out[j])), "tiny+eos")
    res = generate(eos_target, NoisyOracle(target, noise=0.0), prompt, max_new_tokens=30, k=3)
    assert res.tokens.tolist() == out[:j + 1].tolist()
    rep = replay_greedy(eos_target, NoisyOracle(target, noise=0.0), prompt, res.tokens, k=3,
                        max_new_tokens=30)
    # every round but the last is the decoder's; the last one stops at the EOS
    assert rep.accepted[:-1] == res.accepted[:-1]
    assert sum(rep.accepted) + len(rep.accepted) >= j  # all j tokens after the prefill committed


def test_replay_refuses_an_answer_longer_than_its_budget(target):
    with pytest.raises(ValueError, match="max_new_tokens"):
        replay_greedy(target, NoisyOracle(target), torch.tensor(PROMPTS[0]),
                      torch.arange(10), k=3, max_new_tokens=5)


def test_replay_of_a_small_lm_equals_the_decoder(tiny_target_cfg):
    from specdistill.drafters.small_lm import SmallLm, SmallLmConfig
    from specdistill.target.model import load_target

    tgt = load_target(tiny_target_cfg)
    drafter = SmallLm(SmallLmConfig(num_layers=1), tgt).eval()
    prompt = torch.tensor(tgt.tokenizer.encode("The history of the Roman empire"))
    res = generate(tgt, drafter, prompt, max_new_tokens=40, k=4)
    rep = replay_greedy(tgt, drafter, prompt, res.tokens, k=4, max_new_tokens=40)
    assert rep.accepted == res.accepted and sum(res.accepted) > 0


class ExactQ(Drafter):
    """Drafts from the target's own (warped) next-token distribution."""

    def __init__(self, target):
        super().__init__(target.vocab_size)
        self.target = target

    def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
        p = warp(self.target.model(state.tokens[None]).logits[0, -1:], sampling)  # (1, V)
        return ChainProposal(tokens=p.argmax(-1), probs=p)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_draft_acceptance_is_sum_of_min_p_q(target, temperature):
    sampling = SamplingParams(temperature=temperature)
    prompt = torch.tensor(PROMPTS[1])
    answer = generate(target, None, prompt, max_new_tokens=16).tokens
    exact = draft_acceptance(target, ExactQ(target), prompt, answer, sampling)
    assert len(exact) == 15 and all(abs(a - 1.0) < 1e-5 for a in exact)  # q = p: always accepted
    fixed = FixedQ(V)
    got = draft_acceptance(target, fixed, prompt, answer, sampling)
    ids = torch.cat([prompt, answer])
    p = warp(target.model(ids[None]).logits[0, len(prompt):-1], sampling)  # (15, V)
    if sampling.greedy:  # FixedQ's greedy draft is token 0: accepted iff the target's argmax is 0
        want = (p.argmax(-1) == 0).double()
    else:
        want = torch.minimum(p, warp(fixed.logits, sampling).double()).sum(-1)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.double), want)
    assert 0.0 < float(want.mean()) < 1.0 or sampling.greedy


def test_past_end_replays_an_engines_bookkeeping(target):
    """An engine drafts k every round, up to max_new_tokens' end too, and counts a draft accepted
    when the target would have produced it there: a perfect drafter then accepts k drafts in every
    round, the last included, though the decoder's last rounds draft fewer."""
    prompt = torch.tensor(PROMPTS[1])
    n, k = 10, 4
    res = generate(target, NoisyOracle(target, noise=0.0), prompt, max_new_tokens=n, k=k)
    ours = replay_greedy(target, NoisyOracle(target, noise=0.0), prompt, res.tokens, k=k,
                         max_new_tokens=n)
    engine = replay_greedy(target, NoisyOracle(target, noise=0.0), prompt, res.tokens, k=k,
                           max_new_tokens=n, past_end=True)
    assert ours.accepted == res.accepted and ours.drafted[-1] < k  # the decoder's capped tail
    assert len(engine.accepted) == len(ours.accepted)  # the same rounds (same committed text)
    assert engine.drafted == [k] * len(engine.accepted) and engine.accepted == engine.drafted


def test_past_eos_counts_the_drafts_the_target_agrees_with_after_an_eos(target):
    """Our decoder (and llama.cpp) verifies a round's drafts in one forward and counts those the
    target agrees with before cutting the output at an EOS; past_eos=True replays that count from
    the target's greedy continuation, so even the last round equals the decoder's."""
    prompt = torch.tensor(PROMPTS[0])
    out = generate(target, None, prompt, max_new_tokens=12).tokens
    j = next(j for j in range(2, 10) if int(out[j]) not in out[:j].tolist())
    eos_target = Target(target.model, StubTokenizer(eos=int(out[j])), "tiny+eos")
    res = generate(eos_target, NoisyOracle(target, noise=0.0), prompt, max_new_tokens=30, k=3)
    plain = replay_greedy(eos_target, NoisyOracle(target, noise=0.0), prompt, res.tokens, k=3,
                          max_new_tokens=30)
    rep = replay_greedy(eos_target, NoisyOracle(target, noise=0.0), prompt, res.tokens, k=3,
                        max_new_tokens=30, past_eos=True)
    assert rep.accepted == res.accepted and rep.drafted == res.drafted
    assert sum(rep.accepted) > sum(plain.accepted)  # teeth: the last round accepted past the EOS
