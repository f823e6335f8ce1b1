"""Draft-tree builders that drafters share: static (Medusa) and dynamic (EAGLE-2) trees.

Both return a `TreeProposal`: nodes in topological order (a parent before its children), parent
-1 for children of the root (the root is the last committed token). The decoder verifies every
node in one target forward (decode/tree.py).

* `static_tree(choices)` fixes the shape once: each choice is a path of top-k ranks, e.g. [0, 1] =
  "the 2nd candidate at depth 2 under the 1st candidate at depth 1"; `StaticTree.instantiate`
  fills it with the candidates of one round (Medusa: head d gives the top-k tokens at depth d).
* `dynamic_tree(...)` grows the tree from the drafter's own confidence (EAGLE-2): expand the
  top_k most likely nodes per level, then keep the `total_tokens` nodes of highest cumulative
  draft log-probability overall. Sampling: `sampled_tree` draws the children from the warped q
  instead (`dynamic_tree(..., sampling=...)` hands over to it) and keeps each node's q in `probs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdistill.drafters.base import TreeProposal
from specdistill.drafters.parts.sampling import SamplingParams, warp
from specdistill.drafters.parts.vocab import expand_probs


@dataclass
class StaticTree:
    """A fixed tree shape. Node i sits at depth[i] and takes candidate rank[i] of that depth."""

    parents: torch.Tensor  # (N,) long, -1 = child of the root
    depth: torch.Tensor  # (N,) long, 1 for children of the root
    rank: torch.Tensor  # (N,) long: which top-k candidate of its depth the node holds

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if len(self.depth) else 0

    @property
    def max_rank(self) -> int:
        """How many candidates per depth `instantiate` needs."""
        return int(self.rank.max()) + 1 if len(self.rank) else 0

    def instantiate(self, candidates: torch.Tensor) -> TreeProposal:
        """candidates (D, K) long: the top-K tokens at each depth 1..D (best first) -> the tree."""
        if candidates.dim() != 2 or candidates.shape[0] < self.max_depth \
                or candidates.shape[1] < self.max_rank:
            raise ValueError(f"candidates {tuple(candidates.shape)} must be (depth >= "
                             f"{self.max_depth}, top-k >= {self.max_rank})")
        tokens = candidates[self.depth.to(candidates.device) - 1, self.rank.to(candidates.device)]
        return TreeProposal(tokens=tokens, parents=self.parents.to(candidates.device))  # (N,)


def static_tree(choices: Sequence[Sequence[int]]) -> StaticTree:
    """Medusa-style choices (paths of ranks) -> a topologically ordered StaticTree.

    Nodes are sorted by (depth, path) so every parent comes before its children; each path's
    prefix must itself be a choice, otherwise the node would hang from nowhere.
    """
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    index = {p: i for i, p in enumerate(paths)}
    parents = []
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"tree choice {list(p)} must be a non-empty path of ranks >= 0")
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree choice {list(p)} has no parent {list(p[:-1])} in the choices")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return StaticTree(parents=torch.tensor(parents, dtype=torch.long),
                      depth=torch.tensor([len(p) for p in paths], dtype=torch.long),
                      rank=torch.tensor([p[-1] for p in paths], dtype=torch.long))


# expand_fn(tokens (M,), parents (M,), frontier (F,)) -> (F, V) next-token log-probs of the
# frontier nodes; tokens/parents describe every node made so far (same conventions as the tree).
ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dynamic_tree(
    expand_fn: ExpandFn,
    root_logprobs: torch.Tensor,  # (V,) draft log-probs of the first token after the root
    top_k: int,  # children per expanded node, and nodes expanded per level
    depth: int,  # levels to grow
    total_tokens: int,  # nodes kept in the final tree
    sampling: SamplingParams | None = None,  # None / greedy: this top-k tree; else `sampled_tree`
    generator: torch.Generator | None = None,  # the sampled tree's draws
) -> TreeProposal:
    """EAGLE-2 dynamic tree, nodes in creation order (parents first).

    1. Level 1: the top_k tokens of root_logprobs.
    2. Each further level: expand the top_k nodes of the previous level (by cumulative log-prob),
       each with its top_k children; all children join the candidate pool.
    3. Keep the total_tokens best candidates by cumulative log-prob. A child's score is its parent's
       plus a log-prob <= 0 and a parent enters the pool first, so a stable sort keeps every
       ancestor of a kept node: the result is a valid tree (checked anyway).
    """
    if top_k < 1 or depth < 1 or total_tokens < 1:
        raise ValueError(f"top_k ({top_k}), depth ({depth}) and total_tokens ({total_tokens}) "
                         f"must be >= 1")
    if sampling is not None and not sampling.greedy:
        return sampled_tree(expand_fn, root_logprobs, top_k, depth, total_tokens, sampling, generator)
    dev = root_logprobs.device
    score, tok = root_logprobs.float().topk(min(top_k, root_logprobs.shape[-1]))  # (K,), (K,)
    tokens, parents, scores = [tok], [torch.full_like(tok, -1)], [score]
    frontier = torch.arange(len(tok), device=dev)  # (F,) pool indices of the nodes to expand
    size = len(tok)
    for _ in range(depth - 1):
        all_tokens, all_parents = torch.cat(tokens), torch.cat(parents)  # (M,), (M,)
        logp = expand_fn(all_tokens, all_parents, frontier).float()  # (F, V)
        child_score = torch.cat(scores)[frontier, None] + logp  # (F, V) cumulative
        s, t = child_score.topk(min(top_k, logp.shape[-1]), dim=-1)  # (F, K), (F, K)
        tokens.append(t.reshape(-1))
        parents.append(frontier[:, None].expand_as(t).reshape(-1))
        scores.append(s.reshape(-1))
        # the next frontier: the top_k children of this level by cumulative score
        best = s.reshape(-1).topk(min(top_k, s.numel())).indices  # (K,)
        frontier = size + best
        size += s.numel()
    all_tokens, all_parents, all_scores = torch.cat(tokens), torch.cat(parents), torch.cat(scores)
    order = torch.sort(all_scores, descending=True, stable=True).indices[:total_tokens]
    keep = torch.sort(order).values  # (N,) pool indices in creation order: parents first
    new_index = torch.full((size,), -2, dtype=torch.long, device=dev)  # -2 = not kept
    new_index[keep] = torch.arange(len(keep), device=dev)
    kept_parents = all_parents[keep]  # (N,) pool indices, -1 = root
    remapped = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], kept_parents)
    if bool((remapped == -2).any()):
        raise ValueError("dynamic_tree: a kept node lost its parent; expand_fn must return "
                         "log-probabilities (<= 0)")
    return TreeProposal(tokens=all_tokens[keep], parents=remapped)


def in_target_vocab(tree: TreeProposal, d2t: torch.Tensor | None, vocab_size: int) -> TreeProposal:
    """A tree drafted over a pruned draft vocabulary (d2t (Vd,), None = the full one) -> the same
    tree in target ids, its probs (N, Vd) spread over the target vocabulary (N, V)."""
    if d2t is None:
        return tree
    probs = None if tree.probs is None else expand_probs(tree.probs, d2t, vocab_size)  # (N, V)
    return TreeProposal(tokens=d2t[tree.tokens], parents=tree.parents, probs=probs)


def draw_children(q: torch.Tensor, n: int, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """n draws without replacement from q (V,), in draw order (fewer when q has fewer non-zero
    entries): tokens (n',) and the distribution each was drawn from (n', V), i.e. q without the
    earlier draws, renormalised.

    An exponential race: token v finishes at E_v / q_v with E_v ~ Exp(1); the first finisher is a
    draw from q and, the clocks being memoryless, each next one a draw from q without the earlier
    ones, so sorting the finishing times is sampling without replacement.
    """
    n = min(n, int((q > 0).sum()))
    race = torch.empty_like(q, dtype=torch.float64).exponential_(generator=generator)  # (V,)
    finish = (race / q.double()).masked_fill(q <= 0, float("inf"))  # (V,) q = 0 never finishes
    tokens = finish.topk(n, largest=False).indices  # (n,) in finishing order
    drawn = torch.nn.functional.one_hot(tokens, q.shape[-1]).cumsum(0)  # (n, V) drawn so far
    before = drawn - torch.nn.functional.one_hot(tokens, q.shape[-1])  # (n, V) drawn earlier
    cond = q.expand(n, -1).masked_fill(before > 0, 0.0)  # (n, V)
    return tokens, cond / cond.sum(-1, keepdim=True)


def sampled_tree(
    expand_fn: ExpandFn,
    root_logprobs: torch.Tensor,  # (V,) draft log-probs of the first token after the root
    top_k: int,  # children per parent at most, and nodes expanded per level
    depth: int,  # levels to grow
    total_tokens: int,  # nodes in the tree
    sampling: SamplingParams,  # warps q as the target's p is warped
    generator: torch.Generator | None = None,
) -> TreeProposal:
    """A dynamic tree of sampled children whose multi-draft verification stays lossless.

    The rule (decode/tree.py `sample_path`) is exact only if every node is a true draw from the q
    it records: whether a node exists may depend on what was drawn before it, never on its own
    token. `dynamic_tree`'s final cut by each node's own score would keep high-q draws more often,
    so here every choice is made before the draws it concerns:
    1. Level budget: the nodes still to place spread over the levels left (ceil).
    2. Slot j of a parent f gets the key score(f) + log(f's j-th largest q), a stand-in for its
       j-th draw's score that reads f only; the level's budget goes to the best keys (at most
       top_k per parent), giving each parent a number of children.
    3. Each parent draws that many children without replacement (`draw_children`); a node's score
       is its parent's plus log q(its token), EAGLE-2's cumulative draft log-probability.
    4. The top_k nodes of the level by score are expanded (expand_fn) for the next level.
    Nodes come in creation order (parents first, siblings in draw order); probs (N, V).
    """
    if top_k < 1 or depth < 1 or total_tokens < 1:
        raise ValueError(f"top_k ({top_k}), depth ({depth}) and total_tokens ({total_tokens}) "
                         f"must be >= 1")
    dev = root_logprobs.device
    qs = warp(root_logprobs, sampling)[None]  # (F, V) the frontier's draft distributions
    front, fscore = torch.full((1,), -1, device=dev), torch.zeros(1, device=dev)  # (F,), (F,)
    tokens, parents, scores, probs = [], [], [], []  # chunks of (n,), (n,), (n,), (n, V)
    size = 0
    for level in range(depth):
        # 1. this level's budget
        cap = -(-(total_tokens - size) // (depth - level))
        # 2. children per parent from keys that read the parents only
        key = fscore[:, None] + qs.topk(min(top_k, qs.shape[-1]), dim=-1).values.log()  # (F, K)
        n_ok = int(torch.isfinite(key).sum())
        picked = key.reshape(-1).topk(min(cap, n_ok)).indices  # (n,)
        counts = torch.bincount(picked // key.shape[1], minlength=len(front)).tolist()  # (F,)
        # 3. draw them
        start = size
        for f, n in enumerate(counts):
            if n == 0:
                continue
            tok, cond = draw_children(qs[f], n, generator)  # (n,), (n, V)
            tokens.append(tok)
            parents.append(front[f].expand(len(tok)))
            scores.append(fscore[f] + qs[f, tok].log())
            probs.append(cond)
            size += len(tok)
        if level + 1 == depth or size >= total_tokens or size == start:
            break
        # 4. expand the level's best nodes
        all_scores = torch.cat(scores)  # (M,)
        front = start + all_scores[start:].topk(min(top_k, size - start)).indices  # (F,)
        qs = warp(expand_fn(torch.cat(tokens), torch.cat(parents), front), sampling)  # (F, V)
        fscore = all_scores[front]
    return TreeProposal(tokens=torch.cat(tokens), parents=torch.cat(parents),
                        probs=torch.cat(probs))


def position_tree(logits: torch.Tensor, top_k: int, total_tokens: int,
                  sampling: SamplingParams | None = None,
                  generator: torch.Generator | None = None) -> TreeProposal:
    """EAGLE-2's dynamic tree for a drafter whose draft distributions come out of ONE forward, one
    per position (P-EAGLE, DFlash): logits (D, Vd), row d the distribution of draft d+1 whatever
    the drafts before it, so a node at depth d expands with row d. Depth = D."""
    logp = logits.float().log_softmax(-1)  # (D, Vd)

    def expand(tokens: torch.Tensor, parents: torch.Tensor, frontier: torch.Tensor):
        d = TreeProposal(tokens, parents).depths()[frontier]  # (F,) 1 = child of the root
        return logp[d]  # (F, Vd): the next position's distribution

    return dynamic_tree(expand, logp[0], top_k, logp.shape[0], total_tokens, sampling, generator)
