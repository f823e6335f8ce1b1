"""The verification budget of batched speculative decoding: whether and how deep the batch drafts
this round, and how many draft positions its one batched target forward verifies.

A round costs drafting (per row, one row after another) plus ONE padded (B, Q) target forward
(Q = last committed token + w drafts). Verifying draft tokens is free only while that forward is
memory-bound; past that, every rejected draft costs compute, and the drafting alone may cost more
than the drafts bring. So a round is planned in two steps, each maximising the expected committed
tokens per second:

1. Before drafting (`RoundPlanner.depth`): the depth d every row drafts, 0 = a plain round (no
   drafter call at all). Expected tokens B * (1 + S_1 + .. + S_d), S_i the running estimate of a
   row's chance to commit its i-th draft (from the last rounds' outcomes); seconds = verify(B, d+1)
   + B * (drafting seconds per row at depth d, measured online) + B * (the round's other work per
   row, measured online). Where the estimates say no depth pays, the batch drafts only to probe:
   when an optimistic estimate of the S_i (each depth's acceptance counted with one more accepted
   draft) says some depth would pay. The counts fade a little each plain round, so the optimistic
   estimate climbs back and the probes come often where drafting nearly pays and rarely where it
   is far off; where no depth would pay even if every draft were accepted, never. A caller that
   decodes call after call keeps one planner (`generate_batch(planner=...)`), so each call starts
   from what the last ones learnt instead of drafting blind.
2. After drafting (`choose_widths`): the drafting is paid; the verify width w <= d is cut from the
   drafts' own confidences (`survival`) against verify(B, w+1): low-confidence tails are cut.

verify(B, Q) is `CostCurve` (decode/batched/cost.py), a grid of measured padded batched forwards
(the real round's inputs), measured once per (target, machine) and cached, scaled by what the
planner's own rounds' forwards measured (`RoundPlanner.verify`).

Lossless under sampling: step 1 reads only past rounds. In step 2 whether draft i of a row is
verified must not depend on that draft's own value (nor on anything after it), or the kept drafts
would no longer be distributed as q. So the score of depth i uses the drafted tokens'
probabilities before it and only the top probability of q_i (not q_i(d_i)), and the width grows
depth by depth, stopping at the first depth that lowers the expected committed tokens per second
(a stopping rule that never looks ahead). Greedy drafts are deterministic, so greedy takes the
best width over all depths.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch

from specdistill.decode.batched.cost import CostCurve, cost_curve
from specdistill.drafters.base import ChainProposal


class RoundPlanner:
    """Budgeted mode, step 1 (module docstring): how deep every row drafts this round, decided
    before any draft exists, from past rounds only. Keep one per (target, drafter, k) across
    `generate_batch` calls (its `planner` argument): what it learns holds for every batch size.

    What it learns online (acceptance per row, so one estimate serves every batch size):
      * S_i, a row's chance to commit its i-th draft: per depth, decayed counts of rows that
        reached depth i (drafted it, every earlier draft accepted) and of those that committed it;
        a draft cut by step 2 counts as not committed (it brought nothing). Prior: half a reached
        and accepted draft per depth, so depths never tried look worth a try. The counts decay by
        `decay` per drafting row observed (0.987: 0.9 per round of 8 rows) and by `idle_decay`
        per plain round (old evidence fades, so a probe eventually comes back to check it). Per
        row, not per round: a round of one row is one row's evidence (per round, B = 1 kept ~10
        rows and its S_1 swung 0.1-0.6 prompt by prompt, flipping plain and deep rounds);
      * the drafting phase's seconds at each asked depth and number of drafting rows (an EMA per
        (depth, rows): rows drafting together (Drafter.propose_rows) cost less than rows x one
        row; an unseen pair is scaled from the nearest seen one (rows first), linear in depth and
        in rows; nothing seen yet = free);
      * the round's other seconds per row (accept, cache compaction: an EMA);
      * what its forwards really cost against the grid (`verify`): the median of the last
        `verify_window` measured / grid ratios per (B, Q) forwarded (one forward's time varies by
        +-20% on a shared machine), the median over the shapes for one not forwarded yet.
        The grid was timed once, over a short cache, at that moment's load; the rounds run over
        the real caches at today's load. So that every depth's shape gets measured, one drafting
        round in `explore_every` drafts at the depth whose forward was measured least at this B
        (otherwise a depth the grid overprices would never be tried again). Only for a measured
        grid (`learn_costs` None: cost.key set): a grid given by hand is taken as it is.
    """

    def __init__(self, cost: CostCurve, k: int, decay: float = 0.987, idle_decay: float = 0.998,
                 optimism: float = 1.0, ema: float = 0.3, tree_width: float | None = None,
                 explore_every: int = 16, learn_costs: bool | None = None,
                 verify_window: int = 32) -> None:
        self.cost, self.k, self.decay, self.ema = cost, k, decay, ema
        self.learn_costs = bool(cost.key) if learn_costs is None else learn_costs
        self.explore_every, self.drafting_rounds = explore_every, 0
        # trees: the round is plain (0) or the drafter's whole tree (k = its depth), whose
        # forward is tree_width tokens per row (first guessed, then an EMA of the measured ones)
        self.tree_width = tree_width
        self.idle_decay, self.optimism = idle_decay, optimism
        self.reach, self.acc = [0.0] * k, [0.0] * k  # decayed counts per depth 1..k
        self.draft_s: dict[tuple[int, int], float] = {}  # (depth, rows drafting) -> phase seconds
        self.other_row = 0.0  # seconds per row per round outside the drafters and the forward
        self.verify_window = verify_window
        self.verify_ratios: dict[tuple[int, int], list[float]] = {}  # (B, Q) -> last ratios
        self.verify_ratio: dict[tuple[int, int], float] = {}  # (B, Q) -> their median
        self.any_ratio = 1.0  # the median over the shapes: for a shape not forwarded yet
        self.verify_n: dict[tuple[int, int], int] = {}  # (B, Q) -> forwards measured
        self.probes = 0  # rounds drafted only because the optimistic estimate might pay

    @property
    def tree(self) -> bool:
        """Planning trees (plain or the whole tree) rather than chain depths."""
        return self.tree_width is not None

    def survival(self, extra: float = 0.0) -> list[float]:
        """S_1 .. S_k: the running chance that a row commits its i-th draft; with extra > 0 each
        depth's acceptance counts `extra` more accepted drafts (the optimistic estimate)."""
        out, s = [], 1.0
        for r, a in zip(self.reach, self.acc):
            s *= (a + 0.5 + extra) / (r + 0.5 + extra)
            out.append(s)
        return out

    def draft_seconds(self, d: int, B: int) -> float:
        """Estimated seconds of a round's drafting phase: B rows drafting d each."""
        if d == 0 or B == 0 or not self.draft_s:
            return 0.0
        nd, nb = min(self.draft_s, key=lambda x: (abs(x[1] - B), abs(x[0] - d), -x[1], -x[0]))
        return self.draft_s[(nd, nb)] * (d / nd) * (B / nb)

    def rate(self, B: int, d: int, S: Sequence[float]) -> float:
        """Expected committed tokens per second of a round of B rows drafting d each."""
        tokens = B * (1.0 + sum(S[:d]))
        width = self.tree_width if self.tree and d else d + 1
        seconds = self.verify(B, width) + self.draft_seconds(d, B) + B * self.other_row
        return tokens / seconds

    def _best(self, B: int, S: Sequence[float]) -> int:
        """The depth >= 1 with the best rate under S, or 0 where none beats a plain round."""
        plain = self.rate(B, 0, S) * (1 + 1e-9)  # a tie is no gain
        rates = {d: self.rate(B, d, S) for d in ([self.k] if self.tree else range(1, self.k + 1))}
        best = max(rates, key=rates.get)
        return best if rates[best] > plain else 0

    def depth(self, B: int) -> int:
        """This round's draft depth for B rows: 1. the best by the estimates (every
        explore_every-th drafting round of a chain: the depth whose forward was measured least at
        this B); 2. if that is 0 (plain), a probe at the best depth by the optimistic estimate,
        where that one pays; else 0, and the counts fade by idle_decay."""
        if self.k == 0:
            return 0
        d = self._best(B, self.survival())  # 1.
        if d:
            self.drafting_rounds += 1
            if (self.learn_costs and not self.tree
                    and self.drafting_rounds % self.explore_every == 0):
                d = min(range(1, self.k + 1), key=lambda x: (self.verify_n.get((B, x + 1), 0), x))
            return d
        d = self._best(B, self.survival(self.optimism))  # 2.
        if d:
            self.probes += 1
            return d
        self.reach = [x * self.idle_decay for x in self.reach]
        self.acc = [x * self.idle_decay for x in self.acc]
        return 0

    def observe(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """One round's outcome per row: drafts made (before any cut) and drafts committed."""
        if not any(drafted):
            return
        fade = self.decay ** sum(m > 0 for m in drafted)
        self.reach = [x * fade for x in self.reach]
        self.acc = [x * fade for x in self.acc]
        for m, n in zip(drafted, accepted):
            for i in range(min(m, n + 1, self.k)):  # depths 1..min(m, n+1) reached
                self.reach[i] += 1.0
                self.acc[i] += float(i < n)

    def verify(self, B: float, Q: float) -> float:
        """Seconds of a (B, Q) forward: the grid's, times the measured / grid ratio of that shape
        (the median of its last forwards), else the median of the shapes' ratios (1 before
        any)."""
        return self.cost(B, Q) * self.verify_ratio.get((round(B), round(Q)), self.any_ratio)

    def observe_verify(self, B: int, Q: int, seconds: float) -> None:
        """One round's target forward: B rows x Q tokens took `seconds` (ignored for a grid
        given by hand, see the class docstring)."""
        if not self.learn_costs:
            return
        last = self.verify_ratios.setdefault((B, Q), [])
        last.append(seconds / self.cost(B, Q))
        del last[:-self.verify_window]
        self.verify_n[(B, Q)] = self.verify_n.get((B, Q), 0) + 1
        self.verify_ratio[(B, Q)] = statistics.median(last)  # once per forward, not per lookup
        self.any_ratio = statistics.median(self.verify_ratio.values())

    def observe_width(self, width: int) -> None:
        """Trees: a tree round's forward width (tokens per row)."""
        if self.tree:
            self.tree_width += self.ema * (width - self.tree_width)

    def observe_times(self, depth: int, rows_drafted: int, draft_s: float, rows: int,
                      other_s: float) -> None:
        """One round's seconds: its drafting phase over rows_drafted rows at depth `depth`, and
        its work outside the drafters and the forward over all `rows`."""
        if depth and rows_drafted:
            key, old = (depth, rows_drafted), self.draft_s.get((depth, rows_drafted))
            self.draft_s[key] = draft_s if old is None else old + self.ema * (draft_s - old)
        if rows:
            self.other_row += self.ema * (other_s / rows - self.other_row)


def new_planner(cost: CostCurve, k: int, drafter: Any = None, tree: bool = False) -> RoundPlanner:
    """A batch's planner: chains choose a depth in 0..k; trees choose between a plain round and
    the drafter's whole tree, of depth `tree_depth` and first guessed `tree_total_tokens` nodes
    (its config's EAGLE-2 tree settings; k otherwise), then measured."""
    if not tree:
        return RoundPlanner(cost, k)
    cfg = getattr(drafter, "cfg", None)
    depth = int(getattr(cfg, "tree_depth", k))
    return RoundPlanner(cost, depth, tree_width=float(getattr(cfg, "tree_total_tokens", depth)) + 1)


def batch_planner(target: Any, drafter: Any, k: int, tree: bool, planner: RoundPlanner | None,
                  cost: CostCurve | None, cache_dir: str | None, exact: bool = False
                  ) -> RoundPlanner:
    """A budgeted `generate_batch`'s planner: the caller's kept planner (checked against this
    call's settings), else a new one over `cost` (None = the target's measured grid, cached under
    cache_dir; exact: the grid of exact batched decoding)."""
    if planner is None:
        return new_planner(cost if cost is not None else cost_curve(target, cache_dir, exact=exact),
                           k, drafter, tree)
    if planner.tree != tree or (not tree and planner.k != k):
        made = "trees" if planner.tree else f"chains of k={planner.k}"
        asked = "trees" if tree else f"chains of k={k}"
        raise ValueError(f"the planner was made for {made}, this call drafts {asked}; keep one "
                         f"planner per k and tree setting")
    if cost is not None and cost is not planner.cost:
        raise ValueError("cost and planner.cost differ; pass the cost only through the planner")
    return planner


def survival(prop: ChainProposal, m: int) -> torch.Tensor:
    """(m,) score of each of the first m drafts: the drafter's probability that the chain survives
    to it, prod_{j<i} q_j(d_j) * max q_i (greedy: prod_{j<=i} q_j(d_j), the drafted tokens being
    the argmaxes). Never reads draft i's own value at depth i (see the module docstring). A
    deterministic drafter (no probs, no confidence) scores 1 everywhere."""
    tokens = prop.tokens[:m]
    if prop.probs is not None:
        q = prop.probs[:m].float()  # (m, V)
        own = q.gather(-1, tokens[:, None].to(q.device)).squeeze(-1)  # (m,) q_i(d_i)
        top = q.max(-1).values  # (m,)
    elif prop.confidence is not None:  # greedy: the drafted token is the argmax
        own = top = prop.confidence[:m].float()
    else:
        return torch.ones(m)
    before = torch.cat([own.new_ones(1), own[:-1]]).cumprod(0)  # (m,) prod_{j<i} own_j
    return (before * top).cpu()


def choose_widths(scores: list[torch.Tensor], cost: Callable[[float, float], float], greedy: bool
                  ) -> list[int]:
    """Budgeted mode, step 2: per-row verify lengths for one batched forward, the drafting being
    paid. scores[r] (m_r,) from `survival`.

    1. The forward has B rows and width w + 1 (last token + w drafts): cost(B, w + 1).
    2. Expected committed tokens at width w: B (each row's correction / bonus token) plus every
       row's scores at depths <= w.
    3. Greedy: the w with the most expected tokens per second. Sampling: w grows while each depth
       raises that ratio (decided depth by depth, see the module docstring).
    4. Row r verifies min(w, m_r) drafts.
    """
    B = len(scores)
    k = max((len(s) for s in scores), default=0)
    gain, best_w, best = float(B), 0, B / cost(B, 1)  # 1.-2. width 0: plain decoding
    for w in range(1, k + 1):
        gain += sum(float(s[w - 1]) for s in scores if len(s) >= w)
        ratio = gain / cost(B, w + 1)
        if ratio > best:
            best_w, best = w, ratio
        elif not greedy:
            break  # 3. sampling stops at the first depth that does not pay
    return [min(best_w, len(s)) for s in scores]  # 4.
