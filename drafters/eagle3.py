"""EAGLE-3: a drafter over three fused target layers, trained with the training-time test.

At anchor t the drafter reads the target's hidden states of three layers (low / mid / high) at t and
the embedding of token t+1, and predicts token t+2; later steps read the drafter's own output. The
network (fusion, layers, head; its formulas) and its decoding are drafters/parts/fused.py's, shared with
P-EAGLE; the engines' names for its weights are drafters/parts/fused_layouts.py's. This module trains it
and registers the engines' layouts.

Training-time test (`forward_train`): `ttt_length` steps unrolled on the drafter's own outputs, each
with the attention it sees at decode time: step j at anchor t (position t+j-1) attends to step 1's
keys at anchors <= t (real features, causal) and to the keys of steps 2..j at anchor t only. The
later blocks are diagonal, so they are scored as one dot product per query (SpecForge's trick)
instead of a (T x jT) mask: each step costs one T x T attention whatever j is.

Aux layers use our HF `hidden_states` indexing (0 = embeddings, i = output of layer i). vLLM (and
speculators) capture the INPUT of layer id = hidden_states[id], SGLang the OUTPUT = hidden_states[
id + 1]: the exports below write each engine's ids for the same layers.

Sources read (2026-11-30): SGLang srt/models/llama_eagle3.py @03d5a777 and llama.py (capture
= id + 1); vLLM model_executor/models/llama_eagle3.py @00bd1493 (+ _get_eagle3_aux_layers_from_
config; its speculators path defaults norm_before_residual to true); speculators 0.9.0 (PyPI wheel,
models/eagle3/; the slow test loads our export there); SpecForge llama3_eagle.py @01dd7144.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdistill.drafters.base import DraftPrediction, TrainBatch, register
from specdistill.drafters.parts.anchors import capped_steps, counted
from specdistill.drafters.parts.attention import ttt_attention
from specdistill.drafters.parts.fused import FusedConfig, FusedDrafter
from specdistill.drafters.parts.fused_layouts import (
    engine_config,
    engine_refusal,
    engine_state,
    state_from_engine,
)
from specdistill.drafters.parts.layouts import WEIGHTS, ExportLayout, torch_dtype


@dataclass
class Eagle3Config(FusedConfig):
    """EAGLE-3 drafter settings: the fused network's (drafters/parts/fused.py FusedConfig)."""

    name: str = "eagle3"  # registry key


class Eagle3(FusedDrafter):  # registered at the end of the module, with its export layouts
    """EAGLE-3 drafter: the fused-feature network (drafters/parts/fused.py) trained with the
    training-time test."""

    # -- training ---------------------------------------------------------------------------------
    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """`ttt_length` steps (shifts 1, 2, ...): step 1 reads the target's fused features, step
        j > 1 its own step j-1 outputs at the same anchor and the real token t+j. Distribution loss
        only (features=None)."""
        return self._unroll(batch, self.cfg.ttt_length, own_tokens=False)

    def forward_own(self, batch: TrainBatch, steps: int,
                    at: torch.Tensor | None = None) -> list[DraftPrediction]:
        """As forward_train over `steps` steps, but step j > 1 is fed the drafter's own draft of step
        j-1 at the same anchor (its argmax, as a greedy chain drafts), kept in
        DraftPrediction.inputs. With `at` (B, T) bool, steps j > 1 run (layers and head) only at
        those anchors, the ones the target scores (train/on_policy_heads.py): logits (M, Vd),
        row-major, DraftPrediction.scored = at; each still attends to all of step 1's keys."""
        return self._unroll(batch, steps, own_tokens=True, at=at)

    def _unroll(self, batch: TrainBatch, steps: int, own_tokens: bool,
                at: torch.Tensor | None = None) -> list[DraftPrediction]:
        ids, feats = batch.input_ids, batch.features  # (B, T), (B, T, 3H)
        H = self.target.hidden_size
        if feats is None or feats.shape[-1] != 3 * H:
            raise ValueError(f"eagle3: the batch needs the features of aux layers "
                             f"{self.feature_layers} (width {3 * H}); got {getattr(feats, 'shape', None)}")
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)
        keys = batch.attention_mask[:, None, None, :].bool()  # (B, 1, 1, T): never attend to padding
        causal = (pos[None, :] <= pos[:, None])[None, None] & keys  # (B, 1, T, T)
        store: list[list] = [[] for _ in self.layers]  # per layer: (k, v) of each step
        h, preds = self.fuse(feats), []
        idx = valid = None  # on-policy with `at`: steps > 1 run at the anchors only (B, A)
        for j in range(1, capped_steps("drafter.ttt_length", steps, T) + 1):
            # token t+j; the last j columns get a filler id: those anchors are never counted
            tok = torch.cat([ids[:, j:], ids[:, -1:].expand(B, min(j, T))], dim=1)[:, :T]
            if own_tokens and preds:  # the previous step's draft at each anchor, as target ids
                d = preds[-1].logits.detach().argmax(-1)  # (B, T), (N,) at step 1's `at`, (M,) at `at`
                d = d if self.d2t is None else self.d2t[d]
                if preds[-1].at is not None:  # step 1 ran at its counted anchors, which hold `at`
                    d = d[at[preds[-1].at]]  # (M,)
                tok = tok.masked_scatter(at, d) if d.dim() == 1 else d
            if own_tokens and at is not None and j > 1 and not at.any():  # nothing scored
                preds.append(DraftPrediction(logits=self.head(h[:, :0]).flatten(0, 1), shift=j,
                                             weight=self.cfg.ttt_decay ** (j - 1), inputs=tok,
                                             scored=at))
                continue
            if own_tokens and at is not None and j > 1:  # the scored rows' anchors only
                if idx is None:  # their step-1 states, keys and causal rows
                    scored = at.any(-1).nonzero().flatten()  # (R,) rows with an anchor
                    idx, valid = anchor_index(at[scored])  # (R, A) each
                    h = h[scored].gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))  # (R, A, H)
                    rows = causal.expand(B, 1, T, T)[scored].gather(
                        2, idx[:, None, :, None].expand(-1, 1, -1, T))  # (R, 1, A, T)
                    for kv in store:  # step 1's keys and values of the scored rows
                        kv[0] = (kv[0][0][scored], kv[0][1][scored])
                emb = self.target.embed_tokens()(tok[scored].gather(1, idx)).to(h.dtype)  # (R, A, H)
                h = self.run(emb, h, idx + j - 1,
                             lambda i: lambda q, k, v: ttt_attention(q, k, v, store[i], rows))
                logits, where = self.head(h[valid]), None  # (M, Vd), row-major as at.nonzero()
            else:
                emb = self.target.embed_tokens()(tok).to(h.dtype)  # (B, T, H), frozen
                h = self.run(emb, h, (pos + j - 1).expand(B, T),
                             lambda i: lambda q, k, v: ttt_attention(q, k, v, store[i], causal))
                # the head only where the loss reads it (and step 1 drafts for the own steps);
                # a dense own unroll drafts at every anchor
                where = None if own_tokens and at is None else counted(batch, j)  # (B, T)
                where = where | at if own_tokens and where is not None else where
                logits = self.head(h) if where is None else self.head(h[where])  # (B, T | M, Vd)
            preds.append(DraftPrediction(logits=logits, at=where, shift=j,
                                         weight=self.cfg.ttt_decay ** (j - 1),
                                         inputs=tok if own_tokens else None,
                                         scored=at if idx is not None else None))
        return preds


def anchor_index(at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) bool anchors -> each row's anchors in order (B, A) (A = the most in a row, at least
    1; the rest filled with anchor 0) and which of them are real (B, A) bool."""
    counts = at.sum(-1)  # (B,)
    A = max(int(counts.max()) if at.numel() else 0, 1)
    valid = torch.arange(A, device=at.device)[None] < counts[:, None]  # (B, A)
    idx = torch.zeros(at.shape[0], A, dtype=torch.long, device=at.device)
    idx[valid] = at.nonzero(as_tuple=True)[1]  # row-major: row b's anchors, ascending
    return idx, valid


# == Export: the engines' EAGLE-3 layouts (names and configs: drafters/parts/fused_layouts.py). ==
def _layout(engine: str, summary: str, usage: str) -> ExportLayout:
    """The export layout of `engine`: engine_state / engine_config written, state_from_engine read."""
    def write(drafter, state, ctx):
        tensors = engine_state(drafter, engine, state, torch_dtype(ctx.dtype))
        config = engine_config(drafter, engine, ctx.k, ctx.meta.get("base_model"),
                               ctx.dtype)
        return {**config, **ctx.common()}, {WEIGHTS: tensors}

    def read(files, dcfg, vocab_size):
        return state_from_engine(files[WEIGHTS], engine, dcfg.get("draft_vocab_size") is not None)

    return ExportLayout(format=engine, summary=summary, usage=usage, write=write, read=read,
                        check=lambda dcfg: engine_refusal(dcfg, engine), tags=(engine, "eagle3"),
                        serving=SERVING.get(engine, {}))


# who serves which layout (vLLM reads its own and the speculators format; llama.cpp converts both)
SERVING = {engine: {"vllm": {"method": "eagle3"},
                    "llamacpp": {"spec_type": "draft-eagle3", "needs_target": True}}
           for engine in ("vllm", "speculators")}


LAYOUTS = (
    _layout("sglang", "SGLang's EAGLE-3 layout (LlamaForCausalLMEagle3; aux-layer ids in "
            "eagle_config, one below ours: SGLang captures layer outputs).",
            "python -m sglang.launch_server --model-path {base} --speculative-algorithm EAGLE3 "
            "--speculative-draft-model-path {path} --speculative-num-steps {k} "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens {k1}"),
    _layout("vllm", "vLLM's EAGLE-3 layout (LlamaForCausalLMEagle3; aux-layer ids = ours: vLLM "
            "captures layer inputs).",
            "vllm serve {base} --speculative-config "
            "'{{\"method\": \"eagle3\", \"model\": \"{path}\", \"num_speculative_tokens\": {k}}}'"),
    _layout("speculators", "the speculators library's EAGLE-3 format (speculators_model_type "
            "eagle3, Eagle3DraftModel; vLLM serves it directly).",
            "vllm serve {path}      # or in Python:\n"
            "from speculators.models.eagle3 import Eagle3DraftModel\n"
            "model = Eagle3DraftModel.from_pretrained('{path}')"))
register("eagle3", config=Eagle3Config, layouts=LAYOUTS)(Eagle3)
