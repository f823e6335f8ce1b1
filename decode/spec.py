"""The lossless speculative decoding loop: `generate` loops, commits and stops; one function per
round kind (`_chain_round`, `_tree_round`) and one commit step (`commit`), with numbered steps.

Each round the drafter proposes tokens (a chain of up to k, or a tree), the target verifies all of
them in ONE forward over [last committed token, drafts], the acceptance rule keeps the longest valid
prefix plus one target token, and the KV cache is cut back to the committed tokens. Without a
drafter (or with k=0) the same loop is plain decoding: one target forward per token.

Invariants between rounds (T = committed tokens, prompt included):
  * buf[:T] holds the committed tokens; the target's KV cache holds tokens[:T-1] (the last one, the
    target's own bonus/correction token, has not been through the target yet);
  * feats[:T-1] holds the target features of tokens[:T-1] when the drafter reads features.
Buffers are preallocated and only appended to, so a round costs O(k), not O(T), outside the models.

The per-sequence steps are public: batched decoding (decode/batched/spec.py) runs every row through
the same ones, so a row commits what `generate` commits for that sequence alone.
  SequenceState.start(...)   one sequence's models, settings and buffers (the prompt written in)
  check_inputs(...)          step 0: refuse bad arguments before any work, with the fix
  prefill(seq, prompt)       step 1: the prompt through the target; its first token
  commit(seq, new, ...)      step 2: append a round's tokens, cut at EOS / a stop string / the end
  draft_tree(seq, room)      step 3a: the drafter's tree, cut to the depth that can still commit
  record_confidences(...)    step 3c: a chain cut by survival (decode/survival.py), its slot
                             confidences recorded for the calibration
  accept_tree(seq, tree, l)  step 5 for a tree: the accepted branch and the bonus token
  DraftTree, StopChecker, timed(fn, sync): what the steps pass around and how they time calls.
"room" throughout is the number of drafts a round can still commit: end - T - 1.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from specdistill.decode.accept import accept_chain
from specdistill.decode.exact import ExactVerify, active
from specdistill.decode.survival import SurvivalRule, check_survival
from specdistill.decode.tree import (
    accept_path,
    ancestors,
    check_tree,
    compact_cache,
    prune_depth,
    sample_path,
    tree_inputs,
)
from specdistill.drafters.base import ChainProposal, DecodeState, Drafter
from specdistill.drafters.parts.sampling import SamplingParams, warp


@dataclass
class GenerationResult:
    """What one `generate` call produced and how."""

    tokens: torch.Tensor  # (n,) long, on the CPU: generated tokens (the prompt excluded)
    # per decode round (one target forward each, the prefill excluded): drafted tokens (for a tree,
    # its depth) and accepted drafts as verified, before any cut at EOS / stop string / the end
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    target_forwards: int = 0  # prefill included
    time_draft: float = 0.0  # seconds inside drafter.propose / propose_tree
    time_verify: float = 0.0  # seconds inside target forwards (prefill included)
    time_total: float = 0.0  # wall-clock seconds of the whole call
    stop_reason: str = ""  # "eos" | "stop_string" | "max_new_tokens"
    # chains with slot confidences (decode/survival.py): per round, the verified slots'
    # confidences and the drafts accepted, for the calibration; and where they came from
    slot_confidence: list[tuple[list[float], int]] = field(default_factory=list)
    confidence_source: str = ""  # "head" (a trained accept_prob) | "draft_prob" | "" (none)
    cache: Any = field(default=None, repr=False)  # target KV cache of tokens[:-1] (prompt included)

    @property
    def time_other(self) -> float:
        """Seconds outside the drafter and the target: the decoder's own overhead."""
        return self.time_total - self.time_draft - self.time_verify


class StopChecker:
    """Finds the token that completes a stop string, decoding only a short tail of new tokens.

    Tokens are checked one at a time, so an occurrence that ends before token j was already seen
    at an earlier token; the text of the last `window` tokens is enough to catch one ending at j.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stop_strings if s]
        # a token decodes to at least one character, or to one byte of a multi-byte character
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 4

    def hit(self, generated: torch.Tensor) -> bool:
        """generated (n,): True when its last token completes one of the stop strings."""
        tail = generated[-self.window:].tolist()
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return any(s in text for s in self.stops)


def timed(fn, sync: bool):
    """Run fn() and return (its result, seconds), waiting for the GPU when there is one."""
    t0 = time.perf_counter()
    out = fn()
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


@dataclass
class SequenceState:
    """One sequence being decoded: the models and settings its rounds share, its buffers and its
    result. `generate` holds one; batched decoding one per row (decode/batched/spec.py).

    T counts the committed tokens (prompt included); end = P + max_new_tokens is where buf ends."""

    target: Any  # target.model.Target
    drafter: Drafter | None  # None when plain decoding
    sampling: SamplingParams
    generator: torch.Generator | None
    layers: tuple[int, ...]  # target layers whose features the drafter reads (() = none)
    sync: bool  # wait for the GPU around timed calls
    res: GenerationResult
    buf: torch.Tensor  # (end,) long: committed tokens in buf[:T]
    cache: Any  # the target's KV cache of buf[:T-1] between rounds (Dynamic, or exact's Static)
    P: int  # prompt length
    end: int  # P + max_new_tokens
    T: int = 0  # committed tokens, prompt included
    feats: torch.Tensor | None = None  # (end, F) target features of buf[:T-1], allocated at prefill
    exact: ExactVerify | None = None  # exact verification (decode/exact.py), None = off

    @classmethod
    def start(cls, target: Any, drafter: Drafter | None, prompt: torch.Tensor, max_new_tokens: int,
              sampling: SamplingParams, generator: torch.Generator | None,
              layers: tuple[int, ...], exact: bool) -> "SequenceState":
        """A sequence before its prefill: prompt (P,) written into a buffer of P + max_new_tokens,
        an empty KV cache (exact: a static one of the right capacity, decode/exact.py)."""
        P, dev = len(prompt), target.device
        lone = ExactVerify(target, P, max_new_tokens) if exact else None
        res = GenerationResult(tokens=prompt.new_empty(0).cpu(),
                               cache=lone.cache if lone else DynamicCache())
        seq = cls(target=target, drafter=drafter, sampling=sampling, generator=generator,
                  layers=layers, sync=dev.type == "cuda", res=res, cache=res.cache, exact=lone,
                  buf=torch.empty(P + max_new_tokens, dtype=torch.long, device=dev),  # (end,)
                  P=P, end=P + max_new_tokens)
        seq.buf[:P] = prompt
        return seq

    @property
    def room(self) -> int:
        """Drafts a round can still commit: beyond end - T - 1 they never could."""
        return self.end - self.T - 1

    def forward(self, ids: torch.Tensor, **kw) -> Any:
        """One timed, counted target forward over ids (1, n) with the KV cache (exact
        verification: its explicit mask over the static cache, and inside `active()` after the
        prefill; the prefill is the same call in plain and speculative decoding, so it keeps the
        target's fast attention)."""
        ctx = contextlib.nullcontext()
        if self.exact is not None:
            cached = int(self.cache.get_seq_length())
            if "attention_mask" in kw:  # a tree: its mask, widened to the cache's capacity
                kw["attention_mask"] = self.exact.widen(kw["attention_mask"])
            else:
                kw.update(self.exact.chain(cached, ids.shape[1], ids.device))
            ctx = active() if cached else ctx

        def run():
            with ctx:
                return self.target.forward(ids, layers=self.layers, cache=self.cache, **kw)
        out, dt = timed(run, self.sync)
        self.res.time_verify += dt
        self.res.target_forwards += 1
        return out

    def decode_state(self) -> DecodeState:
        """What the drafter sees: the committed tokens and the features of all but the last."""
        feats = self.feats[:self.T - 1] if self.feats is not None else None
        return DecodeState(tokens=self.buf[:self.T], features=feats)


def check_inputs(target: Any, drafter: Drafter | None, P: int, max_new_tokens: int, k: int,
                 sampling: SamplingParams, tree: bool, masks: str = "") -> None:
    """Step 0 of `generate`: fail before any work, with the numbers and the fix. masks: why this
    decode passes its own attention masks ("" = it does not)."""
    if P == 0:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. BOS or a chat template)")
    if max_new_tokens < 0 or k < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) and k ({k}) must be >= 0")
    if P + max_new_tokens > target.max_length:
        raise ValueError(
            f"prompt of {P} tokens + max_new_tokens={max_new_tokens} = {P + max_new_tokens} exceeds "
            f"the target's max_length {target.max_length}; shorten the prompt or lower "
            f"max_new_tokens to at most {max(target.max_length - P, 0)}")
    window = getattr(target, "sliding_window", None)
    if masks and window is not None and P + max_new_tokens > window:
        raise ValueError(
            f"the target has sliding-window attention (window {window}) and {masks} passes its own "
            f"attention masks, which do not apply the window: prompt of {P} tokens + "
            f"max_new_tokens={max_new_tokens} must stay within {window}; lower max_new_tokens, "
            f"or decode one sequence at a time with chains and exact_verify=false")
    if drafter is None or k == 0:
        return
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"drafter {drafter.name!r} proposes tokens of a vocabulary of "
                         f"{drafter.vocab_size}, the target's has {target.vocab_size}; train or "
                         f"load the drafter for this target")
    if tree and not drafter.supports_tree:
        raise ValueError(f"drafter {drafter.name!r} does not propose trees; use tree=False")


def prefill(seq: SequenceState, prompt: torch.Tensor) -> torch.Tensor:
    """Step 1: the prompt (P,) goes through the target; its last logits give the first token (1,)."""
    out = seq.forward(prompt[None], logits_to_keep=1)
    if seq.layers:
        seq.feats = out.features.new_empty(seq.end, out.features.shape[-1])  # (end, F)
        seq.feats[:seq.P] = out.features[0]  # (P, F)
    empty = prompt.new_empty(1, 0)  # (1, 0): no drafts
    _, first = accept_chain(empty, None, out.logits[:, -1:], seq.sampling, seq.generator)  # (1,)
    seq.T = seq.P
    return first


def commit(seq: SequenceState, new: torch.Tensor, kept: torch.Tensor | None, eos: torch.Tensor,
           stop: StopChecker | None) -> bool:
    """Step 2: append the new tokens (n,) to buf (and the features (n, F) of the verified inputs
    they follow), cutting at EOS, a stop string or max_new_tokens. True when generation is over."""
    res, T = seq.res, seq.T
    n_new = len(new)
    is_eos = torch.isin(new, eos)  # (n,)
    if bool(is_eos.any()):
        n_new = int(is_eos.long().argmax()) + 1  # first EOS, included
    n_new = min(n_new, seq.end - T)
    seq.buf[T:T + n_new] = new[:n_new]
    if kept is not None and seq.feats is not None:  # features of the verified inputs now committed
        seq.feats[T - 1:T - 1 + n_new] = kept[:n_new]  # rows of [last, accepted drafts]
    if stop is not None:
        for j in range(T, T + n_new):
            if stop.hit(seq.buf[seq.P:j + 1]):
                n_new, res.stop_reason = j + 1 - T, "stop_string"
                break
    seq.T = T = T + n_new
    if not res.stop_reason:
        if n_new and bool(is_eos[n_new - 1]):
            res.stop_reason = "eos"
        elif T == seq.end:
            res.stop_reason = "max_new_tokens"
    return bool(res.stop_reason)


@dataclass
class DraftTree:
    """A drafted tree, cut to the depth that can still commit (the room): tokens (N,), parents
    (N,), ancestors (N, N) bool (decode/tree.py) and the q each node was drawn from (N, V) or
    None."""

    nodes: torch.Tensor
    parents: torch.Tensor
    anc: torch.Tensor
    probs: torch.Tensor | None

    @classmethod
    def empty(cls, device: torch.device) -> "DraftTree":
        """No nodes: the round verifies only the last committed token."""
        none = torch.empty(0, dtype=torch.long, device=device)
        return cls(none, none, torch.zeros(0, 0, dtype=torch.bool, device=device), None)


def draft_tree(seq: SequenceState, room: int) -> DraftTree:
    """Step 3a: draft a tree of N nodes, cut to depth `room` (deeper nodes could never commit)."""
    dev = seq.buf.device
    prop, dt = timed(lambda: seq.drafter.propose_tree(seq.decode_state(), seq.sampling,
                                                      generator=seq.generator), seq.sync)
    seq.res.time_draft += dt
    nodes, parents = prop.tokens.to(dev), prop.parents.to(dev)  # (N,), (N,)
    check_tree(nodes, parents)
    anc = ancestors(parents)  # (N, N)
    probs = None if prop.probs is None else prop.probs.to(dev)[anc.sum(-1) <= room]  # (N', V)
    nodes, parents, anc = prune_depth(nodes, parents, anc, room)
    return DraftTree(nodes, parents, anc, probs)


def accept_tree(seq: SequenceState, tree: DraftTree, logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 5 for a tree, from the target's logits (N+1, V) at [last committed, nodes]: greedy,
    the deepest branch matching the target's argmax; sampling, the multi-draft walk. Either way
    plus the target's token after the branch. Returns keep (n+1,) input positions of the root
    and the accepted nodes, and the bonus (1,)."""
    if seq.sampling.greedy:
        keep, bonus = accept_path(tree.nodes, tree.parents, tree.anc, logits.argmax(-1))
    else:
        keep, bonus = sample_path(tree.nodes, tree.parents, tree.probs,
                                  warp(logits, seq.sampling), seq.generator)
    seq.res.drafted.append(int(tree.anc.sum(-1).max()) if len(tree.nodes) else 0)
    seq.res.accepted.append(len(keep) - 1)
    return keep, bonus


def _tree_round(seq: SequenceState, room: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 3a-6 for a tree: draft a tree, verify every branch in ONE forward, keep the accepted
    branch. Returns (new (n+1,) accepted nodes + bonus, kept (n+1, F) features or None)."""
    cache_len = seq.T - 1
    tree = draft_tree(seq, room)  # 3a.
    # 4. verify: [last committed, nodes] with a tree attention mask, in one forward
    ids, mask, pos = tree_inputs(seq.buf[seq.T - 1:seq.T], tree.nodes, tree.anc, cache_len)
    out = seq.forward(ids, attention_mask=mask, position_ids=pos)
    keep, bonus = accept_tree(seq, tree, out.logits[0])  # 5.
    # 6. the cache keeps tokens[:T-1] + the accepted branch only
    compact_cache(seq.cache, cache_len, keep)
    kept = out.features[0, keep] if seq.layers else None  # (n+1, F)
    return torch.cat([ids[0, keep[1:]], bonus]), kept  # (n+1,)


def record_confidences(res: GenerationResult, prop: ChainProposal, rule: SurvivalRule,
                       m: int) -> tuple[int, list[float] | None]:
    """Step 3c: the drafts of `prop` to verify, cut by survival (decode/survival.py) from the
    first m, and the verified slots' confidences (None: the drafter gave none). Which source gave
    them is recorded on res for the calibration."""
    conf = rule.confidences(prop, m)  # (m,) | None
    if conf is None:
        return m, None
    res.confidence_source = "head" if prop.accept_prob is not None else "draft_prob"
    w = rule.cut(conf, m)
    return w, conf[:w].tolist()


def _chain_round(seq: SequenceState, room: int, k: int, min_confidence: float,
                 rule: SurvivalRule) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 3b-6 for a chain (no drafter: plain decoding, one token): draft up to k tokens, cut
    them by survival, verify them in ONE forward, keep the longest valid prefix plus the target's
    correction / bonus token. Returns (new (n+1,) tokens to commit, kept (n+1, F) features of the
    verified inputs or None)."""
    res, dev = seq.res, seq.buf.device
    # 3b. draft up to k tokens (none when plain decoding or when no room is left)
    draft, q, pred = seq.buf.new_empty(0), None, None  # (0,)
    if seq.drafter is not None and room > 0:
        prop, dt = timed(lambda: seq.drafter.propose(seq.decode_state(), min(k, room),
                                                     seq.sampling, seq.generator, min_confidence),
                         seq.sync)
        res.time_draft += dt
        # 3c. cut where the chain's survival falls below the threshold (never by a draft's value)
        m, pred = record_confidences(res, prop, rule, min(len(prop.tokens), k, room))
        draft = prop.tokens[:m].to(dev)  # (m,)
        q = prop.probs[:m] if prop.probs is not None else None  # (m, V)
    m = len(draft)
    # 4. verify: ONE target forward over [last committed, d_1 .. d_m] with the KV cache
    ids = torch.cat([seq.buf[seq.T - 1:seq.T], draft])[None]  # (1, m+1)
    out = seq.forward(ids)
    # 5. accept the longest valid prefix and add the target's correction / bonus token
    n_t, nxt = accept_chain(draft[None], None if q is None else q[None], out.logits,
                            seq.sampling, seq.generator)  # (1,), (1,)
    n = int(n_t)
    res.drafted.append(m)
    res.accepted.append(n)
    if pred is not None:
        res.slot_confidence.append((pred, n))
    # 6. cut the rejected drafts from the KV cache (accepted ones are never recomputed)
    if m > n:
        seq.cache.crop(n - m)
    kept = out.features[0, :n + 1] if seq.layers else None  # (n+1, F)
    return torch.cat([draft[:n], nxt]), kept  # (n+1,)


@torch.inference_mode()
def generate(
    target: Any,  # target.model.Target
    drafter: Drafter | None,
    prompt_ids: torch.Tensor | Sequence[int],  # (P,) or (1, P)
    *,
    max_new_tokens: int,
    k: int = 5,
    sampling: SamplingParams | None = None,  # None = greedy
    tree: bool = False,
    min_confidence: float = 0.0,
    stop_strings: Sequence[str] = (),
    generator: torch.Generator | None = None,
    exact_verify: bool = False,
    verify_survival: float = 0.0,
    survival_fallback: str = "none",
) -> GenerationResult:
    """Generate up to max_new_tokens after prompt_ids, losslessly: the output has the distribution
    of (greedy: is token-identical to) plain decoding with the target alone.

    drafter=None or k=0 gives plain decoding. tree=True verifies drafter.propose_tree (sampling:
    with the multi-draft rule). min_confidence > 0 lets the drafter stop a chain early (adaptive
    draft length). exact_verify=True computes every verified row with a one-token step's kernels
    (decode/exact.py): greedy output bit-identical to plain decoding with exact_verify=True at
    any dtype, not only up to near-ties. verify_survival > 0 cuts each chain before the first
    slot whose survival (the product of its slot confidences) falls below it, verifying at least
    one draft; survival_fallback (none | draft_prob) says what a drafter without a trained
    confidence head gives as confidences (decode/survival.py).
    """
    t_start = time.perf_counter()
    sampling = sampling or SamplingParams()
    dev = target.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(dev)  # (P,)
    P = len(prompt)
    # 0. guards: fail before any work, with the numbers and the fix
    speculative = drafter is not None and k > 0
    masks = ("exact verification" if exact_verify else
             "tree verification" if tree and speculative else "")
    check_inputs(target, drafter, P, max_new_tokens, k, sampling, tree, masks)
    check_survival(drafter if speculative else None, verify_survival, survival_fallback,
                   tree and speculative)
    rule = SurvivalRule(verify_survival, survival_fallback)
    seq = SequenceState.start(target, drafter if speculative else None, prompt, max_new_tokens,
                              sampling, generator,
                              tuple(drafter.feature_layers) if speculative else (), exact_verify)
    res = seq.res
    if max_new_tokens == 0:
        res.stop_reason = "max_new_tokens"
        res.time_total = time.perf_counter() - t_start
        return res
    eos = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long, device=dev)  # (E,)
    stop = StopChecker(target.tokenizer, stop_strings) if any(stop_strings) else None
    if speculative:
        drafter.reset()
    # 1. prefill; then rounds of 2. commit, 3-6. draft, verify, accept, cut the cache
    new, kept = prefill(seq, prompt), None
    while not commit(seq, new, kept, eos, stop):
        if speculative and tree and seq.room > 0:
            new, kept = _tree_round(seq, seq.room)
        else:
            new, kept = _chain_round(seq, seq.room, k, min_confidence, rule)
    # 7. leave the cache holding tokens[:-1], so a caller can continue from it
    extra = int(seq.cache.get_seq_length()) - (seq.T - 1)
    if extra > 0:
        seq.cache.crop(-extra)
    res.tokens = seq.buf[P:seq.T].cpu()
    res.time_total = time.perf_counter() - t_start
    return res
