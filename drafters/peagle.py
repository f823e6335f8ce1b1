"""P-EAGLE: parallel drafting on EAGLE-3's network. ONE drafter forward proposes the whole draft.

EAGLE-3 drafts k tokens with k drafter steps, each reading the previous step's output. P-EAGLE
replaces steps 2..k by k-1 *mask positions* appended after the last real position and run in the
same forward: a mask position reads a learnt `mask_hidden` (3H,) in place of the concatenated
aux-layer target features (fused by the same fc, as vLLM does) and the embedding of
`mask_token_id` in place of a token, so its input does not depend on the drafts before it, and
all k draft distributions come out of one forward:

    query = [real positions (token t+1, fused feature t) ...; mask_1 .. mask_{k-1}]   causal
    draft 1 = head(out at the last real position);  draft 1+i = head(out at mask_i)

The network (fc fusion of the low / mid / high target layers, midlayer over [embed; feature],
norm, pruned head) is EAGLE-3's, drafters/parts/fused.py FusedDrafter with the same parameter names,
plus `mask_hidden`.

Training (`forward_train`) reuses EAGLE-3's training-time-test attention: "step" 1 is the real
positions (causal over real features), step j > 1 is mask j-1 at every anchor t, at position
t+j-1, attending to the real keys at anchors <= t and to masks 1..j-1 of the same anchor: exactly
what mask j-1 sees at decode time after the real prefix ending at t. Step j predicts the target's
token t+j+1 (DraftPrediction shift=j), weighted `loss_weights[j-1]` (default ttt_decay ** (j-1)).
All anchors cost ttt_length full passes (12.9x an EAGLE-1 step on SmolLM2, BENCHMARKS.md), so
`mask_anchors` trains the masks at a random subset of each row's anchors, drawn every step, as
P-EAGLE's COD sampling does (speculators: depth d keeps a share r**d of the positions, floored;
here one share for every mask, so a sampled anchor keeps its whole rollout): the masks then run
over A rows with (A x T) attention to the real keys, and their logits carry the anchors
(DraftPrediction.anchors) for the loss. Draft position 1 (the real positions) stays at every anchor.

Proposals (drafters/parts/parallel.py, shared with DFlash) are per-position argmax / samples over the
k logits of `draft_logits`, returning the q each token was sampled from (lossless speculative
sampling); the adaptive length cuts the chain where a position's confidence falls below
min_confidence. Trees come from the same single forward: EAGLE-2's dynamic tree over the
per-position distributions (a node at depth d expands with position d's top-k, whatever its
ancestors), scored by cumulative log-probability.

Sources read (2026-12-01): vLLM model_executor/models/llama_eagle3.py @00bd1493 (with
speculative_config.parallel_drafting: a `mask_hidden` buffer (1, 3H) loaded from the checkpoint,
projected by combine_hidden_states = fc like the real aux states) and vLLM's
get_parallel_drafting_token_id (the mask token id from the draft config's `mask_token_id`, else
`pard_token` / `ptd_token_id`; queries = [last token; masks] at consecutive positions);
speculators 0.9.0 (PyPI wheel; its models/peagle/ equals the repo's main @c05b95b3 but for a
gradient-checkpointing flag): config.py (PEagleSpeculatorConfig = Eagle3SpeculatorConfig +
speculators_model_type "peagle", architectures ["PEagleSpeculator"], mask_token_id,
embed_requires_grad default true), core.py (PEagleDraftModel = Eagle3DraftModel + mask_hidden
(1, 1, 3H), fused through input_norm / fc_norm / fc like the aux states; depth d of anchor a at
position a+d), attention.py (depth 0 causal, depth d sees depth 0 at anchors <= a and its own
rollout: our training attention), data.py (COD sampling).

Exports: `hf` (ours, lossless); `vllm`: EAGLE-3's vLLM layout (drafters/parts/fused_layouts.py) plus the
`mask_hidden` tensor and `mask_token_id` / `parallel_drafting` in config.json, served with
`"method": "eagle3", "parallel_drafting": true`; `speculators`: EAGLE-3's speculators layout with
the peagle type, mask_token_id and mask_hidden (1, 1, 3H); the slow test in tests/test_eagle3.py
loads it with speculators 0.9.0's own PEagleDraftModel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from specdistill.cli.ranges import MAX_COUNT, MAX_DRAFT, MAX_VOCAB, rng
from specdistill.drafters.base import (
    ChainProposal,
    DecodeState,
    DraftPrediction,
    TrainBatch,
    register,
)
from specdistill.drafters.parts import parallel
from specdistill.drafters.parts.anchors import capped_steps, check_anchor_share, counted, draw_anchors
from specdistill.drafters.parts.attention import ttt_attention
from specdistill.drafters.parts.fused import FusedConfig, FusedDrafter
from specdistill.drafters.parts.fused_layouts import (
    engine_config,
    engine_refusal,
    engine_state,
    state_from_engine,
)
from specdistill.drafters.parts.layouts import WEIGHTS, ExportLayout, torch_dtype
from specdistill.drafters.parts.rows import rows_forward, rows_keep


@dataclass
class PeagleConfig(FusedConfig):
    """P-EAGLE drafter settings: the fused network's (aux layers, layers, pruned head; drafters/
    fused.py) plus the masks."""

    name: str = "peagle"  # registry key
    # draft positions trained: the real one + ttt_length - 1 masks; the largest k it drafts
    ttt_length: int = rng(8, 1, MAX_DRAFT)
    # id whose embedding mask positions read (None = V - 1)
    mask_token_id: Optional[int] = rng(None, 0, MAX_VOCAB)
    # loss weight per draft position (ttt_length values); None = ttt_decay ** (position - 1)
    loss_weights: Optional[list[float]] = rng(None, 0, 1000)
    # anchors per row whose masks (draft positions 2..) are trained, drawn each step (P-EAGLE's
    # COD sampling, flat): null or 1.0 = every anchor; a fraction in (0, 1) = that share of the
    # row's anchors; a whole number > 1 = that many. Draft position 1 trains at every anchor.
    mask_anchors: Optional[float] = rng(None, 0, MAX_COUNT, lo_open=True)


# == Export: vLLM's EAGLE-3 loader with parallel drafting (llama_eagle3.py @00bd1493): the fused ==
# == vllm layout, `mask_hidden` (3H,) loaded into its (1, 3H) buffer, the mask id in config.    ==
def _write_vllm(drafter, state, ctx):
    tensors = engine_state(drafter, "vllm", state, torch_dtype(ctx.dtype))  # mask_hidden kept as is
    config = engine_config(drafter, "vllm", ctx.k, ctx.meta.get("base_model"),
                           ctx.dtype)
    config.update(parallel_drafting=True, mask_token_id=drafter.mask_token_id)
    return {**config, **ctx.common()}, {WEIGHTS: tensors}


def _read_vllm(files, dcfg, vocab_size):
    return state_from_engine(files[WEIGHTS], "vllm", dcfg.get("draft_vocab_size") is not None)


VLLM = ExportLayout(
    format="vllm", summary="vLLM's EAGLE-3 layout with parallel drafting (LlamaForCausalLMEagle3 + "
    "mask_hidden; mask_token_id in config.json; aux-layer ids = ours).",
    usage="vllm serve {base} --speculative-config '{{\"method\": \"eagle3\", \"model\": "
          "\"{path}\", \"num_speculative_tokens\": {k}, \"parallel_drafting\": true}}'",
    write=_write_vllm, read=_read_vllm, check=lambda dcfg: engine_refusal(dcfg, "vllm"),
    tags=("vllm", "eagle3", "peagle"), serving={"vllm": {"method": "eagle3", "parallel_drafting": True}})


# == Export: the speculators format's `peagle` type (speculators 0.9.0 models/peagle/: ==
# == PEagleSpeculatorConfig over Eagle3SpeculatorConfig + mask_token_id; PEagleDraftModel = ==
# == Eagle3DraftModel + mask_hidden (1, 1, 3H), fused through its optional norms and fc).   ==
def peagle_speculators_state(drafter, state: Optional[dict] = None,
                             dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The tensors PEagleDraftModel loads: EAGLE-3's speculators tensors (layers.0.*, fc, norms,
    lm_head, embed_tokens, d2t / t2d when pruned) and mask_hidden as its (1, 1, 3H) parameter."""
    out = engine_state(drafter, "speculators", state, dtype)
    out["mask_hidden"] = out["mask_hidden"].reshape(1, 1, -1)
    return out


def peagle_speculators_config(drafter, k: int = 5,
                              verifier: Optional[str] = None, dtype: str = "float32") -> dict:
    """config.json of the speculators `peagle` type: EAGLE-3's with the peagle type, its
    architecture, mask_token_id, at most ttt_length speculative tokens; embed_requires_grad is
    false (its default is true): the embedding is the target's, never trained here."""
    k = min(k, drafter.cfg.ttt_length)
    config = engine_config(drafter, "speculators", k, verifier, dtype)
    config.update(architectures=["PEagleSpeculator"], speculators_model_type="peagle",
                  mask_token_id=drafter.mask_token_id, embed_requires_grad=False)
    config["speculators_config"]["algorithm"] = "peagle"
    return config


def _write_speculators(drafter, state, ctx):
    tensors = peagle_speculators_state(drafter, state, torch_dtype(ctx.dtype))
    config = peagle_speculators_config(drafter, ctx.k,
                                       ctx.meta.get("base_model"), ctx.dtype)
    return {**config, **ctx.common()}, {WEIGHTS: tensors}


def _read_speculators(files, dcfg, vocab_size):
    pruned = dcfg.get("draft_vocab_size") is not None
    state = state_from_engine(files[WEIGHTS], "speculators", pruned)
    return {**state, "mask_hidden": state["mask_hidden"].reshape(-1)}  # (3H,)


SPECULATORS = ExportLayout(
    format="speculators",
    summary="the speculators library's P-EAGLE format (speculators_model_type peagle, "
            "PEagleDraftModel: EAGLE-3's layers + mask_hidden; mask_token_id in config.json).",
    usage="from speculators.models.peagle import PEagleDraftModel\n"
          "model = PEagleDraftModel.from_pretrained('{path}')",
    write=_write_speculators, read=_read_speculators,
    check=lambda dcfg: engine_refusal(dcfg, "speculators"), tags=("speculators", "peagle"))


@register("peagle", config=PeagleConfig, layouts=(VLLM, SPECULATORS))
class Peagle(parallel.ParallelDrafting, FusedDrafter):
    """P-EAGLE drafter: EAGLE-3's network (drafters/parts/fused.py) + a learnt mask hidden state; k
    drafts per forward. No forward_own: it drafts from masks, never from its own tokens."""

    tags = ("peagle", "parallel-drafting")
    trained_setting = "drafter.ttt_length"

    def __init__(self, cfg: PeagleConfig, target) -> None:
        V = target.vocab_size
        mask_id = V - 1 if cfg.mask_token_id is None else cfg.mask_token_id
        if not 0 <= mask_id < V:
            raise ValueError(f"peagle: mask_token_id must be a target token id in [0, {V}), got "
                             f"{mask_id}; null takes {V - 1}")
        if cfg.loss_weights is not None and len(cfg.loss_weights) != cfg.ttt_length:
            raise ValueError(f"peagle: loss_weights needs one weight per draft position "
                             f"(ttt_length={cfg.ttt_length}), got {list(cfg.loss_weights)}")
        check_anchor_share("peagle", "mask_anchors", cfg.mask_anchors)
        super().__init__(cfg, target)  # the fused network, head, device, decode state
        self.mask_token_id = mask_id
        g = torch.Generator().manual_seed(0)  # a small fixed start; trained with the rest
        self.mask_hidden = nn.Parameter(  # (3H,) stands in for the aux-layer features; fused by fc
            (0.02 * torch.randn(3 * target.hidden_size, generator=g)).to(self.fc.weight.device))

    def mask_inputs(self, B: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs of n mask positions per row: (embedding, hidden), each (B, n, H)."""
        dtype = self.fc.weight.dtype
        tok = torch.full((1, 1), self.mask_token_id, device=self.mask_hidden.device)
        emb = self.target.embed_tokens()(tok).to(dtype)  # (1, 1, H), frozen
        h = self.fuse(self.mask_hidden.view(1, 1, -1))  # (1, 1, H): fused like real features
        return emb.expand(B, n, -1), h.expand(B, n, -1)

    def _weight(self, j: int) -> float:
        w = self.cfg.loss_weights
        return float(w[j - 1]) if w is not None else self.cfg.ttt_decay ** (j - 1)

    # -- training ---------------------------------------------------------------------------------
    def mask_anchors(self, batch: TrainBatch, J: int) -> Optional[torch.Tensor]:
        """The anchors (B, A) whose masks train this step (cfg.mask_anchors; None = every anchor):
        draw_anchors among the anchors t where some mask's token (t+3 .. t+1+J) is counted."""
        m = self.cfg.mask_anchors
        if m is None or m == 1 or J < 2:
            return None
        return draw_anchors(batch, 3, J + 1, m)

    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """Draft position j = 1..ttt_length: j = 1 at every anchor t reads the real token t+1 and
        fused feature t; j > 1 is mask j-1 at position t+j-1 (mask inputs, no own outputs fed
        back), at every anchor or at the sampled `mask_anchors` (DraftPrediction.anchors), where
        it costs (A x T) attention instead of (T x T). Attention as at decode time
        (ttt_attention). Returns shifts 1..ttt_length."""
        ids, feats = batch.input_ids, batch.features  # (B, T), (B, T, 3H)
        H = self.target.hidden_size
        if feats is None or feats.shape[-1] != 3 * H:
            raise ValueError(f"peagle: the batch needs the features of aux layers "
                             f"{self.feature_layers} (width {3 * H}); "
                             f"got {getattr(feats, 'shape', None)}")
        B, T = ids.shape
        J = capped_steps("drafter.ttt_length", self.cfg.ttt_length, T)
        pos = torch.arange(T, device=ids.device)
        keys = batch.attention_mask[:, None, None, :].bool()  # (B, 1, 1, T): padding never seen
        causal = (pos[None, :] <= pos[:, None])[None, None] & keys  # (B, 1, T, T)
        anchors = self.mask_anchors(batch, J)  # (B, A) or None
        at, seen = pos.expand(B, T), causal  # mask anchors (B, A); their real keys (B, 1, A, T)
        if anchors is not None:
            at, seen = anchors, (pos[None, None, :] <= anchors[:, :, None])[:, None] & keys
        store: list[list] = [[] for _ in self.layers]  # per layer: (k, v) of each position
        # 1. the real positions: token t+1 (the last column a filler, never counted), feature t
        tok = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # (B, T)
        h = self.fuse(feats)  # (B, T, H)
        emb = self.target.embed_tokens()(tok).to(h.dtype)  # (B, T, H), frozen
        mask_emb, mask_h = self.mask_inputs(B, at.shape[1])  # (B, A, H) each
        preds = []
        for j in range(1, J + 1):
            # 2. j > 1: mask j-1 at each mask anchor t, at position t+j-1
            positions, mask = (pos.expand(B, T), causal) if j == 1 else (at + j - 1, seen)
            if j > 1:
                emb, h = mask_emb, mask_h
            out = self.run(emb, h, positions,
                            lambda i: lambda q, k, v: ttt_attention(q, k, v, store[i], mask))
            dense = j == 1 or anchors is None  # out (B, T, H): the head only where the loss reads it
            where = counted(batch, j) if dense else None  # (B, T)
            preds.append(DraftPrediction(logits=self.head(out if where is None else out[where]),
                                         at=where, shift=j, weight=self._weight(j),  # (M | B, A, Vd)
                                         anchors=None if dense else anchors))
        return preds

    # -- decoding: parallel drafts (drafters/parts/parallel.py) from one forward (parts/drafting.py) --
    @torch.no_grad()
    def draft_logits(self, state: DecodeState, k: int) -> torch.Tensor:
        """The k draft distributions (k, Vd) after state.tokens, from ONE forward over the new
        real positions and k-1 mask positions after them (at T-1 .. T+k-3); the cache keeps the
        real ones only."""
        masks = torch.cat(self.mask_inputs(1, k - 1), dim=-1)  # (1, k-1, 2H)
        h = self.drafting.after(state, masks)  # (1, k, H): the last real position, the masks
        return self.head(h[0]).float()  # (k, Vd)

    def trained_positions(self) -> int:
        return self.cfg.ttt_length

    def rows_round(self, slots, states, ks, sampling, generators, min_confidence
                   ) -> list[ChainProposal]:
        """The batched round: ONE forward for every row, over its new real positions and its k-1
        mask positions after them (padded, each row through its own cache); each row's chain is
        then drawn from its k distributions, as propose draws it."""
        ks = [parallel.trained_k(self, k) for k in ks]
        masks = torch.cat(self.mask_inputs(1, max(ks) - 1), dim=-1)[0]  # (max k - 1, 2H)
        ends = [int(s.tokens.shape[0]) - 2 for s in states]  # each row's last real position
        dev = masks.device
        tails = [(masks[:k - 1], e + 1 + torch.arange(k - 1, device=dev)) for k, e in zip(ks, ends)]
        h, rows, n = rows_forward(slots, states, tails)  # (B, Q, H)
        rows_keep(slots, rows, n)
        at = [(b, n[b] - 1 + i) for b, k in enumerate(ks) for i in range(k)]  # rows' draft positions
        logits = self.head(h[[b for b, _ in at], [j for _, j in at]]).float()  # (sum k, Vd)
        return parallel.draw_chains(self, logits.split(ks), ks, sampling, generators,
                                    min_confidence)
