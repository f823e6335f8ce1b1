"""The drafter interface, its config schema and the registry. Interfaces live here and nowhere
else: what training hands a drafter (TrainBatch) and gets back (DraftPrediction), what the decoder
shows it (DecodeState) and gets back (ChainProposal, TreeProposal), the Drafter class and
`register`; the export layout contract a drafter registers with it (ExportLayout) is
drafters/parts/layouts.py.

A drafter proposes tokens for the frozen target to verify. The decoder (decode/) and the trainer
(train/) only ever talk to this interface. A new drafter is one module in drafters/ (drafters/__init__.py
imports every module there, and those of $SPECDISTILL_DRAFTERS) plus `conf/drafter/<name>.yaml`:

    @register("toy", config=ToyConfig, layouts=(TOY_LAYOUT,))   # ToyConfig.name defaults to "toy"
    class Toy(Drafter): ...

It is built from the shared parts: drafters/parts/head.py (the draft head: the target's frozen LM head or
a pruned trainable one with d2t/t2d), drafters/parts/cache.py (its own KV cache kept in step with the
committed tokens, tree-level masks), `Drafter.draft_chain` (the one chain-proposal loop) and the
default `Drafter.build`. A drafter that drafts step by step through its own KV cache subclasses
drafters/parts/drafting.py CausalDrafter and gives its network's four public methods (drafters/eagle.py
is the example). Every trainable drafter exports as `hf` (STATE_DICT_LAYOUT, lossless);
engine layouts are `ExportLayout`s registered by the drafter module that owns them.

Decode-time contract (see decode/spec.py for the loop that drives it):
  * Before the first round of a prompt the decoder calls `reset()`.
  * Each round it calls `propose(state, k, sampling, generator)` (chain) or `propose_tree(state,
    sampling, generator)` (tree). Batched decoding (decode/batched/spec.py) instead calls
    `propose_rows(slots, states, ks, ...)` once for every row's chain (slots[r]: row r's copy of
    the drafter, holding its state); the default loops over `propose`, EAGLE-family drafters put
    the rows through one forward per draft step (drafters/parts/rows.py). `state.tokens` holds every
    committed token; between two calls it only grows by appending (accepted drafts + the target's
    bonus token), so a drafter with its own KV cache crops it back to the longest prefix it still
    shares with `state.tokens`.
  * Drafters that read target features (EAGLE, Medusa) list the hidden-state indices they need in
    `feature_layers` (HF `hidden_states` indexing: 0 = embeddings, i = output of layer i, -1 = the
    final-normed state the LM head sees); the decoder then fills `state.features`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import nn

from specdistill.drafters.parts.head import set_draft_vocab as _set_draft_vocab
from specdistill.drafters.parts.layouts import STATE_DICT_LAYOUT, ExportLayout
from specdistill.drafters.parts.sampling import SamplingParams, draft_token
from specdistill.drafters.parts.vocab import expand_probs

DECODE_TIME_PREFIX = "tree_"  # drafter settings that only shape decoding (tree size), not weights


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
    # (B, T, V) target logits at t (its distribution of token t+1): a dense tensor, or TeacherRows
    # (the trainer's: only the positions a loss reads), indexed by position alike
    target_logits: torch.Tensor | TeacherRows
    features: torch.Tensor | None = None  # (B, T, F) target features of `feature_layers` at t
    # (B, A) the anchors this batch trains, drawn before its teacher (Drafter.teacher_rows) by a
    # drafter that trains a drawn share of them; None: the drafter draws (or needs) none
    anchors: torch.Tensor | None = None


class TeacherRows:
    """The target's logits at the positions a loss reads, compact: `rows` (M + 1, V) and `index`
    (B, T) into them, row M all NaN and indexed by every other position, so a read there shows up
    as a non-finite loss instead of a quiet wrong teacher. Indexed by position like the dense
    (B, T, V) tensor it stands for ([b, t] with index tensors, or a (B, T) bool mask -> (..., V)),
    it holds M rows where the dense one held B * T (a block drafter's loss reads about a third
    of the positions: train/teacher.py)."""

    def __init__(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """rows (M + 1, V): the logits at the M True positions of `at` (B, T) in row-major order,
        then a NaN row."""
        if rows.shape[0] != int(at.sum()) + 1 or not bool(rows[-1].isnan().all()):
            raise ValueError(f"TeacherRows: {rows.shape[0]} rows for {int(at.sum())} positions; "
                             f"give one per True of `at`, then one NaN row")
        self.rows = rows
        self.index = torch.full(at.shape, rows.shape[0] - 1, dtype=torch.long, device=rows.device)
        self.index[at.to(rows.device)] = torch.arange(rows.shape[0] - 1, device=rows.device)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.index.shape, self.rows.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def known(self) -> torch.Tensor:  # (B, T) bool: the positions that have their rows
        return self.index < self.rows.shape[0] - 1

    def __getitem__(self, key) -> torch.Tensor:
        return self.rows[self.index[key]]

    def to(self, device) -> TeacherRows:
        out = TeacherRows.__new__(TeacherRows)
        out.rows, out.index = self.rows.to(device), self.index.to(device)
        return out

    def dense(self) -> torch.Tensor:
        """The (B, T, V) tensor it stands for (NaN where no loss reads)."""
        return self.rows[self.index]


@dataclass
class DraftPrediction:
    """One of a drafter's training predictions, aligned for the loss.

    logits[:, t] is the drafter's distribution of token t + 1 + shift, so it is compared with
    target_logits[:, t + shift] and counts where loss_mask[:, t + 1 + shift] == 1. With `at`
    (B, T) bool (drafters/parts/anchors.py counted), the head ran only there: logits (M, Vd), row-major.
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
    # a drafter with a confidence head (DSpark): its logit of this draft's acceptance, one per
    # row of `logits` without the vocabulary axis ((B, T) | (B, A)); trained by SlotObjective
    confidence: torch.Tensor | None = None


@dataclass(frozen=True)
class SlotObjective:
    """A drafter's own training objective over the slots of its blocks (DSpark's, arXiv
    2607.05147 / deepseek-ai/DeepSpec deepspec/modeling/dspark/loss.py), declared by the drafter
    (`Drafter.objective`) and computed by train/losses.py slot_loss instead of trainer.loss:

        loss = ce * CE(q, argmax p') + l1 * |q - p'|_1 + confidence * BCE(c, target)

    each a weighted mean over every kept (row, anchor, slot): slot j of a block weighs its
    DraftPrediction.weight (exp(-j / gamma)), and the slots after a block's first unsupervised one
    (a token outside the assistant turns, or past the row's end) are dropped. p' is the target's
    distribution over the draft vocabulary, c the drafter's confidence logit (DraftPrediction.confidence).
    DeepSpec's CE reads the data's next token; here it reads the target's argmax (the batch holds the
    target's logits, and with regenerated data the two agree), defined in any draft vocabulary."""

    ce: float = 0.1  # weight of the cross-entropy on the target's argmax
    l1: float = 0.9  # weight of the L1 distance between draft and target probabilities (= 2 TV)
    confidence: float = 1.0  # weight of the confidence head's binary cross-entropy
    # what the confidence learns: tv = 1 - TV(q, p'), the draft's expected acceptance when sampled;
    # greedy = 1 when argmax q is the target's argmax (what greedy verification accepts), else 0
    confidence_target: str = "tv"


CONFIDENCE_TARGETS = ("tv", "greedy")


# =================================================================================================
# What the decoder shows a drafter and what a drafter proposes (decode/spec.py drives them)
# =================================================================================================
@dataclass
class DecodeState:
    """What the decoder shows a drafter before a round."""

    tokens: torch.Tensor  # (T,) long: prompt + generated tokens committed so far
    # (T-1, F) target features of tokens[:-1] (the last committed token, the target's bonus token,
    # has not been through the target yet), F = sum of the widths of `feature_layers`, concatenated
    # in that order. None when the drafter asks for no features.
    features: torch.Tensor | None = None


@dataclass
class ChainProposal:
    """k drafted tokens that continue `state.tokens`, in order."""

    tokens: torch.Tensor  # (k,) long
    # (k, V) the warped draft distributions q_i the tokens were sampled from, needed by the lossless
    # sampling rule. None means a deterministic drafter: q_i is one-hot on tokens[i].
    probs: torch.Tensor | None = None
    # (k,) max_x q_i(x) per position, for verify budgets (decode/batched/planner.py); None: deterministic
    confidence: torch.Tensor | None = None
    # (k,) a TRAINED estimate of P(draft i is accepted | drafts < i were), e.g. DSpark's confidence
    # head; survival of draft i = prod_{j <= i} accept_prob[j]. None: the drafter has no such head
    accept_prob: torch.Tensor | None = None


@dataclass
class TreeProposal:
    """A draft tree rooted at the last committed token. Nodes are topologically ordered."""

    tokens: torch.Tensor  # (N,) long: the token of each node
    parents: torch.Tensor  # (N,) long: index of the parent node, -1 = child of the root
    # (N, V) warped q node i was drawn from given its path and earlier siblings (drawn in index
    # order), for the lossless multi-draft rule; None = a deterministic tree (q one-hot on tokens)
    probs: torch.Tensor | None = None

    def depths(self) -> torch.Tensor:
        """(N,) depth of each node, 1 for children of the root."""
        depth = torch.zeros_like(self.parents)
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth


class ChainDraw:
    """One chain being drafted, draw by draw (Drafter.draft_chain; several at once in a drafter's
    batched propose_rows):
    1. draw draft i from its logits (argmax, or a sample from the warped q_i);
    2. stop early when its confidence falls below min_confidence (never on the first);
    3. map it to a target id; the chain goes on until k drafts;
    4. package the target ids, their confidences and (sampling) q over the target vocabulary.
    `drafter` is the drafters.base.Drafter drafting (its target_ids, d2t and vocab_size)."""

    def __init__(self, drafter: Any, k: int, sampling: SamplingParams,
                 generator: torch.Generator | None, min_confidence: float) -> None:
        self.drafter, self.k, self.sampling = drafter, k, sampling
        self.generator, self.min_confidence = generator, min_confidence
        self.tokens: list[torch.Tensor] = []  # target ids
        self.qs: list[torch.Tensor | None] = []
        self.confs: list[float] = []
        self.done = k < 1

    @property
    def n(self) -> int:
        return len(self.tokens)

    def draw(self, logits: torch.Tensor) -> bool:
        """Draw the next draft from logits (Vd,); True when the chain wants the next logits."""
        if self.done:
            return False
        d, q, conf = draft_token(logits, self.sampling, self.generator, self.min_confidence)
        if self.tokens and conf < self.min_confidence:  # 2.
            self.done = True
            return False
        self.tokens.append(self.drafter.target_ids(d))  # 3.
        self.qs.append(q)
        self.confs.append(conf)
        self.done = self.n >= self.k
        return not self.done

    def proposal(self) -> ChainProposal:  # 4.
        if not self.tokens:
            return ChainProposal(tokens=torch.empty(0, dtype=torch.long))
        tokens, conf = torch.stack(self.tokens).long(), torch.tensor(self.confs)  # (n,), (n,)
        q = None if self.sampling.greedy else expand_probs(torch.stack(self.qs), self.drafter.d2t,
                                                           self.drafter.vocab_size)
        return ChainProposal(tokens=tokens, probs=q, confidence=conf)  # q: (n, V) | None


# =================================================================================================
# The drafter
# =================================================================================================
class Drafter(nn.Module):
    """Base class of every drafter. Subclasses implement `propose` and optionally `propose_tree`;
    trainable drafters also implement `forward_train`. Set by `register`: `name`, `config_class`,
    `layouts`."""

    name: ClassVar[str] = "?"
    config_class: ClassVar[type[DrafterConfig]] = DrafterConfig  # its config schema
    layouts: ClassVar[dict[str, ExportLayout]] = {}  # format -> the export layouts it supports
    tags: ClassVar[tuple[str, ...]] = ()  # extra model-card tags (e.g. "eagle1")
    feature_layers: tuple[int, ...] = ()  # target hidden states the drafter reads at decode time
    # True: its ChainProposal.accept_prob comes from a trained confidence head (e.g. DSpark's), so
    # the decoder may cut a chain by survival (decode/survival.py) and reports its calibration
    accept_prob_head: ClassVar[bool] = False

    def __init__(self, vocab_size: int, cfg: DrafterConfig | None = None, target=None) -> None:
        super().__init__()
        self.vocab_size = vocab_size  # the target vocabulary the proposals are expressed in
        self.cfg = cfg  # its config (a `config_class` instance)
        self.target = target  # the frozen target: a plain attribute, not a submodule, never saved

    @classmethod
    def build(cls, cfg, target) -> "Drafter":
        """The drafter from its config in any form (dataclass, OmegaConf node, dict) on `target`."""
        return cls(parse_config(cfg, cls.config_class), target)

    @property
    def objective(self) -> SlotObjective | None:
        """The drafter's own training objective (train/losses.py slot_loss), which replaces
        trainer.loss; None (most drafters): the trainer's divergence (distill_loss)."""
        return None

    def reset(self) -> None:
        """Forget per-prompt state (caches) before a new prompt."""

    def rescale_confidence(self, a: float, b: float) -> None:
        """Make the trained confidence head give sigmoid(a * z + b) where it gave sigmoid(z), in its
        own weights (a calibration fitted to observed acceptance, decode/survival.py fit_platt;
        engines that read the head then serve the calibrated confidences). Drafters with
        accept_prob_head implement it."""
        raise NotImplementedError(f"drafter {self.name!r} has no trained confidence head to calibrate")

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

    def teacher_rows(self, batch: TrainBatch) -> torch.Tensor | None:
        """(B, T) bool: the positions whose teacher rows (target_logits) this batch's loss will
        read, when that is fewer than every scored one, so the trainer's teacher (train/teacher.py)
        runs the target's LM head there only; None: every scored position. Called once per batch
        before its teacher is built; a drafter that trains a drawn share of anchors draws them
        here into batch.anchors, and forward_train trains those."""
        return None

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

    # A pruned draft vocabulary (drafters/parts/head.py): drafters that support one hold `self.draft_vocab`
    # (a drafters.parts.vocab.DraftVocab, None = the full target vocabulary) and a trainable `self.lm_head`
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
        """Use the draft vocab d2t (drafters.parts.vocab.select_draft_vocab) and restart the pruned head
        from the full head's rows d2t."""
        _set_draft_vocab(self, self.full_head(), d2t)

    @property
    def supports_tree(self) -> bool:
        return type(self).propose_tree is not Drafter.propose_tree

    @classmethod
    def trainable(cls) -> bool:
        return cls.forward_train is not Drafter.forward_train


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
    refused with the known names when the drafter is built). The range check (cli/ranges.py)
    walks a `drafter` setting against it."""
    name = cfg.get("name") if hasattr(cfg, "get") else getattr(cfg, "name", None)
    return CONFIGS.get(name)


def trainable_drafters() -> list[str]:
    """Names of the registered drafters that implement forward_train."""
    return sorted(n for n, c in DRAFTERS.items() if c.trainable())


# =================================================================================================
# Construction. Every drafter class has `@classmethod build(cls, cfg, target) -> Drafter`
# (Drafter.build by default), cfg being its config dataclass, an OmegaConf node or a plain dict.
# Saving and loading a drafter folder: store/drafter.py.
# =================================================================================================
def build_drafter(cfg, target) -> Drafter:
    """Build the drafter named by cfg.name (cfg: its config in any form) on top of `target`."""
    name = config_dict(cfg).get("name")
    if not name or name == "?":
        raise KeyError(f"drafter config has no `name` (got {name!r}); known: {sorted(DRAFTERS)}")
    return drafter_class(name).build(cfg, target)


def config_dict(cfg) -> dict:
    """A drafter config (dataclass, OmegaConf node or dict) as a plain, JSON-ready dict."""
    from omegaconf import OmegaConf

    if isinstance(cfg, dict):
        return dict(cfg)
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def parse_config(cfg, schema):
    """Any config form -> an instance of `schema`, type-checked by OmegaConf (typos fail here)."""
    from omegaconf import OmegaConf

    if isinstance(cfg, schema):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(schema), config_dict(cfg))
    return OmegaConf.to_object(merged)


def store_drafter_schemas() -> list[str]:
    """Store every registered drafter's schema in Hydra's ConfigStore (group `drafter`, as
    `schema_<name>`), so each conf/drafter/<name>.yaml that starts from it fails at start on a
    misspelt key or a wrong type. Every entry point calls it before Hydra composes. Returns the
    names stored, sorted."""
    from hydra.core.config_store import ConfigStore

    import specdistill.drafters  # noqa: F401  (importing the package registers every drafter)

    cs = ConfigStore.instance()
    for name, schema in CONFIGS.items():
        cs.store(group="drafter", name=f"schema_{name}", node=schema)
    return sorted(CONFIGS)
