"""The target answers a batch of prompts, and its hidden states of every token come with the answers.

    out = generate_with_features(model, prompts, max_new_tokens=256, eos_ids={2}, layers=(2, 15, 27))
    out[i].answer      # (n_i,) the generated ids (ending with an EOS id unless the budget ran out)
    out[i].features    # (P_i + n_i, F) the hidden states of `layers` at every position, or None
    out[i].final       # (P_i + n_i, H) the final-normed hidden state (what the LM head reads)

Why one pass: a drafter trained on the target's own answers needs the target's features of the
prompt AND of the answer. Capturing them afterwards costs one more forward over every token
(data/capture.py); here they come out of the forwards that write the answer: the prefill gives the
prompt's, and decode step j, which feeds the j-th answer token, gives that token's. An answer that
ends in EOS gets one more step for the EOS itself (its features are trained on too).

How it stays fast on CPUs (measured in BENCHMARKS.md "The target's own answers"):
1. One static KV cache per batch (transformers' StaticCache: written in place, no per-step torch.cat
   of a growing cache), prompts left-padded to the batch's longest, positions counted per row.
2. Logits of the last position only, from the final hidden state the step already computed.
3. Rows that finish leave the batch: when fewer than `compact_below` of the rows still generate, the
   cache, mask and positions are cut to the live rows (one gather), so a batch does not run at full
   width until its longest answer ends.
Greedy by default (temperature 0); with temperature > 0 each row samples with its own generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import StaticCache


@dataclass
class Answer:
    answer: torch.Tensor  # (n,) generated ids
    features: Optional[torch.Tensor]  # (P + n, F) hidden states of the asked layers
    final: torch.Tensor  # (P + n, H) final-normed hidden state
    ended: bool  # True when the answer ends with an EOS id (False: the budget ran out)


def _select_rows(cache: StaticCache, keep: torch.Tensor) -> None:
    """Keep only the batch rows `keep` of a static cache (StaticLayer has no batch_select)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.keys = layer.keys.index_select(0, keep)
            layer.values = layer.values.index_select(0, keep)
            layer.batch_size = len(keep)


def _pick(logits: torch.Tensor, temperature: float, gens: list[torch.Generator] | None
          ) -> torch.Tensor:
    """(B, V) -> (B,) next ids: argmax, or one sample per row from its own generator."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in zip(probs, gens)])


class _Rows:
    """The per-row state of one batch: what each row wrote, its hidden states so far (prompt first,
    then one per fed token), whether it still writes, and which batch row holds it."""

    def __init__(self, prompts: list[torch.Tensor], layers: tuple[int, ...]) -> None:
        self.P = max(len(p) for p in prompts)
        self.pad = [self.P - len(p) for p in prompts]  # left padding of each row
        self.layers = layers
        self.answers: list[list[int]] = [[] for _ in prompts]
        self.feats: list[list[torch.Tensor]] = [[] for _ in prompts]
        self.finals: list[list[torch.Tensor]] = [[] for _ in prompts]
        self.eos = [False] * len(prompts)  # the answer ended with an EOS id
        self.done = [False] * len(prompts)  # EOS fed, or the budget written
        self.live = list(range(len(prompts)))  # original row of each batch row

    def record(self, hidden: tuple[torch.Tensor, ...], batch_rows: Sequence[int],
               prefill: bool) -> None:
        """Append the hidden states of batch rows `batch_rows`: the prompt's (prefill, without the
        padding) or the fed token's."""
        final = hidden[-1]  # (b, q, H)
        feats = torch.cat([hidden[i] for i in self.layers], -1) if self.layers else None
        for b in batch_rows:
            r = self.live[b]
            s = self.pad[r] if prefill else -1
            self.finals[r].append(final[b, s:].cpu())
            if feats is not None:
                self.feats[r].append(feats[b, s:].cpu())

    def result(self, r: int) -> Answer:
        feats = torch.cat(self.feats[r]) if self.layers else None
        return Answer(torch.tensor(self.answers[r], dtype=torch.long), feats,
                      torch.cat(self.finals[r]), self.eos[r])


@torch.inference_mode()
def generate_with_features(model, prompts: Sequence[torch.Tensor | Sequence[int]], *,
                           max_new_tokens: int, eos_ids: set[int], layers: Sequence[int] = (),
                           pad_id: int = 0, temperature: float = 0.0,
                           generators: list[torch.Generator] | None = None,
                           compact_below: float = 0.75) -> list[Answer]:
    """Answer every prompt (one batch; the caller sizes it) with `model` (an HF causal LM);
    `layers` index HF hidden_states (0 = embeddings, i = output of layer i); the final-normed
    state is always returned."""
    prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    dev = next(model.parameters()).device
    rows = _Rows(prompts, tuple(layers))
    B, P = len(prompts), rows.P
    width = P + max_new_tokens  # answer token j is fed at step j, into column P + j - 1
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.long)
    for r, p in enumerate(prompts):  # 1. left-padded prompts, one static cache
        ids[r, rows.pad[r]:] = p
        mask[r, rows.pad[r]:P] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    cache = StaticCache(config=model.config, max_cache_len=width)
    out = model.model(ids, attention_mask=mask[:, :P], cache=cache, output_hidden_states=True,
                      position_ids=(mask[:, :P].cumsum(-1) - 1).clamp(min=0),
                      cache_position=torch.arange(P, device=dev))
    rows.record(out.hidden_states, range(B), prefill=True)
    positions = mask[:, :P].sum(-1)  # (B,) the position of each row's next token
    gens = list(generators) if generators is not None else None
    nxt = _pick(model.lm_head(out.hidden_states[-1][:, -1]), temperature, gens)  # 2. (B,)
    eos = torch.tensor(sorted(eos_ids), device=dev)
    for step in range(1, max_new_tokens + 1):
        writing = [b for b, r in enumerate(rows.live) if not rows.done[r]]
        if not writing:
            break
        if len(writing) < compact_below * len(rows.live):  # 3. finished rows leave the batch
            keep = torch.tensor(writing, device=dev)
            _select_rows(cache, keep)
            mask, positions, nxt = mask[keep], positions[keep], nxt[keep]
            rows.live = [rows.live[b] for b in writing]
            gens = [gens[b] for b in writing] if gens is not None else None
            writing = list(range(len(writing)))
        live = torch.zeros(len(rows.live), dtype=torch.bool, device=dev)
        live[writing] = True
        col = P + step - 1
        mask[:, col] = live.long()  # a finished row's column stays masked (its input is padding)
        fed = torch.where(live, nxt, torch.full_like(nxt, pad_id))
        out = model.model(fed[:, None], attention_mask=mask[:, :col + 1], cache=cache,
                          position_ids=positions[:, None], output_hidden_states=True,
                          cache_position=torch.tensor([col], device=dev))
        positions = positions + live.long()
        rows.record(out.hidden_states, writing, prefill=False)
        is_eos = torch.isin(fed, eos).tolist()
        for b in writing:  # the fed token joins the answer; EOS or the budget ends the row
            r = rows.live[b]
            rows.answers[r].append(int(fed[b]))
            rows.eos[r] = bool(is_eos[b])
            rows.done[r] = rows.eos[r] or step == max_new_tokens
        nxt = _pick(model.lm_head(out.hidden_states[-1][:, -1]), temperature, gens)
    return [rows.result(r) for r in range(B)]
