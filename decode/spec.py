"""The lossless speculative decoding loop: one function, `generate`, with numbered steps.

Each round the drafter proposes tokens (a chain of up to k, or a tree), the target verifies all of
them in ONE forward over [last committed token, drafts], the acceptance rule keeps the longest valid
prefix plus one target token, and the KV cache is cut back to the committed tokens. Without a
drafter (or with k=0) the same loop is plain decoding: one target forward per token.

Invariants between rounds (T = committed tokens, prompt included):
  * buf[:T] holds the committed tokens; the target's KV cache holds tokens[:T-1] (the last one, the
    target's own bonus/correction token, has not been through the target yet);
  * feats[:T-1] holds the target features of tokens[:T-1] when the drafter reads features.
Buffers are preallocated and only appended to, so a round costs O(k), not O(T), outside the models.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from decode.accept import accept_chain
from decode.tree import (accept_path, ancestors, check_tree, compact_cache, prune_depth,
                         tree_inputs)
from drafters.base import DecodeState, Drafter
from drafters.sampling import SamplingParams


@dataclass
class GenerationResult:
    """What one `generate` call produced and how."""

    tokens: torch.Tensor  # (n,) long, on the CPU: generated tokens (the prompt excluded)
    # per decode round (one target forward each, the prefill excluded): drafted tokens (for a tree,
    # its depth) and accepted drafts as verified, before any cut at EOS / stop string / budget
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    target_forwards: int = 0  # prefill included
    time_draft: float = 0.0  # seconds inside drafter.propose / propose_tree
    time_verify: float = 0.0  # seconds inside target forwards (prefill included)
    time_total: float = 0.0  # wall-clock seconds of the whole call
    stop_reason: str = ""  # "eos" | "stop_string" | "max_new_tokens"
    cache: Any = field(default=None, repr=False)  # target KV cache of tokens[:-1] (prompt included)

    @property
    def time_other(self) -> float:
        """Seconds outside the drafter and the target: the decoder's own overhead."""
        return self.time_total - self.time_draft - self.time_verify


class _StopChecker:
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


def _timed(fn, sync: bool):
    """Run fn() and return (its result, seconds), waiting for the GPU when there is one."""
    t0 = time.perf_counter()
    out = fn()
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


@torch.inference_mode()
def generate(
    target: Any,  # drafters.target.Target
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
) -> GenerationResult:
    """Generate up to max_new_tokens after prompt_ids, losslessly: the output has the distribution
    of (greedy: is token-identical to) plain decoding with the target alone.

    drafter=None or k=0 gives plain decoding. tree=True verifies drafter.propose_tree (greedy
    only). min_confidence > 0 lets the drafter stop a chain early (adaptive draft length).
    """
    t_start = time.perf_counter()
    sampling = sampling or SamplingParams()
    dev = target.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(dev)  # (P,)
    P = len(prompt)
    # -- 0. guards: fail before any work, with the numbers and the fix -----------------------------
    if P == 0:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. BOS or a chat template)")
    if max_new_tokens < 0 or k < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) and k ({k}) must be >= 0")
    if P + max_new_tokens > target.max_length:
        raise ValueError(
            f"prompt of {P} tokens + max_new_tokens={max_new_tokens} = {P + max_new_tokens} exceeds "
            f"the target's max_length {target.max_length}; shorten the prompt or lower "
            f"max_new_tokens to at most {max(target.max_length - P, 0)}")
    speculative = drafter is not None and k > 0
    if speculative and drafter.vocab_size != target.vocab_size:
        raise ValueError(f"drafter {drafter.name!r} proposes tokens of a vocabulary of "
                         f"{drafter.vocab_size}, the target's has {target.vocab_size}; train or "
                         f"load the drafter for this target")
    if speculative and tree:
        if not sampling.greedy:
            raise ValueError("tree decoding is greedy only (its acceptance walk needs temperature=0); "
                             "use a chain (tree=False) or temperature=0")
        if not drafter.supports_tree:
            raise ValueError(f"drafter {drafter.name!r} does not propose trees; use tree=False")
    sync = dev.type == "cuda"
    res = GenerationResult(tokens=prompt.new_empty(0).cpu())
    eos = torch.tensor(sorted(target.eos_token_ids), dtype=torch.long, device=dev)  # (E,)
    stop = _StopChecker(target.tokenizer, stop_strings) if any(stop_strings) else None
    layers = tuple(drafter.feature_layers) if speculative else ()
    buf = torch.empty(P + max_new_tokens, dtype=torch.long, device=dev)  # committed tokens
    buf[:P] = prompt
    feats: torch.Tensor | None = None  # (P + max_new_tokens, F), allocated at the first forward
    cache = DynamicCache()
    res.cache = cache
    if max_new_tokens == 0:
        res.stop_reason = "max_new_tokens"
        res.time_total = time.perf_counter() - t_start
        return res
    if speculative:
        drafter.reset()

    # -- 1. prefill: the prompt goes through the target; its last logits give the first token -----
    out, dt = _timed(lambda: target.forward(prompt[None], layers=layers, cache=cache,
                                            logits_to_keep=1), sync)
    res.time_verify += dt
    res.target_forwards += 1
    if layers:
        feats = out.features.new_empty(P + max_new_tokens, out.features.shape[-1])
        feats[:P] = out.features[0]  # (P, F)
    empty = prompt.new_empty(1, 0)  # (1, 0): no drafts
    _, first = accept_chain(empty, None, out.logits[:, -1:], sampling, generator)  # (1,)
    new, kept, T = first, None, P  # tokens to commit; feature rows of the verified inputs to keep

    while True:
        # -- 2. commit: append the new tokens, cutting at EOS, a stop string or the budget ---------
        n_new = len(new)
        is_eos = torch.isin(new, eos)  # (len(new),)
        if bool(is_eos.any()):
            n_new = int(is_eos.long().argmax()) + 1  # first EOS, included
        n_new = min(n_new, P + max_new_tokens - T)
        buf[T:T + n_new] = new[:n_new]
        if kept is not None and feats is not None:  # features of the verified inputs now committed
            feats[T - 1:T - 1 + n_new] = kept[:n_new]  # rows of [last, accepted drafts]
        if stop is not None:
            for j in range(T, T + n_new):
                if stop.hit(buf[P:j + 1]):
                    n_new, res.stop_reason = j + 1 - T, "stop_string"
                    break
        T += n_new
        if not res.stop_reason:
            if n_new and bool(is_eos[n_new - 1]):
                res.stop_reason = "eos"
            elif T == P + max_new_tokens:
                res.stop_reason = "max_new_tokens"
        if res.stop_reason:
            break
        state = DecodeState(tokens=buf[:T], features=feats[:T - 1] if feats is not None else None)
        budget = P + max_new_tokens - T - 1  # drafts beyond this could never be committed
        cache_len = T - 1

        # -- 3a. tree round: draft a tree, verify every branch in one forward, keep the best one ---
        if speculative and tree and budget > 0:
            prop, dt = _timed(lambda: drafter.propose_tree(state, sampling), sync)
            res.time_draft += dt
            nodes, parents = prop.tokens.to(dev), prop.parents.to(dev)  # (N,), (N,)
            check_tree(nodes, parents)
            nodes, parents, anc = prune_depth(nodes, parents, ancestors(parents), budget)
            ids, mask, pos = tree_inputs(buf[T - 1:T], nodes, anc, cache_len)
            out, dt = _timed(lambda: target.forward(ids, layers=layers, cache=cache,
                                                    attention_mask=mask, position_ids=pos), sync)
            res.time_verify += dt
            res.target_forwards += 1
            keep, bonus = accept_path(nodes, parents, anc, out.logits[0].argmax(-1))
            compact_cache(cache, cache_len, keep)  # the cache now holds tokens[:T-1] + the branch
            new = torch.cat([ids[0, keep[1:]], bonus])  # (n+1,) accepted nodes + bonus
            kept = out.features[0, keep] if layers else None  # (n+1, F)
            res.drafted.append(int(anc.sum(-1).max()) if len(nodes) else 0)
            res.accepted.append(len(keep) - 1)
            continue

        # -- 3b. chain round: draft up to k tokens (none when plain decoding) ----------------------
        draft, q = empty[0], None  # (0,)
        if speculative and budget > 0:
            prop, dt = _timed(lambda: drafter.propose(state, min(k, budget), sampling, generator,
                                                      min_confidence), sync)
            res.time_draft += dt
            m = min(len(prop.tokens), k, budget)
            draft = prop.tokens[:m].to(dev)  # (m,)
            q = prop.probs[:m] if prop.probs is not None else None  # (m, V)
        m = len(draft)

        # -- 4. verify: ONE target forward over [last committed, d_1 .. d_m] with the KV cache -----
        ids = torch.cat([buf[T - 1:T], draft])[None]  # (1, m+1)
        out, dt = _timed(lambda: target.forward(ids, layers=layers, cache=cache), sync)
        res.time_verify += dt
        res.target_forwards += 1

        # -- 5. accept the longest valid prefix and add the target's correction / bonus token ------
        n_t, nxt = accept_chain(draft[None], None if q is None else q[None], out.logits,
                                sampling, generator)  # (1,), (1,)
        n = int(n_t)
        new = torch.cat([draft[:n], nxt])  # (n+1,)
        kept = out.features[0, :n + 1] if layers else None  # (n+1, F)
        res.drafted.append(m)
        res.accepted.append(n)

        # -- 6. cut the rejected drafts from the KV cache (accepted ones are never recomputed) ------
        if m > n:
            cache.crop(n - m)

    # -- 7. leave the cache holding tokens[:-1], so a caller can continue from it ------------------
    extra = cache.get_seq_length() - (T - 1)
    if extra > 0:
        cache.crop(-extra)
    res.tokens = buf[P:T].cpu()
    res.time_total = time.perf_counter() - t_start
    return res
