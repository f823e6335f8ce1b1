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
and speculators exactly (the layouts at the end of this module).

Parts: the draft head (drafters/parts/head.py): the target's LM head, frozen (draft_vocab_size=None), or a
trainable Linear(H -> Vd) over a pruned draft vocabulary started from the target's rows; the layers'
config and the start from a target layer (drafters/parts/layers.py). Decoding is the shared component's
(drafters/parts/drafting.py CausalDrafter: the KV cache, chain, tree and batched rows), driven through
this module's `inputs`, `backbone` and `head`: the example of a step-by-step drafter. Embedding: the
target's, frozen. Target modules are reached through `self.target` (a plain attribute), never
registered as submodules, so the drafter's state_dict holds only its own weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specdistill.cli.ranges import MAX_DRAFT, MAX_LAYERS, MAX_TREE, MAX_VOCAB, rng
from specdistill.drafters.base import DrafterConfig, DraftPrediction, TrainBatch, register
from specdistill.drafters.parts.anchors import counted
from specdistill.drafters.parts.cache import additive_mask
from specdistill.drafters.parts.drafting import CausalDrafter
from specdistill.drafters.parts.head import head_logits
from specdistill.drafters.parts.layers import drafter_llama_config, finish_init
from specdistill.drafters.parts.layouts import WEIGHTS, ExportLayout, llama_layer_config, speculators_config


@dataclass
class EagleConfig(DrafterConfig):
    """EAGLE drafter settings."""

    name: str = "eagle"  # registry key
    # target hidden state read and predicted (-1 = final-normed, EAGLE-1)
    feature_layer: int = rng(-1, -1, MAX_LAYERS)
    # pruned LM head size (None = the target's head, frozen). For SmolLM2 the full head (49152 x 576
    # = 28 M weights) is 21% of the whole target and would dominate the drafter's step; a trainable
    # head over the 8192 most frequent training tokens costs a sixth of that, and rare tokens it
    # cannot propose are rarely accepted anyway. null = the layout serving engines load.
    draft_vocab_size: Optional[int] = rng(8192, 1, MAX_VOCAB)
    num_layers: int = rng(1, 1, MAX_LAYERS)  # decoder layers of the drafter
    # copy this target layer's weights (None = random)
    init_from_target_layer: Optional[int] = rng(None, 0, MAX_LAYERS)
    # RMSNorm on fc's output before layer 0's attention. false = the EAGLE-1 layout the serving
    # engines load (vLLM, SGLang and speculators drop layer 0's input_layernorm), so the head can
    # be exported to them exactly (ENGINE_NEEDS below)
    input_norm: bool = True
    # training-time test steps (1 = teacher forced; k>1 adds shifts 2..k)
    train_unroll: int = rng(1, 1, MAX_DRAFT)
    # loss weight of unrolled step j is unroll_decay ** (j - 1)
    unroll_decay: float = rng(0.8, 0, 1)
    # EAGLE-2 tree: children per expanded node and nodes expanded per level
    tree_top_k: int = rng(8, 1, MAX_DRAFT)
    tree_depth: int = rng(6, 1, MAX_DRAFT)  # EAGLE-2 tree: levels grown
    tree_total_tokens: int = rng(60, 1, MAX_TREE)  # EAGLE-2 tree: nodes kept for verification
    # sampling: draw the tree's children from the warped q (False: EAGLE-2's top-k candidates,
    # verified as deterministic drafts; both lossless)
    tree_sampled: bool = True


# =================================================================================================
# Export layouts (sources read 2026-11-29). All three run the same network as ours with
# input_norm=false: fc (2H -> H, no bias) over [embed(token), hidden], decoder layer(s) whose layer 0
# has no input_layernorm, the TARGET's embeddings and LM head (shared), and the target's
# final-normed state as the feature; hence ENGINE_NEEDS.
#   vllm         vllm/model_executor/models/llama_eagle.py, EagleLlamaForCausalLM: `layers.N.*`;
#                config: a Llama config (vLLM's EAGLEConfig adds the Eagle prefix).
#   sglang       python/sglang/srt/models/llama_eagle.py, LlamaForCausalLMEagle: the same, but its
#                fc has a bias (written as zeros, else it keeps its random init) and it ignores
#                lm_head weights (set_embed_and_head shares the target's).
#   speculators  vllm-project/speculators src/speculators/models/eagle.py, EagleSpeculator
#                (speculators_model_type "eagle", layernorms=false, fusion_bias=false): fusion_fc,
#                transformer.* (ONE LlamaDecoderLayer); src/speculators/config.py: speculators_config
#                = algorithm, proposal_methods, default_proposal_method, verifier.
# =================================================================================================
ENGINE_NEEDS = {"feature_layer": -1,  # the engines feed the target's final-normed hidden state
                "draft_vocab_size": None,  # they score with the target's own LM head
                "input_norm": False}  # their layer 0 has no input_layernorm


def _write_vllm(drafter, state, ctx):
    llama = llama_layer_config(drafter.llama_config, ctx.target, ctx.dtype)
    return {**llama, "architectures": ["LlamaForCausalLM"], **ctx.common()}, {WEIGHTS: state}


def _write_sglang(drafter, state, ctx):
    llama = llama_layer_config(drafter.llama_config, ctx.target, ctx.dtype)
    state["fc.bias"] = torch.zeros(state["fc.weight"].shape[0], dtype=state["fc.weight"].dtype)
    return {**llama, "architectures": ["LlamaForCausalLMEagle"], **ctx.common()}, {WEIGHTS: state}


def _read_sglang(files, dcfg, vocab_size):
    t = dict(files[WEIGHTS])
    t.pop("fc.bias")
    return t


def _verify_sglang(files, dcfg, target, dtype) -> list[str]:
    bias = files.get(WEIGHTS, {}).get("fc.bias")
    return (["fc.bias must be zero (our fc has no bias; SGLang's adds it)"]
            if bias is not None and bool(bias.any()) else [])


def _write_speculators(drafter, state, ctx):
    tensors = {("fusion_fc." + n[3:]) if n.startswith("fc.") else "transformer." + n[len("layers.0."):]: v
               for n, v in state.items()}
    llama = llama_layer_config(drafter.llama_config, ctx.target, ctx.dtype)
    layer = {**llama, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    for key in ("torch_dtype", "dtype"):
        layer.pop(key)
    cfg = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
           "speculators_model_type": "eagle", "speculators_version": "0.1.0",
           "transformer_layer_architecture": "LlamaDecoderLayer",
           "transformer_layer_config": layer, "layernorms": False, "fusion_bias": False,
           "speculators_config": speculators_config("eagle", ctx.k,
                                                    ctx.meta.get("base_model"), ctx.target),
           **ctx.common()}
    return cfg, {WEIGHTS: tensors}


def _read_speculators(files, dcfg, vocab_size):
    return {("fc." + n[len("fusion_fc."):]) if n.startswith("fusion_fc.")
            else "layers.0." + n[len("transformer."):]: v for n, v in files[WEIGHTS].items()}


VLLM = ExportLayout(
    format="vllm", tags=("vllm",), requires=ENGINE_NEEDS,
    summary="vLLM's EAGLE-1 layout (EagleLlamaForCausalLM; the target's embeddings and LM head are "
            "shared).",
    usage="vllm serve {base} --speculative-config "
          "'{{\"method\": \"eagle\", \"model\": \"{path}\", \"num_speculative_tokens\": {k}}}'",
    write=_write_vllm, read=lambda files, dcfg, vocab_size: dict(files[WEIGHTS]),
    serving={"vllm": {"method": "eagle"}})
SGLANG = ExportLayout(
    format="sglang", tags=("sglang",), requires=ENGINE_NEEDS,
    summary="SGLang's EAGLE layout (LlamaForCausalLMEagle).",
    usage="python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE "
          "--speculative-draft-model-path {path} --speculative-num-steps {k} "
          "--speculative-eagle-topk 1 --speculative-num-draft-tokens {k1}",
    write=_write_sglang, read=_read_sglang, verify=_verify_sglang)
SPECULATORS = ExportLayout(
    format="speculators", tags=("speculators",),
    requires={**ENGINE_NEEDS, "num_layers": 1},  # EagleSpeculator holds one decoder layer
    summary="the speculators library's EAGLE format (EagleSpeculator with speculators_config).",
    usage="from speculators.models.eagle import EagleSpeculator\n"
          "model = EagleSpeculator.from_pretrained('{path}', verifier='{base}')",
    write=_write_speculators, read=_read_speculators)


@register("eagle", config=EagleConfig, layouts=(VLLM, SGLANG, SPECULATORS))
class Eagle(CausalDrafter):
    """EAGLE drafter: fc + Llama decoder layer(s) + the target's (or a pruned) LM head."""

    tags = ("eagle1",)

    def __init__(self, cfg: EagleConfig, target) -> None:
        super().__init__(target.vocab_size, cfg, target)
        if cfg.num_layers < 1 or cfg.train_unroll < 1:
            raise ValueError(f"eagle: num_layers ({cfg.num_layers}) and train_unroll "
                             f"({cfg.train_unroll}) must be >= 1")
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
        finish_init(self, cfg, target)  # draft head, init_from_target_layer, device, reset

    # -- the network ------------------------------------------------------------------------------
    def inputs(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """tokens (B, Q) target ids, feats (B, Q, H) target features or the drafter's own
        predicted ones -> fc inputs (B, Q, H)."""
        dtype = self.fc.weight.dtype
        emb = self.target.embed_tokens()(tokens).to(dtype)  # (B, Q, H), frozen
        return self.fc(torch.cat([emb, feats.to(dtype)], dim=-1))  # (B, Q, H)

    def backbone(self, x, positions, mask, cache=None) -> torch.Tensor:
        """x (B, Q, H) at positions (B, Q), additive mask (B, 1, Q, K) -> features (B, Q, H)."""
        rope = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, cache=cache,
                      use_cache=cache is not None, position_embeddings=rope)
        return x

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Predicted features (..., H) -> logits (..., Vd) over the draft vocabulary."""
        return head_logits(self, h if self.norm is None else self.norm(h))

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
            x = self.inputs(tok, h)  # (B, T, H)
            allowed = torch.cat([causal] + [diag] * (j - 1), dim=-1)  # (B, T, j*T)
            h = self.backbone(x, (pos + j - 1).expand(B, T), additive_mask(allowed, x.dtype), cache)
            at = counted(batch, j)  # (B, T): the head only where the loss reads it
            preds.append(DraftPrediction(logits=self.head(h[at]), at=at, shift=j,  # (M, Vd)
                                         weight=self.cfg.unroll_decay ** (j - 1), features=h))
        return preds
