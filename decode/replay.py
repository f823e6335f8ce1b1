"""Greedy acceptance replayed on the target's own greedy answers: the decoder's tau, without the
target's verification forwards.

In greedy speculative decoding the committed text is the target's greedy answer y_0 .. y_{N-1},
whatever the drafter does. A round that starts after y_<t drafts d_1 .. d_m (m = min(k, room), the
room being the drafts that can still be committed) from the committed prefix and accepts the
longest run with d_i == y_{t+i-1}; then y_{t+n} is the target's token (the bonus) and the next
round starts after it. Given the answer, every round is therefore fixed by the drafter alone:
`replay_greedy` calls the drafter's `propose` on exactly the prefixes the decoder would (with the
target features of the committed tokens, from ONE target forward over prompt + answer) and counts
the accepted drafts. That gives the decoder's per-round accepted counts
(`GenerationResult.accepted`) up to floating-point ties between the cached and the one-pass target
forward, at the cost of the drafting alone: on many prompts that separates drafters whose
real-decoder tau on a few prompts is within noise.

One difference by construction: the decoder's last round of an answer that ends at EOS may
accept drafts past the EOS that the target agrees with (counted before the cut); the replay does
not know the target's tokens after EOS and stops at it, unless past_eos=True (the target's greedy
continuation stands in for them).

`draft_acceptance` adds, at every answer position, the expected acceptance of one sampled draft,
E[min(1, p/q)] = sum_x min(p(x), q(x)) at the given sampling settings: the per-draft acceptance
rate of speculative sampling on the target's text (an indicator for temperature > 0, where the
decoder's path depends on the samples).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.decode.accept import GREEDY
from specdistill.drafters.base import DecodeState, Drafter
from specdistill.drafters.parts.sampling import SamplingParams, warp


@dataclass
class Replay:
    """One answer replayed: accepted drafts per round (the decoder's `accepted`) and drafts
    proposed per round (its `drafted`)."""

    accepted: list[int]
    drafted: list[int]


def _target_pass(target, drafter: Drafter, ids: torch.Tensor):
    """One target forward over prompt + answer -> (logits (T, V), features (T, F) or None)."""
    out = target.forward(ids[None], layers=tuple(drafter.feature_layers or ()))
    feats = out.features[0] if out.features is not None else None
    return out.logits[0], feats


def _state(ids: torch.Tensor, feats: torch.Tensor | None, t: int) -> DecodeState:
    """The decoder's state with tokens[:t] committed (features of all but the last)."""
    return DecodeState(tokens=ids[:t], features=None if feats is None else feats[:t - 1])


@torch.inference_mode()
def greedy_continuation(target, ids: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) the target's greedy tokens after ids (P,), EOS or not: what a verify forward past the
    end of an answer would compare drafts with."""
    from transformers import DynamicCache

    cache, out, x = DynamicCache(), [], ids[None].to(target.device)  # (1, P)
    for _ in range(n):
        logits = target.forward(x, cache=cache, logits_to_keep=1).logits[0, -1]  # (V,)
        out.append(int(logits.argmax()))
        x = torch.tensor([[out[-1]]], device=target.device)
    return torch.tensor(out, dtype=torch.long)


@torch.inference_mode()
def replay_greedy(target, drafter: Drafter, prompt: torch.Tensor, answer: torch.Tensor, *, k: int,
                  max_new_tokens: int, past_end: bool = False, past_eos: bool = False
                  ) -> Replay:
    """Replay greedy chain decoding with `drafter` (k drafts a round) on the target's greedy
    `answer` (N,) to `prompt` (P,), generated with `max_new_tokens` (how many drafts the decoder
    can still commit, its room, depends on it). Returns the per-round accepted and drafted counts.

    past_end=True replays a serving engine's bookkeeping instead of our decoder's: every round
    drafts k, near max_new_tokens and after an EOS too, and a draft past the answer's end counts as
    accepted when it is the target's greedy token there (vLLM's counters count those; our decoder
    never drafts what it could not commit). past_eos=True keeps our decoder's room but compares
    drafts past the answer's end (after an EOS) with the target's greedy continuation, as our
    decoder and llama.cpp count a round that accepts past an EOS before the output is cut."""
    P, N = len(prompt), len(answer)
    if N > max_new_tokens:
        raise ValueError(f"the answer has {N} tokens, more than max_new_tokens={max_new_tokens}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    dev = target.device
    ids = torch.cat([prompt, answer]).to(dev)  # (P + N,)
    # the target runs only for the features a drafter reads (none for a small LM)
    feats = _target_pass(target, drafter, ids)[1] if drafter.feature_layers else None
    known = answer.to(dev)  # the target's tokens a draft is compared with
    if past_end or (past_eos and N < max_new_tokens):  # an answer cut at max_new_tokens: no past
        known = torch.cat([known, greedy_continuation(target, ids, k).to(dev)])
    drafter.reset()
    accepted, drafted = [], []
    t = 1  # the prefill commits answer[0]; rounds start after it
    while t < N:
        # the decoder never drafts what could not be committed (an engine does: past_end)
        room = k if past_end else max_new_tokens - t - 1
        n = m = 0
        if room > 0:
            prop = drafter.propose(_state(ids, feats, P + t), min(k, room), GREEDY)
            draft = prop.tokens[:min(k, room)].to(dev)  # (m,)
            m = len(draft)
            truth = known[t:t + m]  # the target's tokens there (fewer near the end)
            same = draft[:len(truth)] == truth
            n = int(same.long().cumprod(0).sum())
        accepted.append(n)
        drafted.append(m)
        t += n + 1
    return Replay(accepted=accepted, drafted=drafted)


@torch.inference_mode()
def draft_acceptance(target, drafter: Drafter, prompt: torch.Tensor, answer: torch.Tensor,
                     sampling: SamplingParams, generator: torch.Generator | None = None
                     ) -> list[float]:
    """sum_x min(p(x), q(x)) of the first draft at every answer position t >= 1, p the target's
    and q the drafter's distribution (both warped by `sampling`) after prompt + answer[:t]."""
    P, N = len(prompt), len(answer)
    ids = torch.cat([prompt, answer]).to(target.device)  # (P + N,)
    logits, feats = _target_pass(target, drafter, ids)
    drafter.reset()
    out = []
    for t in range(1, N):
        prop = drafter.propose(_state(ids, feats, P + t), 1, sampling, generator)
        if len(prop.tokens) == 0:
            out.append(0.0)
            continue
        q = prop.probs[0] if prop.probs is not None else torch.nn.functional.one_hot(
            prop.tokens[0], logits.shape[-1]).float()  # (V,)
        p = warp(logits[P + t - 1], sampling)  # (V,)
        out.append(float(torch.minimum(p, q.to(p.device, p.dtype)).sum()))
    return out
