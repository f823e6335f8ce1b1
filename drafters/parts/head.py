"""The draft head: how a drafter turns its hidden states into logits over its vocabulary.

Two kinds, chosen by a drafter config's `draft_vocab_size`:
  * None: the target's LM head, frozen and shared (never a submodule of the drafter, so never
    trained nor saved). `frozen_logits` applies it, casting the small activation to the head's
    dtype rather than the (V x H) head to the activation's (no copy of the head per step).
`head_logits(drafter, h)` applies whichever of the two the drafter has.
  * Vd: a trainable Linear(H -> Vd) over the Vd most frequent target tokens, started from the full
    head's rows d2t, plus the maps (drafters.parts.vocab.DraftVocab). `init_draft_head` sets both up
    under the drafter's fixed attribute names `draft_vocab` and `lm_head` (the names checkpoints
    and export layouts use).
`Shared` wraps any frozen target module (embedding or head) the same way, for drafters such as
small_lm that hold the module inside a Hugging Face model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdistill.drafters.parts.vocab import DraftVocab, select_draft_vocab
from specdistill.target.precision import cast_floats
from specdistill.target.prepack import is_prepacked, use_prepacked_linear


def frozen_logits(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """h (..., H) through a frozen head (Linear-like: weight, optional bias) -> (..., V) in h's dtype.
    Gradients flow to h only."""
    w, b = head.weight, getattr(head, "bias", None)
    return F.linear(h.to(w.dtype), w, b).to(h.dtype)


def head_logits(drafter: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A drafter's logits (..., Vd) for its final states h (..., H): its pruned trainable
    `lm_head`, else the target's full head, frozen (gradients flow to h only)."""
    if drafter.lm_head is not None:
        return drafter.lm_head(h)
    return frozen_logits(drafter.target.lm_head(), h)


def head_from_target(lm_head: nn.Module, d2t: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    """A trainable Linear(H -> Vd) whose rows start as the full head's rows d2t (all rows if None)."""
    w = lm_head.weight.detach()
    rows = w if d2t is None else w[d2t.to(w.device)]  # (Vd, H)
    bias = getattr(lm_head, "bias", None)
    head = nn.Linear(w.shape[1], rows.shape[0], bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(rows)
        if bias is not None:
            head.bias.copy_(bias.detach() if d2t is None else bias.detach()[d2t])
    return head.to(dtype)


def init_draft_head(drafter: nn.Module, full_head: nn.Module, draft_vocab_size: int | None,
                    vocab_size: int) -> None:
    """Give `drafter` its draft head: `draft_vocab` and `lm_head` are None with the full vocabulary
    (the caller applies the frozen `full_head` with frozen_logits), else a placeholder map (the
    first Vd ids, replaced by set_draft_vocab before training) and a float32 pruned head."""
    drafter.draft_vocab = drafter.lm_head = None
    if draft_vocab_size is not None and not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"{drafter.name}: draft_vocab_size={draft_vocab_size} must be in [1, "
                         f"{vocab_size}] (the target's vocabulary); set a smaller one, or "
                         f"drafter.draft_vocab_size=null for the target's own head")
    if draft_vocab_size is not None:
        drafter.draft_vocab = DraftVocab(torch.arange(draft_vocab_size), vocab_size)
        drafter.lm_head = head_from_target(full_head, drafter.draft_vocab.d2t, torch.float32)


def set_draft_vocab(drafter: nn.Module, full_head: nn.Module, d2t: torch.Tensor) -> None:
    """Use draft vocab d2t (drafters.parts.vocab.select_draft_vocab) and restart the pruned head from the
    full head's rows d2t."""
    if getattr(drafter, "draft_vocab", None) is None:
        raise ValueError(f"{drafter.name}: set_draft_vocab needs draft_vocab_size in the config")
    drafter.draft_vocab.set(d2t.to(drafter.draft_vocab.d2t.device))
    with torch.no_grad():
        drafter.lm_head.weight.copy_(full_head.weight[drafter.draft_vocab.d2t])


def fit_draft_vocab(drafter: nn.Module, token_counts: torch.Tensor, always_include=()) -> bool:
    """Give a drafter with a pruned head (`draft_vocab` set) the draft vocab of the most frequent
    training tokens (drafters.parts.vocab.select_draft_vocab); False (no-op) for a full-vocab drafter.
    The trainer calls it once before training; a loaded drafter already has its map."""
    vocab = getattr(drafter, "draft_vocab", None)
    if vocab is None:
        return False
    drafter.set_draft_vocab(select_draft_vocab(token_counts, vocab.size, always_include))
    return True


class Shared(nn.Module):
    """Calls a frozen target module (embedding or LM head) without owning it: nothing of it is in
    parameters() or state_dict(), so it is neither trained, nor saved, nor deep-copied."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.__dict__["module"] = module  # a plain attribute: not registered as a submodule
        self.dtype = dtype  # the drafter's compute dtype (the target may run in bf16)

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.module, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.module, nn.Embedding):
            return self.module(x).to(self.dtype)  # ids (B, T) -> (B, T, H)
        return frozen_logits(self, x)  # (B, T, H) -> (B, T, V)

    def __deepcopy__(self, memo) -> "Shared":
        return Shared(self.module, self.dtype)


def cast_drafter(drafter, target, dtype: torch.dtype):
    """Run `drafter` at `dtype` (at decode time: the target's, so the draft steps get the same
    native-bf16 speed-up as the target's). Casts the drafter's OWN floating parameters and buffers
    and the compute dtype of the target modules it calls (`Shared`), never the modules it shares
    with the target: `drafter.to(dtype)` would cast the target's embedding / LM head in place and
    change the target being verified against. Lossless at any dtype: the target verifies.
    At fp32 on a CPU the drafter's linear layers are then packed for oneDNN like the target's
    (target/prepack.py; EAGLE-3's draft ms per k=2 round 9.0 -> 5.8 on the AVX2 EPYC at 2
    threads), unless the target was loaded with `prepack=false`."""
    for mod in drafter.modules():
        if isinstance(mod, Shared):
            mod.dtype = dtype
    cast_floats(drafter, dtype, keep={p.data_ptr() for p in target.model.parameters()})
    if is_prepacked(target.model):  # the same kernels as the target's (fp32 CPU layers only)
        use_prepacked_linear(drafter)
    return drafter
