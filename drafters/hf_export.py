"""small_lm's `causal_lm` export layout: the drafter as a plain Hugging Face causal-LM folder.

The folder holds config.json, model.safetensors, generation_config.json and the target's tokenizer
files (plus the model card drafters/export.py adds). `AutoModelForCausalLM.from_pretrained(folder)`
loads it with no specdistill code, and it drafts for the target anywhere a draft model is
accepted, e.g. `target.generate(..., assistant_model=draft)`, vLLM / SGLang draft models. LoRA
adapters are merged, the target's shared embeddings and LM head copied in (SmallLm.to_hf_model).
A self-saving layout (drafters/base.py ExportLayout): `save` writes the folder and reads it back
with transformers alone (same logits as the drafter); `load` rebuilds a small_lm drafter from it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specdistill.drafters.base import ExportLayout, build_drafter
from specdistill.drafters.export_formats import ExportError, torch_dtype


def _check(folder: Path, drafter, dtype: torch.dtype) -> None:
    """Reload the folder with transformers alone; its logits must equal the drafter's."""
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(drafter.target.device).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, drafter.vocab_size, (1, 12), generator=g).to(drafter.target.device)
    was_training = drafter.training
    drafter.eval()
    with torch.no_grad():
        want = drafter.logits(ids).float()  # (1, 12, V)
        got = back(ids).logits.float()  # (1, 12, V)
    drafter.train(was_training)
    tol = 1e-4 if dtype == torch.float32 else 5e-2 * float(want.abs().max())
    if got.shape != want.shape or not torch.allclose(got, want, atol=tol, rtol=0):
        raise ExportError(f"causal_lm export {folder}: the reloaded model's logits differ from the "
                          f"drafter's (max |diff| {float((got - want).abs().max()):.3g})")


def save_causal_lm(drafter, folder, ctx) -> None:
    """Write the standalone model and the target's tokenizer into `folder`, then check it."""
    dtype = torch_dtype(ctx.dtype)
    model = drafter.to_hf_model().to(dtype)  # 1. standalone model: LoRA merged
    gen = getattr(ctx.target.model, "generation_config", None)
    if gen is not None:  # the target's EOS / BOS / pad, and our draft length for HF assisted decoding
        model.generation_config = gen.__class__.from_dict(gen.to_dict())
    model.generation_config.num_assistant_tokens = ctx.speculative_tokens
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.config.specdistill = ctx.meta  # what load_export needs to know it again
    model.save_pretrained(folder)  # 2. config.json, model.safetensors, generation_config.json
    ctx.target.tokenizer.save_pretrained(folder)
    _check(Path(folder), drafter, dtype)  # 3. read back with transformers alone


def load_causal_lm(folder, target):
    """An exported folder as a drafter for our decoder: small_lm with source=pretrained (which
    refuses a folder whose tokenizer is not the target's)."""
    return build_drafter({"name": "small_lm", "source": "pretrained", "pretrained": str(folder)},
                         target)


CAUSAL_LM = ExportLayout(
    format="causal_lm", tags=("transformers",), save=save_causal_lm, load=load_causal_lm,
    requires={"draft_vocab_size": None},  # an HF causal LM scores the full vocabulary
    summary="a standalone Hugging Face causal LM (LoRA merged, the target's embeddings and LM head "
            "copied in) that transformers, vLLM and SGLang load as a draft model.",
    usage="from transformers import AutoModelForCausalLM\n"
          "target = AutoModelForCausalLM.from_pretrained('{base}')\n"
          "draft = AutoModelForCausalLM.from_pretrained('{path}')\n"
          "out = target.generate(**inputs, assistant_model=draft, do_sample=False)  # k={k}")
