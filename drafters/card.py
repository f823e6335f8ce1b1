"""The model card (README.md) of an export: YAML metadata the Hub indexes, then what the folder is,
how to serve it, the acceptance measured in training, train/serve parity and the training config.

Only reads what the caller hands over (the layout's config, the run's files as RunInfo, a parity
result), so drafters/export.py stays free of train/ and decode/ imports.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

USAGE = {
    "hf": ("specdistill's own lossless format (every drafter, pruned vocab included).",
           "python -m decode ckpt={path} eval=mtbench      # or in Python:\n"
           "from drafters.export import load_export; drafter = load_export('{path}', target)"),
    "vllm": ("vLLM's EAGLE-1 layout (EagleLlamaForCausalLM; the target's embeddings and LM head "
             "are shared).",
             "vllm serve {base} --speculative-config "
             "'{{\"method\": \"eagle\", \"model\": \"{path}\", \"num_speculative_tokens\": {k}}}'"),
    "sglang": ("SGLang's EAGLE layout (LlamaForCausalLMEagle).",
               "python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE "
               "--speculative-draft-model-path {path} --speculative-num-steps {k} "
               "--speculative-eagle-topk 1 --speculative-num-draft-tokens {k1}"),
    "speculators": ("the speculators library's EAGLE format (EagleSpeculator with speculators_config).",
                    "from speculators.models.eagle import EagleSpeculator\n"
                    "model = EagleSpeculator.from_pretrained('{path}', verifier='{base}')"),
    "medusa": ("Medusa heads as vLLM's Medusa loader reads them (model.safetensors) and, when it can "
               "hold them, as the original Medusa repo reads them (medusa_lm_head.pt).",
               "vllm serve {base} --speculative-config "
               "'{{\"method\": \"medusa\", \"model\": \"{path}\", \"num_speculative_tokens\": {k}}}'"),
}


def _tags(fmt: str, drafter: str) -> list[str]:
    tags = ["speculative-decoding", "draft-model", "specdistill", drafter]
    if drafter == "eagle":
        tags.append("eagle1")
    if fmt in ("vllm", "sglang", "speculators"):
        tags.append(fmt)
    if drafter == "medusa" and fmt in ("medusa", "vllm"):
        tags.append("vllm")
    return tags


def _last_simulated_eval(run_dir: Path | None) -> str | None:
    """A one-line summary of the run's latest simulated eval (metrics.jsonl), if any."""
    if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
        return None
    last = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "eval/sim_tau" in row:
            last = row
    if last is None:
        return None
    acc = [f"{last[k]:.3f}" for k in sorted((k for k in last if k.startswith("eval/acc_")),
                                              key=lambda k: int(k.rsplit("_", 1)[1]))]
    return (f"Simulated acceptance on held-out conversations at step {last['step']}: tau "
            f"{last['eval/sim_tau']:.3f}, per-position acceptance {', '.join(acc)}.")


def model_card(fmt: str, meta: dict[str, Any], info, parity: dict[str, Any] | None,
               files: list[tuple[str, int]], license: str) -> str:
    """README.md text. info: drafters.export.RunInfo or None; files: (name, bytes) of the export."""
    drafter = meta["drafter"]["name"]
    base = meta.get("base_model")
    front = {"license": license, "tags": _tags(fmt, drafter)}
    if base:
        front["base_model"] = base
    k = meta.get("speculative_tokens", 5)
    what, usage = USAGE[fmt]
    if drafter == "medusa" and fmt != "hf":  # vLLM's Medusa proposes one token per head
        what, usage = USAGE["medusa"]
        k = meta["drafter"]["num_heads"]
    source = meta["target"]["source"]
    name = base or (source if len(source) <= 60 else source[:57] + "...")
    lines = ["---", yaml.safe_dump(front, sort_keys=True).strip(), "---", "",
             f"# {drafter} drafter for {name}", "",
             f"A speculative-decoding drafter distilled from the frozen target `{name}` with "
             f"specdistill, exported as `{fmt}`: {what} Speculative decoding with it is lossless: "
             f"greedy output is token-identical to the target's, sampling keeps its "
             f"distribution.", "",
             "```bash", usage.format(path="<this folder or repo id>", base=base or "<target>",
                                     k=k, k1=k + 1), "```", ""]
    lines += ["## Measured acceptance", ""]
    if info is not None and info.final_md:
        s = info.final or {}
        lines += [f"The real decoder on {s.get('eval', 'mtbench')} at the end of training "
                  f"({s.get('generations', '?')} generations, greedy, k={s.get('k', '?')}, "
                  f"{s.get('max_new_tokens', '?')} new tokens). tau = tokens per target forward, "
                  "bonus token included.", "", info.final_md, ""]
    sim = _last_simulated_eval(info.run_dir if info is not None else None)
    if sim:
        lines += [sim, ""]
    if (info is None or not info.final_md) and not sim:
        lines += ["No evaluation was recorded with this drafter.", ""]
    if parity is not None:
        lines += ["## Train/serve parity", "", parity["markdown"], ""]
    if info is not None and info.config:
        lines += ["## Training configuration", "", "```yaml",
                  yaml.safe_dump(info.config, sort_keys=False).strip(), "```", ""]
    lines += ["## Files", ""] + [f"- `{n}` ({b / 2**20:.2f} MiB)" for n, b in files] + [""]
    return "\n".join(lines)
