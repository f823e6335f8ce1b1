"""The decode-time half of the drafter interface (drafters/base.py re-exports it): what the decoder
shows a drafter before a round (`DecodeState`), what a drafter proposes (`ChainProposal`,
`TreeProposal`), and the chain-drawing loop every drafter shares (`ChainDraw`, driven by
`Drafter.draft_chain` and by batched `propose_rows`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdistill.drafters.sampling import SamplingParams, draft_token
from specdistill.drafters.vocab import expand_probs


@dataclass
class DecodeState:
    """What the decoder shows a drafter before a round."""

    tokens: torch.Tensor  # (T,) long: prompt + generated tokens committed so far
    # (T-1, F) target features of tokens[:-1] (the last committed token, the target's bonus token,
    # has not been through the target yet), F = sum of the widths of `feature_layers`, concatenated
    # in that order. None when the drafter asks for no features.
    features: torch.Tensor | None = None


@dataclass
class ChainProposal:
    """k drafted tokens that continue `state.tokens`, in order."""

    tokens: torch.Tensor  # (k,) long
    # (k, V) the warped draft distributions q_i the tokens were sampled from, needed by the lossless
    # sampling rule. None means a deterministic drafter: q_i is one-hot on tokens[i].
    probs: torch.Tensor | None = None
    # (k,) max_x q_i(x) per position, for verify budgets (decode/batched/planner.py); None: deterministic
    confidence: torch.Tensor | None = None


@dataclass
class TreeProposal:
    """A draft tree rooted at the last committed token. Nodes are topologically ordered."""

    tokens: torch.Tensor  # (N,) long: the token of each node
    parents: torch.Tensor  # (N,) long: index of the parent node, -1 = child of the root
    # (N, V) warped q node i was drawn from given its path and earlier siblings (drawn in index
    # order), for the lossless multi-draft rule; None = a deterministic tree (q one-hot on tokens)
    probs: torch.Tensor | None = None

    def depths(self) -> torch.Tensor:
        """(N,) depth of each node, 1 for children of the root."""
        depth = torch.zeros_like(self.parents)
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth


class ChainDraw:
    """One chain being drafted, draw by draw (Drafter.draft_chain; several at once in a drafter's
    batched propose_rows):
    1. draw draft i from its logits (argmax, or a sample from the warped q_i);
    2. stop early when its confidence falls below min_confidence (never on the first);
    3. map it to a target id; the chain goes on until k drafts;
    4. package the target ids, their confidences and (sampling) q over the target vocabulary.
    `drafter` is the drafters.base.Drafter drafting (its target_ids, d2t and vocab_size)."""

    def __init__(self, drafter: Any, k: int, sampling: SamplingParams,
                 generator: torch.Generator | None, min_confidence: float) -> None:
        self.drafter, self.k, self.sampling = drafter, k, sampling
        self.generator, self.min_confidence = generator, min_confidence
        self.tokens: list[torch.Tensor] = []  # target ids
        self.qs: list[torch.Tensor | None] = []
        self.confs: list[float] = []
        self.done = k < 1

    @property
    def n(self) -> int:
        return len(self.tokens)

    def draw(self, logits: torch.Tensor) -> bool:
        """Draw the next draft from logits (Vd,); True when the chain wants the next logits."""
        if self.done:
            return False
        d, q, conf = draft_token(logits, self.sampling, self.generator, self.min_confidence)
        if self.tokens and conf < self.min_confidence:  # 2.
            self.done = True
            return False
        self.tokens.append(self.drafter.target_ids(d))  # 3.
        self.qs.append(q)
        self.confs.append(conf)
        self.done = self.n >= self.k
        return not self.done

    def proposal(self) -> ChainProposal:  # 4.
        if not self.tokens:
            return ChainProposal(tokens=torch.empty(0, dtype=torch.long))
        tokens, conf = torch.stack(self.tokens).long(), torch.tensor(self.confs)  # (n,), (n,)
        q = None if self.sampling.greedy else expand_probs(torch.stack(self.qs), self.drafter.d2t,
                                                           self.drafter.vocab_size)
        return ChainProposal(tokens=tokens, probs=q, confidence=conf)  # q: (n, V) | None
