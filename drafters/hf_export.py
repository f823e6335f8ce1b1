"""The `causal_lm` export: a drafter that is a Hugging Face causal LM written as a plain Hugging
Face causal-LM folder (the layout itself is registered by that drafter's own module).

The folder holds config.json, model.safetensors, generation_config.json and the target's tokenizer
files (plus the model card drafters/export.py adds). `AutoModelForCausalLM.from_pretrained(folder)`
loads it with no specdistill code, and it drafts for the target anywhere a draft model is
accepted, e.g. `target.generate(..., assistant_model=draft)`, vLLM / SGLang draft models. LoRA
adapters are merged, the target's shared embeddings and LM head copied in (the drafter's
`to_hf_model`). `save_causal_lm` is a self-saving layout's `save` (drafters/base.py ExportLayout):
it writes the folder and reads it back with transformers alone (same logits as the drafter's
`logits`).
"""
from __future__ import annotations

from pathlib import Path

import torch

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


def _drop_load_kwargs(path: Path) -> None:
    """transformers records how OUR process loaded the tokenizer (`local_files_only`: whether
    HF_HUB_OFFLINE was set); a served folder must not carry that into the user's process."""
    import json

    if path.is_file():
        conf = json.loads(path.read_text())
        if conf.pop("local_files_only", None) is not None:
            path.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")


def save_causal_lm(drafter, folder, ctx) -> None:
    """Write the standalone model and the target's tokenizer into `folder`, then check it."""
    dtype = torch_dtype(ctx.dtype)
    model = drafter.to_hf_model().to(dtype)  # 1. standalone model: LoRA merged
    gen = getattr(ctx.target.model, "generation_config", None)
    if gen is not None:  # the target's EOS / BOS / pad, and our draft length for HF assisted decoding
        model.generation_config = gen.__class__.from_dict(gen.to_dict())
    model.generation_config.num_assistant_tokens = ctx.k
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.config.specdistill = ctx.meta  # what load_export needs to know it again
    for key in [k for k in vars(model.config) if k.startswith("_specdistill")]:
        delattr(model.config, key)  # our decoders' private marks (decode/exact.py), not the model's
    model.save_pretrained(folder)  # 2. config.json, model.safetensors, generation_config.json
    ctx.target.tokenizer.save_pretrained(folder)
    _drop_load_kwargs(Path(folder) / "tokenizer_config.json")
    _check(Path(folder), drafter, dtype)  # 3. read back with transformers alone
