"""The drafter interface, its config schema, its export layouts and the registry. Interfaces live
here and nowhere else (the decode-time types, drafters/proposals.py, are re-exported here).

A drafter proposes tokens for the frozen target to verify. The decoder (decode/) and the trainer
(train/) only ever talk to this interface. A new drafter is one module in drafters/ (any `drafters/`
folder on sys.path: drafters/__init__.py imports them all) plus `conf/drafter/<name>.yaml`:

    @register("toy", config=ToyConfig, layouts=(TOY_LAYOUT,))   # ToyConfig.name defaults to "toy"
    class Toy(Drafter): ...

It is built from the shared parts: drafters/head.py (the draft head: the target's frozen LM head or
a pruned trainable one with d2t/t2d), drafters/cache.py (its own KV cache kept in step with the
committed tokens, tree-level masks), `Drafter.draft_chain` (the one chain-proposal loop) and the
default `Drafter.build`. A drafter that drafts step by step through its own KV cache subclasses
drafters/drafting.py CausalDrafter and gives its network's four public methods (drafters/eagle.py
is the example). Every trainable drafter exports as `hf` (STATE_DICT_LAYOUT, lossless);
engine layouts are `ExportLayout`s registered by the drafter module that owns them.

Decode-time contract (see decode/spec.py for the loop that drives it):
  * Before the first round of a prompt the decoder calls `reset()`.
  * Each round it calls `propose(state, k, sampling, generator)` (chain) or `propose_tree(state,
    sampling, generator)` (tree). Batched decoding (decode/batched/spec.py) instead calls
    `propose_rows(slots, states, ks, ...)` once for every row's chain (slots[r]: row r's copy of
    the drafter, holding its state); the default loops over `propose`, EAGLE-family drafters put
    the rows through one forward per draft step (drafters/rows.py). `state.tokens` holds every
    committed token; between two calls it only grows by appending (accepted drafts + the target's
    bonus token), so a drafter with its own KV cache crops it back to the longest prefix it still
    shares with `state.tokens`.
  * Drafters that read target features (EAGLE, Medusa) list the hidden-state indices they need in
    `feature_layers` (HF `hidden_states` indexing: 0 = embeddings, i = output of layer i, -1 = the
    final-normed state the LM head sees); the decoder then fills `state.features`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import nn

from specdistill.drafters.folder import (  # noqa: F401  (re-exported)
    CONFIG_FILE, DECODE_TIME_PREFIX, WEIGHTS_FILE, TargetMismatch, check_trained_target, config_dict,
    parse_config, save_drafter)
from specdistill.drafters.head import fit_draft_vocab, set_draft_vocab as _set_draft_vocab  # noqa: F401
from specdistill.drafters.proposals import (  # noqa: F401  (re-exported)
    ChainDraw, ChainProposal, DecodeState, TreeProposal)
from specdistill.drafters.sampling import SamplingParams
from specdistill.drafters.vocab import d2t_to_offsets, offsets_to_d2t


@dataclass
class DrafterConfig:
    """Fields every drafter config has. Each drafter subclasses this with its own settings."""

    name: str = "?"  # registry key; set by each drafter's schema


@dataclass
class TrainBatch:
    """One training micro-batch with the frozen target's outputs on it (captured online or offline)."""

    input_ids: torch.Tensor  # (B, T) long, right-padded
    attention_mask: torch.Tensor  # (B, T) 1 on real tokens, 0 on padding
    loss_mask: torch.Tensor  # (B, T) 1 where token t is an assistant token the drafter must predict
    target_logits: torch.Tensor  # (B, T, V) target logits at t (its distribution of token t+1)
    features: torch.Tensor | None = None  # (B, T, F) target features of `feature_layers` at t


@dataclass
class DraftPrediction:
    """One of a drafter's training predictions, aligned for the loss.

    logits[:, t] is the drafter's distribution of token t + 1 + shift, so it is compared with
    target_logits[:, t + shift] and counts where loss_mask[:, t + 1 + shift] == 1. With `at`
    (B, T) bool (drafters/anchors.py counted), the head ran only there: logits (M, Vd), row-major.
    """

    logits: torch.Tensor  # (B, T, Vd) over the draft vocabulary (Vd = V without a pruned vocab)
    at: torch.Tensor | None = None  # (B, T) bool: logits (M, Vd) only at these anchors (None: all)
    shift: int = 0  # 0 = next token, 1 = the one after (EAGLE step / Medusa head 1), ...
    weight: float = 1.0  # weight of this prediction in the total loss (e.g. Medusa's 0.8^k)
    features: torch.Tensor | None = None  # (B, T, F') EAGLE: predicted feature of position t + shift
    anchors: torch.Tensor | None = None  # (B, A): logits (B, A, Vd) at these anchors (None: all)
    # on-policy steps (Drafter.forward_own): the tokens fed (B, T) (target ids); the anchors the
    # target scores (B, T) bool, logits then (M, Vd) there (row-major); set by the trainer, the
    # target's logits after the fed tokens there (M, Vd | V), the teacher instead of the batch's
    inputs: torch.Tensor | None = None
    teacher: torch.Tensor | None = None
    scored: torch.Tensor | None = None


class Drafter(nn.Module):
    """Base class of every drafter. Subclasses implement `propose` and optionally `propose_tree`;
    trainable drafters also implement `forward_train`. Set by `register`: `name`, `config_class`,
    `layouts`."""

    name: ClassVar[str] = "?"
    config_class: ClassVar[type[DrafterConfig]] = DrafterConfig  # its config schema
    layouts: ClassVar[dict[str, "ExportLayout"]] = {}  # format -> the export layouts it supports
    tags: ClassVar[tuple[str, ...]] = ()  # extra model-card tags (e.g. "eagle1")
    feature_layers: tuple[int, ...] = ()  # target hidden states the drafter reads at decode time

    def __init__(self, vocab_size: int, cfg: DrafterConfig | None = None, target=None) -> None:
        super().__init__()
        self.vocab_size = vocab_size  # the target vocabulary the proposals are expressed in
        self.cfg = cfg  # its config (a `config_class` instance)
        self.target = target  # the frozen target: a plain attribute, not a submodule, never saved

    @classmethod
    def build(cls, cfg, target) -> "Drafter":
        """The drafter from its config in any form (dataclass, OmegaConf node, dict) on `target`."""
        return cls(parse_config(cfg, cls.config_class), target)

    def reset(self) -> None:
        """Forget per-prompt state (caches) before a new prompt."""

    def propose(
        self,
        state: DecodeState,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        min_confidence: float = 0.0,
    ) -> ChainProposal:
        """Draft up to k tokens continuing state.tokens (fewer when the draft's own probability of its
        next token falls below min_confidence: adaptive draft length)."""
        raise NotImplementedError

    def propose_tree(self, state: DecodeState, sampling: SamplingParams,
                     generator: torch.Generator | None = None) -> TreeProposal:
        """Draft a token tree (static or dynamic) continuing state.tokens (sampled: with probs)."""
        raise NotImplementedError(f"drafter {self.name!r} does not propose trees; use a chain")

    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """Teacher-forced training predictions on a batch (trainable drafters only)."""
        raise NotImplementedError(f"drafter {self.name!r} is not trainable")

    def forward_own(self, batch: TrainBatch, steps: int, at=None) -> list[DraftPrediction]:
        """On-policy training predictions: `steps` draft steps at every anchor, step j > 1 fed
        the drafter's own step j-1 draft (DraftPrediction.inputs) instead of the real token, as a
        chain drafts at decode time (train/on_policy_heads.py); with `at` (B, T) bool, steps j > 1
        predict only at those anchors (DraftPrediction.scored)."""
        raise NotImplementedError(f"drafter {self.name!r} has no on-policy steps (forward_own)")

    def forward(self, batch: TrainBatch, own_steps: int = 0, at=None) -> list[DraftPrediction]:
        """`module(batch)` trains: DDP and DeepSpeed wrappers hook into forward(); own_steps > 0
        runs forward_own."""
        return self.forward_own(batch, own_steps, at) if own_steps else self.forward_train(batch)

    def propose_rows(self, slots: Sequence["Drafter"], states: Sequence[DecodeState],
                     ks: Sequence[int], sampling: SamplingParams,
                     generators: Sequence[torch.Generator | None],
                     min_confidence: float = 0.0) -> list[ChainProposal]:
        """Chains for several sequences decoded together (decode/batched/spec.py): row r's drafter is
        slots[r] (a copy of this drafter holding row r's state), drafting up to ks[r] tokens after
        states[r] with generators[r]. Each row gets what slots[r].propose would give it. This
        default runs the rows one after another; drafters that can put every row through one
        forward per draft step override it."""
        return [d.propose(s, k, sampling, g, min_confidence)
                for d, s, k, g in zip(slots, states, ks, generators)]

    def draft_chain(self, logits: torch.Tensor, step: Callable[[int, torch.Tensor], torch.Tensor],
                    k: int, sampling: SamplingParams, generator: torch.Generator | None = None,
                    min_confidence: float = 0.0) -> ChainProposal:
        """The chain-proposal loop every drafter shares. logits (Vd,): the first draft's; step(i,
        token) feeds draft i (a target id) and returns the next draft's logits (Vd,)."""
        chain = ChainDraw(self, k, sampling, generator, min_confidence)
        while chain.draw(logits):
            logits = step(chain.n - 1, chain.tokens[-1])  # (Vd,)
        return chain.proposal()

    # A pruned draft vocabulary (drafters/head.py): drafters that support one hold `self.draft_vocab`
    # (a drafters.vocab.DraftVocab, None = the full target vocabulary) and a trainable `self.lm_head`
    # over it. d2t[i] is the target id of draft token i; the loss restricts the target distribution
    # to these ids.
    @property
    def d2t(self) -> torch.Tensor | None:  # (Vd,) or None
        vocab = getattr(self, "draft_vocab", None)  # no class attribute: nn.Module keeps it in _modules
        return None if vocab is None else vocab.d2t

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (identity without a pruned vocabulary)."""
        vocab = getattr(self, "draft_vocab", None)
        return ids if vocab is None else vocab.d2t[ids]

    def full_head(self) -> nn.Module:
        """The full-vocabulary head a pruned head starts from (the target's LM head by default)."""
        return self.target.lm_head()

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """Use the draft vocab d2t (drafters.vocab.select_draft_vocab) and restart the pruned head
        from the full head's rows d2t."""
        _set_draft_vocab(self, self.full_head(), d2t)

    @property
    def supports_tree(self) -> bool:
        return type(self).propose_tree is not Drafter.propose_tree

    @classmethod
    def trainable(cls) -> bool:
        return cls.forward_train is not Drafter.forward_train


# =================================================================================================
# Export layouts
# =================================================================================================
@dataclass
class ExportContext:
    """What a layout writer knows besides the drafter."""

    target: Any  # drafters.target.Target the drafter was trained on
    drafter_config: dict[str, Any]  # the drafter's full config (every field)
    dtype: str  # weights dtype name: float32 | bfloat16 | float16
    meta: dict[str, Any]  # config.json's `specdistill` section (format, drafter, target, ...)
    k: int = 5  # the draft length, for configs that carry one (written as their own key)

    def common(self) -> dict[str, Any]:
        """The config.json keys every layout ends with."""
        return {"specdistill": self.meta, "torch_dtype": self.dtype}


Files = dict[str, dict[str, torch.Tensor]]  # file name -> {tensor name: tensor}


@dataclass(frozen=True)
class ExportLayout:
    """One folder layout a drafter can be exported to (`format=<format>`), registered by the drafter
    module that owns it (`register(..., layouts=...)`); drafters/export.py only dispatches.

    A tensor layout gives `write` and `read`; drafters/export.py writes config.json and the files
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
          "from drafters.export import load_export; drafter = load_export('{path}', target)",
    write=_write_state_dict, read=_read_state_dict)


# =================================================================================================
# The registry
# =================================================================================================
DRAFTERS: dict[str, type[Drafter]] = {}
CONFIGS: dict[str, type[DrafterConfig]] = {}


def register(name: str, config: type[DrafterConfig], layouts: tuple[ExportLayout, ...] = ()
             ) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: make a drafter, its config schema and its export layouts known under
    `name`. Checks that the schema is a DrafterConfig dataclass whose `name` defaults to `name`
    and that the layouts are ExportLayouts with distinct formats; a trainable drafter also gets
    `hf` (STATE_DICT_LAYOUT) unless it registers its own."""
    import dataclasses

    if not (isinstance(config, type) and issubclass(config, DrafterConfig)
            and dataclasses.is_dataclass(config)):
        raise TypeError(f"drafter {name!r}: config= must be a DrafterConfig dataclass, got {config!r}")
    if config().name != name:
        raise ValueError(f"drafter {name!r}: its config {config.__name__}.name defaults to "
                         f"{config().name!r}; set `name: str = {name!r}`")
    bad = [x for x in layouts if not isinstance(x, ExportLayout)]
    formats = [x.format for x in layouts]
    if bad or len(set(formats)) != len(formats):
        raise TypeError(f"drafter {name!r}: layouts= must be ExportLayouts with distinct formats "
                        f"(got {formats + bad})")

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        if name in DRAFTERS:
            raise ValueError(f"drafter {name!r} registered twice")
        cls.name, cls.config_class = name, config
        own = {x.format: x for x in layouts}
        cls.layouts = {"hf": STATE_DICT_LAYOUT, **own} if cls.trainable() else own
        DRAFTERS[name], CONFIGS[name] = cls, config
        return cls

    return wrap


def drafter_class(name: str) -> type[Drafter]:
    """The registered drafter class `name`; an unknown name lists the known ones."""
    if name not in DRAFTERS:
        raise KeyError(f"unknown drafter {name!r}; known drafters: {sorted(DRAFTERS)}")
    return DRAFTERS[name]


def drafter_schema(cfg) -> type[DrafterConfig] | None:
    """The registered schema of a drafter config in any form, by its `name` (None: unknown name,
    refused with the known names when the drafter is built). The range check (drafters/ranges.py)
    walks a `drafter` setting against it."""
    name = cfg.get("name") if hasattr(cfg, "get") else getattr(cfg, "name", None)
    return CONFIGS.get(name)


def trainable_drafters() -> list[str]:
    """Names of the registered drafters that implement forward_train."""
    return sorted(n for n, c in DRAFTERS.items() if c.trainable())


# =================================================================================================
# Construction, saving and loading of drafters. Every drafter class has `@classmethod build(cls,
# cfg, target) -> Drafter` (Drafter.build by default), cfg being its config dataclass, an OmegaConf
# node or a plain dict. A drafter folder (drafter.safetensors + drafter.json): drafters/folder.py
# (save_drafter, config_dict and parse_config re-exported here) and load_drafter below.
# =================================================================================================
def build_drafter(cfg, target) -> Drafter:
    """Build the drafter named by cfg.name (cfg: its config in any form) on top of `target`."""
    name = config_dict(cfg).get("name")
    if not name or name == "?":
        raise KeyError(f"drafter config has no `name` (got {name!r}); known: {sorted(DRAFTERS)}")
    return drafter_class(name).build(cfg, target)


def load_drafter(folder, target, decode_overrides: dict | None = None) -> Drafter:
    """Rebuild a saved drafter on `target` and load its weights strictly. `decode_overrides`
    replaces decode-time settings (the `tree_*` keys) of the saved config; any other key is
    refused, since the weights were trained with it. A drafter trained for another target is
    refused with both targets named (folder.py check_trained_target; by its weights' shapes for a folder
    saved before drafters recorded their target). Callers resolve and verify the folder first
    (drafters/resolve.py)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).is_file():
            raise FileNotFoundError(f"{folder} holds no {f}; a saved drafter folder has "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE} (written by save_drafter)")
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    for key, value in (decode_overrides or {}).items():
        if not key.startswith(DECODE_TIME_PREFIX) or key not in cfg:
            raise ValueError(f"drafter.{key} cannot change after training (only the decode-time "
                             f"{sorted(k for k in cfg if k.startswith(DECODE_TIME_PREFIX))} can)")
        cfg[key] = value
    check_trained_target(folder, target)
    drafter = build_drafter(cfg, target)
    state = load_file(str(folder / WEIGHTS_FILE), device=str(target.device))
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as e:  # e.g. "size mismatch for fc.weight: ... torch.Size([64, 128]) ..."
        detail = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), None)
        if detail is None:
            raise
        raise TargetMismatch(f"{folder} does not fit target {target.source} (hidden "
                             f"{target.hidden_size}, vocab {target.vocab_size}): {detail}; it was "
                             f"trained for another target: pass that one (target=...)") from e
    return drafter
