"""The n-gram (prompt-lookup) drafter: exact proposals on hand-made sequences, the incremental
index equals a brute-force search after every append, trees merge continuations by prefix."""
import time
from types import SimpleNamespace

import pytest
import torch

from specdistill.drafters.base import CONFIGS, DRAFTERS, DecodeState, build_drafter
from specdistill.drafters.ngram import Ngram, NgramConfig
from specdistill.drafters.parts.sampling import SamplingParams

GREEDY = SamplingParams()


def propose(drafter, toks, k):
    return drafter.propose(DecodeState(torch.tensor(toks)), k, GREEDY).tokens.tolist()


def brute_force(toks, k, max_n=3, min_n=1):
    """Longest suffix first, most recent earlier occurrence, periodic past the end."""
    T = len(toks)
    for n in range(min(max_n, T - 1), min_n - 1, -1):
        for e in range(T - 2, n - 2, -1):
            if toks[e - n + 1:e + 1] == toks[T - n:]:
                return [toks[e + 1 + j % (T - 1 - e)] for j in range(k)]
    return []


def test_registered_and_built_from_any_config_form():
    assert DRAFTERS["ngram"] is Ngram and CONFIGS["ngram"] is NgramConfig
    target = SimpleNamespace(vocab_size=77)
    d = build_drafter({"name": "ngram", "max_ngram": 4}, target)
    assert isinstance(d, Ngram) and d.cfg.max_ngram == 4 and d.vocab_size == 77
    with pytest.raises(Exception, match="max_ngrams"):
        build_drafter({"name": "ngram", "max_ngrams": 4}, target)  # a typo fails loudly


def test_hand_made_proposals():
    d = Ngram(vocab_size=100)
    assert propose(d, [1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    d.reset()
    # the 2-gram (2, 3) wins over the more recent 1-gram (3) -> 8
    assert propose(d, [5, 2, 3, 9, 7, 3, 8, 2, 3], 3) == [9, 7, 3]
    d.reset()
    # the most recent of two occurrences of (0, 1): the one followed by 6
    assert propose(d, [0, 1, 5, 0, 1, 6, 0, 1], 2) == [6, 0]
    d.reset()
    # a loop: the continuation wraps around the period (1, 2, 3)
    assert propose(d, [7, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]
    d.reset()
    assert propose(d, [1, 2, 3, 4], 3) == []  # nothing repeats: no proposal
    assert propose(Ngram(NgramConfig(min_ngram=2), 100), [4, 1, 2, 3, 1], 3) == []


def test_incremental_index_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    for cfg in [NgramConfig(), NgramConfig(max_ngram=4, min_ngram=2)]:
        d = Ngram(cfg, vocab_size=5)
        toks = torch.randint(5, (3,), generator=g).tolist()
        for _ in range(150):  # append 1-3 tokens per round, as the decoder does
            toks += torch.randint(5, (int(torch.randint(1, 4, (), generator=g)),),
                                  generator=g).tolist()
            assert propose(d, toks, 4) == brute_force(toks, 4, cfg.max_ngram, cfg.min_ngram)
        # a new prompt without reset(): the index notices and rebuilds
        other = [4, 4, 3, 4, 4]
        assert propose(d, other, 3) == brute_force(other, 3, cfg.max_ngram, cfg.min_ngram)


def test_tree_merges_continuations_by_prefix():
    d = Ngram(NgramConfig(max_ngram=2, tree_depth=3, tree_branches=3), vocab_size=100)
    # (1, 2) ended at 1, 4 and 8; most recent first: [9,8,1], [7,1,2], [9,1,2]
    toks = [1, 2, 9, 1, 2, 7, 1, 2, 9, 8, 1, 2]
    tree = d.propose_tree(DecodeState(torch.tensor(toks)), GREEDY)
    #  9 -> 8 -> 1,   7 -> 1 -> 2,   9 -> 1 -> 2 (shares the node 9)
    assert tree.tokens.tolist() == [9, 8, 1, 7, 1, 2, 1, 2]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 3, 4, 0, 6]
    chain = propose(d, toks, 3)
    assert chain == [9, 8, 1]  # the chain is the tree's first branch


def test_config_is_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        Ngram(NgramConfig(min_ngram=3, max_ngram=2), vocab_size=10)


def test_rounds_cost_does_not_grow_with_the_context():
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(50, (20_000,), generator=g)
    d = Ngram(vocab_size=50)
    d.propose(DecodeState(toks), 5, GREEDY)  # indexes the long prompt once
    t0 = time.perf_counter()
    for _ in range(200):  # each round appends 3 tokens: only those may be indexed
        toks = torch.cat([toks, torch.randint(50, (3,), generator=g)])
        d.propose(DecodeState(toks), 5, GREEDY)
    assert time.perf_counter() - t0 < 1.0  # re-indexing 20k tokens per round takes ~7 s
