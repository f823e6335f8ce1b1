"""Simulated acceptance on held-out conversations (the trainer's periodic eval). The acceptance
rules themselves, used by the decoder, live in decode/accept.py.

At sampled assistant positions t of a conversation, the drafter sees the true prefix tokens[:t+1]
(and the target's features of it), drafts k tokens unrolled on its OWN outputs, and the target
verifies them greedily in one forward, exactly as one round of the real decoder would. From the
accepted lengths we get the per-position acceptance rate acc_i = P(draft i accepted | drafts
1..i-1 accepted) and the simulated tau = 1 + sum_k prod_{i<=k} acc_i (tokens per target forward,
bonus token included, comparable with the decoder's `tau`).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from specdistill.decode.accept import GREEDY
from specdistill.drafters.base import DecodeState, Drafter


# held-out positions by how much context precedes them: [start, end) token ranges (None: open)
CONTEXT_BUCKETS = ((0, 512), (512, 2048), (2048, 8192), (8192, None))


def sampled_positions(loss_mask: list[int], positions: int) -> torch.Tensor:
    """The (ascending) positions t of a conversation the eval drafts at: up to `positions` evenly
    spread over those whose next token is an assistant token."""
    mask = torch.as_tensor(loss_mask)
    cand = (mask[1:] == 1).nonzero().flatten()  # t such that token t+1 is an assistant token
    if len(cand) == 0:
        return cand
    return cand[torch.linspace(0, len(cand) - 1, min(positions, len(cand))).long()].unique()


def bucket_label(start: int, end: int | None) -> str:
    """'0-512', '512-2k', '8k+': a context bucket's name in logs and reports."""
    def k(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
    return f"{k(start)}+" if end is None else f"{k(start)}-{k(end)}"


def by_context(pairs: list[tuple[int, int]], at: list[int], k: int) -> list[dict[str, object]]:
    """acceptance_summary of the (accepted, proposed) pairs drafted at positions `at`, per
    CONTEXT_BUCKETS bucket that holds any: its label, range, positions, draft tokens proposed
    and accepted, and the summary's acceptance, sim_tau, mean_accepted."""
    out = []
    for start, end in CONTEXT_BUCKETS:
        got = [p for p, t in zip(pairs, at) if t >= start and (end is None or t < end)]
        if got:
            out.append({"bucket": bucket_label(start, end), "start": start, "end": end,
                        "drafted": sum(n for _, n in got), "accepted": sum(a for a, _ in got),
                        **acceptance_summary(got, k)})
    return out


@torch.inference_mode()
def accepted_lengths(target, drafter: Drafter, input_ids: list[int], loss_mask: list[int], k: int,
                     positions: int, pick: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """(accepted, proposed) for up to `positions` assistant positions of one conversation, one pair
    per position of `pick` (default: sampled_positions) in descending position order."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=target.device)
    if pick is None:
        pick = sampled_positions(loss_mask, positions)
    if len(pick) == 0:
        return []
    last = int(pick.max())
    # 1. One target forward over the prefix up to the last sampled position: features + cache,
    # and the LM head only at the sampled positions (a conversation's ~1 k positions cost a fifth
    # of the forward over the full vocabulary, and 8 of them are read).
    cache = DynamicCache(config=target.config)
    out = target.forward(ids[None, :last + 1], layers=drafter.feature_layers, cache=cache,
                         logits_to_keep=pick.to(target.device))
    argmax0 = torch.full((last + 1,), -1, dtype=torch.long, device=target.device)
    argmax0[pick.to(target.device)] = out.logits[0].argmax(-1)  # the target's greedy tokens there
    feats = out.features[0] if out.features is not None else None  # (last+1, F)
    results = []
    for t in pick.flip(0).tolist():  # descending, so cropping the cache never loses what we need
        # 2. Draft k tokens from the true prefix, unrolled on the drafter's own outputs.
        drafter.reset()
        state = DecodeState(tokens=ids[:t + 1], features=None if feats is None else feats[:t])
        draft = drafter.propose(state, k, GREEDY).tokens.to(target.device)  # (k',)
        # 3. Verify: the target's argmax after prefix + drafts[:i] for every i, in one forward.
        cache.crop(-(cache.get_seq_length() - (t + 1)))
        if len(draft) > 1:
            logits = target.forward(draft[None, :-1], cache=cache).logits[0]  # (k'-1, V)
            want = torch.cat([argmax0[t:t + 1], logits.argmax(-1)])  # (k',)
        else:
            want = argmax0[t:t + 1]
        ok = (draft == want[: len(draft)]).long()
        results.append((int(ok.cumprod(0).sum()), len(draft)))
    return results


def acceptance_summary(pairs: list[tuple[int, int]], k: int) -> dict[str, object]:
    """Per-position conditional acceptance and the simulated tau from (accepted, proposed) pairs."""
    acc = []
    for i in range(1, k + 1):
        reached = sum(1 for a, n in pairs if a >= i - 1 and n >= i)  # draft i was verified
        accepted = sum(1 for a, n in pairs if a >= i)
        acc.append(accepted / reached if reached else None)  # None: not measured
    if not any(n for _, n in pairs):  # no position, or no draft proposed: nothing measured
        return {"acceptance": acc, "sim_tau": None, "mean_accepted": None, "positions": len(pairs)}
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a or 0.0  # a position no draft reached adds nothing
        tau += run
    mean_acc = sum(a for a, _ in pairs) / len(pairs)
    return {"acceptance": acc, "sim_tau": tau, "mean_accepted": mean_acc, "positions": len(pairs)}


def simulate_acceptance(target, drafter: Drafter, conversations, k: int = 5,
                        positions: int = 8) -> dict[str, object]:
    """Run `accepted_lengths` over conversations (rows with input_ids, loss_mask) and summarise,
    overall and by the context before each position ("by_context": by_context's buckets)."""
    pairs: list[tuple[int, int]] = []
    at: list[int] = []  # the position of each pair
    was_training = drafter.training
    drafter.eval()
    try:
        for row in conversations:
            pick = sampled_positions(row["loss_mask"], positions)
            pairs += accepted_lengths(target, drafter, row["input_ids"], row["loss_mask"], k,
                                      positions, pick)
            at += pick.flip(0).tolist()  # accepted_lengths' order: last position first
    finally:
        drafter.train(was_training)
    return {**acceptance_summary(pairs, k), "by_context": by_context(pairs, at, k)}
