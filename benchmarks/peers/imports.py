"""A peer's exported drafter, rebuilt as ours so our greedy replay measures it: an EAGLE-3 export as
our Eagle3, a speculators DSpark export as our DSpark (`import_dspark`).

Both peers export a layout vLLM serves: speculators its own format (`speculators_model_type:
eagle3`, weights `layers.0.*`), SpecForge `LlamaForCausalLMEagle3` (weights `midlayer.*`, SGLang's
format). The renaming is our export layouts' own inverse (drafters/parts/fused_layouts.py
`state_from_engine`); the network options (norm_before_residual, norm_before_fc, fc_norm,
norm_output) come from the peer's config where it writes them, else the engine's default for that
format (vLLM reads a missing norm_before_residual as false for LlamaForCausalLMEagle3). A draft
vocabulary in the peer's order is put in ours (ascending target ids), rows of the head with it.
The load is strict: a weight we would not use, or one we miss, fails.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdistill.drafters.base import build_drafter
from specdistill.drafters.parts.fused_layouts import FLAGS, state_from_engine
from specdistill.drafters.parts.vocab import d2t_to_offsets, offsets_to_d2t

log = logging.getLogger(__name__)


def peer_format(config: dict) -> str:
    """speculators | sglang (SpecForge's LlamaForCausalLMEagle3), from an export's config.json."""
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        return "sglang"
    raise ValueError(f"not an EAGLE-3 export of speculators or SpecForge: architectures "
                     f"{config.get('architectures')}, speculators_model_type "
                     f"{config.get('speculators_model_type')!r}")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def sorted_vocab(tensors: dict[str, torch.Tensor],
                 rows: tuple[str, ...] = ("lm_head.weight",)) -> dict[str, torch.Tensor]:
    """The draft vocabulary in ascending target ids (ours), the rows of every tensor in `rows`
    that is indexed by draft id (the head; DSpark's Markov W2 too) permuted with it."""
    if "d2t" not in tensors:
        return tensors
    d2t = offsets_to_d2t(tensors["d2t"].long())
    order = torch.argsort(d2t)
    out = dict(tensors)
    out["d2t"] = d2t_to_offsets(d2t[order])
    for name in rows:
        if name in tensors:
            out[name] = tensors[name][order]
    return out


def import_peer(folder, target, aux_layers: list[int]):
    """Our drafter holding the weights of a peer's export in `folder`: Eagle3 (its aux layers:
    `aux_layers`, the ones its training features came from), or DSpark for speculators'
    `speculators_model_type: dspark`."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("speculators_model_type") == "dspark":
        return import_dspark(folder, config, target, aux_layers)
    fmt = peer_format(config)
    tensors = sorted_vocab({k.removeprefix("model."): v for k, v in read_weights(folder).items()})
    layer = config.get("transformer_layer_config", config)
    draft_vocab = int(tensors["d2t"].shape[0]) if "d2t" in tensors else None
    cfg = {"name": "eagle3", "aux_layers": list(aux_layers), "draft_vocab_size": draft_vocab,
           "num_layers": int(layer.get("num_hidden_layers", 1)), "ttt_length": 1,
           **{f: bool(config.get(f, False)) for f in FLAGS}}
    drafter = build_drafter(cfg, target)
    keep = {k: v for k, v in tensors.items() if not k.startswith(("verifier", "embed_tokens"))}
    state = state_from_engine(keep, "speculators" if fmt == "speculators" else "vllm",
                              pruned=draft_vocab is not None)
    drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return drafter.eval()


def dspark_config(config: dict, target, aux_layers: list[int]) -> dict:
    """Our DSpark config (drafters/dspark.py DSparkConfig) of a speculators `dspark` config.json:
    what its layout flags and sizes say, each read, none assumed. Refused (ValueError, naming the
    setting): another target's vocabulary, features of other layers than the data's, a confidence
    head on the backbone state alone (ours reads [h; e], speculators' confidence_head_with_markov)."""
    layer = config.get("transformer_layer_config", {})
    problems = []
    if layer.get("vocab_size", target.vocab_size) != target.vocab_size:
        problems.append(f"vocab_size {layer.get('vocab_size')} is not the target's {target.vocab_size}")
    if list(config.get("aux_hidden_state_layer_ids") or []) != list(aux_layers):
        problems.append(f"aux_hidden_state_layer_ids {config.get('aux_hidden_state_layer_ids')} are "
                        f"not the layers its features came from {list(aux_layers)}")
    heads = config.get("enable_confidence_head", True)
    if heads and not config.get("confidence_head_with_markov", True):
        problems.append("confidence_head_with_markov false: our confidence head reads [h; e]")
    if int(config.get("markov_rank", 256)) < 1:
        problems.append("markov_rank 0 (no Markov head): that is DFlash, not DSpark")
    if problems:
        raise ValueError("speculators' DSpark export: " + "; ".join(problems))
    if layer.get("use_sliding_window") and layer.get("sliding_window"):  # its dspark default: 2048
        log.info("speculators' DSpark attends within a %d-token window, ours to the whole context: "
                 "the same drafts on contexts up to %d tokens", layer["sliding_window"],
                 layer["sliding_window"])
    vd = config.get("draft_vocab_size")
    return {"name": "dspark", "aux_layers": list(aux_layers),
            "num_layers": int(layer.get("num_hidden_layers", 1)),
            "block_size": int(config["block_size"]), "mask_token_id": config.get("mask_token_id"),
            "draft_vocab_size": None if vd in (None, target.vocab_size) else int(vd),
            "sample_from_anchor": bool(config["sample_from_anchor"]),
            "markov_rank": int(config.get("markov_rank", 256)),
            "markov_head_type": config.get("markov_head_type", "vanilla"), "confidence_head": bool(heads)}


def import_dspark(folder: Path, config: dict, target, aux_layers: list[int]):
    """Our DSpark holding a speculators `dspark` export: its config read by `dspark_config`, its
    weights by our speculators layout's own reader (the inverse of what we export for it), the
    load strict."""
    from specdistill.drafters.base import drafter_class
    from specdistill.drafters.parts.layouts import WEIGHTS

    cfg = dspark_config(config, target, aux_layers)
    tensors = sorted_vocab({k: v for k, v in read_weights(folder).items()
                            if not k.startswith(("verifier", "embed_tokens"))},
                           rows=("lm_head.weight", "markov_head.markov_w2.weight"))
    state = drafter_class("dspark").layouts["speculators"].read({WEIGHTS: tensors}, cfg, target.vocab_size)
    drafter = build_drafter(cfg, target)
    drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return drafter.eval()
