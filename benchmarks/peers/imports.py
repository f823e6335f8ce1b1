"""A peer's exported EAGLE-3 drafter, rebuilt as our Eagle3 so our greedy replay measures it.

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
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdistill.drafters.base import build_drafter
from specdistill.drafters.parts.fused_layouts import FLAGS, state_from_engine
from specdistill.drafters.parts.vocab import d2t_to_offsets, offsets_to_d2t


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


def sorted_vocab(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draft vocabulary in ascending target ids (ours), the head's rows permuted with it."""
    if "d2t" not in tensors:
        return tensors
    d2t = offsets_to_d2t(tensors["d2t"].long())
    order = torch.argsort(d2t)
    out = dict(tensors)
    out["d2t"] = d2t_to_offsets(d2t[order])
    out["lm_head.weight"] = tensors["lm_head.weight"][order]
    return out


def import_peer(folder, target, aux_layers: list[int]):
    """Our Eagle3 holding the weights of a peer's export in `folder` (its aux layers: `aux_layers`,
    the ones its training features came from)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
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
