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
4. The prompts are prefilled `prefill_rows` at a time, each part padded to its own longest prompt,
   and the parts' caches joined for the decode steps: a batch large enough to make the one-token
   steps efficient (128 rows: 1.1-1.8x the tokens/s of 32 on a 2-core CPU) would otherwise prefill
   in one forward that holds every layer's hidden states of every prompt token (5.4 GB peak at 128
   rows of 292-384 tokens, against 2.1 GB at 32).
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
        self.prompts = prompts
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
               prefill_rows: Sequence[int] | None = None) -> None:
        """Append the hidden states of `batch_rows` (indices into `hidden`): the fed token's, or
        with `prefill_rows` (their rows, each left-padded to the forward's width) the prompt's
        without the padding."""
        final = hidden[-1]  # (b, q, H)
        feats = torch.cat([hidden[i] for i in self.layers], -1) if self.layers else None
        for j, b in enumerate(batch_rows):
            r = self.live[b] if prefill_rows is None else prefill_rows[j]
            s = final.shape[1] - len(self.prompts[r]) if prefill_rows is not None else -1
            self.finals[r].append(final[b, s:].cpu())
            if feats is not None:
                self.feats[r].append(feats[b, s:].cpu())

    def result(self, r: int) -> Answer:
        feats = torch.cat(self.feats[r]) if self.layers else None
        return Answer(torch.tensor(self.answers[r], dtype=torch.long), feats,
                      torch.cat(self.finals[r]), self.eos[r])


def _prefill(model, rows: _Rows, ids: torch.Tensor, mask: torch.Tensor, width: int, part: int
             ) -> tuple[StaticCache, torch.Tensor]:
    """Prefill the left-padded prompts `ids` (B, P) `part` rows at a time, each part cut to its own
    longest prompt, and record their hidden states. Returns one static cache of `width` columns
    holding every row (the prompts' keys and values in columns up to P; padding columns zero and
    masked out) and (B, H) the final state of each prompt's last token."""
    B, P = ids.shape
    dev = ids.device
    cache = StaticCache(config=model.config, max_cache_len=width)
    if part >= B or any(layer.is_sliding for layer in cache.layers):  # one forward, into the batch's
        parts = [(range(B), cache, 0)]
    else:
        parts = []
        for s in range(0, B, part):
            span = range(s, min(B, s + part))
            cut = P - max(len(rows.prompts[r]) for r in span)  # padding columns the part skips
            parts.append((span, StaticCache(config=model.config, max_cache_len=P - cut), cut))
    last = []
    for span, c, cut in parts:
        sub, m = ids[span.start:span.stop, cut:], mask[span.start:span.stop, cut:]
        out = model.model(sub, attention_mask=m, cache=c, output_hidden_states=True,
                          position_ids=(m.cumsum(-1) - 1).clamp(min=0),
                          cache_position=torch.arange(P - cut, device=dev))
        rows.record(out.hidden_states, range(len(span)), prefill_rows=list(span))
        last.append(out.hidden_states[-1][:, -1])
        del out
    if len(parts) > 1:  # join the parts' caches into the batch's
        for i, layer in enumerate(cache.layers):
            k, v = parts[0][1].layers[i].keys, parts[0][1].layers[i].values
            layer.lazy_initialization(k.new_empty(B, k.shape[1], 0, k.shape[3]),
                                      v.new_empty(B, v.shape[1], 0, v.shape[3]))  # zeros, B rows
            for span, c, cut in parts:
                layer.keys[span.start:span.stop, :, cut:P] = c.layers[i].keys
                layer.values[span.start:span.stop, :, cut:P] = c.layers[i].values
            layer.cumulative_length.fill_(P)
    return cache, torch.cat(last)


@torch.inference_mode()
def generate_with_features(model, prompts: Sequence[torch.Tensor | Sequence[int]], *,
                           max_new_tokens: int, eos_ids: set[int], layers: Sequence[int] = (),
                           pad_id: int = 0, temperature: float = 0.0,
                           generators: list[torch.Generator] | None = None,
                           compact_below: float = 0.75, prefill_rows: int | None = 32
                           ) -> list[Answer]:
    """Answer every prompt (one batch; the caller sizes it) with `model` (an HF causal LM);
    `layers` index HF hidden_states (0 = embeddings, i = output of layer i); the final-normed
    state is always returned. prefill_rows: prompts per prefill forward (None = all at once)."""
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
    cache, last = _prefill(model, rows, ids, mask[:, :P], width, prefill_rows or B)  # 4.
    positions = mask[:, :P].sum(-1)  # (B,) the position of each row's next token
    gens = list(generators) if generators is not None else None
    nxt = _pick(model.lm_head(last), temperature, gens)  # 2. (B,)
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
        rows.record(out.hidden_states, writing)
        is_eos = torch.isin(fed, eos).tolist()
        for b in writing:  # the fed token joins the answer; EOS or the budget ends the row
            r = rows.live[b]
            rows.answers[r].append(int(fed[b]))
            rows.eos[r] = bool(is_eos[b])
            rows.done[r] = rows.eos[r] or step == max_new_tokens
        nxt = _pick(model.lm_head(out.hidden_states[-1][:, -1]), temperature, gens)
    return [rows.result(r) for r in range(B)]
