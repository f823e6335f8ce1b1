"""DFlash: a block drafter. ONE forward over a block [last committed token; mask x (b-1)] gives
all b-1 drafts, conditioned on the target's fused features through the attention keys alone.

    ctx_t   = hidden_norm(fc([low_t; mid_t; high_t]))          the target's aux layers at t
    block   = embed([x_{n-1}, m, m, ..., m]) at positions n-1 .. n-2+b   (m = mask_token_id)
    layer:  x += o(attn(q = q_norm(q(ln(x))),  keys / values = [k_norm(k(ctx_<n-1)); k_norm(k(ln(x)))]))
            x += mlp(post_ln(x))        bidirectional inside the block; no query at context positions
    draft i = lm_head(norm(x_i)), i = 1 .. b-1: the token at position n-1+i

Unlike EAGLE (one query per committed position, drafts one after another) and P-EAGLE (causal
mask positions after the real ones), the context enters each layer only as keys and values
projected from the fused features, so a committed token costs the drafter L (k, v) projections,
and a round costs one forward of b queries whatever k is (k <= b-1; the block is always b wide,
as trained). Slot 0 holds the last committed token (the target's bonus token, whose features
are not computed yet); the context is every earlier position.

Training (`forward_train`): at anchor a (slot 0 = token a at position a) the block sees the
fused features at positions < a and its own b slots; slot i predicts token a+i, compared with
the target's logits at a+i-1 (DraftPrediction shift i-1 at anchor a), weighted exp(-(i-1)/gamma)
(DFlash's decay; `loss_weights` overrides). `anchors` draws a share of each row's anchors per
step (drafters/parts/anchors.py); null trains every position as an anchor.

Sources read (2026-12-01): speculators 0.9.0 (PyPI wheel) models/dflash/ (config.py
DFlashSpeculatorConfig: block_size, aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor
false = slot 0 is the bonus token; model_definitions.py Qwen3DFlashAttention: context k/v
projected from fc's normed output, q_norm / k_norm per head; core.py _backbone_forward: the
anchored-block mask, targets at anchor + i - 1; metrics.py: exp decay gamma) and the main branch
@c05b95b3; vLLM model_executor/models/qwen3_dflash.py @036a00d1 (context k/v from
hidden_norm(fc(aux)), non-causal full-attention layers, d2t offsets, embedding / head shared when
absent) and eagle3_utils.get_eagle3_aux_layers_from_config (eagle_aux ids first, else z-lab's
target_layer_ids + 1); the DFlash paper (Chen, Liang, Liu 2026, arXiv 2602.06036). Exports
`speculators` (loaded by speculators' own DFlashDraftModel in the slow test) and `vllm` (the
z-lab layout vLLM registers as DFlashDraftModel); both rebuilt from the files in the tests. One
denoising pass per round, as DFlash and vLLM decode; tree drafts come from the per-position
top-k (as for P-EAGLE).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from specdistill.cli.ranges import MAX_COUNT, MAX_DRAFT, MAX_LAYERS, MAX_TREE, MAX_VOCAB, rng
from specdistill.drafters.base import (
    ChainProposal,
    DecodeState,
    Drafter,
    DrafterConfig,
    DraftPrediction,
    TrainBatch,
    register,
)
from specdistill.drafters.parts import parallel
from specdistill.drafters.parts.anchors import check_anchor_share, draw_anchors
from specdistill.drafters.parts.attention import block_attention
from specdistill.drafters.parts.cache import DraftCache, RowsKV, additive_mask
from specdistill.drafters.parts.fused_layouts import aux_fix, state_from_engine
from specdistill.drafters.parts.head import head_logits, init_draft_head
from specdistill.drafters.parts.layers import default_aux_layers, drafter_llama_config
from specdistill.drafters.parts.layouts import (
    WEIGHTS,
    ExportError,
    ExportLayout,
    cast,
    llama_layer_config,
    speculators_config,
    torch_dtype,
)
from specdistill.drafters.parts.vocab import d2t_to_offsets, t2d_mask
from specdistill.target.attention import few_query, grouped_attention


@dataclass
class DFlashConfig(DrafterConfig):
    """DFlash drafter settings."""

    name: str = "dflash"  # registry key
    # target hidden_states indices fused as context; None = EAGLE-3's (2, L//2, L-3), so eagle3,
    # peagle and dflash train on one capture
    aux_layers: Optional[list[int]] = rng(None, 0, MAX_LAYERS)
    num_layers: int = rng(1, 1, MAX_LAYERS)  # draft layers (the paper: 5 on 8B targets)
    # slot 0 = the last committed token: block_size - 1 drafts per forward
    block_size: int = rng(8, 2, MAX_DRAFT)
    # pruned LM head size (None = target's head, frozen)
    draft_vocab_size: Optional[int] = rng(None, 1, MAX_VOCAB)
    # id whose (frozen) embedding fills the block (None = V - 1)
    mask_token_id: Optional[int] = rng(None, 0, MAX_VOCAB)
    # draft i weighs exp(-(i - 1) / gamma) (DFlash: 4 for blocks of 8)
    loss_gamma: float = rng(4.0, 0, 1000, lo_open=True)
    # one per draft (block_size - 1); overrides gamma
    loss_weights: Optional[list[float]] = rng(None, 0, 1000)
    # anchors per row trained each step: null = every position; a fraction in (0, 1) = that share
    # of the row's anchors with a scored token in the block; a whole number > 1 = that many
    anchors: Optional[float] = rng(None, 0, MAX_COUNT, lo_open=True)
    # dynamic tree over the per-position distributions: children per node
    tree_top_k: int = rng(8, 1, MAX_DRAFT)
    tree_depth: int = rng(6, 1, MAX_DRAFT)  # levels (capped at block_size - 1)
    tree_total_tokens: int = rng(60, 1, MAX_TREE)  # nodes kept for verification
    tree_sampled: bool = True  # sampling: draw the tree's children from q (else top-k, deterministic)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (B, h, Q, d) with cos / sin (B, Q, d)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """q/k/v/o + per-head q_norm / k_norm (speculators' Qwen3DFlashAttention names). The keys and
    values of the context come from `context`; the block's own from `forward`."""

    def __init__(self, lc) -> None:
        super().__init__()
        self.head_dim, q, kv = lc.head_dim, lc.num_attention_heads, lc.num_key_value_heads
        self.q_proj = nn.Linear(lc.hidden_size, q * self.head_dim, bias=False)
        self.k_proj = nn.Linear(lc.hidden_size, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(lc.hidden_size, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(q * self.head_dim, lc.hidden_size, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=lc.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=lc.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        B, Q, _ = x.shape
        return proj(x).view(B, Q, -1, self.head_dim).transpose(1, 2)  # (B, h, Q, d)

    def kv(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, Q, H) -> keys (normed, RoPE) and values (B, kv, Q, d)."""
        return rope(self.k_norm(self._heads(x, self.k_proj)), *cos_sin), self._heads(x, self.v_proj)

    def forward(self, x: torch.Tensor, cos_sin, attend) -> torch.Tensor:
        """x (B, Q, H) normed block states -> (B, Q, H); attend(q, k, v) adds the context."""
        B, Q, _ = x.shape
        q = rope(self.q_norm(self._heads(x, self.q_proj)), *cos_sin)  # (B, h, Q, d)
        out = attend(q, *self.kv(x, cos_sin))  # (B, h, Q, d)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer over the block whose attention also reads the context."""

    def __init__(self, lc) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(lc.hidden_size, eps=lc.rms_norm_eps)
        self.self_attn = DFlashAttention(lc)
        self.post_attention_layernorm = LlamaRMSNorm(lc.hidden_size, eps=lc.rms_norm_eps)
        self.mlp = LlamaMLP(lc)

    def forward(self, x: torch.Tensor, cos_sin, attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


# == Exports. speculators 0.9.0 models/dflash/ (`dflash` type, DFlashDraftModel) and vLLM's DFlash ==
# == loader (model_executor/models/qwen3_dflash.py @036a00d1, architecture DFlashDraftModel, the   ==
# == z-lab layout): the layers under our names, a Qwen3 decoder-layer config (q_norm / k_norm).    ==
def dflash_state(drafter, engine: str, state: Optional[dict] = None,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The tensors `engine` loads: layers.*, fc, hidden_norm, norm, and a pruned head with its d2t
    offsets / t2d; speculators also the target's embedding and, at full vocabulary, its head
    (vLLM shares both with the target when the files lack them)."""
    state = dict(drafter.state_dict() if state is None else state)
    d2t, _ = state.pop("draft_vocab.d2t", None), state.pop("draft_vocab.t2d", None)
    out = {n: cast(v, dtype) for n, v in state.items()}
    if engine == "speculators":
        out["embed_tokens.weight"] = cast(drafter.target.embed_tokens().weight, dtype)
        if d2t is None:
            out["lm_head.weight"] = cast(drafter.target.lm_head().weight, dtype)
    if d2t is not None:
        out["d2t"] = d2t_to_offsets(d2t.cpu())  # (Vd,) int64: target id = i + d2t[i]
        out["t2d"] = t2d_mask(d2t.cpu(), drafter.vocab_size)  # (V,) bool
    return out


def dflash_config(drafter, engine: str, verifier: Optional[str] = None, dtype: str = "float32") -> dict:
    """config.json for `engine`. Aux layers: speculators and vLLM capture layer inputs (= our
    hidden_states indices, `eagle_aux_hidden_state_layer_ids`, read first by vLLM); z-lab's
    `dflash_config.target_layer_ids` name layer outputs (ours - 1). Slot 0 is the bonus token
    (speculators' sample_from_anchor false): block_size - 1 speculative tokens."""
    L, ids, b = drafter.target.num_layers, list(drafter.feature_layers), drafter.cfg.block_size
    lo = 1 if engine == "vllm" else 0
    if not all(lo <= i <= L - 1 for i in ids):
        raise ExportError(f"dflash: {engine} captures hidden_states in [{lo}, {L - 1}]; this "
                          f"drafter reads {ids}: " + aux_fix(ids, L))
    layer = llama_layer_config(drafter.llama_config, drafter.target, dtype)
    layer.update(model_type="qwen3", layer_types=["full_attention"] * drafter.cfg.num_layers,
                 use_sliding_window=False)
    vd = drafter.vocab_size if drafter.d2t is None else len(drafter.d2t)
    if engine == "vllm":
        return {**layer, "architectures": ["DFlashDraftModel"], "block_size": b,
                "draft_vocab_size": vd, "eagle_aux_hidden_state_layer_ids": ids,
                "dflash_config": {"mask_token_id": drafter.mask_token_id,
                                  "target_layer_ids": [i - 1 for i in ids]}}
    for key in ("torch_dtype", "dtype"):
        layer.pop(key)
    return {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
            "transformer_layer_config": {**layer, "architectures": ["Qwen3ForCausalLM"]},
            "draft_vocab_size": vd, "block_size": b, "target_hidden_size": None,
            "aux_hidden_state_layer_ids": ids, "mask_token_id": drafter.mask_token_id,
            "sliding_window_non_causal": False, "sample_from_anchor": False,
            "tie_word_embeddings": False,
            "speculators_config": speculators_config("dflash", b - 1, verifier, drafter.target)}


def _layout(engine: str, summary: str, usage: str) -> ExportLayout:
    def write(drafter, state, ctx):
        tensors = dflash_state(drafter, engine, state, torch_dtype(ctx.dtype))
        config = dflash_config(drafter, engine, ctx.meta.get("base_model"), ctx.dtype)
        return {**config, **ctx.common()}, {WEIGHTS: tensors}

    def read(files, dcfg, vocab_size):  # our names throughout: the fused reader without renames
        return state_from_engine(files[WEIGHTS], engine, dcfg.get("draft_vocab_size") is not None)

    return ExportLayout(format=engine, summary=summary, usage=usage, write=write, read=read,
                        tags=(engine, "dflash"), serving=SERVING[engine])


# vLLM reads both layouts; llama.cpp's converter reads the z-lab (vllm) one with the target's folder
# (without a d2t, i.e. a full-vocabulary head only, and it decodes an anchor + k mask block, so it
# matches the trained block at k = block_size - 1 only)
SERVING = {"vllm": {"vllm": {"method": "dflash"},
                    "llamacpp": {"spec_type": "draft-dflash", "needs_target": True}},
           "speculators": {"vllm": {"method": "dflash"}}}


LAYOUTS = (
    _layout("vllm", "vLLM's DFlash layout (DFlashDraftModel, the z-lab layout: Qwen3 draft layers, "
            "dflash_config with the mask id and target layers; embedding and full head shared).",
            "vllm serve {base} --speculative-config '{{\"method\": \"dflash\", \"model\": "
            "\"{path}\", \"num_speculative_tokens\": {k}}}'"),
    _layout("speculators", "the speculators library's DFlash format (speculators_model_type "
            "dflash, DFlashDraftModel).",
            "vllm serve {path}      # or in Python:\n"
            "from speculators.models.dflash import DFlashDraftModel\n"
            "model = DFlashDraftModel.from_pretrained('{path}')"))


@register("dflash", config=DFlashConfig, layouts=LAYOUTS)
class DFlash(parallel.ParallelDrafting, Drafter):
    """DFlash block drafter: fc over the target's aux layers + draft layers over a mask block."""

    tags = ("dflash", "block-drafting", "parallel-drafting")
    trained_setting = "drafter.block_size - 1"

    def __init__(self, cfg: DFlashConfig, target) -> None:
        super().__init__(target.vocab_size, cfg, target)
        L, V, H = target.num_layers, target.vocab_size, target.hidden_size
        aux = list(cfg.aux_layers) if cfg.aux_layers is not None else default_aux_layers(L)
        if not aux or not all(0 <= i <= L for i in aux):
            raise ValueError(f"{cfg.name}: aux_layers must be hidden_states indices in [0, {L}] (0 = "
                             f"embeddings, i = output of layer i), got {aux}; null takes "
                             f"{default_aux_layers(L)}")
        mask_id = V - 1 if cfg.mask_token_id is None else cfg.mask_token_id
        if not 0 <= mask_id < V:
            raise ValueError(f"{cfg.name}: mask_token_id must be a target token id in [0, {V}), got "
                             f"{mask_id}; null takes {V - 1}")
        if cfg.num_layers < 1 or cfg.block_size < 2 or cfg.loss_gamma <= 0:
            raise ValueError(f"{cfg.name}: num_layers >= 1, block_size >= 2 and loss_gamma > 0 "
                             f"needed, got {cfg.num_layers}, {cfg.block_size}, {cfg.loss_gamma}")
        n = self.trained_positions(cfg)
        if cfg.loss_weights is not None and len(cfg.loss_weights) != n:
            raise ValueError(f"{cfg.name}: loss_weights needs one weight per draft ({n}), got "
                             f"{list(cfg.loss_weights)}")
        check_anchor_share(cfg.name, "anchors", cfg.anchors)
        self.feature_layers, self.mask_token_id = tuple(aux), mask_id
        self.llama_config = lc = drafter_llama_config(target, cfg.num_layers)
        self.fc = nn.Linear(len(aux) * H, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=lc.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(lc) for _ in range(cfg.num_layers))
        self.rotary_emb = LlamaRotaryEmbedding(lc)
        self.norm = LlamaRMSNorm(H, eps=lc.rms_norm_eps)
        with torch.no_grad():  # the head reads what the target's head reads: start from its norm
            self.norm.weight.copy_(target.model.model.norm.weight.float())
        init_draft_head(self, target.lm_head(), cfg.draft_vocab_size, V)
        self.to(target.device)
        self.reset()

    # -- the network ------------------------------------------------------------------------------
    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, n*H) of the aux layers -> the context states (B, T, H)."""
        x = feats.to(self.fc.weight.dtype)
        if x.is_inference() and torch.is_grad_enabled():  # captured under inference_mode
            x = x.clone()
        return self.hidden_norm(self.fc(x))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Block outputs (..., H) -> logits (..., Vd) over the draft vocabulary."""
        return head_logits(self, self.norm(h))

    def _block(self, first: torch.Tensor) -> torch.Tensor:
        """Slot-0 tokens (B, A) -> the blocks' embeddings (B, A*b, H): token, then masks."""
        b = self.cfg.block_size
        tok = torch.full((*first.shape, b), self.mask_token_id, device=first.device)  # (B, A, b)
        tok[..., 0] = first
        return self.target.embed_tokens()(tok.flatten(1)).to(self.fc.weight.dtype)

    def _weight(self, i: int) -> float:
        w = self.cfg.loss_weights
        return float(w[i - 1]) if w is not None else math.exp(-(i - 1) / self.cfg.loss_gamma)

    # -- training ---------------------------------------------------------------------------------
    def draw(self, batch: TrainBatch) -> Optional[torch.Tensor]:
        """The anchors (B, A) this step trains (`anchors` of them, drawn among those with a scored
        token in their block), or None: every position."""
        m = self.cfg.anchors
        return None if m is None or m == 1 else draw_anchors(batch, 1, self.trained_positions(), m)

    def teacher_rows(self, batch: TrainBatch) -> Optional[torch.Tensor]:
        """The drawn anchors' blocks: draft j of the block at anchor a reads the teacher at a + j
        (j < trained_positions()), so with anchors = 0.1 and a block of 4 about a third of the
        positions need the target's LM head (drafters/base.py Drafter.teacher_rows). The anchors
        are drawn here, into batch.anchors; None when every position is an anchor."""
        drawn = self.draw(batch)
        if drawn is None:
            return None
        batch.anchors = drawn
        B, T = batch.input_ids.shape
        j = torch.arange(self.trained_positions(), device=drawn.device)
        where = (drawn[:, :, None] + j).clamp(max=T - 1)  # (B, A, n)
        rows = torch.zeros(B, T, dtype=torch.bool, device=drawn.device)
        return rows.scatter_(1, where.flatten(1), True)

    def block_states(self, batch: TrainBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The blocks at each anchor a (every position, or `anchors` drawn): their last layer's
        states (B, A, b, H) before the final norm, slot i at position a+i, and the drawn anchors
        (B, A) (None: every position, A = T)."""
        ids, feats = batch.input_ids, batch.features  # (B, T), (B, T, n*H)
        width = len(self.feature_layers) * self.target.hidden_size
        if feats is None or feats.shape[-1] != width:
            raise ValueError(f"{self.name}: the batch needs the features of aux layers "
                             f"{self.feature_layers} (width {width}); got {getattr(feats, 'shape', None)}")
        B, T = ids.shape
        b, dev = self.cfg.block_size, ids.device
        drawn = batch.anchors if batch.anchors is not None else self.draw(batch)
        at = torch.arange(T, device=dev).expand(B, T) if drawn is None else drawn  # (B, A)
        A = at.shape[1]
        pos = torch.arange(T, device=dev)
        seen = (pos[None, None, :] < at[:, :, None]) & batch.attention_mask[:, None, :].bool()
        ctx = self.context(feats)  # (B, T, H)
        ctx_cs = self.rotary_emb(ctx, pos.expand(B, T))
        x = self._block(ids.gather(1, at))  # (B, A*b, H)
        cs = self.rotary_emb(x, (at[:, :, None] + torch.arange(b, device=dev)).flatten(1))
        for layer in self.layers:
            ck, cv = layer.self_attn.kv(ctx, ctx_cs)  # (B, kv, T, d) each
            x = layer(x, cs, lambda q, k, v: block_attention(q, k, v, ck, cv, seen, b))
        return x.view(B, A, b, -1), drawn

    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """Draft i = 1 .. b-1 of the block at each anchor a (every position, or `anchors` drawn):
        DraftPrediction shift i-1 at anchor a, weighted _weight(i)."""
        x, drawn = self.block_states(batch)  # (B, A, b, H)
        logits = self.head(x[:, :, 1:])  # (B, A, b-1, Vd)
        b = self.cfg.block_size
        return [DraftPrediction(logits=logits[:, :, i - 1], shift=i - 1, weight=self._weight(i),
                                anchors=drawn) for i in range(1, b)]

    # -- decoding ---------------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache = DraftCache()  # per layer: context keys / values of the committed positions

    def sync(self, state: DecodeState) -> None:
        """Crop the cache to what it shares with the committed tokens, then add the context keys
        and values of the committed positions it lacks (all but the last token's)."""
        tokens, feats = state.tokens, state.features  # (T,), (T-1, n*H)
        T = tokens.shape[0]
        if feats is None or T < 2 or feats.shape[0] != T - 1:
            raise ValueError("dflash: propose needs >= 2 tokens and state.features for tokens[:-1]")
        cache = self.cache
        keep = max(0, min(cache.committed, cache.shared_prefix(tokens), T - 1))
        cache.sync_to(tokens, keep, committed=T - 1)
        if keep == T - 1:
            return
        ctx = self.context(feats[keep:][None])  # (1, n, H)
        cs = self.rotary_emb(ctx, torch.arange(keep, T - 1, device=ctx.device)[None])
        for i, layer in enumerate(self.layers):
            cache.kv.update(*layer.self_attn.kv(ctx, cs), i)

    def run_block_states(self, first: torch.Tensor, pos: torch.Tensor, kv, mask) -> torch.Tensor:
        """Blocks after the slot-0 tokens first (B,) at positions pos (B, b), attending through
        kv (context columns, then the block) under the additive mask (B, 1, b, K) or None (= all)
        -> their last layer's states (B, b, H) before the final norm."""
        x = self._block(first[:, None])  # (B, b, H)
        cs = self.rotary_emb(x, pos)

        def attend(i: int):
            def run(q, k, v):
                k, v = kv.update(k, v, i)  # (B, kv, K, d): context, then block
                if mask is None and few_query(q, k.shape[2]):  # 16-bit CPU, long cache: plain ops
                    return grouped_attention(q, k, v, None, causal=False)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return run
        for i, layer in enumerate(self.layers):
            x = layer(x, cs, attend(i))
        return x

    def run_block(self, first: torch.Tensor, pos: torch.Tensor, kv, mask, k: int) -> torch.Tensor:
        """run_block_states -> the first k draft distributions of each block (B, k, Vd)."""
        return self.head(self.run_block_states(first, pos, kv, mask)[:, 1:1 + k]).float()

    @torch.no_grad()
    def decode_states(self, state: DecodeState) -> torch.Tensor:
        """ONE forward over the block after state.tokens -> its states (1, b, H) before the final
        norm (slot 0 = the last committed token); the cache keeps the context only."""
        self.sync(state)
        T, b = state.tokens.shape[0], self.cfg.block_size
        pos = torch.arange(T - 1, T - 1 + b, device=state.tokens.device)[None]  # (1, b)
        try:
            return self.run_block_states(state.tokens[-1:], pos, self.cache.kv, None)  # (1, b, H)
        finally:
            self.cache.forget_drafts()  # the block is per round: keep the context only

    @torch.no_grad()
    def draft_logits(self, state: DecodeState, k: int) -> torch.Tensor:
        """The first k draft distributions (k, Vd) of ONE forward over the block after state.tokens."""
        return self.head(self.decode_states(state)[:, 1:1 + k]).float()[0]  # (k, Vd)

    def trained_positions(self, cfg: Optional[DFlashConfig] = None) -> int:
        """Drafts per block: slot 0 holds the last committed token, the others draft."""
        return (cfg or self.cfg).block_size - 1

    def rows_round(self, slots, states, ks, sampling, generators, min_confidence
                   ) -> list[ChainProposal]:
        """The batched round: every row's block in ONE padded forward. Each row's
        context (its own cache, synced as propose syncs it) goes into one batch cache (RowsKV);
        its block sees its own context columns and itself; its cache keeps the context only."""
        for d, s in zip(slots, states):
            d.sync(s)
        rows = RowsKV([d.cache for d in slots], states[0].tokens.device)
        B, b = len(slots), self.cfg.block_size
        ends = torch.tensor([len(s.tokens) - 1 for s in states], device=rows.allowed.device)
        allowed = torch.cat([rows.allowed[:, None].expand(-1, b, -1),
                             rows.allowed.new_ones(B, b, b)], dim=-1)  # (B, b, K + b)
        logits = self.run_block(torch.stack([s.tokens[-1] for s in states]),
                                 ends[:, None] + torch.arange(b, device=ends.device), rows.kv,
                                 additive_mask(allowed, self.fc.weight.dtype), max(ks))
        return parallel.draw_chains(self, logits, ks, sampling, generators, min_confidence)
