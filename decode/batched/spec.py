"""`generate_batch`: batched speculative decoding, one round at a time (the package docstring
gives the modes).

Every sequence runs decode/spec.py's own per-sequence state (`SequenceState`: token buffer,
features, result) and its public steps (prefill, commit, draft_tree, accept_tree), so a sequence
decoded in a batch commits what `decode.spec.generate` commits for it alone (greedy: the same
tokens; sampling: the same rule and, in verify_all mode with the same generator, the same draws).
Shared across the rows: the verification forward, and for chains the drafting
(`Drafter.propose_rows`: EAGLE-family drafters put every row through one padded drafter forward per
draft step, P-EAGLE one per round, each row attending to its own drafter cache; other drafters draft
row after row). The batch KV cache (kv_cache.py) is one transformers DynamicCache with a row per
sequence, rows left-aligned: row r holds its committed tokens[:T_r - 1] in columns [0, L_r),
L_r = T_r - 1, and garbage after. A round appends Q columns; row r attends to its own [0, L_r) and
causally within the new block (a 4-D mask), at positions L_r + t; afterwards the kept columns of
each row move to [L_r, L_r + n_r + 1) and the cache is cropped to the longest row
(`kv_cache.compact`); exact_verify keeps each row as its lone exact decode does instead (exact.py).
"""
from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache

from specdistill.decode.accept import accept_chain
from specdistill.decode.batched import kv_cache
from specdistill.decode.batched.cost import CostCurve
from specdistill.decode.batched.exact import ExactRows
from specdistill.decode.batched.planner import RoundPlanner, batch_planner, choose_widths, survival
from specdistill.decode.spec import (
    DraftTree,
    GenerationResult,
    SequenceState,
    StopChecker,
    accept_tree,
    check_inputs,
    commit,
    draft_tree,
    prefill,
    record_confidences,
    timed,
)
from specdistill.decode.survival import SurvivalRule, check_survival
from specdistill.decode.survival import survival as survival_of
from specdistill.drafters.base import ChainProposal, Drafter
from specdistill.drafters.parts.sampling import SamplingParams

MODES = ("plain", "verify_all", "budgeted", "adaptive")
PLANNED = ("budgeted", "adaptive")  # the modes whose rounds a RoundPlanner plans


@dataclass
class BatchResult:
    """What one `generate_batch` call produced: per prompt (in prompt order) and over the batch."""

    results: list[GenerationResult]  # one per prompt; time_total = admission to finish
    latency: list[float]  # per prompt: seconds from the call's start to its last token
    time_total: float = 0.0  # wall-clock seconds of the whole call
    rounds: int = 0  # batched target forwards (prefills excluded)
    time_draft: float = 0.0  # seconds inside the drafters
    time_verify: float = 0.0  # seconds inside target forwards: the batched ones and the prefills
    batch_sizes: list[int] = field(default_factory=list)  # rows in each round's forward
    widths: list[int] = field(default_factory=list)  # width Q (tokens per row) of each forward
    depths: list[int] = field(default_factory=list)  # drafts asked per row each round (0: plain)

    @property
    def new_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        """Throughput over the batch: every generated token / wall-clock seconds."""
        return self.new_tokens / self.time_total if self.time_total else 0.0


@dataclass
class _Seq:
    """One sequence in the batch: its prompt index, spec's state for it and its admission time."""

    index: int
    state: SequenceState
    t_admit: float


@dataclass
class BatchRound:
    """What every round of one `generate_batch` call shares, passed whole to the batch."""

    layers: tuple[int, ...]  # target layers whose features the drafter reads (() = none)
    sampling: SamplingParams  # the acceptance rule's sampling (greedy by default)
    k: int  # verify_all: drafts asked per row each round; budgeted: the deepest the planner asks
    mode: str  # plain | verify_all | budgeted | adaptive (MODES)
    min_confidence: float  # > 0: a drafter may stop a chain early
    stop: StopChecker | None  # the stop strings (None = none)
    eos: torch.Tensor  # (E,) the target's EOS ids
    sync: bool  # wait for the GPU around timed calls
    tree: bool = False  # rows draft trees (decode/tree.py) instead of chains
    batch_drafts: bool = True  # chains: rows draft together (propose_rows), else one by one
    exact: bool = False  # rows kept as their lone exact decodes keep them (batched/exact.py)
    # chains: each row cut by survival (verify_survival), and adaptive mode's width scores
    rule: SurvivalRule = field(default_factory=SurvivalRule)


def slot_drafter(drafter: Drafter | Callable[[], Drafter]) -> Drafter:
    """A drafter for one sequence of a batch: a factory's product, or a shallow copy of `drafter`
    that shares its modules and weights; reset() then gives it its own per-prompt state (every
    drafter (re)assigns its caches in reset(), never mutates them in place across prompts)."""
    d = drafter() if not isinstance(drafter, Drafter) and callable(drafter) else copy.copy(drafter)
    d.reset()
    return d


def _check_batch(mode: str, n_prompts: int, batch_size: int, max_new_tokens: int | Sequence[int],
                 generators: Sequence | None) -> list[int]:
    """generate_batch's argument checks; returns each prompt's max_new_tokens."""
    if mode not in MODES:
        raise ValueError(f"batch mode {mode!r} is unknown; use one of {MODES}")
    if batch_size < 1 or n_prompts < 1:
        raise ValueError(f"need batch_size >= 1 and at least one prompt (got batch_size="
                         f"{batch_size}, {n_prompts} prompts)")
    if generators is not None and len(generators) != n_prompts:
        raise ValueError(f"{len(generators)} generators for {n_prompts} prompts; give one each")
    max_new = ([max_new_tokens] * n_prompts if isinstance(max_new_tokens, int)
               else [int(n) for n in max_new_tokens])
    if len(max_new) != n_prompts:
        raise ValueError(f"{len(max_new)} max_new_tokens for {n_prompts} prompts; give one "
                         f"int or one per prompt")
    return max_new


class _Batch:
    """The running batch: its sequences (row r of the cache = seqs[r]) and the shared settings."""

    def __init__(self, target: Any, drafter: Drafter | Callable[[], Drafter] | None,
                 cfg: BatchRound, planner: RoundPlanner | None = None) -> None:
        self.target, self.drafter, self.cfg = target, drafter, cfg  # drafter None: plain rounds
        self.seqs: list[_Seq] = []
        self.cache = DynamicCache()
        # exact verification: rows kept as their lone exact decodes keep them (batched/exact.py)
        self.exact = ExactRows(target) if cfg.exact else None
        self.time_verify = 0.0  # seconds in target forwards, prefills included
        # budgeted: each round's draft depth from past rounds only, before any draft exists
        self.planner = planner if cfg.mode in PLANNED and drafter is not None else None

    def admit(self, index: int, prompt: torch.Tensor, max_new_tokens: int,
              generator: torch.Generator | None) -> tuple[_Seq, bool]:
        """Prefill prompt (P,) alone (spec's step 1, its own cache), commit its first token and,
        unless that already ends it, add it as a new row. Returns (the sequence, added)."""
        t0, cfg = time.perf_counter(), self.cfg
        st = SequenceState.start(self.target, slot_drafter(self.drafter) if self.drafter else None,
                                 prompt, max_new_tokens, cfg.sampling, generator, cfg.layers,
                                 cfg.exact)
        seq, res = _Seq(index, st, t0), st.res
        if max_new_tokens == 0:
            res.stop_reason = "max_new_tokens"
            return seq, False
        first = prefill(st, prompt)
        self.time_verify += res.time_verify
        added = not commit(st, first, None, cfg.eos, cfg.stop)
        if added:
            if self.exact:
                self.exact.add_row(st.exact, st.T - 1)
            elif self.seqs:
                kv_cache.add_row(self.cache, st.cache)
            else:  # the first row: its own cache becomes the batch cache
                self.cache = st.cache
            self.seqs.append(seq)
        res.cache = st.cache = st.exact = None  # the row now lives in the batch cache
        return seq, added

    def _draft(self, depth: int) -> list[tuple[torch.Tensor, torch.Tensor | None,
                                               torch.Tensor | None, list[float] | None]]:
        """Step 1 for every row: (draft (m,) of at most `depth` tokens cut by survival, q (m, V)
        or None, budgeted / adaptive: width scores (m,), the verified slots' confidences or None)
        each, from ONE propose_rows call: the rows draft together
        where the drafter can (one forward per draft step for all rows), or, with batch_drafts off,
        through the base class's one-row-after-another loop. The call's seconds are shared evenly
        by its rows."""
        asks = [min(depth, s.state.room) if s.state.drafter is not None else 0
                for s in self.seqs]  # drafts beyond the room could never be committed
        live = [r for r, b in enumerate(asks) if b > 0]
        props = [None] * len(self.seqs)
        if live:
            states = [self.seqs[r].state for r in live]
            propose_rows = states[0].drafter.propose_rows if self.cfg.batch_drafts else partial(
                Drafter.propose_rows, states[0].drafter)
            got, dt = timed(lambda: propose_rows(
                [st.drafter for st in states], [st.decode_state() for st in states],
                [asks[r] for r in live], self.cfg.sampling, [st.generator for st in states],
                self.cfg.min_confidence), self.cfg.sync)
            for r, st, prop in zip(live, states, got):
                props[r] = prop
                st.res.time_draft += dt / len(live)
        return [self._row_draft(s, b, prop) for s, b, prop in zip(self.seqs, asks, props)]

    def _row_draft(self, s: _Seq, b: int, prop: ChainProposal | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                              list[float] | None]:
        """One row's `_draft` entry: its first b drafts, cut where its survival falls below
        verify_survival (spec's rule); the width scores: budgeted, the planner's draft-prob
        survival; adaptive, the survival of the slot confidences (the draft-prob one without)."""
        if prop is None:
            return s.state.buf.new_empty(0), None, torch.ones(0), None
        m, pred = record_confidences(s.state.res, prop, self.cfg.rule, min(len(prop.tokens), b))
        q = prop.probs[:m] if prop.probs is not None else None  # (m, V)
        scores = None
        if self.cfg.mode == "adaptive" and pred is not None:
            scores = survival_of(torch.tensor(pred))  # (m,)
        elif self.cfg.mode in PLANNED:
            scores = survival(prop, m)  # (m,)
        return prop.tokens[:m].to(s.state.buf.device), q, scores, pred

    def _depth(self) -> int:
        """Drafts asked per row this round: k (verify_all), 0 (plain), or the planner's."""
        if self.drafter is None or self.cfg.mode == "plain":
            return 0
        return self.planner.depth(len(self.seqs)) if self.planner else self.cfg.k

    def round(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int, int]:
        """One round for every row: 1. draft, 2. budgeted: cut the verify widths, 3. ONE padded
        forward, 4. accept, 5. compact the cache, 6. budgeted: the planner learns from the round.
        Returns each row's tokens to commit (n_r+1,), the features (n_r+1, F) of its verified
        inputs (or None), the forward's width Q and the draft depth asked."""
        t_round, depth = time.perf_counter(), self._depth()
        if self.cfg.tree and depth:
            return self._tree_round(t_round, depth)
        drafts = self._draft(depth)  # 1.
        t_draft = time.perf_counter() - t_round
        lens = [len(d) for d, _, _, _ in drafts]
        if self.planner and depth:  # 2. cut every row to the width the cost grid pays for
            lens = choose_widths([sc for _, _, sc, _ in drafts], self.planner.verify,
                                 self.cfg.sampling.greedy)
        ids, out, dt, L, cache_len = self._verify(  # 3.
            [d[:m] for (d, _, _, _), m in zip(drafts, lens)])
        new, kept, n_keep = [], [], []
        for r, (s, (d, q, _, pred), m) in enumerate(zip(self.seqs, drafts, lens)):  # 4.
            res = s.state.res
            n_t, nxt = accept_chain(d[None, :m], None if q is None else q[None, :m],
                                    out.logits[r:r + 1, :m + 1], self.cfg.sampling,
                                    s.state.generator)
            n = int(n_t)
            res.drafted.append(m)
            res.accepted.append(n)
            if pred is not None and m:
                res.slot_confidence.append((pred[:m], n))
            new.append(torch.cat([d[:n], nxt]))  # (n+1,)
            kept.append(out.features[r, :n + 1] if self.cfg.layers else None)  # (n+1, F)
            n_keep.append(n + 1)
        self._compact(L, n_keep, cache_len)  # 5.
        # 6. a draft cut in step 2 counts as drafted, not accepted
        self._learn(depth, [len(d) for d, _, _, _ in drafts], [n - 1 for n in n_keep], t_round,
                    t_draft, dt, ids.shape[1])
        return new, kept, ids.shape[1], depth

    def _tree_round(self, t_round: float, depth: int
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int, int]:
        """`round` with trees: 1. every row drafts a tree (spec's step, cut to the depth its
        room can still commit), 3. ONE padded forward, each row under its own tree mask, 4. each
        row's branch by spec's rule (greedy walk or multi-draft sampling), 5. compact the cache to
        the accepted branches, 6. budgeted: the planner learns. No width cut after drafting: which
        nodes are verified never depends on their values."""
        trees = []
        for s in self.seqs:  # 1.
            if s.state.room > 0:
                trees.append(draft_tree(s.state, s.state.room))
            else:
                trees.append(DraftTree.empty(s.state.buf.device))
        t_draft = time.perf_counter() - t_round
        ids, out, dt, L, cache_len = self._verify([t.nodes for t in trees], [t.anc for t in trees])
        new, kept, keeps = [], [], []
        for r, (s, t) in enumerate(zip(self.seqs, trees)):  # 4.
            keep, bonus = accept_tree(s.state, t, out.logits[r, :len(t.nodes) + 1])
            new.append(torch.cat([ids[r, keep[1:]], bonus]))  # (n+1,)
            kept.append(out.features[r, keep] if self.cfg.layers else None)  # (n+1, F)
            keeps.append(keep)
        self._compact(L, keeps, cache_len)  # 5.
        if self.planner:  # 6. each tree's depth counts as drafted
            self.planner.observe_width(ids.shape[1])
        self._learn(depth, [s.state.res.drafted[-1] for s in self.seqs],
                    [len(x) - 1 for x in keeps], t_round, t_draft, dt, ids.shape[1])
        return new, kept, ids.shape[1], depth

    def _verify(self, drafts: list[torch.Tensor], trees: list[torch.Tensor] | None = None):
        """Step 3: ONE padded target forward over every row's [last committed, drafts] (a chain,
        or a tree under its ancestor mask), timed and counted for the batch and every row.
        Returns (ids (B, Q), the target's output, seconds, each row's cached length L_r, the
        cache length before the forward)."""
        rows = [torch.cat([s.state.buf[s.state.T - 1:s.state.T], d])
                for s, d in zip(self.seqs, drafts)]  # (m_r+1,) each
        L = [s.state.T - 1 for s in self.seqs]  # committed tokens in each row's cache
        if self.exact:
            cache_len, cache, ctx = 0, self.exact.cache, self.exact.context()
            ids, mask, pos = self.exact.inputs(rows, L, trees)
        else:
            cache_len, cache, ctx = self.cache.get_seq_length(), self.cache, nullcontext()
            ids, mask, pos = kv_cache.inputs(rows, L, cache_len, trees=trees)

        def run():
            with ctx:
                return self.target.forward(ids, layers=self.cfg.layers, cache=cache,
                                           attention_mask=mask, position_ids=pos)
        out, dt = timed(run, self.cfg.sync)
        self.time_verify += dt
        for s in self.seqs:
            s.state.res.time_verify += dt
            s.state.res.target_forwards += 1
        return ids, out, dt, L, cache_len

    def _compact(self, L: list[int], keep: list, cache_len: int) -> None:
        """Step 5: each row keeps its last committed token and accepted drafts in its cache."""
        if self.exact:
            self.exact.compact(L, keep)
        else:
            kv_cache.compact(self.cache, L, keep, cache_len)

    def _learn(self, depth: int, made: list[int], accepted: list[int], t_round: float,
               t_draft: float, dt: float, width: int) -> None:
        """Step 6, budgeted: the planner learns each row's drafts made and committed, and the
        round's seconds (drafting, the (B, width) forward, the rest)."""
        if self.planner:
            self.planner.observe(made, accepted)
            self.planner.observe_verify(len(self.seqs), width, dt)
            self.planner.observe_times(depth, sum(m > 0 for m in made), t_draft, len(self.seqs),
                                       time.perf_counter() - t_round - t_draft - dt)

    def commit(self, new: list[torch.Tensor], kept: list[torch.Tensor | None]) -> list[_Seq]:
        """Spec's commit step per row; the finished sequences leave the batch (and the cache)."""
        done = [commit(s.state, n, f, self.cfg.eos, self.cfg.stop)  # spec's step, per row
                for s, n, f in zip(self.seqs, new, kept)]
        finished = [s for s, d in zip(self.seqs, done) if d]
        if finished:
            stay = [r for r, d in enumerate(done) if not d]
            self.seqs = [self.seqs[r] for r in stay]
            if self.exact:
                self.exact.select_rows(stay)
            else:
                kv_cache.select_rows(self.cache, stay, max((s.state.T - 1 for s in self.seqs),
                                                           default=0))
        return finished


def _finish(seq: _Seq, t_start: float, results: list, latency: list) -> None:
    st, now = seq.state, time.perf_counter()
    st.res.tokens = st.buf[st.P:st.T].cpu()
    st.res.time_total = now - seq.t_admit
    results[seq.index], latency[seq.index] = st.res, now - t_start


@torch.inference_mode()
def generate_batch(
    target: Any,  # target.model.Target
    drafter: Drafter | Callable[[], Drafter] | None,  # one is shared (slot_drafter), or a factory
    prompts: Sequence[torch.Tensor | Sequence[int]],  # each (P_i,)
    *,
    max_new_tokens: int | Sequence[int],  # one for all, or one per prompt
    batch_size: int = 8,  # at most this many sequences in one forward
    k: int = 5,
    mode: str = "verify_all",  # plain | verify_all | budgeted | adaptive
    sampling: SamplingParams | None = None,  # None = greedy
    min_confidence: float = 0.0,
    stop_strings: Sequence[str] = (),
    generators: Sequence[torch.Generator] | None = None,  # one per prompt (sampling)
    seed: int = 0,  # without generators: prompt i samples with a generator seeded seed + i
    cost: CostCurve | None = None,  # budgeted: the cost curve (None = measured once and cached)
    cache_dir: str | None = None,  # where a measured cost curve is cached
    planner: RoundPlanner | None = None,  # budgeted: kept across calls (None = a fresh one)
    tree: bool = False,  # every row verifies the drafter's tree (decode/tree.py) instead of a chain
    batch_drafts: bool = True,  # chains: rows draft together (Drafter.propose_rows), else 1 by 1
    exact_verify: bool = False,  # every row rounds as its lone exact decode (batched/exact.py)
    verify_survival: float = 0.0,  # chains: cut each row by survival (decode/survival.py, 0 = off)
    survival_fallback: str = "none",  # slot confidences without a head: none | draft_prob
) -> BatchResult:
    """Decode every prompt, up to batch_size at a time in one target forward per round,
    losslessly per sequence: each output is what `decode.spec.generate` gives that prompt alone
    (greedy: token-identical; at 16 bits up to near-tie flips, a row's rounding depending on the
    batch, unless exact_verify: then bit-identical to `generate(..., exact_verify=True)` alone).

    budgeted: pass the same `planner` (a `decode.batched.planner.RoundPlanner` for this target,
    drafter and k) to every call, as a server would keep it, so a call starts from the acceptance
    and drafting times the earlier ones measured instead of drafting blind in its first rounds.

    adaptive: budgeted with each row's survival as its width scores (the package docstring)."""
    t_start, sampling, dev = time.perf_counter(), sampling or SamplingParams(), target.device
    max_new = _check_batch(mode, len(prompts), batch_size, max_new_tokens, generators)
    prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1).to(dev) for p in prompts]
    one = slot_drafter(drafter) if drafter is not None else None  # for the checks and the layers
    speculative = one is not None and k > 0 and mode != "plain"
    for p, n in zip(prompts, max_new):  # 0. guards, as spec's, before any work
        check_inputs(target, one if speculative else None, len(p), n, k, sampling, tree,
                     masks="batched decoding")
    check_survival(one if speculative else None, verify_survival, survival_fallback,
                   tree and speculative)
    if speculative and mode in PLANNED:
        planner = batch_planner(target, one, k, tree, planner, cost, cache_dir, exact_verify)
    gens = list(generators) if generators is not None else [
        torch.Generator(device=dev).manual_seed(seed + i) for i in range(len(prompts))]
    eos = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long, device=dev)  # (E,)
    stop = StopChecker(target.tokenizer, stop_strings) if any(stop_strings) else None
    cfg = BatchRound(layers=tuple(one.feature_layers) if speculative else (), sampling=sampling,
                        k=k, mode=mode, min_confidence=min_confidence, stop=stop, eos=eos,
                        sync=dev.type == "cuda", tree=tree, batch_drafts=batch_drafts,
                        exact=exact_verify, rule=SurvivalRule(verify_survival, survival_fallback))
    batch = _Batch(target, drafter if speculative else None, cfg, planner)
    results: list = [None] * len(prompts)
    latency: list = [0.0] * len(prompts)
    out = BatchResult(results=results, latency=latency)
    waiting = list(range(len(prompts)))
    while waiting or batch.seqs:
        # 1. admit waiting prompts into free rows (a prompt may finish at its prefill)
        while waiting and len(batch.seqs) < batch_size:
            i = waiting.pop(0)
            seq, added = batch.admit(i, prompts[i], max_new[i], gens[i])
            if not added:
                _finish(seq, t_start, results, latency)
        if not batch.seqs:
            continue
        # 2. one round over the batch; 3. commit, and let the finished sequences leave
        out.batch_sizes.append(len(batch.seqs))
        new, kept, width, depth = batch.round()
        out.widths.append(width)
        out.depths.append(depth)
        out.rounds += 1
        for seq in batch.commit(new, kept):
            _finish(seq, t_start, results, latency)
    out.time_total = time.perf_counter() - t_start
    out.time_verify = batch.time_verify
    out.time_draft = sum(r.time_draft for r in results)
    return out
