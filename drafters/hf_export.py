"""Export a small_lm drafter as a plain Hugging Face causal-LM folder.

    from drafters.hf_export import export_hf
    export_hf(drafter, "exports/small-lm", target.tokenizer, run_dir="runs/train/<run>")

The folder holds config.json, model.safetensors, generation_config.json, the target's tokenizer
files and a model card (README.md) with the acceptance measured at the end of training when the run
has final_eval/result.json. `AutoModelForCausalLM.from_pretrained(folder)` loads it with no
specdistill code, and it drafts for the target anywhere a draft model is accepted, e.g.
`target.generate(..., assistant_model=draft)`. LoRA adapters are merged, the target's shared
embeddings and LM head copied in (SmallLm.to_hf_model). Like drafters/export.py the folder is
written next to `out`, read back and checked (same logits as the drafter), then renamed into place.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _acceptance_section(run_dir: Optional[Path]) -> list[str]:
    """The card's measured-acceptance lines from a run's final_eval/result.json (if any)."""
    result = run_dir / "final_eval" / "result.json" if run_dir is not None else None
    if result is None or not result.is_file():
        return ["No decoder evaluation was recorded with this drafter."]
    s = json.loads(result.read_text())["summary"]
    lines = [f"specdistill's lossless decoder on {s.get('eval')} at the end of training: "
             f"{s.get('generations')} generations, k={s.get('k')}, temperature "
             f"{s.get('temperature')}, {s.get('max_new_tokens')} new tokens.", "",
             "| tau (tokens per target forward) | speedup vs plain | outputs identical to plain |",
             "|---:|---:|:---:|",
             f"| {s.get('tau', 0.0):.3f} | {s.get('speedup', float('nan')):.2f}x | "
             f"{s.get('outputs_identical_to_plain', 'n/a')} |"]
    acc = s.get("spec_accept_cond") or []
    if acc:
        lines += ["", "Acceptance per draft position (given the earlier ones were accepted): "
                  + ", ".join(f"{a:.3f}" for a in acc) + "."]
    return lines


def model_card(drafter, target, base_model: Optional[str], run_dir: Optional[Path], k: int) -> str:
    """README.md: what the folder is, how to use it, the measured acceptance, its config."""
    import yaml

    from drafters.base import config_dict

    name = base_model or target.source
    front = {"library_name": "transformers", "license": "apache-2.0",
             "tags": ["speculative-decoding", "draft-model", "specdistill", "small_lm"]}
    if base_model:
        front["base_model"] = base_model
    n_layers = drafter.hf_model.config.num_hidden_layers
    return "\n".join([
        "---", yaml.safe_dump(front, sort_keys=True).strip(), "---", "",
        f"# {n_layers}-layer draft model for {name}", "",
        f"A small causal LM distilled from `{name}` with specdistill (source "
        f"`{drafter.cfg.source}`). It uses the target's tokenizer, so it drafts for the target in "
        f"speculative decoding, which is lossless: greedy output is token-identical to the "
        f"target's, sampling keeps its distribution.", "",
        "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"target = AutoModelForCausalLM.from_pretrained({name!r})",
        "draft = AutoModelForCausalLM.from_pretrained('<this folder or repo id>')",
        f"out = target.generate(**inputs, assistant_model=draft, do_sample=False)  # k={k}",
        "```", "", "## Measured acceptance", "", *_acceptance_section(run_dir), "",
        "## Drafter configuration", "", "```yaml",
        yaml.safe_dump(config_dict(drafter.cfg), sort_keys=False).strip(), "```", ""])


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
        raise ValueError(f"hf export {folder}: the reloaded model's logits differ from the "
                         f"drafter's (max |diff| {float((got - want).abs().max()):.3g})")


def export_hf(drafter, out, tokenizer, *, run_dir=None, base_model: Optional[str] = None,
              dtype: str = "float32", k: int = 5, overwrite: bool = False,
              check: Optional[Callable[[Path], dict]] = None) -> Path:
    """Write a small_lm drafter as an HF causal-LM folder `out` (steps in the module docstring).
    run_dir: the training run (its final_eval/result.json goes into the card); check(folder) may
    measure the written folder before it is committed and returns {"markdown": ...} for the card
    (train/export.py's parity). Returns out."""
    if getattr(drafter, "name", None) != "small_lm" or not hasattr(drafter, "to_hf_model"):
        raise ValueError(f"export_hf writes small_lm drafters; {getattr(drafter, 'name', drafter)!r} "
                         f"has no standalone LM (use drafters/export.py formats)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True or another folder")
    model = drafter.to_hf_model().to(DTYPES[dtype])  # 1. standalone model: LoRA merged
    gen = getattr(drafter.target.model, "generation_config", None)
    if gen is not None:  # the target's EOS / BOS / pad, and our draft length for HF assisted decoding
        model.generation_config = gen.__class__.from_dict(gen.to_dict())
    model.generation_config.num_assistant_tokens = k
    model.config.specdistill = {  # what load_hf_export / drafters.export need to know it again
        "format": "hf", "drafter": {"name": "small_lm", "source": drafter.cfg.source},
        "target": {"source": drafter.target.source, "vocab_size": drafter.target.vocab_size,
                   "hidden_size": drafter.target.hidden_size}}
    model.generation_config.num_assistant_tokens_schedule = "constant"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)  # 2. config.json, model.safetensors, generation_config.json
        tokenizer.save_pretrained(tmp)
        _check(tmp, drafter, DTYPES[dtype])  # 3. read back with transformers alone
        parity = check(tmp) if check is not None else None
        run = Path(run_dir) if run_dir is not None else None
        card = model_card(drafter, drafter.target, base_model, run, k)
        if parity is not None:
            card += "\n## Train/serve parity\n\n" + parity["markdown"] + "\n"
        (tmp / "README.md").write_text(card)
        old = out.parent / f".old-{out.name}-{os.getpid()}"  # 4. rename into place
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out



def load_hf_export(folder, target):
    """An exported folder as a drafter for our decoder: small_lm with source=pretrained (which
    refuses a folder whose tokenizer is not the target's)."""
    from drafters.base import build_drafter

    return build_drafter({"name": "small_lm", "source": "pretrained", "pretrained": str(folder)},
                         target)
