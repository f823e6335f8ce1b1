"""Construction parts the Llama-layer drafters (EAGLE, EAGLE-3, P-EAGLE, DFlash) share: the
LlamaConfig of their layers, the default aux layers of the fused-feature drafters, and the start
from the target's own layers (`init_from_target_layer`). Each drafter builds its network from
these side by side; none builds on another drafter's class.
"""
from __future__ import annotations

from typing import Callable

from torch import nn
from transformers import LlamaConfig

from specdistill.drafters.parts.head import init_draft_head
from specdistill.target.attention import FEW_Q


def drafter_llama_config(target, num_layers: int) -> LlamaConfig:
    """A LlamaConfig for the drafter's layers: the target's widths, heads, norm eps and RoPE."""
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
    cfg._attn_implementation = FEW_Q  # SDPA, but plain ops for 16-bit CPU draft steps (our masks:
    # explicit additive float masks)
    return cfg


def default_aux_layers(num_layers: int) -> list[int]:
    """The engines' default aux layers of a fused-feature drafter (EAGLE-3, P-EAGLE, DFlash):
    inputs of layers (2, L//2, L-3). Shallower targets (tests) take (1, L//2, L-1), which every
    engine can still name, and below 4 layers the embeddings, the middle and the last hidden state
    (no engine export then)."""
    L = num_layers
    return [2, L // 2, L - 3] if L >= 7 else [1, L // 2, L - 1] if L >= 4 else [0, L // 2, L]


# (drafter layer i, target-layer weights under HF names) -> drafter layer i's weights
LayerWeights = Callable[[int, dict], dict]


def layers_from_target(drafter: nn.Module, index: int, convert: LayerWeights | None = None) -> None:
    """drafter.layers[i] takes the weights of target layer index - (num_layers - 1) + i (HF
    names match), through `convert` where the drafter's layer differs from the target's."""
    src = drafter.target.model.model.layers
    last = index % len(src)
    first = last - (len(drafter.layers) - 1)
    if first < 0:
        raise ValueError(f"{drafter.name}: init_from_target_layer={index} leaves too few target "
                         f"layers for {len(drafter.layers)} drafter layers")
    for i, layer in enumerate(drafter.layers):
        own = layer.state_dict().keys()  # without layer 0's input norm when input_norm=false
        state = {k: v.float() for k, v in src[first + i].state_dict().items() if k in own}
        layer.load_state_dict(convert(i, state) if convert else state, strict=True)


def finish_init(drafter: nn.Module, cfg, target, convert: LayerWeights | None = None) -> None:
    """The end of a Llama-layer drafter's constructor: the draft head (cfg.draft_vocab_size), the
    optional start from a target layer (cfg.init_from_target_layer), the target's device, an
    empty decode state (reset)."""
    init_draft_head(drafter, target.lm_head(), cfg.draft_vocab_size, target.vocab_size)
    if cfg.init_from_target_layer is not None:
        layers_from_target(drafter, cfg.init_from_target_layer, convert)
    drafter.to(target.device)
    drafter.reset()
