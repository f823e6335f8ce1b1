"""Export layouts: how a drafter's weights and config map onto the files each consumer loads.

Every layout below was written against the loader that reads it (sources read 2026-11-29):
  hf           ours, lossless for every registered drafter: the state dict, with a pruned vocab's
               maps stored EAGLE-3 style (`d2t` int64 offsets, target_id = i + d2t[i]; `t2d` bool).
  vllm (eagle) vllm/model_executor/models/llama_eagle.py, EagleLlamaForCausalLM: fc (2H -> H, no
               bias) over [embed(token), hidden], `layers.N.*` (layer 0 has no input_layernorm: vLLM
               replaces it by Identity), output = last layer + residual, logits from the TARGET's
               lm_head and embeddings (shared), hidden = the target's final-normed state. Config: a
               Llama config; vLLM's EAGLEConfig turns LlamaForCausalLM into EagleLlamaForCausalLM.
  sglang (eagle) python/sglang/srt/models/llama_eagle.py, LlamaForCausalLMEagle: the same network,
               but its fc has a bias (written as zeros, else it keeps its random init) and it
               ignores lm_head weights (set_embed_and_head shares the target's).
  speculators  vllm-project/speculators src/speculators/models/eagle.py, EagleSpeculator
               (speculators_model_type "eagle", layernorms=false, fusion_bias=false): fusion_fc,
               transformer.* (ONE LlamaDecoderLayer, input_layernorm Identity), lm_head and embeddings
               from the verifier; src/speculators/config.py: speculators_config = algorithm,
               proposal_methods [{proposal_type, speculative_tokens, ...}], default_proposal_method,
               verifier {name_or_path, architectures}.
  medusa, vllm (medusa) vllm/model_executor/models/medusa.py + transformers_utils/configs/medusa.py:
               blocks.{i}.layers.{j}.{weight,bias} (medusa_fc_bias), lm_heads.0.weight shared by all
               heads (original_lm_head), token_map + truncated_vocab_size for a pruned vocab; and, where
               it can hold the heads (full vocab, <= 1 block), FasterDecoding/Medusa
               medusa/model/medusa_model.py: medusa_lm_head.pt, loaded by
               `model.medusa_head.load_state_dict(sd, strict=False)` -- so keyed relative to the
               medusa_head ModuleList: {i}.{j}.linear.{weight,bias} and {i}.{L}.weight (a
               "medusa_head." prefix would be skipped silently) -- and config medusa_num_heads /
               medusa_num_layers / base_model_name_or_path. (That repo repeats ONE ResBlock object
               per head, so more than one block would be tied on load.)
  eagle3       vllm llama_eagle3.py / sglang llama_eagle3.py: midlayer.* with qkv over [norm(embed),
               norm(hidden)] (2H), fc (3H -> H), norm, lm_head over draft_vocab_size, d2t, t2d. No
               drafter here has that network: our `eagle` is EAGLE-1 (fc mixes embed and feature
               before one norm), so no weight mapping onto EAGLE-3 exists and the format is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from drafters.vocab import d2t_to_offsets, offsets_to_d2t

FORMATS = ("hf", "vllm", "sglang", "speculators", "medusa", "eagle3")
WEIGHTS = "model.safetensors"
MEDUSA_ORIGINAL = "medusa_lm_head.pt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """An export that cannot be written or does not validate; the message says what and the fix."""


@dataclass
class Layout:
    """What one export folder holds (README.md aside)."""

    config: dict[str, Any]  # config.json
    files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # file -> tensors


def unsupported(fmt: str, dcfg: dict[str, Any]) -> str | None:
    """Why drafter config `dcfg` cannot be written in format `fmt` (None = it can)."""
    from drafters.base import DRAFTERS, drafter_class

    name = dcfg.get("name")
    if fmt not in FORMATS:
        return f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}"
    drafter_class("ngram")  # importing drafters/ fills the registry
    if name not in DRAFTERS:
        return f"unknown drafter {name!r}; known: {sorted(DRAFTERS)}"
    if fmt == "hf":  # the state dict as it is: any registered drafter
        return None
    if name not in ("eagle", "medusa"):
        return f"drafter {name!r} has engine layouts only through format=hf here"
    if fmt == "eagle3":
        return ("format eagle3 needs an EAGLE-3 drafter (fc over 3 target layers, a layer over "
                "[norm(embed), norm(hidden)]); no drafter here has that network and our "
                f"{name!r} does not map onto it. Use format=vllm or sglang (EAGLE-1 / Medusa "
                "layouts) or format=hf.")
    if name == "medusa":
        if fmt in ("sglang", "speculators"):
            return (f"format {fmt} has no Medusa loader (SGLang serves EAGLE/EAGLE-3/n-gram; this "
                    f"export's speculators layout is EAGLE's). Use format=medusa (vLLM and the "
                    f"Medusa repo) or format=hf.")
        return None
    if fmt == "medusa":
        return "format medusa is for medusa drafters; an eagle drafter exports as vllm, sglang, speculators or hf"
    need = []
    if dcfg.get("feature_layer", -1) != -1:
        need.append("feature_layer=-1 (the engines feed the target's final-normed hidden state)")
    if dcfg.get("draft_vocab_size") is not None:
        need.append("draft_vocab_size=null (their EAGLE-1 loaders score with the target's own LM "
                    "head; a trained pruned head has nowhere to go)")
    if dcfg.get("input_norm", True):
        need.append("input_norm=false (their layer 0 has no input_layernorm)")
    if fmt == "speculators" and dcfg.get("num_layers", 1) != 1:
        need.append("num_layers=1 (EagleSpeculator holds one decoder layer)")
    if need:
        return (f"format {fmt} serves EAGLE-1 heads trained with " + "; ".join(need)
                + ". Train with those drafter settings, or export format=hf (lossless, read by "
                  "our decoder).")
    return None


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CPU copy (own storage: safetensors refuses tensors that share memory, e.g. tied weights)."""
    t = t.detach().cpu()
    return (t.to(dtype) if t.is_floating_point() else t).clone().contiguous()


def _llama_config(drafter, target, dtype: str) -> dict[str, Any]:
    """The drafter's decoder-layer config as engines read it: transformers 5's rope_parameters plus
    the legacy rope_theta / rope_scaling that engines on transformers 4 read."""
    c = drafter.llama_config.to_dict()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias")
    out = {k: c[k] for k in keys}
    rope = dict(c.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
    out["rope_parameters"] = rope
    out["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    out["rope_scaling"] = (None if rope.get("rope_type", "default") == "default"
                           else {k: v for k, v in rope.items() if k != "rope_theta"})
    tc = target.config
    out.update(model_type="llama", tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
               bos_token_id=getattr(tc, "bos_token_id", None), eos_token_id=getattr(tc, "eos_token_id", None),
               pad_token_id=getattr(tc, "pad_token_id", None), torch_dtype=dtype, dtype=dtype)
    return out


def to_layout(fmt: str, drafter, dcfg: dict[str, Any], target, meta: dict[str, Any],
              dtype: str = "float32", speculative_tokens: int = 5) -> Layout:
    """The files of `drafter` (config dcfg) in format fmt. meta goes into config.json under
    `specdistill` (our own config, so load_export can rebuild the drafter from any format)."""
    reason = unsupported(fmt, dcfg)
    if reason:
        raise ExportError(reason)
    dt = DTYPES[dtype]
    state = {k: _cast(v, dt) for k, v in drafter.state_dict().items()}
    base = {"specdistill": meta, "torch_dtype": dtype}
    if fmt == "hf":
        name = dcfg["name"]
        d2t = state.pop("draft_vocab.d2t", None)
        t2d = state.pop("draft_vocab.t2d", None)
        if d2t is not None:
            state["d2t"], state["t2d"] = d2t_to_offsets(d2t), t2d
        cfg = {"architectures": [f"Specdistill{name.capitalize()}Drafter"],
               "model_type": f"specdistill_{name}", "vocab_size": target.vocab_size,
               "hidden_size": target.hidden_size, "draft_vocab_size": dcfg.get("draft_vocab_size"),
               **base}
        return Layout(cfg, {WEIGHTS: state})
    if dcfg["name"] == "eagle":
        llama = _llama_config(drafter, target, dtype)
        if fmt == "vllm":
            return Layout({**llama, "architectures": ["LlamaForCausalLM"], **base}, {WEIGHTS: state})
        if fmt == "sglang":
            state["fc.bias"] = torch.zeros(state["fc.weight"].shape[0], dtype=dt)
            return Layout({**llama, "architectures": ["LlamaForCausalLMEagle"], **base}, {WEIGHTS: state})
        return _speculators(state, llama, target, meta, base, speculative_tokens)
    return _medusa(state, drafter, dcfg, target, meta, base, dt)


def _speculators(state, llama, target, meta, base, k: int) -> Layout:
    tensors = {("fusion_fc." + n[3:]) if n.startswith("fc.") else "transformer." + n[len("layers.0."):]: v
               for n, v in state.items()}
    layer = {**llama, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    for key in ("torch_dtype", "dtype"):
        layer.pop(key)
    cfg = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
           "speculators_model_type": "eagle", "speculators_version": "0.1.0",
           "transformer_layer_architecture": "LlamaDecoderLayer",
           "transformer_layer_config": layer, "layernorms": False, "fusion_bias": False,
           "speculators_config": {
               "algorithm": "eagle",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
               "default_proposal_method": "greedy",
               "verifier": {"name_or_path": meta.get("base_model"),
                            "architectures": list(getattr(target.config, "architectures", None)
                                                  or ["LlamaForCausalLM"])}},
           **base}
    return Layout(cfg, {WEIGHTS: tensors})


def _medusa(state, drafter, dcfg, target, meta, base, dt) -> Layout:
    K, L = dcfg["num_heads"], dcfg["num_layers"]
    vllm = {}
    for name, v in state.items():  # heads.{i}.{j}.linear.{weight,bias} -> blocks.{i}.layers.{j}.*
        if name.startswith("heads."):
            _, i, j, _, kind = name.split(".")
            vllm[f"blocks.{i}.layers.{j}.{kind}"] = v
    pruned = dcfg.get("draft_vocab_size") is not None
    head = state["lm_head.weight"] if pruned else _cast(target.lm_head().weight, dt)  # (Vd|V, H)
    vllm["lm_heads.0.weight"] = head
    if pruned:
        vllm["token_map"] = state["draft_vocab.d2t"]  # (Vd,) target ids of the head's rows
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa",
           "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
           "num_heads": K, "num_hidden_layers": L, "medusa_num_heads": K, "medusa_num_layers": L,
           "truncated_vocab_size": head.shape[0], "medusa_fc_bias": True, "original_lm_head": True,
           "base_model_name_or_path": meta.get("base_model"), **base}
    files = {WEIGHTS: vllm}
    if not pruned and L <= 1:  # the original repo's layout; one head tensor shared by K keys is
        orig = {}              # stored once by torch.save
        for i in range(K):
            for j in range(L):
                for kind in ("weight", "bias"):
                    orig[f"{i}.{j}.linear.{kind}"] = state[f"heads.{i}.{j}.linear.{kind}"]
            orig[f"{i}.{L}.weight"] = head
        files[MEDUSA_ORIGINAL] = orig
    return Layout(cfg, files)


def from_layout(fmt: str, dcfg: dict[str, Any], files: dict[str, dict[str, torch.Tensor]],
                vocab_size: int) -> dict[str, torch.Tensor]:
    """Inverse of to_layout: the drafter's own state dict (names and vocab maps) from the files."""
    t = dict(files[WEIGHTS])
    if fmt == "hf":
        if "d2t" in t:
            t["draft_vocab.d2t"] = offsets_to_d2t(t.pop("d2t"))
            t["draft_vocab.t2d"] = t.pop("t2d")
        return t
    if dcfg["name"] == "eagle":
        if fmt == "sglang":
            t.pop("fc.bias")
        if fmt == "speculators":
            t = {("fc." + n[len("fusion_fc."):]) if n.startswith("fusion_fc.")
                 else "layers.0." + n[len("transformer."):]: v for n, v in t.items()}
        return t
    state = {}
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


def vocab_maps(files: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """The draft vocab of an export as {"d2t": target ids (Vd,), "t2d": mask or None}, or None."""
    t = files.get(WEIGHTS, {})
    if "d2t" in t:
        return {"d2t": offsets_to_d2t(t["d2t"].long()), "t2d": t.get("t2d")}
    if "token_map" in t:
        return {"d2t": t["token_map"].long(), "t2d": None}
    return None
