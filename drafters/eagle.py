"""EAGLE (EAGLE-1/2): a one-layer autoregressive head over the target's features.

At position t the drafter reads the target's feature f_t and the embedding of the token t+1 that
f_t produced, and predicts the target's next feature f_{t+1}; the target's LM head on that
prediction gives the distribution of token t+2:

    x_t = fc([embed(token_{t+1}), f_t])          fc: Linear(2H -> H)
    h_t = LlamaDecoderLayer(s)(x_t)               causal attention over positions <= t, RoPE
    logits_t = lm_head(h_t)                       h_t ~ f_{t+1}

Design decision (feature normalisation): the default feature is the target's *final-normed* hidden
state (feature_layer=-1), as in EAGLE-1. The drafter predicts that normed state directly and feeds
it to the LM head with no norm of its own, so (1) the feature loss and the token loss aim at the
same vector, and (2) at decode time a predicted feature is a drop-in replacement for a real one as
the next step's input. With an intermediate feature_layer (an un-normed residual stream) a trainable
RMSNorm, initialised from the target's final norm, sits before the LM head.

Design decision (layer 0's input norm, `input_norm`): on by default (an RMSNorm on fc's output);
`input_norm=false` drops it as EAGLE-1 and the serving engines' EAGLE loaders do, which together
with the target's own LM head (draft_vocab_size=None) makes the head exportable to vLLM, SGLang
and speculators exactly (drafters/export_formats.py).

Embedding: the target's, frozen. LM head: the target's, frozen (draft_vocab_size=None), or a
trainable Linear(H -> Vd) over a pruned draft vocabulary started from the target's rows (vocab.py).
Target modules are reached through `self.target` (a plain attribute), never registered as
submodules, so the drafter's state_dict holds only its own weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from drafters.base import (ChainProposal, DecodeState, Drafter, DrafterConfig, DraftPrediction,
                           TrainBatch, TreeProposal, parse_config, register)
from drafters.sampling import SamplingParams, draft_token
from drafters.tree import dynamic_tree
from drafters.vocab import DraftVocab, expand_probs, head_from_target


@dataclass
class EagleConfig(DrafterConfig):
    """EAGLE drafter settings."""

    name: str = "eagle"  # registry key
    feature_layer: int = -1  # target hidden state read and predicted (-1 = final-normed, EAGLE-1)
    draft_vocab_size: Optional[int] = None  # pruned LM head size (None = target's head, frozen)
    num_layers: int = 1  # decoder layers of the drafter
    init_from_target_layer: Optional[int] = None  # copy this target layer's weights (None = random)
    # RMSNorm on fc's output before layer 0's attention. false = the EAGLE-1 layout the serving
    # engines load (vLLM, SGLang and speculators drop layer 0's input_layernorm), so the head can
    # be exported to them exactly (drafters/export.py)
    input_norm: bool = True
    train_unroll: int = 1  # training-time test steps (1 = teacher forced; k>1 adds shifts 2..k)
    unroll_decay: float = 0.8  # loss weight of unrolled step j is unroll_decay ** (j - 1)
    tree_top_k: int = 8  # EAGLE-2 tree: children per expanded node and nodes expanded per level
    tree_depth: int = 6  # EAGLE-2 tree: levels grown
    tree_total_tokens: int = 60  # EAGLE-2 tree: nodes kept for verification


def drafter_llama_config(target, num_layers: int) -> LlamaConfig:
    """A LlamaConfig for the drafter's layers, with the target's widths, heads, norm eps and RoPE."""
    tc = target.config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    cfg = LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=head_dim, hidden_act=getattr(tc, "hidden_act", "silu"),
        max_position_embeddings=target.max_length, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters=getattr(tc, "rope_parameters", None))
    cfg._attn_implementation = "sdpa"  # our masks are explicit additive float masks
    return cfg


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (..., Q, K) True = may attend -> additive float mask (..., 1, Q, K) for the layers.
    The finite minimum (not -inf) keeps a fully masked padding row from producing NaN."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, neg).unsqueeze(-3)


@register("eagle", EagleConfig)
class Eagle(Drafter):
    """EAGLE drafter: fc + Llama decoder layer(s) + the target's (or a pruned) LM head."""

    def __init__(self, cfg: EagleConfig, target) -> None:
        super().__init__(target.vocab_size)
        if cfg.num_layers < 1 or cfg.train_unroll < 1:
            raise ValueError(f"eagle: num_layers ({cfg.num_layers}) and train_unroll "
                             f"({cfg.train_unroll}) must be >= 1")
        self.cfg = cfg
        self.target = target  # plain attribute: not a submodule, never saved
        self.feature_layers = (cfg.feature_layer,)
        H = target.hidden_size
        self.llama_config = drafter_llama_config(target, cfg.num_layers)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(self.llama_config, i)
                                    for i in range(cfg.num_layers))
        if not cfg.input_norm:  # EAGLE-1 / engine layout: fc's output goes straight to attention
            self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(self.llama_config)
        self.norm = None
        if cfg.feature_layer != -1:  # an un-normed feature needs a norm before the LM head
            self.norm = LlamaRMSNorm(H, eps=self.llama_config.rms_norm_eps)
            with torch.no_grad():
                self.norm.weight.copy_(target.model.model.norm.weight.float())
        self.draft_vocab = self.lm_head = None
        if cfg.draft_vocab_size is not None:  # placeholder map until set_draft_vocab
            self.draft_vocab = DraftVocab(torch.arange(cfg.draft_vocab_size), target.vocab_size)
            self.lm_head = head_from_target(target.lm_head(), self.draft_vocab.d2t, torch.float32)
        if cfg.init_from_target_layer is not None:
            self._init_from_target(cfg.init_from_target_layer)
        self.to(target.device)
        self.reset()

    @classmethod
    def build(cls, cfg, target) -> "Eagle":
        return cls(parse_config(cfg, EagleConfig), target)

    def _init_from_target(self, index: int) -> None:
        """Layer i takes the weights of target layer index - (num_layers - 1) + i (HF names match)."""
        src = self.target.model.model.layers
        last = index % len(src)
        first = last - (len(self.layers) - 1)
        if first < 0:
            raise ValueError(f"eagle: init_from_target_layer={index} leaves too few target layers "
                             f"for {len(self.layers)} drafter layers")
        for i, layer in enumerate(self.layers):
            own = layer.state_dict().keys()  # without layer 0's input norm when input_norm=false
            state = {k: v.float() for k, v in src[first + i].state_dict().items() if k in own}
            layer.load_state_dict(state, strict=True)

    # -- the network ------------------------------------------------------------------------------
    def _inputs(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """tokens (B, Q) target ids, feats (B, Q, H) -> fc inputs (B, Q, H)."""
        dtype = self.fc.weight.dtype
        emb = self.target.embed_tokens()(tokens).to(dtype)  # (B, Q, H), frozen
        return self.fc(torch.cat([emb, feats.to(dtype)], dim=-1))  # (B, Q, H)

    def _layers(self, x, positions, mask, cache=None) -> torch.Tensor:
        """x (B, Q, H) at positions (B, Q), additive mask (B, 1, Q, K) -> features (B, Q, H)."""
        rope = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, cache=cache,
                      use_cache=cache is not None, position_embeddings=rope)
        return x

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Predicted features (..., H) -> logits (..., Vd) over the draft vocabulary."""
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            return self.lm_head(h)
        lm = self.target.lm_head()  # frozen target head: gradients flow to h only
        # h is cast to the head's dtype, not the (V x H) head to h's: no copy of the head per step
        return F.linear(h.to(lm.weight.dtype), lm.weight, lm.bias).to(h.dtype)

    # -- training ---------------------------------------------------------------------------------
    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """Teacher-forced step (shift 1) plus train_unroll - 1 steps fed with the drafter's own
        features (shifts 2, 3, ...: the EAGLE-3 "training-time test").

        Step j at anchor t (the last real feature f_t) reads token t+j and the feature step j-1
        predicted at the same anchor, sits at position t+j-1 and predicts token t+j+1 (shift j).
        Its query attends to step 1's keys at anchors <= t (real features) and to the keys of
        steps 2..j at anchor t only, which is exactly what it sees at decode time after t.
        """
        ids, feats = batch.input_ids, batch.features  # (B, T), (B, T, H)
        if feats is None:
            raise ValueError("eagle: the batch has no target features (feature_layers)")
        B, T = ids.shape
        dev = ids.device
        pos = torch.arange(T, device=dev)
        keys = batch.attention_mask[:, None, :].bool()  # (B, 1, T): no attending to padding
        causal = (pos[None, :] <= pos[:, None])[None] & keys  # (B, T, T)
        diag = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T)  # (B, T, T)
        cache = DynamicCache() if self.cfg.train_unroll > 1 else None
        preds, h = [], feats
        for j in range(1, self.cfg.train_unroll + 1):
            # token t+j; the last j columns get a filler id: those anchors are never counted
            tok = torch.cat([ids[:, j:], ids[:, -1:].expand(B, min(j, T))], dim=1)[:, :T]  # (B, T)
            x = self._inputs(tok, h)  # (B, T, H)
            allowed = torch.cat([causal] + [diag] * (j - 1), dim=-1)  # (B, T, j*T)
            h = self._layers(x, (pos + j - 1).expand(B, T), additive_mask(allowed, x.dtype), cache)
            preds.append(DraftPrediction(logits=self.head(h), shift=j,  # (B, T, Vd)
                                         weight=self.cfg.unroll_decay ** (j - 1), features=h))
        return preds

    # -- decoding ---------------------------------------------------------------------------------
    def reset(self) -> None:
        self._cache = DynamicCache()
        self._tokens = torch.empty(0, dtype=torch.long)  # tokens whose positions the cache holds
        self._n = 0  # positions in the cache, all from real target features

    @torch.no_grad()
    def _sync(self, state: DecodeState) -> torch.Tensor:
        """Bring the cache up to date with the committed tokens; return the predicted feature of
        the position after the last processed one (1, 1, H): the input for the first draft."""
        tokens, feats = state.tokens, state.features  # (T,), (T-1, H)
        T = tokens.shape[0]
        if feats is None or T < 2 or feats.shape[0] != T - 1:
            raise ValueError("eagle: propose needs >= 2 tokens and state.features for tokens[:-1]")
        # 1. position t needs tokens[: t + 2] unchanged; crop to the shared prefix (at least the
        #    last position is recomputed, so its output is at hand)
        prev = self._tokens.to(tokens.device)
        m = min(len(prev), T)
        same = (prev[:m] == tokens[:m]).long().cumprod(0)
        keep = max(0, min(self._n, int(same.sum()) - 1, T - 2))
        if self._cache.get_seq_length() > keep:
            self._cache.crop(keep - self._cache.get_seq_length())
        # 2. the new committed positions keep .. T-2, from real target features
        n_new = T - 1 - keep
        x = self._inputs(tokens[keep + 1:][None], feats[keep:][None])  # (1, n_new, H)
        pos = torch.arange(keep, T - 1, device=tokens.device)  # (n_new,)
        allowed = torch.arange(T - 1, device=tokens.device)[None, :] <= pos[:, None]  # (n_new, T-1)
        h = self._layers(x, pos[None], additive_mask(allowed[None], x.dtype), self._cache)
        self._tokens, self._n = tokens.clone(), T - 1
        assert self._cache.get_seq_length() == self._n and n_new >= 1
        return h[:, -1:]  # (1, 1, H)

    def _forget_drafts(self) -> None:
        """Drop cache entries made from predicted features (they must be redone from real ones)."""
        extra = self._cache.get_seq_length() - self._n
        if extra > 0:
            self._cache.crop(-extra)

    @torch.no_grad()
    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        """Draft up to k tokens autoregressively, feeding the drafter's own predicted features."""
        if k < 1:
            return ChainProposal(tokens=state.tokens.new_empty(0))
        h = self._sync(state)  # (1, 1, H)
        T = state.tokens.shape[0]
        toks, qs = [], []
        for i in range(k):
            logits = self.head(h)[0, 0].float()  # (Vd,)
            d, q, conf = draft_token(logits, sampling, generator, min_confidence)  # q: (Vd,) | None
            if i > 0 and conf < min_confidence:
                break
            toks.append(self.target_ids(d))
            qs.append(q)
            if i + 1 < k:  # the next step reads the drafted token and this predicted feature
                x = self._inputs(toks[-1].view(1, 1), h)  # (1, 1, H)
                pos = torch.full((1, 1), T - 1 + i, device=x.device)
                h = self._layers(x, pos, None, self._cache)  # no mask: attends to the whole cache
        self._forget_drafts()
        tokens = torch.stack(toks).long()  # (n,)
        if sampling.greedy:
            return ChainProposal(tokens=tokens, probs=None)
        probs = expand_probs(torch.stack(qs), self.d2t, self.vocab_size)  # (n, V)
        return ChainProposal(tokens=tokens, probs=probs)

    @torch.no_grad()
    def propose_tree(self, state: DecodeState, sampling: SamplingParams) -> TreeProposal:
        """EAGLE-2 dynamic tree (greedy only). Each level's frontier runs as one batch of queries
        through the cache with a tree mask: a node sees the committed prefix, its ancestors and
        itself, so a level costs one drafter step whatever its width."""
        if not sampling.greedy:
            raise ValueError("eagle: tree drafting supports greedy decoding only; use a chain")
        h_root = self._sync(state)[0, 0]  # (H,)
        T, dev = state.tokens.shape[0], state.tokens.device
        out = {}  # pool index -> predicted feature (H,) of that node's position
        slot = {}  # pool index -> its index in the cache

        def expand(tokens: torch.Tensor, parents: torch.Tensor, frontier: torch.Tensor):
            depth, anc = [], []
            for f in frontier.tolist():  # 1. each frontier node's ancestors (already cached)
                chain, p = [], int(parents[f])
                while p >= 0:
                    chain.append(slot[p])
                    p = int(parents[p])
                depth.append(len(chain) + 1)
                anc.append(chain)
            feats = torch.stack([out[int(parents[f])] if parents[f] >= 0 else h_root
                                 for f in frontier.tolist()])  # (F, H)
            x = self._inputs(self.target_ids(tokens[frontier])[None], feats[None])  # (1, F, H)
            base, n_f = self._cache.get_seq_length(), len(frontier)
            allowed = torch.zeros(n_f, base + n_f, dtype=torch.bool, device=dev)  # (F, K)
            allowed[:, :self._n] = True  # 2. the committed prefix, ancestors and the node itself
            for i, chain in enumerate(anc):
                allowed[i, chain] = True
                allowed[i, base + i] = True
            pos = (T - 2 + torch.tensor(depth, device=dev))[None]  # (1, F)
            h = self._layers(x, pos, additive_mask(allowed[None], x.dtype), self._cache)[0]  # (F, H)
            for i, f in enumerate(frontier.tolist()):
                out[f], slot[f] = h[i], base + i
            return self.head(h).float().log_softmax(-1)  # (F, Vd)

        root = self.head(h_root).float().log_softmax(-1)  # (Vd,)
        try:
            tree = dynamic_tree(expand, root, self.cfg.tree_top_k, self.cfg.tree_depth,
                               self.cfg.tree_total_tokens)
        finally:
            self._forget_drafts()
        return TreeProposal(tokens=self.target_ids(tree.tokens), parents=tree.parents)
