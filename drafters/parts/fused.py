"""The fused-feature draft network of EAGLE-3, which P-EAGLE shares: fc over three target layers,
decoder layer(s) whose first reads [embed; feature], a final norm and the draft head.

    g_t = fc([low_t; mid_t; high_t])                 fc: Linear(3H -> H), no bias
    a_t = attn([input_layernorm(embed(tok_{t+1})); hidden_norm(g_t)])   q/k/v over 2H, RoPE
    h_t = g_t + a_t;  h_t = h_t + mlp(post_attention_layernorm(h_t))    (more layers: plain Llama)
    logits_t = lm_head(norm(h_t))   over a pruned draft vocabulary (d2t / t2d)
    next step: g <- h_t (or norm(h_t) with norm_output; options named as the engines name them)

`FusedDrafter` is the network as a step-by-step drafter (drafters/parts/drafting.py CausalDrafter:
`project` = the fusion, `inputs`, `backbone`, `head`), with `run`, the layers under an attention
passed in, for the training unrolls; `FusedConfig` holds its settings. drafters/eagle3.py and
drafters/peagle.py each subclass both, side by side; the engines' names and configs for its
weights: drafters/parts/fused_layouts.py. Parameter names are the engines' (layers.0 = their midlayer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specdistill.cli.ranges import MAX_DRAFT, MAX_LAYERS, MAX_TREE, MAX_VOCAB, rng
from specdistill.drafters.base import DrafterConfig
from specdistill.drafters.parts.drafting import CausalDrafter
from specdistill.drafters.parts.head import head_logits
from specdistill.drafters.parts.layers import default_aux_layers, drafter_llama_config, finish_init
from specdistill.target.attention import few_query, grouped_attention


@dataclass
class FusedConfig(DrafterConfig):
    """Settings of the fused-feature network; the eagle3 and peagle configs add their name and
    their own."""

    # target hidden_states indices (low, mid, high); None = the engines' (2, L//2, L-3)
    aux_layers: Optional[list[int]] = rng(None, 0, MAX_LAYERS)
    draft_vocab_size: Optional[int] = rng(None, 1, MAX_VOCAB)  # pruned head (None: target's, frozen)
    num_layers: int = rng(1, 1, MAX_LAYERS)  # layer 0 reads [embed; feature], the others are plain
    # copy this target layer's weights (None = random); layer 0's q/k/v get them in both halves
    init_from_target_layer: Optional[int] = rng(None, 0, MAX_LAYERS)
    norm_before_residual: bool = False  # residual = hidden_norm(feature) (false: the raw feature)
    norm_before_fc: bool = False  # RMSNorm(3H) over the concatenated aux states before fc
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per aux layer before fc
    norm_output: bool = False  # EAGLE-3.1: feed the final-normed output back to the next step
    ttt_length: int = rng(7, 1, MAX_DRAFT)  # training-time test steps (EAGLE-3 recipe: 7)
    ttt_decay: float = rng(0.8, 0, 1)  # loss weight of step j: ttt_decay ** (j - 1) (SpecForge 0.8)
    # EAGLE-2 tree: children per expanded node and nodes expanded per level
    tree_top_k: int = rng(8, 1, MAX_DRAFT)
    tree_depth: int = rng(6, 1, MAX_DRAFT)  # EAGLE-2 tree: levels grown
    tree_total_tokens: int = rng(60, 1, MAX_TREE)  # EAGLE-2 tree: nodes kept for verification
    # sampling: draw the tree's children from the warped q (False: EAGLE-2's top-k candidates,
    # verified as deterministic drafts; both lossless)
    tree_sampled: bool = True


# == The network: fusion, decoder layers, head. Attention is passed in (`attend`), so the same ==
# == layers serve the training-time test and the decode-time KV cache.                          ==
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Eagle3Attention(nn.Module):
    """q/k/v/o projections under HF / engine names; the attention pattern comes from outside."""

    def __init__(self, cfg, in_dim: int) -> None:
        super().__init__()
        self.head_dim, q, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(in_dim, q * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(q * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        """x (B, Q, in_dim) -> (B, Q, H)."""
        B, Q, _ = x.shape
        q, k, v = (p(x).view(B, Q, -1, self.head_dim).transpose(1, 2)  # (B, h | kv, Q, d)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *rope)
        return self.o_proj(attend(q, k, v).transpose(1, 2).reshape(B, Q, -1))  # (B, Q, H)


class Eagle3Layer(nn.Module):
    """Layer 0 (`midlayer` in the engines): attention over [input_layernorm(embed); hidden_norm(g)].
    Later layers: a plain pre-norm Llama layer over the residual stream (vLLM / speculators)."""

    def __init__(self, cfg, first: bool, norm_before_residual: bool) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.first, self.norm_before_residual = first, norm_before_residual
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps) if first else None
        self.self_attn = Eagle3Attention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, emb, h, rope, attend: Attend) -> torch.Tensor:
        """emb (B, Q, H) token embeddings (layer 0 only), h (B, Q, H) -> (B, Q, H)."""
        if self.first:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # (B, Q, 2H)
        else:
            residual, x = h, self.input_layernorm(h)
        h = residual + self.self_attn(x, rope, attend)  # (B, Q, H)
        return h + self.mlp(self.post_attention_layernorm(h))


def layer_from_target(i: int, state: dict) -> dict:
    """init_from_target_layer (drafters/parts/layers.py): layer 0's 2H-wide q/k/v take the target's
    weights in both halves [W | W] over [embed; feature], its hidden_norm the target's input norm."""
    if i > 0:
        return state
    state = {k: torch.cat([v, v], dim=1) if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
             else v for k, v in state.items()}
    return {**state, "hidden_norm.weight": state["input_layernorm.weight"]}


class FusedDrafter(CausalDrafter):
    """fc over three target layers + decoder layer(s) + final norm + draft head. Decoding is
    drafters/parts/drafting.py's, driven through `project` (the fusion), `inputs`, `backbone` and
    `head`; the training unrolls of eagle3 and peagle run `run`."""

    def __init__(self, cfg: FusedConfig, target) -> None:
        super().__init__(target.vocab_size, cfg, target)
        L = target.num_layers
        aux = list(cfg.aux_layers) if cfg.aux_layers is not None else default_aux_layers(L)
        if len(aux) != 3 or not all(0 <= i <= L for i in aux):
            raise ValueError(f"{self.name}: aux_layers must be 3 hidden_states indices in [0, {L}] "
                             f"(0 = embeddings, i = output of layer i), got {aux}; "
                             f"null takes the engines' default {default_aux_layers(L)}")
        if cfg.num_layers < 1 or cfg.ttt_length < 1:
            raise ValueError(f"{self.name}: num_layers and ttt_length must be >= 1, got {cfg}")
        self.feature_layers = tuple(aux)
        H = target.hidden_size
        self.llama_config = lc = drafter_llama_config(target, cfg.num_layers)
        self.input_norm = LlamaRMSNorm(3 * H, eps=lc.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(LlamaRMSNorm(H, eps=lc.rms_norm_eps) for _ in range(3))
                        if cfg.fc_norm else None)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.layers = nn.ModuleList(Eagle3Layer(lc, i == 0, cfg.norm_before_residual)
                                    for i in range(cfg.num_layers))
        self.rotary_emb = LlamaRotaryEmbedding(lc)
        self.norm = LlamaRMSNorm(H, eps=lc.rms_norm_eps)
        with torch.no_grad():  # the head reads what the target's head reads: start from its norm
            self.norm.weight.copy_(target.model.model.norm.weight.float())
        finish_init(self, cfg, target, layer_from_target)  # draft head, start layer, device, reset

    # -- the network ------------------------------------------------------------------------------
    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features (B, Q, 3H) of the aux layers -> fused feature (B, Q, H)."""
        x = feats.to(self.fc.weight.dtype)
        if x.is_inference() and torch.is_grad_enabled():  # captured under inference_mode
            x = x.clone()
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([n(c) for n, c in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        return self.fc(x)  # (B, Q, H)

    def run(self, emb, h, positions, attend: Callable[[int], Attend]) -> torch.Tensor:
        """Token embeddings emb (B, Q, H) and input states h (B, Q, H) at positions (B, Q) -> the
        state fed to the next step (B, Q, H): the last layer's output, normed with norm_output."""
        rope = self.rotary_emb(h, positions)
        for i, layer in enumerate(self.layers):
            h = layer(emb, h, rope, attend(i))
        return self.norm(h) if self.cfg.norm_output else h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Recurrent state (..., H) -> logits (..., Vd) over the draft vocabulary."""
        return head_logits(self, h if self.cfg.norm_output else self.norm(h))

    # -- decoding: drafters/parts/drafting.py drives these (project, inputs, backbone, head) ----------
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, Q, 3H) -> the drafter's states (B, Q, H): the fusion."""
        return self.fuse(features)

    def inputs(self, tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """tokens (B, Q) target ids, states (B, Q, H) (fused target features or the drafter's own)
        -> [embed; state] (B, Q, 2H)."""
        emb = self.target.embed_tokens()(tokens).to(states.dtype)  # (B, Q, H), frozen
        return torch.cat([emb, states.to(self.fc.weight.dtype)], dim=-1)

    def backbone(self, x, positions, mask, cache=None) -> torch.Tensor:
        """x (B, Q, 2H) from inputs at positions (B, Q), additive mask (B, 1, Q, K) or None (=
        attend to the whole cache), through the drafter's KV cache -> next state (B, Q, H)."""
        def attend(i: int) -> Attend:
            def run(q, k, v):
                k, v = cache.update(k, v, i)  # (B, kv, K, d)
                if few_query(q, k.shape[2]):  # 16-bit CPU draft step, long cache: plain ops
                    return grouped_attention(q, k, v, mask, causal=False)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return run
        emb, h = x.chunk(2, dim=-1)  # (B, Q, H) each
        return self.run(emb, h, positions, attend)
