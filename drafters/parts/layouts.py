"""Helpers every export layout shares (drafters/base.py ExportLayout; the layouts themselves live
with the drafter that owns them, the dispatcher in export/folder.py). No drafter names here.
"""
from __future__ import annotations

from typing import Any

import torch

WEIGHTS = "model.safetensors"  # the weights file of most layouts
# dtype names an export may carry (target.DTYPES maps them)
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """An export that cannot be written or does not validate; the message says what and the fix."""


def torch_dtype(name: str) -> torch.dtype:
    """An export dtype name -> the torch dtype (the one dtype map: target.precision.DTYPES)."""
    from specdistill.target.precision import DTYPES

    if name not in EXPORT_DTYPES:
        raise ExportError(f"dtype must be one of {list(EXPORT_DTYPES)}, not {name!r}")
    return DTYPES[name]


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CPU copy (own storage: safetensors refuses tensors that share memory, e.g. tied weights)."""
    t = t.detach().cpu()
    return (t.to(dtype) if t.is_floating_point() else t).clone().contiguous()


def llama_layer_config(llama_config, target, dtype: str) -> dict[str, Any]:
    """A drafter's Llama decoder-layer config as engines read it: transformers 5's rope_parameters
    plus the legacy rope_theta / rope_scaling that engines on transformers 4 read, and the target's
    special-token ids."""
    c = llama_config.to_dict()
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
    # a draft owns neither the embedding nor the head it would tie: SGLang's set_embed_and_head
    # fails on tie_word_embeddings=true (copied from a tied target such as SmolLM2)
    out.update(model_type="llama", tie_word_embeddings=False,
               bos_token_id=getattr(tc, "bos_token_id", None), eos_token_id=getattr(tc, "eos_token_id", None),
               pad_token_id=getattr(tc, "pad_token_id", None), torch_dtype=dtype, dtype=dtype)
    return out


def speculators_config(algorithm: str, k: int, verifier: str | None,
                       target) -> dict[str, Any]:
    """The `speculators_config` section of a speculators-format config.json (src/speculators/
    config.py): one greedy proposal method of k tokens and the verifier (the target)."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier,
                         "architectures": list(getattr(target.config, "architectures", None)
                                               or ["LlamaForCausalLM"])}}
