"""The export layout contract (ExportLayout: a format's writer, reader and checks; the layouts
themselves live with the drafter that owns them and register with it, drafters/base.py register;
the dispatcher is export/folder.py), specdistill's own lossless layout every trainable drafter
gets, and the helpers every layout shares. No drafter names here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from specdistill.drafters.parts.vocab import d2t_to_offsets, offsets_to_d2t

if TYPE_CHECKING:
    from specdistill.drafters.base import Drafter

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


@dataclass
class ExportContext:
    """What a layout writer knows besides the drafter."""

    target: Any  # target.model.Target the drafter was trained on
    drafter_config: dict[str, Any]  # the drafter's full config (every field)
    dtype: str  # weights dtype name: float32 | bfloat16 | float16
    meta: dict[str, Any]  # config.json's `specdistill` section (format, drafter, target, ...)
    k: int = 5  # the draft length, for configs that carry one (written as their own key)

    def common(self) -> dict[str, Any]:
        """The config.json keys every layout ends with."""
        return {"specdistill": self.meta, "torch_dtype": self.dtype}


Files = dict[str, dict[str, torch.Tensor]]  # file name -> {tensor name: tensor}


@dataclass(frozen=True)
class LayoutTrap:
    """A mistake in a layout that an engine loads without a word and then serves wrong (drafts
    accepted at ~0%): the layout writes the flag explicitly and validation (export/folder.py)
    refuses the mistake; tests/ make each trap's mistake and expect `says`."""

    name: str  # the flag or tensor, e.g. "sample_from_anchor"
    effect: str  # what an engine does with the mistake, one sentence (docs)
    # the mistake, made in place on a written folder's (config.json dict, {file: tensors})
    make: Callable[[dict[str, Any], "Files"], None]
    says: str  # a regex of the validation error that names it
    applies: Callable[[dict[str, Any]], bool] = lambda dcfg: True  # the drafter configs it concerns


@dataclass(frozen=True)
class ExportLayout:
    """One folder layout a drafter can be exported to (`format=<format>`), registered by the drafter
    module that owns it (`register(..., layouts=...)`); export/folder.py only dispatches.

    A tensor layout gives `write` and `read`; export/folder.py writes config.json and the files
    (.safetensors, else torch.save), validates them against a freshly built drafter's layout and
    checks that `read` gives the exact state dict back. A self-saving layout (a standalone model,
    e.g. small_lm's HF causal LM) gives `save` and `load` instead and checks itself in `save`.
    """

    format: str  # the name users pass: format=vllm
    summary: str  # model card: what the folder is, one sentence
    usage: str  # model card: how to run it; str.format fields {path} {base} {k} {k1} {drafter[key]}
    # (drafter, its state dict cast to the export dtype, ctx) -> (config.json dict, {file: tensors})
    write: Callable[["Drafter", dict[str, torch.Tensor], ExportContext],
                    tuple[dict[str, Any], Files]] | None = None
    # (files, drafter config, target vocab size) -> the drafter's own state dict
    read: Callable[[Files, dict[str, Any], int], dict[str, torch.Tensor]] | None = None
    requires: dict[str, Any] = field(default_factory=dict)  # drafter settings it needs, e.g. input_norm=False
    # optional: why a drafter config cannot use it beyond `requires` (None = it can)
    check: Callable[[dict[str, Any]], str | None] | None = None
    # optional: problems in values a name/shape check cannot see (files, drafter config, target, dtype)
    verify: Callable[[Files, dict[str, Any], Any, torch.dtype], list[str]] | None = None
    tags: tuple[str, ...] = ()  # model-card tags
    # how serving engines serve this layout (decode/engine/ reads it): engine -> its entry. vllm:
    # the speculative_config keys besides model / k ({"method": "eagle3"}); llamacpp: llama-server's
    # `spec_type`, whether its converter `needs_target` (the target's folder) and optionally `check`,
    # (config.json, files) -> why it would not serve the folder as trained (None: it would), asked
    # before anything is built or converted. Absent: not served.
    serving: dict[str, dict[str, Any]] = field(default_factory=dict)
    traps: tuple[LayoutTrap, ...] = ()  # mistakes engines load silently, refused by validation
    save: Callable[["Drafter", Any, ExportContext], None] | None = None  # self-saving: fill a folder
    load: Callable[[Any, Any], "Drafter"] | None = None  # self-saving: (folder, target) -> drafter

    def refusal(self, dcfg: dict[str, Any]) -> str | None:
        """Why drafter config dcfg cannot be exported in this layout (None = it can)."""
        need = [f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                for k, v in self.requires.items() if dcfg.get(k) != v]
        if need:
            return (f"format {self.format} needs the drafter trained with " + ", ".join(need)
                    + "; train with those settings, or export format=hf (lossless, read by our "
                      "decoder)")
        return self.check(dcfg) if self.check is not None else None


def _write_state_dict(drafter: Drafter, state, ctx: ExportContext):
    """`hf`: the state dict as it is, a pruned vocab's maps stored EAGLE-3 style (d2t as int64
    offsets, target_id = i + d2t[i]; t2d bool)."""
    d2t, t2d = state.pop("draft_vocab.d2t", None), state.pop("draft_vocab.t2d", None)
    if d2t is not None:
        state["d2t"], state["t2d"] = d2t_to_offsets(d2t), t2d
    name = drafter.name
    config = {"architectures": [f"Specdistill{name.capitalize()}Drafter"],
              "model_type": f"specdistill_{name}", "vocab_size": ctx.target.vocab_size,
              "hidden_size": ctx.target.hidden_size,
              "draft_vocab_size": ctx.drafter_config.get("draft_vocab_size"), **ctx.common()}
    return config, {"model.safetensors": state}


def _read_state_dict(files: Files, dcfg, vocab_size: int) -> dict[str, torch.Tensor]:
    t = dict(files["model.safetensors"])
    if "d2t" in t:
        t["draft_vocab.d2t"] = offsets_to_d2t(t.pop("d2t"))
        t["draft_vocab.t2d"] = t.pop("t2d")
    return t


STATE_DICT_LAYOUT = ExportLayout(
    format="hf", summary="specdistill's own lossless format (every drafter, pruned vocab included).",
    usage="python -m decode ckpt={path} eval=mtbench      # or in Python:\n"
          "from specdistill.export.folder import load_export; drafter = load_export('{path}', target)",
    write=_write_state_dict, read=_read_state_dict)
