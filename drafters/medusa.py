"""Medusa (Medusa-1): K extra heads on the target's last hidden state, head k guessing the token
k+1 places past the target's own next token.

    head_k(f_t) = lm_head(ResBlock^L(f_t))      ResBlock(x) = x + SiLU(Linear(H -> H)(x))

f_t is the target's final-normed hidden state at position t (feature_layers=(-1,)); the target's
LM head on f_t gives token t+1, head k gives token t+2+k. Each ResBlock's Linear starts at zero
(weight and bias), so a fresh head is exactly the target's LM head: training starts from "guess
that the token repeats the target's next-token distribution" rather than from noise.

The vocab projection is the draft head (drafters/parts/head.py): the target's LM head, frozen and shared
by all heads, or, with draft_vocab_size, one trainable Linear(H -> Vd) shared by all heads and
started from the target's rows d2t. Heads do not see each other's drafts, so drafting costs no
drafter recurrence and the chain is just every head's argmax (or sample) at once; trees come from a
static shape.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.cli.ranges import MAX_DRAFT, MAX_LAYERS, MAX_VOCAB, rng
from specdistill.drafters.base import (
    ChainProposal,
    DecodeState,
    Drafter,
    DrafterConfig,
    DraftPrediction,
    TrainBatch,
    TreeProposal,
    register,
)
from specdistill.drafters.parts.anchors import counted
from specdistill.drafters.parts.head import head_logits, init_draft_head
from specdistill.drafters.parts.layouts import WEIGHTS, ExportLayout, cast, torch_dtype
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.drafters.parts.tree import StaticTree, static_tree

# A 26-node Medusa tree (paths of per-depth top-k ranks), widest where heads are most accurate:
# 4 candidates at depth 1, 7 at depth 2, 7 at depth 3, 8 at depth 4.
DEFAULT_TREE = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0], [1, 0, 0], [1, 1, 0], [2, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0],
    [1, 1, 0, 0], [2, 0, 0, 0],
]


@dataclass
class MedusaConfig(DrafterConfig):
    """Medusa drafter settings."""

    name: str = "medusa"  # registry key
    # heads; head k predicts the token k+2 after the last processed position
    num_heads: int = rng(4, 1, MAX_DRAFT)
    num_layers: int = rng(1, 1, MAX_LAYERS)  # residual blocks per head
    # pruned shared head size (None = target's head, frozen)
    draft_vocab_size: Optional[int] = rng(None, 1, MAX_VOCAB)
    head_decay: float = rng(0.8, 0, 1)  # loss weight of head k is head_decay ** k (Medusa's 0.8)
    # static tree: list of rank paths, or that list as a string; paths deeper than num_heads or
    # with a rank >= tree_top_k are dropped (with their descendants)
    tree_choices: Any = field(default_factory=lambda: [list(c) for c in DEFAULT_TREE])
    tree_top_k: int = rng(10, 1, MAX_DRAFT)  # candidates taken per depth for the static tree


class MedusaResBlock(nn.Module):
    """x + SiLU(Linear(x)), with the Linear zero-initialised (identity at start)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))  # (..., H)


def parse_tree_choices(choices: Any, max_depth: int, top_k: int) -> StaticTree:
    """Config tree_choices (list or string) -> a StaticTree limited to max_depth and ranks < top_k."""
    if isinstance(choices, str):
        choices = ast.literal_eval(choices)
    paths = [[int(r) for r in c] for c in choices]
    # the kept set stays prefix-closed: a path's prefixes are no deeper and have no larger rank
    kept = [p for p in paths if len(p) <= max_depth and max(p, default=0) < top_k]
    if not kept:
        raise ValueError(f"medusa: no tree choice fits num_heads={max_depth}, tree_top_k={top_k}")
    return static_tree(kept)


# =================================================================================================
# Export layouts (sources read 2026-11-29)
#   vllm/model_executor/models/medusa.py + transformers_utils/configs/medusa.py: blocks.{i}.layers.{j}
#   .{weight,bias} (medusa_fc_bias), lm_heads.0.weight shared by all heads (original_lm_head),
#   token_map + truncated_vocab_size for a pruned vocab; and, where it can hold the heads (full
#   vocab, <= 1 block), FasterDecoding/Medusa medusa/model/medusa_model.py: medusa_lm_head.pt, loaded
#   by `model.medusa_head.load_state_dict(sd, strict=False)` -- so keyed relative to the medusa_head
#   ModuleList: {i}.{j}.linear.{weight,bias} and {i}.{L}.weight (a "medusa_head." prefix would be
#   skipped silently) -- and config medusa_num_heads / medusa_num_layers / base_model_name_or_path.
#   (That repo repeats ONE ResBlock object per head, so more than one block would be tied on load.)
#   `medusa` and `vllm` are the same folder: vLLM's Medusa loader reads it.
# =================================================================================================
ORIGINAL = "medusa_lm_head.pt"  # the Medusa repo's heads file


def _write_medusa(drafter, state, ctx):
    dcfg, target = ctx.drafter_config, ctx.target
    K, L = dcfg["num_heads"], dcfg["num_layers"]
    vllm = {}
    for name, v in state.items():  # heads.{i}.{j}.linear.{weight,bias} -> blocks.{i}.layers.{j}.*
        if name.startswith("heads."):
            _, i, j, _, kind = name.split(".")
            vllm[f"blocks.{i}.layers.{j}.{kind}"] = v
    pruned = dcfg.get("draft_vocab_size") is not None
    head = (state["lm_head.weight"] if pruned
            else cast(target.lm_head().weight, torch_dtype(ctx.dtype)))  # (Vd|V, H)
    vllm["lm_heads.0.weight"] = head
    if pruned:
        vllm["token_map"] = state["draft_vocab.d2t"]  # (Vd,) target ids of the head's rows
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa",
           "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
           "num_heads": K, "num_hidden_layers": L, "medusa_num_heads": K, "medusa_num_layers": L,
           "truncated_vocab_size": head.shape[0], "medusa_fc_bias": True, "original_lm_head": True,
           "base_model_name_or_path": ctx.meta.get("base_model"), **ctx.common()}
    files = {WEIGHTS: vllm}
    if not pruned and L <= 1:  # the original repo's layout; one head tensor shared by K keys is
        orig = {}              # stored once by torch.save
        for i in range(K):
            for j in range(L):
                for kind in ("weight", "bias"):
                    orig[f"{i}.{j}.linear.{kind}"] = state[f"heads.{i}.{j}.linear.{kind}"]
            orig[f"{i}.{L}.weight"] = head
        files[ORIGINAL] = orig
    return cfg, files


def _read_medusa(files, dcfg, vocab_size):
    t, state = files[WEIGHTS], {}
    for name, v in t.items():
        if name.startswith("blocks."):
            _, i, _, j, kind = name.split(".")
            state[f"heads.{i}.{j}.linear.{kind}"] = v
    if dcfg.get("draft_vocab_size") is not None:
        state["lm_head.weight"] = t["lm_heads.0.weight"]
        d2t = t["token_map"].long()
        state["draft_vocab.d2t"] = d2t
        state["draft_vocab.t2d"] = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, d2t, True)
    return state


def _verify_medusa(files, dcfg, target, dtype) -> list[str]:
    """A full-vocab head must be the target's (shared); medusa_lm_head.pt must repeat model.safetensors."""
    out, w = [], files.get(WEIGHTS, {})
    head = w.get("lm_heads.0.weight")
    if dcfg.get("draft_vocab_size") is None and head is not None \
            and head.shape == target.lm_head().weight.shape \
            and not torch.equal(head, target.lm_head().weight.detach().cpu().to(dtype)):
        out.append("lm_heads.0.weight differs from the target's LM head, which a full-vocab Medusa "
                   "drafter shares: exported for another target?")
    orig = files.get(ORIGINAL)
    if orig is not None and head is not None and not out:
        L = dcfg["num_layers"]
        for name, v in orig.items():  # {i}.{j}.linear.{kind} or {i}.{L}.weight
            i, rest = name.split(".", 1)
            inner = rest.replace('.linear', '')
            twin = head if rest == f"{L}.weight" else w.get(f"blocks.{i}.layers.{inner}")
            if twin is not None and twin.shape == v.shape and not torch.equal(twin, v):
                out.append(f"{ORIGINAL}: {name} differs from its copy in {WEIGHTS}")
    return out


def _medusa_layout(fmt: str) -> ExportLayout:
    return ExportLayout(
        format=fmt, tags=("vllm",), write=_write_medusa, read=_read_medusa, verify=_verify_medusa,
        summary="Medusa heads as vLLM's Medusa loader reads them (model.safetensors) and, when it "
                "can hold them, as the original Medusa repo reads them (medusa_lm_head.pt).",
        # vLLM's Medusa proposes one token per head
        usage="vllm serve {base} --speculative-config '{{\"method\": \"medusa\", \"model\": "
              "\"{path}\", \"num_speculative_tokens\": {drafter[num_heads]}}}'",
        serving={"vllm": {"method": "medusa"}} if fmt == "vllm" else {})


@register("medusa", config=MedusaConfig, layouts=(_medusa_layout("medusa"), _medusa_layout("vllm")))
class Medusa(Drafter):
    """Medusa drafter: independent residual heads over the target's final hidden state."""

    feature_layers = (-1,)

    def __init__(self, cfg: MedusaConfig, target) -> None:
        super().__init__(target.vocab_size, cfg, target)
        if cfg.num_heads < 1 or cfg.num_layers < 0:
            raise ValueError(f"medusa: num_heads ({cfg.num_heads}) must be >= 1 and num_layers "
                             f"({cfg.num_layers}) >= 0")
        H = target.hidden_size
        self.heads = nn.ModuleList(nn.Sequential(*[MedusaResBlock(H) for _ in range(cfg.num_layers)])
                                   for _ in range(cfg.num_heads))
        init_draft_head(self, target.lm_head(), cfg.draft_vocab_size, target.vocab_size)
        self.tree = parse_tree_choices(cfg.tree_choices, cfg.num_heads, cfg.tree_top_k)
        self.to(target.device)

    def head_logits(self, feats: torch.Tensor, k: int) -> torch.Tensor:
        """Target features (..., H) -> head k's logits (..., Vd)."""
        dtype = next(self.parameters(), torch.empty(0)).dtype
        feats = feats.clone() if feats.is_inference() else feats  # from Target.forward's inference mode
        h = self.heads[k](feats.to(dtype))  # (..., H)
        return head_logits(self, h)  # the target's head (if not pruned), shared by every head

    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """Head k at position t predicts token t+2+k: shift k+1, weight head_decay**k."""
        if batch.features is None:
            raise ValueError("medusa: the batch has no target features (feature_layers=(-1,))")
        preds = []
        for k in range(self.cfg.num_heads):
            at = counted(batch, k + 1)  # (B, T): the head only where the loss reads it
            preds.append(DraftPrediction(logits=self.head_logits(batch.features[at], k), at=at,
                                         shift=k + 1, weight=self.cfg.head_decay ** k))  # (M, Vd)
        return preds

    @torch.no_grad()
    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        """The bonus token tokens[-1] came from the feature of position T-2 = features[-1]; head i
        on that same feature guesses the token i+1 places after the bonus token."""
        if k < 1:
            return ChainProposal(tokens=state.tokens.new_empty(0))
        if state.features is None or state.features.shape[0] < 1:
            raise ValueError("medusa: propose needs state.features for tokens[:-1]")
        f = state.features[-1]  # (H,)
        return self.draft_chain(self.head_logits(f, 0).float(),  # head i+1 needs no drafted token
                                lambda i, token: self.head_logits(f, i + 1).float(),
                                min(k, self.cfg.num_heads), sampling, generator, min_confidence)

    @torch.no_grad()
    def propose_tree(self, state: DecodeState, sampling: SamplingParams,
                     generator: torch.Generator | None = None) -> TreeProposal:
        """The static tree filled with each head's top-k tokens. Deterministic also when sampling
        (probs None: the multi-draft rule then tests each candidate with q one-hot on it)."""
        if state.features is None or state.features.shape[0] < 1:
            raise ValueError("medusa: propose_tree needs state.features for tokens[:-1]")
        f = state.features[-1]  # (H,)
        D, K = self.tree.max_depth, self.tree.max_rank
        logits = torch.stack([self.head_logits(f, d) for d in range(D)])  # (D, Vd)
        cand = self.target_ids(logits.topk(K, dim=-1).indices)  # (D, K) target ids
        return self.tree.instantiate(cand)
