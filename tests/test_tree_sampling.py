"""Trees with sampling: the multi-draft rule (decode/accept.py `multi_draft`) is exact by
enumeration, sampled trees record true draws (drafters/parts/tree.py), and tree decoding at temperature
> 0 gives the target's own distribution (chi-square), while wrong rules fail the same checks."""
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from decode_toys import SampledToyTree, chi2_stat, make_target, pair_counts, pair_joint

import specdistill.decode.tree  # noqa: F401  (loads the submodule for decode.<name>)
from specdistill import decode
from specdistill.decode.accept import multi_draft
from specdistill.decode.tree import sample_path
from specdistill.drafters.base import DecodeState, build_drafter
from specdistill.drafters.parts.sampling import SamplingParams, warp
from specdistill.drafters.parts.tree import draw_children, dynamic_tree, sampled_tree

ROOT = Path(__file__).resolve().parents[1]
# a target with an impossible token and a drafter that disagrees with it and never drafts token 3
P = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3], dtype=torch.float64)
Q = torch.tensor([0.5, 0.1, 0.2, 0.0, 0.2], dtype=torch.float64)


def without(q: torch.Tensor, drawn) -> torch.Tensor:
    """q with the tokens already drawn removed, renormalised: the next draw's distribution."""
    q = q.clone()
    q[list(drawn)] = 0
    return q / q.sum()


def outcome(p: torch.Tensor, tokens, q) -> torch.Tensor:
    """The next token's exact distribution (V,) under the rule, given these siblings."""
    pick, residual = multi_draft(p, torch.tensor(tokens, dtype=torch.long), q)
    out = pick[-1] * residual
    for i, t in enumerate(tokens):
        out[t] += pick[i]
    return out


def enumerate_without_replacement(p, q, m, rule_q=None):
    """Sum over every ordered draw of m siblings without replacement from q of its probability
    times the rule's output; rule_q(seq) overrides the q rows handed to the rule."""
    total, mass = torch.zeros_like(p), 0.0
    for seq in itertools.permutations([v for v in range(len(q)) if q[v] > 0], m):
        conds = torch.stack([without(q, seq[:i]) for i in range(m)])  # (m, V)
        prob = math.prod(float(conds[i, t]) for i, t in enumerate(seq))
        total += prob * outcome(p, seq, conds if rule_q is None else rule_q(seq))
        mass += prob
    assert abs(mass - 1) < 1e-12
    return total


# -- the rule, exactly --------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_rule_is_exact_for_siblings_drawn_without_replacement(m):
    assert torch.allclose(enumerate_without_replacement(P, Q, m), P, atol=1e-12)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_rule_is_exact_for_iid_siblings(m):
    total = torch.zeros_like(P)
    for seq in itertools.product(range(len(Q)), repeat=m):
        prob = math.prod(float(Q[t]) for t in seq)
        if prob > 0:
            total += prob * outcome(P, seq, Q.expand(m, -1))
    assert torch.allclose(total, P, atol=1e-12)


def test_rule_is_exact_for_deterministic_candidates():
    """q None (one-hot on each candidate): any fixed list, repeats and impossible tokens included,
    and a p that is one-hot (no mass left after a rejection)."""
    for tokens in ([1], [0, 1], [3, 1, 4], [1, 1, 2], [2, 0, 3, 4, 1]):
        assert torch.allclose(outcome(P, tokens, None), P, atol=1e-12)
    one_hot = torch.tensor([0, 0, 1.0, 0, 0], dtype=torch.float64)
    assert torch.allclose(outcome(one_hot, [2, 0], None), one_hot)
    assert torch.allclose(outcome(one_hot, [0, 2], None), one_hot)


def test_wrong_rules_are_not_exact():
    """Controls the enumeration must catch: siblings drawn without replacement but verified with
    the i.i.d. rule (q not updated), and accepting the first sibling without the ratio test."""
    iid_rule = enumerate_without_replacement(P, Q, 2, rule_q=lambda seq: Q.expand(2, -1))
    assert float((iid_rule - P).abs().max()) > 0.01, iid_rule
    no_ratio = sum(float(Q[t]) * torch.nn.functional.one_hot(torch.tensor(t), 5).double()
                   for t in range(5))  # the first child always wins: the output is q
    assert float((no_ratio - P).abs().max()) > 0.1


# -- sampled trees record true draws ------------------------------------------------------------
def test_draw_children_samples_without_replacement_in_order():
    gen = torch.Generator().manual_seed(0)
    toks, conds = draw_children(Q, 9, gen)  # more than the 4 tokens q can give
    assert sorted(toks.tolist()) == [0, 1, 2, 4]
    for i in range(4):
        assert torch.allclose(conds[i], without(Q, toks[:i].tolist()))
    counts = torch.zeros(25)
    for _ in range(6000):
        a, b = draw_children(Q, 2, gen)[0].tolist()
        counts[a * 5 + b] += 1
    exact = torch.tensor([float(Q[a] * Q[b] / (1 - Q[a])) if a != b else 0.0
                          for a in range(5) for b in range(5)])
    stat, crit = chi2_stat(counts, exact)
    assert stat < crit, (stat, crit)


def _toy_expand(V=12, seed=0):
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 2  # (V, V)

    def expand(tokens, parents, frontier):
        return table[tokens[frontier]].log_softmax(-1)  # (F, V) depends on the node's token

    return table, expand


def test_sampled_tree_records_each_nodes_distribution():
    """Every node's probs row is its parent's warped q without its earlier siblings; the tree has
    total_tokens nodes over `depth` levels; greedy dynamic_tree is unchanged by the new options."""
    table, expand = _toy_expand()
    root = table[5].log_softmax(-1)  # (V,)
    sp = SamplingParams(temperature=0.8, top_k=7)
    tree = sampled_tree(expand, root, top_k=3, depth=4, total_tokens=11, sampling=sp,
                        generator=torch.Generator().manual_seed(1))
    tokens, parents, probs = tree.tokens, tree.parents, tree.probs
    assert len(tokens) == 11 and int(tree.depths().max()) == 4
    assert bool((parents < torch.arange(11)).all())  # topological
    seen: dict[int, list[int]] = {}
    for i in range(11):
        par = int(parents[i])
        q = warp(root if par < 0 else table[int(tokens[par])].log_softmax(-1), sp)
        sibs = seen.setdefault(par, [])
        assert torch.allclose(probs[i], without(q, sibs), atol=1e-6)
        assert float(probs[i, tokens[i]]) > 0 and len(sibs) < 3  # at most top_k children
        sibs.append(int(tokens[i]))
    greedy = dynamic_tree(expand, root, 3, 4, 11)
    same = dynamic_tree(expand, root, 3, 4, 11, SamplingParams(), torch.Generator())
    assert torch.equal(greedy.tokens, same.tokens) and torch.equal(greedy.parents, same.parents)
    assert greedy.probs is None


def test_sample_path_walks_the_tree_with_the_target_distribution():
    """A deterministic tree root -> {a, b}, a -> {c}: the first two tokens of a walk are exactly
    p0(x) p_x(y) when x is a or b (the walk descends), p0(x) and nothing more otherwise."""
    V, gen = 5, torch.Generator().manual_seed(0)
    tokens, parents = torch.tensor([1, 4, 0]), torch.tensor([-1, -1, 0])
    p = torch.softmax(torch.randn(4, V, generator=gen, dtype=torch.float64) * 1.5, -1)  # (N+1, V)
    exact = torch.zeros(V, V + 1)  # [first, second] (column V = no second token)
    for x in range(V):
        if x in (1, 4):  # node 0 (token 1) or node 1 (token 4): the next token follows its p
            exact[x, :V] = p[0, x] * p[1 if x == 1 else 2]
        else:
            exact[x, V] = p[0, x]
    counts = torch.zeros(V, V + 1)
    for _ in range(8000):
        keep, nxt = sample_path(tokens, parents, None, p, gen)
        path = tokens[keep[1:] - 1].tolist() + nxt.tolist()
        counts[path[0], path[1] if len(path) > 1 else V] += 1
    stat, crit = chi2_stat(counts.reshape(-1), exact.reshape(-1))
    assert stat < crit, (stat, crit)


# -- tree decoding at temperature > 0 has the target's distribution -----------------------------
Vs, PROMPT = 8, [1, 2, 3, 4]


@pytest.fixture(scope="module")
def tgt():
    return make_target(vocab=Vs, seed=3, init=0.2)


@pytest.mark.parametrize("mode,sp", [
    ("without", SamplingParams(temperature=1.0)),
    ("iid", SamplingParams(temperature=1.0, top_k=6)),
    ("fixed", SamplingParams(temperature=1.0)),
    ("without", SamplingParams(temperature=1.0, top_p=0.9)),
])
def test_sampled_tree_decoding_has_the_target_distribution(tgt, mode, sp):
    """Tokens 2 and 3 come from one tree round cut to depth 2; their empirical joint matches the
    exact one from the target's logits, with 0, 1 and 2 drafts each accepted often."""
    c, first_round = pair_counts(tgt, SampledToyTree(Vs, mode), PROMPT, sp, 2000, tree=True)
    assert bool((first_round > 100).all()), first_round
    stat, crit = chi2_stat(c, pair_joint(tgt, PROMPT, sp))
    assert stat < crit, (stat, crit)


def no_ratio_test(p, tokens, q):
    """Wrong: the first sibling is always accepted (trusting the drafter's sample)."""
    pick = p.new_zeros(len(tokens) + 1)
    pick[0 if len(tokens) else -1] = 1.0
    return pick, p


def iid_rule(p, tokens, q):
    """Wrong for draws without replacement: every sibling tested against the first one's q."""
    return multi_draft(p, tokens, None if q is None else q[:1].expand(len(tokens), -1))


@pytest.mark.parametrize("rule", [no_ratio_test, iid_rule])
def test_a_wrong_rule_fails_the_same_chi_square(tgt, monkeypatch, rule):
    sp = SamplingParams(temperature=1.0)
    monkeypatch.setattr(decode.tree, "multi_draft", rule)
    c, _ = pair_counts(tgt, SampledToyTree(Vs, "without", width=3), PROMPT, sp, 2000, tree=True)
    stat, crit = chi2_stat(c, pair_joint(tgt, PROMPT, sp))
    assert stat > 2 * crit, (stat, crit)  # far off, not borderline


def test_eagle_sampled_tree_decoding_has_the_target_distribution(tgt):
    """A real drafter's sampled dynamic tree (untrained EAGLE with a pruned draft vocabulary, so
    q is spread back over the target vocabulary) through the whole decoder."""
    torch.manual_seed(0)
    d = build_drafter({"name": "eagle", "draft_vocab_size": 6, "tree_top_k": 3, "tree_depth": 3,
                       "tree_total_tokens": 7}, tgt)
    sp = SamplingParams(temperature=1.0, top_k=6)
    c, first_round = pair_counts(tgt, d, PROMPT, sp, 2000, tree=True)
    assert bool((first_round > 50).all()), first_round
    stat, crit = chi2_stat(c, pair_joint(tgt, PROMPT, sp))
    assert stat < crit, (stat, crit)


@pytest.mark.parametrize("name", ["eagle", "peagle", "small_lm"])
def test_tree_sampled_false_keeps_the_top_k_tree_when_sampling(tgt, name):
    """drafter.tree_sampled=false: at temperature > 0 the dynamic tree is the greedy one (EAGLE-2's
    top-k candidates, probs None: verified as deterministic drafts); true: sampled, with probs."""
    trees = {}
    for sampled in (True, False):
        torch.manual_seed(0)
        d = build_drafter({"name": name, "draft_vocab_size": None, "tree_top_k": 3, "tree_depth": 3,
                           "tree_total_tokens": 7, "tree_sampled": sampled}, tgt)
        ids = torch.tensor(PROMPT + [5, 6])
        feats = tgt.forward(ids[None], layers=d.feature_layers).features
        state = DecodeState(ids, None if feats is None else feats[0, :-1])
        d.reset()
        greedy = d.propose_tree(state, SamplingParams())
        d.reset()
        trees[sampled] = d.propose_tree(state, SamplingParams(temperature=1.0),
                                        torch.Generator().manual_seed(0))
    assert trees[True].probs is not None and len(trees[True].tokens) == 7
    assert trees[False].probs is None
    assert torch.equal(trees[False].tokens, greedy.tokens)
    assert torch.equal(trees[False].parents, greedy.parents)


def test_decode_cli_runs_a_sampled_tree(tmp_path, tiny_run):
    """`python -m decode ckpt=<eagle run> tree=true temperature=0.7` end to end on target=tiny."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {w}."})
                                 for i, w in enumerate(["three", "five"])) + "\n")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "decode", "target=tiny", f"ckpt={tiny_run}",
                          "eval=jsonl", f"eval.path={prompts}", "max_new_tokens=16", "tree=true",
                          "temperature=0.7", f"run_dir={run_dir}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((run_dir / "result.json").read_text())
    assert res["summary"]["tree"] is True and res["summary"]["prompts"] == 2
    assert all(row["new_tokens"] == len(row["generated_ids"]) > 0 for row in res["prompts"])
