"""The serving engines' names and configs for the fused-feature network's weights (drafters/
fused.py): eagle3's and peagle's export layouts write them, dflash's reads its files back with
`state_from_engine`. A renaming at most: layers.0 <-> midlayer (SGLang, vLLM), d2t ids <->
offsets plus t2d, and each engine's aux-layer ids (vLLM and speculators capture the INPUT of
layer id = hidden_states[id], SGLang the OUTPUT = hidden_states[id + 1]). Versions read: the
module docstring of drafters/eagle3.py.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from specdistill.drafters.parts.fused import FusedDrafter
from specdistill.drafters.parts.layouts import ExportError, cast, llama_layer_config, speculators_config
from specdistill.drafters.parts.vocab import d2t_to_offsets, offsets_to_d2t, t2d_mask

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


def aux_fix(ids: list[int], num_layers: int) -> str:
    """The fix of feature layers an engine cannot capture: a layer past the target's last means
    the drafter meets another target than its own (more layers) before its aux_layers are wrong."""
    if max(ids) > num_layers:
        return (f"the target given has {num_layers} layers, fewer than this drafter reads: give the "
                f"target it was trained on (target=...), or train with aux_layers inside that range")
    return "train with aux_layers inside that range"


def engine_layer_ids(drafter: FusedDrafter, engine: str) -> list[int]:
    """The aux-layer ids `engine` must be given to capture our feature_layers: vLLM / speculators
    capture the input of layer id (= hidden_states[id]), SGLang the output (= hidden_states[id+1]).
    ExportError when `engine` cannot run this drafter exactly, naming the setting and the fix."""
    why = engine_refusal(dataclasses.asdict(drafter.cfg), engine)
    L, ids = drafter.target.num_layers, list(drafter.feature_layers)
    lo = 1 if engine == "sglang" else 0  # SGLang cannot name the embeddings, neither the last state
    if not why and (len(set(ids)) != 3 or not all(lo <= i <= L - 1 for i in ids)):
        why = (f"eagle3: {engine} captures 3 distinct hidden_states in [{lo}, {L - 1}]; this "
               f"drafter reads {ids}: " + aux_fix(ids, L))
    if why:
        raise ExportError(why)
    return [i - 1 for i in ids] if engine == "sglang" else ids


def engine_state(drafter: FusedDrafter, engine: str, state: Optional[dict] = None,
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


def engine_config(drafter: FusedDrafter, engine: str, k: int = 5,
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
            "speculators_config": speculators_config("eagle3", k, verifier,
                                                     drafter.target)}
