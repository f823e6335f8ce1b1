"""The speculative loop is lossless: greedy chain and tree decoding give exactly the target's own
greedy tokens (vs our plain path and transformers' generate), sampling gives exactly the target's
distribution, the KV cache and features stay equal to a fresh forward's, and the guards fire.

The toys (tests/decode_toys.py) are tiny float64 Llamas and drafters that are right only some of
the time, so every branch of the acceptance rules runs.
"""
import pytest
import torch
from decode_toys import FixedQ, NoisyOracle, StubTokenizer, V, check_sampling_lossless, make_target

import specdistill.decode.spec as spec_module
from specdistill.decode.spec import generate
from specdistill.drafters.base import Drafter
from specdistill.drafters.ngram import Ngram, NgramConfig
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.target.model import Target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target():
    return make_target()


PROMPTS = [[3, 17, 5, 9, 41], list(range(20, 32)), [(7 * i) % V for i in range(30)]]


def plain(target, prompt, n, **kw):
    return generate(target, None, prompt, max_new_tokens=n, **kw)


def hf_greedy(target, prompt, n, **kw):
    """transformers' own greedy generate, new tokens only."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=n, **kw)
    return out[0, len(prompt):].tolist()


# -- greedy losslessness ---------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_matches_transformers_generate(target, prompt):
    ours = plain(target, prompt, 40)
    assert ours.tokens.tolist() == hf_greedy(target, prompt, 40)
    assert ours.target_forwards == 40 and ours.drafted == [0] * 39  # one forward per token
    assert ours.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_spec_is_lossless(target, prompt, k, tree):
    ref = plain(target, prompt, 40).tokens
    drafter = NoisyOracle(target, noise=0.3, seed=k)
    res = generate(target, drafter, prompt, max_new_tokens=40, k=k, tree=tree)
    assert res.tokens.tolist() == ref.tolist()
    # teeth: some rounds accepted drafts and some rejected them
    assert any(n > 0 for n in res.accepted) and any(n < m for n, m in zip(res.accepted, res.drafted))
    assert res.target_forwards == 1 + len(res.accepted) < 40


def _eos_case(target):
    """A prompt whose greedy output has a first-time token at index 2..5 to serve as EOS."""
    for prompt in PROMPTS:
        out = plain(target, prompt, 12).tokens.tolist()
        for j in range(2, 6):
            if out[j] not in out[:j]:
                return prompt, out, j
    raise AssertionError("no prompt gives a usable EOS position; change the seed")


@pytest.mark.parametrize("tree", [False, True])
def test_eos_inside_an_accepted_block(target, tree):
    prompt, out, j = _eos_case(target)
    eos_target = Target(target.model, StubTokenizer(eos=out[j]), "tiny+eos")
    res = generate(eos_target, NoisyOracle(target, noise=0.0), prompt, max_new_tokens=30, k=5,
                   tree=tree)
    assert res.tokens.tolist() == out[:j + 1] and res.stop_reason == "eos"
    assert res.accepted[0] > j - 1  # the EOS was a draft of the first round, not its bonus
    assert res.tokens.tolist() == hf_greedy(target, prompt, 30, eos_token_id=out[j])


@pytest.mark.parametrize("n", [1, 2, 4, 7, 13])
@pytest.mark.parametrize("tree", [False, True])
def test_max_new_tokens_is_never_exceeded(target, n, tree):
    ref = plain(target, PROMPTS[0], n).tokens
    drafter = NoisyOracle(target, noise=0.0, over_propose=6)  # drafts more than asked for
    res = generate(target, drafter, PROMPTS[0], max_new_tokens=n, k=5, tree=tree)
    assert res.tokens.tolist() == ref.tolist() and len(res.tokens) == n
    assert res.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("tree", [False, True])
def test_stop_string_ends_at_the_completing_token(target, tree):
    out = plain(target, PROMPTS[1], 30).tokens.tolist()
    tok = target.tokenizer
    stop = tok.decode(out[3:5])[1:]  # 3 characters, starting inside token 3, completed by token 4
    first = next(i for i in range(30) if stop in tok.decode(out[:i + 1]))
    res = generate(target, NoisyOracle(target, noise=0.0), PROMPTS[1], max_new_tokens=30, k=5,
                   tree=tree, stop_strings=["never seen", stop])
    assert res.tokens.tolist() == out[:first + 1] and res.stop_reason == "stop_string"
    # the prompt's text does not count: a stop string found only in the prompt changes nothing
    in_prompt = tok.decode(PROMPTS[1][:2])
    if in_prompt not in tok.decode(out):
        again = generate(target, None, PROMPTS[1], max_new_tokens=30, stop_strings=[in_prompt])
        assert again.tokens.tolist() == out


@pytest.mark.parametrize("tree", [False, True])
def test_ngram_drafter_is_lossless(target, tree):
    prompt = [5, 6, 7, 8] * 4 + [5, 6]  # the prompt already repeats, so lookups hit
    ref = plain(target, prompt, 40).tokens
    drafter = Ngram(NgramConfig(), vocab_size=V)
    res = generate(target, drafter, prompt, max_new_tokens=40, k=4, tree=tree)
    assert res.tokens.tolist() == ref.tolist()
    assert sum(res.accepted) > 0


def test_adaptive_draft_length_reaches_the_drafter(target):
    seen = []

    class Shy(NoisyOracle):
        """Drafts half of k when asked for confidence (a stand-in for a confidence cut-off)."""

        def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
            seen.append(min_confidence)
            return super().propose(state, k // 2 if min_confidence > 0 else k, sampling)

    res = generate(target, Shy(target, noise=0.2), PROMPTS[0], max_new_tokens=30, k=4,
                   min_confidence=0.6)
    assert res.tokens.tolist() == plain(target, PROMPTS[0], 30).tokens.tolist()
    assert set(seen) == {0.6} and max(res.drafted) == 2


# -- KV cache and features ------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [False, True])
def test_cache_and_features_equal_a_fresh_forward_every_round(target, tree, monkeypatch):
    caches = []

    class RecordingCache(spec_module.DynamicCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            caches.append(self)

    monkeypatch.setattr(spec_module, "DynamicCache", RecordingCache)
    drafter = NoisyOracle(target, noise=0.5, seed=1, feature_layers=(1, -1))
    res = generate(target, drafter, PROMPTS[2], max_new_tokens=30, k=4, tree=tree)
    assert res.tokens.tolist() == plain(target, PROMPTS[2], 30).tokens.tolist()
    assert any(n < m for n, m in zip(res.accepted, res.drafted))  # rounds with rejections
    full = list(PROMPTS[2]) + res.tokens.tolist()
    ref = target.model(torch.tensor([full]), output_hidden_states=True)
    want = torch.cat([ref.hidden_states[1], ref.hidden_states[-1]], -1)[0]  # (T, 2H)
    for tokens, feats in drafter.states:  # every round: features of tokens[:-1]
        assert tokens.tolist() == full[:len(tokens)]
        torch.testing.assert_close(feats, want[:len(tokens) - 1])
    # the final cache holds exactly tokens[:-1] and equals a fresh prefill's, position by position
    cache = res.cache
    assert cache is caches[0] and cache.get_seq_length() == len(full) - 1
    fresh = spec_module.DynamicCache()
    target.forward(torch.tensor([full[:-1]]), cache=fresh)
    for got, exp in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, exp.keys)
        torch.testing.assert_close(got.values, exp.values)
    nxt = target.forward(torch.tensor([full[-1:]]), cache=cache).logits[0, -1]
    torch.testing.assert_close(nxt, ref.logits[0, -1])


def test_cache_length_is_committed_minus_one_after_each_round(target, monkeypatch):
    caches, lengths = [], []

    class RecordingCache(spec_module.DynamicCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            caches.append(self)

    class Checking(NoisyOracle):
        def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
            lengths.append((caches[-1].get_seq_length(), len(state.tokens)))
            return super().propose(state, k, sampling, generator, min_confidence)

    monkeypatch.setattr(spec_module, "DynamicCache", RecordingCache)
    res = generate(target, Checking(target, noise=0.5), PROMPTS[0], max_new_tokens=25, k=3)
    assert any(n < m for n, m in zip(res.accepted, res.drafted))
    # the drafter is asked every round but the last (whose budget leaves room for no draft)
    assert len(lengths) == len(res.accepted) - 1 and all(c == t - 1 for c, t in lengths)


# -- guards ----------------------------------------------------------------------------------------
def test_guards():
    small = make_target(max_pos=40)
    with pytest.raises(ValueError, match=r"30 tokens \+ max_new_tokens=11 = 41 .*max_length 40"):
        generate(small, None, list(range(30)), max_new_tokens=11)
    generate(small, None, list(range(30)), max_new_tokens=10)  # exactly at the limit is fine
    with pytest.raises(ValueError, match="vocabulary of 65"):
        generate(small, Ngram(vocab_size=V + 1), [1, 2], max_new_tokens=4)
    sampled_tree = generate(small, Ngram(vocab_size=V), [1, 2], max_new_tokens=4, tree=True,
                            sampling=SamplingParams(temperature=0.7))  # no longer refused
    assert len(sampled_tree.tokens) == 4

    class ChainOnly(Drafter):
        def propose(self, state, k, sampling, generator=None, min_confidence=0.0):
            raise AssertionError("k=0 must not call the drafter")

    with pytest.raises(ValueError, match="does not propose trees"):
        generate(small, ChainOnly(V), [1, 2], max_new_tokens=4, tree=True)
    res = generate(small, ChainOnly(V), [1, 2, 3], max_new_tokens=12, k=0)
    assert res.tokens.tolist() == plain(small, [1, 2, 3], 12).tokens.tolist()


# -- sampling: the output distribution is the target's ----------------------------------------------
def test_sampled_generation_has_the_target_distribution(monkeypatch):
    """Tokens 2 and 3 come from one speculative round (2 drafts from q != p); their empirical joint
    matches the exact one from the target's logits, and the same test catches a wrong rule."""
    Vs = 8
    check_sampling_lossless(make_target(vocab=Vs, seed=3, init=0.2), FixedQ(Vs), monkeypatch,
                            wrong_n=1000, min_round=100)
