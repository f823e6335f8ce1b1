"""The drafter interface, its config schema and the registry. Interfaces live here and nowhere else.

A drafter proposes tokens for the frozen target to verify. The decoder (decode/) and the trainer
(train/) only ever talk to this interface; a new drafter is one file in drafters/ that subclasses
`Drafter`, decorates itself with `@register("name")`, plus `conf/drafter/<name>.yaml`.

Decode-time contract (see decode/spec.py for the loop that drives it):
  * Before the first round of a prompt the decoder calls `reset()`.
  * Each round it calls `propose(state, k, sampling, generator)` (chain) or
    `propose_tree(state, sampling)` (tree). `state.tokens` holds every committed token; between
    two calls it only grows by appending (accepted drafts + the target's bonus token), so a drafter
    with its own KV cache crops it back to the longest prefix it still shares with `state.tokens`.
  * Drafters that read target features (EAGLE, Medusa) list the hidden-state indices they need in
    `feature_layers` (HF `hidden_states` indexing: 0 = embeddings, i = output of layer i, -1 = the
    final-normed state the LM head sees); the decoder then fills `state.features`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import nn

from drafters.sampling import SamplingParams


@dataclass
class DrafterConfig:
    """Fields every drafter config has. Each drafter subclasses this with its own settings."""

    name: str = "?"  # registry key; set by each drafter's schema


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


@dataclass
class TreeProposal:
    """A draft tree rooted at the last committed token. Nodes are topologically ordered."""

    tokens: torch.Tensor  # (N,) long: the token of each node
    parents: torch.Tensor  # (N,) long: index of the parent node, -1 = child of the root

    def depths(self) -> torch.Tensor:
        """(N,) depth of each node, 1 for children of the root."""
        depth = torch.zeros_like(self.parents)
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth


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
    target_logits[:, t + shift] and counts where loss_mask[:, t + 1 + shift] == 1.
    """

    logits: torch.Tensor  # (B, T, Vd) over the draft vocabulary (Vd = V without a pruned vocab)
    shift: int = 0  # 0 = next token, 1 = the one after (EAGLE step / Medusa head 1), ...
    weight: float = 1.0  # weight of this prediction in the total loss (e.g. Medusa's 0.8^k)
    # (B, T, F') EAGLE: predicted target feature of position t + shift (the one that produced
    # target_logits[:, t + shift]), regressed on it
    features: torch.Tensor | None = None


class Drafter(nn.Module):
    """Base class of every drafter. Subclasses implement `propose` and optionally `propose_tree`;
    trainable drafters also implement `forward_train`."""

    name: ClassVar[str] = "?"
    feature_layers: tuple[int, ...] = ()  # target hidden states the drafter reads at decode time

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size  # the target vocabulary the proposals are expressed in

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

    def propose_tree(self, state: DecodeState, sampling: SamplingParams) -> TreeProposal:
        """Draft a token tree (static or dynamic) continuing state.tokens."""
        raise NotImplementedError(f"drafter {self.name!r} does not propose trees; use a chain")

    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """Teacher-forced training predictions on a batch (trainable drafters only)."""
        raise NotImplementedError(f"drafter {self.name!r} is not trainable")

    def forward(self, batch: TrainBatch) -> list[DraftPrediction]:
        """`module(batch)` trains: DDP and DeepSpeed wrappers hook into forward()."""
        return self.forward_train(batch)

    # A pruned draft vocabulary: drafters that support one hold `self.draft_vocab` (a
    # drafters.vocab.DraftVocab, None = the full target vocabulary) and a trainable `self.lm_head`
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

    def chain_proposal(self, toks: list[torch.Tensor], qs: list[torch.Tensor],
                       sampling: SamplingParams) -> ChainProposal:
        """Package drafted target ids and their draft-vocab distributions q (sampling only)."""
        from drafters.vocab import expand_probs

        tokens = torch.stack(toks).long()  # (n,)
        if sampling.greedy:
            return ChainProposal(tokens=tokens, probs=None)
        return ChainProposal(tokens=tokens, probs=expand_probs(torch.stack(qs), self.d2t,
                                                               self.vocab_size))  # (n, V)

    def full_head(self) -> nn.Module:
        """The full-vocabulary head a pruned head starts from (the target's LM head by default)."""
        return self.target.lm_head()

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """Use the draft vocab d2t (drafters.vocab.select_draft_vocab) and restart the pruned head
        from the full head's rows d2t."""
        if getattr(self, "draft_vocab", None) is None:
            raise ValueError(f"{self.name}: set_draft_vocab needs draft_vocab_size in the config")
        self.draft_vocab.set(d2t.to(self.draft_vocab.d2t.device))
        with torch.no_grad():
            self.lm_head.weight.copy_(self.full_head().weight[self.d2t])

    @property
    def supports_tree(self) -> bool:
        return type(self).propose_tree is not Drafter.propose_tree


DRAFTERS: dict[str, type[Drafter]] = {}
CONFIGS: dict[str, type[DrafterConfig]] = {}


def register(name: str, config: type[DrafterConfig]) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: make a drafter and its config schema known under `name`."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        if name in DRAFTERS:
            raise ValueError(f"drafter {name!r} registered twice")
        cls.name = name
        DRAFTERS[name] = cls
        CONFIGS[name] = config
        return cls

    return wrap


def drafter_class(name: str) -> type[Drafter]:
    import drafters  # noqa: F401  (importing the package registers every drafter)

    if name not in DRAFTERS:
        raise KeyError(f"unknown drafter {name!r}; known drafters: {sorted(DRAFTERS)}")
    return DRAFTERS[name]


# =================================================================================================
# Construction, saving and loading of drafters
#
# Every drafter class has `@classmethod build(cls, cfg, target) -> Drafter`, where cfg is its config
# dataclass, an OmegaConf node or a plain dict. A saved drafter is a folder with
#   drafter.safetensors  the drafter's own parameters and buffers (e.g. the draft-vocab maps), never
#                        the frozen target's weights: drafters keep references to target modules
#                        outside their module tree, so `state_dict()` cannot reach them;
#   drafter.json         its config as a dict, including `name`.
# =================================================================================================
WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter.json"


def config_dict(cfg) -> dict:
    """A drafter config (dataclass, OmegaConf node or dict) as a plain, JSON-ready dict."""
    from omegaconf import OmegaConf

    if isinstance(cfg, dict):
        return dict(cfg)
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def parse_config(cfg, schema: type[DrafterConfig]):
    """Any config form -> an instance of `schema`, type-checked by OmegaConf (typos fail here)."""
    from omegaconf import OmegaConf

    if isinstance(cfg, schema):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(schema), config_dict(cfg))
    return OmegaConf.to_object(merged)


def build_drafter(cfg, target) -> Drafter:
    """Build the drafter named by cfg.name (cfg: its config in any form) on top of `target`."""
    name = config_dict(cfg).get("name")
    if not name or name == "?":
        raise KeyError(f"drafter config has no `name` (got {name!r}); known: {sorted(DRAFTERS)}")
    return drafter_class(name).build(cfg, target)


def trainable_drafters() -> list[str]:
    """Names of the registered drafters that implement forward_train."""
    import drafters  # noqa: F401  (importing the package registers every drafter)

    return sorted(n for n, c in DRAFTERS.items() if c.forward_train is not Drafter.forward_train)


def _atomic_write(path, write) -> None:
    """write(tmp_path) into a temporary file next to `path`, then rename it into place."""
    import os

    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_drafter(drafter: Drafter, cfg, folder) -> None:
    """Write drafter.safetensors + drafter.json into `folder` (created if missing), atomically."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    meta = config_dict(cfg)
    meta.setdefault("name", drafter.name)

    def write_json(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")

    _atomic_write(folder / WEIGHTS_FILE, lambda tmp: save_file(state, tmp, metadata={"name": drafter.name}))
    _atomic_write(folder / CONFIG_FILE, write_json)


DECODE_TIME_PREFIX = "tree_"  # drafter settings that only shape decoding (tree size), not weights


def load_drafter(folder, target, decode_overrides: dict | None = None) -> Drafter:
    """Rebuild a saved drafter on `target` and load its weights strictly. `decode_overrides`
    replaces decode-time settings (the `tree_*` keys) of the saved config; any other key is
    refused, since the weights were trained with it."""
    import json
    from pathlib import Path

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
    drafter = build_drafter(cfg, target)
    state = load_file(str(folder / WEIGHTS_FILE), device=str(target.device))
    drafter.load_state_dict(state, strict=True)
    return drafter


def fit_draft_vocab(drafter: Drafter, token_counts: torch.Tensor, always_include=()) -> bool:
    """Give a drafter with a pruned head (`draft_vocab` set) the draft vocab of the most frequent
    training tokens (drafters.vocab.select_draft_vocab); False (no-op) for a full-vocab drafter.
    The trainer calls it once before training; a loaded drafter already has its map."""
    from drafters.vocab import select_draft_vocab

    vocab = getattr(drafter, "draft_vocab", None)
    if vocab is None:
        return False
    drafter.set_draft_vocab(select_draft_vocab(token_counts, vocab.size, always_include))
    return True
