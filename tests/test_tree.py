"""Draft trees: static (Medusa) and dynamic (EAGLE-2) builders, and the verification side: masks,
positions, the accept walk and KV-cache compaction, checked by hand and against fresh forwards."""
import math

import pytest
import torch
from decode_toys import make_target
from transformers import DynamicCache

from specdistill.decode.tree import (
    accept_path,
    ancestors,
    check_tree,
    compact_cache,
    prune_depth,
    tree_inputs,
)
from specdistill.drafters.parts.tree import dynamic_tree, static_tree

#        root
#       /    \
#     0(10)  1(11)
#    /    \      \
#  2(12) 3(13)   5(15)
#   |
#  4(14)
PARENTS = torch.tensor([-1, -1, 0, 0, 2, 1])
TOKENS = torch.tensor([10, 11, 12, 13, 14, 15])


def test_static_tree_from_medusa_choices():
    tree = static_tree([[0], [0, 0], [1], [0, 1], [0, 0, 0], [0]])  # a duplicate is dropped
    assert tree.parents.tolist() == [-1, -1, 0, 0, 2]  # order [0] [1] [0,0] [0,1] [0,0,0]
    assert tree.depth.tolist() == [1, 1, 2, 2, 3] and tree.rank.tolist() == [0, 1, 0, 1, 0]
    cands = torch.tensor([[10, 11], [20, 21], [30, 31]])  # top-2 tokens at depths 1..3
    prop = tree.instantiate(cands)
    assert prop.tokens.tolist() == [10, 11, 20, 21, 30] and prop.depths().tolist() == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="no parent"):
        static_tree([[0], [1, 0]])
    with pytest.raises(ValueError, match="must be"):
        tree.instantiate(torch.tensor([[10, 11], [20, 21]]))  # too shallow


BIGRAM = torch.tensor([[0.10, 0.60, 0.20, 0.10],  # next-token probs after token 0
                       [0.70, 0.15, 0.10, 0.05],  # after token 1
                       [0.25, 0.25, 0.25, 0.25],
                       [0.25, 0.25, 0.25, 0.25]]).log()
ROOT = torch.tensor([0.50, 0.28, 0.17, 0.05]).log()


def test_dynamic_tree_by_hand():
    calls = []

    def expand(tokens, parents, frontier):
        calls.append(frontier.tolist())
        return BIGRAM[tokens[frontier]]  # (F, V)

    # pool: n0 t0 .50 | n1 t1 .28 | n2 t1<n0 .30 | n3 t2<n0 .10 | n4 t0<n1 .196 | n5 t1<n1 .042
    #       n6 t0<n2 .21 | n7 t1<n2 .045 | n8 t1<n4 .1176 | n9 t2<n4 .0392
    tree = dynamic_tree(expand, ROOT, top_k=2, depth=3, total_tokens=6)
    assert calls == [[0, 1], [2, 4]]  # level 2 expands the two best level-2 nodes
    assert tree.tokens.tolist() == [0, 1, 1, 0, 0, 1]  # n0 n1 n2 n4 n6 n8
    assert tree.parents.tolist() == [-1, -1, 0, 1, 2, 3]
    small = dynamic_tree(expand, ROOT, top_k=2, depth=2, total_tokens=4)
    assert small.tokens.tolist() == [0, 1, 1, 0] and small.parents.tolist() == [-1, -1, 0, 1]
    check_tree(tree.tokens, tree.parents)


def test_dynamic_tree_keeps_ancestors_on_ties_and_rejects_bad_logprobs():
    certain = torch.full((4, 4), -math.inf)
    certain[:, 2] = 0.0  # every node's child is token 2 with probability 1: equal scores
    tree = dynamic_tree(lambda t, p, f: certain[t[f]], ROOT, top_k=2, depth=3, total_tokens=1)
    assert tree.tokens.tolist() == [0] and tree.parents.tolist() == [-1]
    tree = dynamic_tree(lambda t, p, f: certain[t[f]], ROOT, top_k=2, depth=3, total_tokens=3)
    assert tree.tokens.tolist() == [0, 2, 2] and tree.parents.tolist() == [-1, 0, 1]
    with pytest.raises(ValueError, match="log-probabilities"):
        dynamic_tree(lambda t, p, f: torch.full((len(f), 4), 5.0), ROOT, top_k=2, depth=2,
                     total_tokens=2)


def test_ancestors_prune_and_check():
    anc = ancestors(PARENTS)
    assert anc[4].nonzero().squeeze(-1).tolist() == [0, 2, 4]
    assert anc[5].nonzero().squeeze(-1).tolist() == [1, 5]
    assert anc.sum(-1).tolist() == [1, 1, 2, 2, 3, 2]  # depths
    toks, par, a2 = prune_depth(TOKENS, PARENTS, anc, 2)
    assert toks.tolist() == [10, 11, 12, 13, 15] and par.tolist() == [-1, -1, 0, 0, 1]
    assert torch.equal(a2, ancestors(par))
    toks, par, a1 = prune_depth(TOKENS, PARENTS, anc, 1)
    assert toks.tolist() == [10, 11] and par.tolist() == [-1, -1] and torch.equal(a1, ancestors(par))
    with pytest.raises(ValueError, match="topological"):
        check_tree(TOKENS[:3], torch.tensor([-1, 2, 0]))


def test_tree_inputs_mask_and_positions():
    ids, mask, pos = tree_inputs(torch.tensor([7]), TOKENS, ancestors(PARENTS), cache_len=3)
    assert ids.tolist() == [[7, 10, 11, 12, 13, 14, 15]]
    assert pos.tolist() == [[3, 4, 4, 5, 5, 6, 5]]  # base + depth
    assert mask.shape == (1, 1, 7, 3 + 7) and bool(mask[0, 0, :, :3].all())  # the cache: all
    tree_part = mask[0, 0, :, 3:].long().tolist()
    assert tree_part == [[1, 0, 0, 0, 0, 0, 0],  # root: itself
                         [1, 1, 0, 0, 0, 0, 0],  # node 0: root, itself
                         [1, 0, 1, 0, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0, 0],  # node 2: root, 0, itself
                         [1, 1, 0, 0, 1, 0, 0],
                         [1, 1, 0, 1, 0, 1, 0],  # node 4: root, 0, 2, itself
                         [1, 0, 1, 0, 0, 0, 1]]


def test_accept_path_walks_the_matching_branch():
    anc = ancestors(PARENTS)
    # target argmax at [root, n0..n5]: root -> 10 (n0), n0 -> 12 (n2), n2 -> 14 (n4), n4 -> 99
    best = torch.tensor([10, 12, 0, 14, 0, 99, 0])
    keep, nxt = accept_path(TOKENS, PARENTS, anc, best)
    assert keep.tolist() == [0, 1, 3, 5] and nxt.tolist() == [99]
    best = torch.tensor([11, 0, 15, 0, 0, 0, 42])  # second child of the root, then its child
    keep, nxt = accept_path(TOKENS, PARENTS, anc, best)
    assert keep.tolist() == [0, 2, 6] and nxt.tolist() == [42]
    best = torch.tensor([10, 13, 0, 0, 0, 0, 0])  # n0 then its non-first child n3
    keep, nxt = accept_path(TOKENS, PARENTS, anc, best)
    assert keep.tolist() == [0, 1, 4] and nxt.tolist() == [0]
    best = torch.tensor([5, 0, 0, 0, 0, 0, 0])  # nothing matches: the root's argmax is next
    keep, nxt = accept_path(TOKENS, PARENTS, anc, best)
    assert keep.tolist() == [0] and nxt.tolist() == [5]
    # a deeper match below a non-matching node does not count: n4 (14) under rejected n2
    best = torch.tensor([10, 13, 0, 14, 0, 0, 0])
    keep, _ = accept_path(TOKENS, PARENTS, anc, best)
    assert keep.tolist() == [0, 1, 4]


def test_compact_cache_keeps_the_branch_in_place():
    cache = DynamicCache()
    pos = torch.arange(3 + 7, dtype=torch.float32)  # 3 committed + root + 6 nodes
    kv = pos[None, None, :, None].expand(1, 2, 10, 4).clone()  # (B, H, T, D): value = position
    for layer in range(2):
        cache.update(kv.clone(), -kv.clone(), layer)
    compact_cache(cache, 3, torch.tensor([0, 1, 3, 5]))
    assert cache.get_seq_length() == 7
    for layer in cache.layers:
        assert layer.keys[0, 1, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 8]
        assert layer.values[0, 0, :, 3].tolist() == [-0.0, -1, -2, -3, -4, -6, -8]
    compact_cache(cache, 4, torch.tensor([0, 1]))  # already in place: only the tail goes
    assert cache.get_seq_length() == 6
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6]


def test_tree_forward_equals_each_branch_alone():
    """Every node's logits equal a fresh forward over committed + its path: the mask and the
    positions give each branch exactly its own context."""
    target = make_target()
    committed = torch.tensor([3, 9, 27, 5, 40])
    cache = DynamicCache()
    target.forward(committed[None, :-1], cache=cache)  # the cache holds all but the last
    anc = ancestors(PARENTS)
    ids, mask, pos = tree_inputs(committed[-1:], TOKENS, anc, cache_len=4)
    logits = target.forward(ids, cache=cache, attention_mask=mask, position_ids=pos).logits[0]
    for i in range(len(TOKENS)):
        path = TOKENS[anc[i]]  # ancestors-or-self in order
        fresh = target.forward(torch.cat([committed, path])[None]).logits[0, -1]
        torch.testing.assert_close(logits[i + 1], fresh)
    torch.testing.assert_close(logits[0], target.forward(committed[None]).logits[0, -1])
