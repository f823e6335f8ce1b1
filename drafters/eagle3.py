"""EAGLE-3: a drafter over three fused target layers, trained with the training-time test.

At anchor t the drafter reads the target's hidden states of three layers (low / mid / high) at t and
the embedding of token t+1, and predicts token t+2; later steps read the drafter's own output:

    g_t = fc([low_t; mid_t; high_t])                 fc: Linear(3H -> H), no bias
    a_t = attn([input_layernorm(embed(tok_{t+1})); hidden_norm(g_t)])   q/k/v over 2H, RoPE
    h_t = g_t + a_t;  h_t = h_t + mlp(post_attention_layernorm(h_t))    (more layers: plain Llama)
    logits_t = lm_head(norm(h_t))   over a pruned draft vocabulary (d2t / t2d)
    next step: g <- h_t (or norm(h_t) with norm_output; options named as the engines name them)

Training-time test (`forward_train`): `ttt_length` steps unrolled on the drafter's own outputs, each
with the attention it sees at decode time: step j at anchor t (position t+j-1) attends to step 1's
keys at anchors <= t (real features, causal) and to the keys of steps 2..j at anchor t only. The
later blocks are diagonal, so they are scored as one dot product per query (SpecForge's trick)
instead of a (T x jT) mask: each step costs one T x T attention whatever j is.

Aux layers use our HF `hidden_states` indexing (0 = embeddings, i = output of layer i). vLLM (and
speculators) capture the INPUT of layer id = hidden_states[id], SGLang the OUTPUT = hidden_states[
id + 1]: the exports below write each engine's ids for the same layers.

Sources read (2026-11-30): SGLang srt/models/llama_eagle3.py @03d5a777 and llama.py (capture
= id + 1); vLLM model_executor/models/llama_eagle3.py @00bd1493 (+ _get_eagle3_aux_layers_from_
config; its speculators path defaults norm_before_residual to true); speculators 0.9.0 (PyPI wheel,
models/eagle3/; the slow test loads our export there); SpecForge llama3_eagle.py @01dd7144.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from specdistill.drafters.anchors import capped_steps
from specdistill.drafters.attention import few_query, grouped_attention, ttt_attention
from specdistill.drafters.base import DrafterConfig, DraftPrediction, ExportLayout, TrainBatch, register
from specdistill.drafters.drafting import CausalDrafter
from specdistill.drafters.export_formats import (WEIGHTS, ExportError, cast, llama_layer_config,
                                     speculators_config, torch_dtype)
from specdistill.drafters.head import head_logits
from specdistill.drafters.parts import default_aux_layers, drafter_llama_config, finish_init
from specdistill.drafters.ranges import MAX_DRAFT, MAX_LAYERS, MAX_TREE, MAX_VOCAB, rng
from specdistill.drafters.vocab import d2t_to_offsets, offsets_to_d2t, t2d_mask


@dataclass
class Eagle3Config(DrafterConfig):
    """EAGLE-3 drafter settings."""

    name: str = "eagle3"  # registry key
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
    """init_from_target_layer (drafters/parts.py): layer 0's 2H-wide q/k/v take the target's
    weights in both halves [W | W] over [embed; feature], its hidden_norm the target's input norm."""
    if i > 0:
        return state
    state = {k: torch.cat([v, v], dim=1) if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
             else v for k, v in state.items()}
    return {**state, "hidden_norm.weight": state["input_layernorm.weight"]}


class Eagle3(CausalDrafter):  # registered at the end of the module, with its export layouts
    """EAGLE-3 drafter: fc over three target layers + decoder layer(s) + final norm + LM head.
    Decoding is drafters/drafting.py's, driven through `project` (the fusion), `inputs`,
    `backbone` and `head`."""

    def __init__(self, cfg: Eagle3Config, target) -> None:
        super().__init__(target.vocab_size, cfg, target)
        L = target.num_layers
        aux = list(cfg.aux_layers) if cfg.aux_layers is not None else default_aux_layers(L)
        if len(aux) != 3 or not all(0 <= i <= L for i in aux):
            raise ValueError(f"eagle3: aux_layers must be 3 hidden_states indices in [0, {L}] "
                             f"(0 = embeddings, i = output of layer i), got {aux}; "
                             f"null takes the engines' default {default_aux_layers(L)}")
        if cfg.num_layers < 1 or cfg.ttt_length < 1:
            raise ValueError(f"eagle3: num_layers and ttt_length must be >= 1, got {cfg}")
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

    def _run(self, emb, h, positions, attend: Callable[[int], Attend]) -> torch.Tensor:
        """Token embeddings emb (B, Q, H) and input states h (B, Q, H) at positions (B, Q) -> the
        state fed to the next step (B, Q, H): the last layer's output, normed with norm_output."""
        rope = self.rotary_emb(h, positions)
        for i, layer in enumerate(self.layers):
            h = layer(emb, h, rope, attend(i))
        return self.norm(h) if self.cfg.norm_output else h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Recurrent state (..., H) -> logits (..., Vd) over the draft vocabulary."""
        return head_logits(self, h if self.cfg.norm_output else self.norm(h))

    # -- training ---------------------------------------------------------------------------------
    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """`ttt_length` steps (shifts 1, 2, ...): step 1 reads the target's fused features, step
        j > 1 its own step j-1 outputs at the same anchor and the real token t+j. Distribution loss
        only (features=None)."""
        return self._unroll(batch, self.cfg.ttt_length, own_tokens=False)

    def forward_own(self, batch: TrainBatch, steps: int) -> list[DraftPrediction]:
        """As forward_train over `steps` steps, but step j > 1 is fed the drafter's own draft of step
        j-1 (its argmax, as a greedy chain drafts), kept in DraftPrediction.inputs."""
        return self._unroll(batch, steps, own_tokens=True)

    def _unroll(self, batch: TrainBatch, steps: int, own_tokens: bool) -> list[DraftPrediction]:
        ids, feats = batch.input_ids, batch.features  # (B, T), (B, T, 3H)
        H = self.target.hidden_size
        if feats is None or feats.shape[-1] != 3 * H:
            raise ValueError(f"eagle3: the batch needs the features of aux layers "
                             f"{self.feature_layers} (width {3 * H}); got {getattr(feats, 'shape', None)}")
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        keys = batch.attention_mask[:, None, None, :].bool()  # (B, 1, 1, T): never attend to padding
        causal = (pos[None, :] <= pos[:, None])[None, None] & keys  # (B, 1, T, T)
        store: list[list] = [[] for _ in self.layers]  # per layer: (k, v) of each step
        h, preds = self.fuse(feats), []
        for j in range(1, capped_steps("drafter.ttt_length", steps, T) + 1):
            if own_tokens and preds:  # the previous step's draft at each anchor, as target ids
                d = preds[-1].logits.detach().argmax(-1)  # (B, T)
                tok = d if self.d2t is None else self.d2t[d]
            else:  # token t+j; the last j columns get a filler id: those anchors are never counted
                tok = torch.cat([ids[:, j:], ids[:, -1:].expand(B, min(j, T))], dim=1)[:, :T]
            emb = self.target.embed_tokens()(tok).to(h.dtype)  # (B, T, H), frozen
            h = self._run(emb, h, (pos + j - 1).expand(B, T),
                          lambda i: lambda q, k, v: ttt_attention(q, k, v, store[i], causal))
            preds.append(DraftPrediction(logits=self.head(h), shift=j,  # (B, T, Vd)
                                         weight=self.cfg.ttt_decay ** (j - 1),
                                         inputs=tok if own_tokens else None))
        return preds

    # -- decoding: drafters/drafting.py drives these (project, inputs, backbone, head) ----------
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
        return self._run(emb, h, positions, attend)


# == Export: the engines' EAGLE-3 layouts (versions in the module docstring). A renaming at most: ==
# == layers.0 <-> midlayer (SGLang, vLLM), d2t ids <-> offsets, plus each engine's aux-layer ids. ==
ENGINES = ("sglang", "vllm", "speculators")
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# options the engine's loader (as read) does not implement: an export would silently drop them
UNSUPPORTED = {"sglang": FLAGS, "vllm": FLAGS[1:], "speculators": ()}


def engine_refusal(dcfg: dict, engine: str) -> Optional[str]:
    """Why `engine` cannot run a drafter of config dcfg exactly (None = it can); the aux-layer ids
    are checked when written (engine_layer_ids), since they depend on the target's depth."""
    if engine not in ENGINES:
        return f"eagle3: unknown engine {engine!r}; engines: {', '.join(ENGINES)}"
    bad = [f for f in UNSUPPORTED[engine] if dcfg.get(f)]
    if bad:
        return (f"eagle3: the {engine} EAGLE-3 loader does not implement {bad}; train without "
                f"them or export to another engine / format=hf")
    if engine == "sglang" and dcfg.get("num_layers", 1) > 1:  # its extra layers drop the residual
        return "eagle3: SGLang's extra draft layers differ from ours; num_layers must be 1"
    if engine == "speculators" and dcfg.get("norm_before_fc") and dcfg.get("fc_norm"):
        return "eagle3: speculators refuses norm_before_fc with fc_norm; train with one"
    return None


def engine_layer_ids(drafter: Eagle3, engine: str) -> list[int]:
    """The aux-layer ids `engine` must be given to capture our feature_layers: vLLM / speculators
    capture the input of layer id (= hidden_states[id]), SGLang the output (= hidden_states[id+1]).
    ExportError when `engine` cannot run this drafter exactly, naming the setting and the fix."""
    why = engine_refusal(dataclasses.asdict(drafter.cfg), engine)
    L, ids = drafter.target.num_layers, list(drafter.feature_layers)
    lo = 1 if engine == "sglang" else 0  # SGLang cannot name the embeddings, neither the last state
    if not why and (len(set(ids)) != 3 or not all(lo <= i <= L - 1 for i in ids)):
        why = (f"eagle3: {engine} captures 3 distinct hidden_states in [{lo}, {L - 1}]; this "
               f"drafter reads {ids}: train with aux_layers inside that range")
    if why:
        raise ExportError(why)
    return [i - 1 for i in ids] if engine == "sglang" else ids


def engine_state(drafter: Eagle3, engine: str, state: Optional[dict] = None,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The weights `engine` loads: our state dict (default: the drafter's) renamed, d2t as offsets,
    t2d, the target's head at full vocabulary (and speculators' embeddings), cast to dtype."""
    engine_layer_ids(drafter, engine)  # refuses what the engine cannot run
    state = dict(drafter.state_dict() if state is None else state)
    d2t, _ = state.pop("draft_vocab.d2t", None), state.pop("draft_vocab.t2d", None)
    mid = "layers.0." if engine == "speculators" else "midlayer."
    out = {(mid + n[len("layers.0."):] if n.startswith("layers.0.") else n): cast(v, dtype)
           for n, v in state.items()}
    if engine == "speculators":  # its checkpoints carry it; it fills a missing one only if NaN
        out["embed_tokens.weight"] = cast(drafter.target.embed_tokens().weight, dtype)
    if d2t is None:
        out["lm_head.weight"] = cast(drafter.target.lm_head().weight, dtype)
        if engine == "speculators":  # no maps at full vocab: it has no buffers for them
            return out
        d2t = torch.arange(drafter.vocab_size)
    out["d2t"] = d2t_to_offsets(d2t.cpu())  # (Vd,) int64: target id = i + d2t[i]
    out["t2d"] = t2d_mask(d2t.cpu(), drafter.vocab_size)  # (V,) bool
    return out


def state_from_engine(tensors: dict[str, torch.Tensor], engine: str, pruned: bool) -> dict:
    """Inverse of engine_state: our state dict (pruned = the drafter has draft_vocab_size)."""
    state = {("layers.0." + n[len("midlayer."):]) if n.startswith("midlayer.") else n: v
             for n, v in tensors.items() if n not in ("d2t", "t2d", "embed_tokens.weight")}
    if pruned:
        d2t = offsets_to_d2t(tensors["d2t"].long())
        state["draft_vocab.d2t"], state["draft_vocab.t2d"] = d2t, t2d_mask(d2t, len(tensors["t2d"]))
    else:
        state.pop("lm_head.weight", None)  # at full vocabulary the target's head (absent: shared)
    return state


def engine_config(drafter: Eagle3, engine: str, speculative_tokens: int = 5,
                  verifier: Optional[str] = None, dtype: str = "float32") -> dict:
    """config.json for `engine`: `LlamaForCausalLMEagle3` (SGLang: ids in eagle_config; vLLM: ids
    at the top level, read first) or the speculators format. tie_word_embeddings is false: the
    draft owns neither embedding nor head to tie (SGLang would tie them and fail)."""
    ids = engine_layer_ids(drafter, engine)
    layer = {**llama_layer_config(drafter.llama_config, drafter.target, dtype),
             "tie_word_embeddings": False}
    vd = drafter.vocab_size if drafter.d2t is None else len(drafter.d2t)
    flags = {f: bool(getattr(drafter.cfg, f)) for f in FLAGS}
    if engine == "sglang":
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": vd,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
    if engine == "vllm":
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": vd,
                "eagle_aux_hidden_state_layer_ids": ids, **flags}
    for key in ("torch_dtype", "dtype"):
        layer.pop(key)
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": vd, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": ids, "embed_requires_grad": False,
            "tie_word_embeddings": False, **flags,
            "speculators_config": speculators_config("eagle3", speculative_tokens, verifier,
                                                     drafter.target)}


def _layout(engine: str, summary: str, usage: str) -> ExportLayout:
    """The export layout of `engine`: engine_state / engine_config written, state_from_engine read."""
    def write(drafter, state, ctx):
        tensors = engine_state(drafter, engine, state, torch_dtype(ctx.dtype))
        config = engine_config(drafter, engine, ctx.speculative_tokens, ctx.meta.get("base_model"),
                               ctx.dtype)
        return {**config, **ctx.common()}, {WEIGHTS: tensors}

    def read(files, dcfg, vocab_size):
        return state_from_engine(files[WEIGHTS], engine, dcfg.get("draft_vocab_size") is not None)

    return ExportLayout(format=engine, summary=summary, usage=usage, write=write, read=read,
                        check=lambda dcfg: engine_refusal(dcfg, engine), tags=(engine, "eagle3"))


LAYOUTS = (
    _layout("sglang", "SGLang's EAGLE-3 layout (LlamaForCausalLMEagle3; aux-layer ids in "
            "eagle_config, one below ours: SGLang captures layer outputs).",
            "python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE3 "
            "--speculative-draft-model-path {path} --speculative-num-steps {k} "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens {k1}"),
    _layout("vllm", "vLLM's EAGLE-3 layout (LlamaForCausalLMEagle3; aux-layer ids = ours: vLLM "
            "captures layer inputs).",
            "vllm serve {base} --speculative-config "
            "'{{\"method\": \"eagle3\", \"model\": \"{path}\", \"num_speculative_tokens\": {k}}}'"),
    _layout("speculators", "the speculators library's EAGLE-3 format (speculators_model_type "
            "eagle3, Eagle3DraftModel; vLLM serves it directly).",
            "vllm serve {path}      # or in Python:\n"
            "from speculators.models.eagle3 import Eagle3DraftModel\n"
            "model = Eagle3DraftModel.from_pretrained('{path}')"))
register("eagle3", config=Eagle3Config, layouts=LAYOUTS)(Eagle3)
