"""Training-free n-gram (prompt-lookup) drafter: propose what followed the last time the current
suffix occurred in the prompt or the generated text.

It needs no weights, so it is the baseline every trained drafter must beat, and it gives tree
decoding a real drafter: several earlier occurrences give several continuations, merged by prefix.

Lookups are O(1) per round: an index maps every n-gram (min_ngram..max_ngram tokens) to the
positions where it ended, and is updated only with the tokens appended since the last round (the
decoder's append-only contract), so a long context costs nothing per round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.cli.ranges import MAX_DRAFT, MAX_TREE, rng
from specdistill.drafters.base import (
    ChainProposal,
    DecodeState,
    Drafter,
    DrafterConfig,
    TreeProposal,
    parse_config,
    register,
)
from specdistill.drafters.parts.sampling import SamplingParams


@dataclass
class NgramConfig(DrafterConfig):
    name: str = "ngram"
    # longest suffix matched against earlier text (tried first)
    max_ngram: int = rng(3, 1, MAX_DRAFT)
    min_ngram: int = rng(1, 1, MAX_DRAFT)  # shortest suffix tried before giving up on a round
    tree_depth: int = rng(5, 1, MAX_DRAFT)  # tokens per continuation in a tree proposal
    tree_branches: int = rng(4, 1, MAX_DRAFT)  # distinct continuations merged into a tree proposal
    # most recent occurrences per n-gram considered for a tree
    max_matches: int = rng(8, 1, MAX_TREE)


@register("ngram", NgramConfig)
class Ngram(Drafter):
    """Prompt-lookup drafter. Deterministic: proposals carry probs=None (one-hot q)."""

    def __init__(self, cfg: NgramConfig | None = None, vocab_size: int = 0) -> None:
        super().__init__(vocab_size)
        self.cfg = cfg = cfg or NgramConfig()
        if not 1 <= cfg.min_ngram <= cfg.max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({cfg.min_ngram}) <= max_ngram ({cfg.max_ngram})")
        if cfg.tree_depth < 1 or cfg.tree_branches < 1 or cfg.max_matches < 1:
            raise ValueError("tree_depth, tree_branches and max_matches must be >= 1")
        self.reset()

    @classmethod
    def build(cls, cfg, target) -> "Ngram":
        """From its config in any form (dataclass, OmegaConf node, dict); needs no weights."""
        return cls(parse_config(cfg, NgramConfig), target.vocab_size)

    def reset(self) -> None:
        self._toks: list[int] = []  # the tokens indexed so far
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token

    # -- the incremental index -------------------------------------------------------------------
    def _sync(self, tokens: torch.Tensor) -> list[int]:
        """Index the tokens appended since the last call; rebuild if the history changed."""
        seen = len(self._toks)
        if seen > len(tokens) or (seen and int(tokens[seen - 1]) != self._toks[-1]):
            self.reset()  # not an append (a new prompt without reset()): start over
            seen = 0
        toks, ends = self._toks, self._ends
        for tok in tokens[seen:].tolist():
            toks.append(tok)
            e = len(toks) - 1
            for n in range(self.cfg.min_ngram, min(self.cfg.max_ngram, e + 1) + 1):
                ends.setdefault(tuple(toks[e - n + 1:]), []).append(e)
        return toks

    def _matches(self, toks: list[int]):
        """Earlier end positions of the current suffix: longest n-gram first, most recent first."""
        T = len(toks)
        for n in range(min(self.cfg.max_ngram, T - 1), self.cfg.min_ngram - 1, -1):
            ends = self._ends.get(tuple(toks[T - n:]), [])
            # ends[-1] is T-1, the suffix itself; the ones before it are earlier occurrences
            yield from reversed(ends[-self.cfg.max_matches - 1:-1])

    @staticmethod
    def _continuation(toks: list[int], e: int, length: int) -> list[int]:
        """The `length` tokens after position e. When the match is closer than `length` to the end,
        the text between it and the end repeats (a loop), so extend it periodically."""
        period = len(toks) - 1 - e
        return [toks[e + 1 + j % period] for j in range(length)]

    # -- proposals ---------------------------------------------------------------------------------
    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        toks = self._sync(state.tokens)
        e = next(self._matches(toks), None)
        cont = self._continuation(toks, e, k) if e is not None and k > 0 else []
        return ChainProposal(tokens=torch.tensor(cont, dtype=torch.long, device=state.tokens.device))

    def propose_tree(self, state: DecodeState, sampling: SamplingParams,
                     generator: torch.Generator | None = None) -> TreeProposal:
        """Up to tree_branches distinct continuations of tree_depth tokens, merged by prefix
        (deterministic, also when sampling: probs None)."""
        toks = self._sync(state.tokens)
        conts: list[tuple[int, ...]] = []
        for e in self._matches(toks):
            c = tuple(self._continuation(toks, e, self.cfg.tree_depth))
            if c not in conts:
                conts.append(c)
                if len(conts) == self.cfg.tree_branches:
                    break
        node: dict[tuple[int, ...], int] = {}  # path prefix -> node index (a trie)
        tokens, parents = [], []
        for c in conts:  # the first (longest, most recent) match gets the first children
            for d in range(1, len(c) + 1):
                if c[:d] not in node:
                    node[c[:d]] = len(tokens)
                    tokens.append(c[d - 1])
                    parents.append(node[c[:d - 1]] if d > 1 else -1)
        dev = state.tokens.device
        return TreeProposal(tokens=torch.tensor(tokens, dtype=torch.long, device=dev),
                            parents=torch.tensor(parents, dtype=torch.long, device=dev))
