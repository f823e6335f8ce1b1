"""The trainer's simulated eval (decode/simulate.py): at each sampled assistant position the
accepted count is the longest prefix of the drafter's chain that the target's greedy continuation
agrees with, as one round of the decoder would count it."""
import pytest
import torch
from decode_toys import NoisyOracle, greedy_next, make_target

from specdistill.decode.accept import GREEDY
from specdistill.decode.simulate import accepted_lengths
from specdistill.drafters.base import DecodeState


def test_each_sampled_position_counts_the_drafts_the_target_agrees_with():
    target = make_target()
    ids = torch.randint(3, 60, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    mask = [0] * 10 + [1] * 30  # a prompt, then the answer
    got = accepted_lengths(target, NoisyOracle(target, noise=0.4, seed=1), ids, mask, k=4,
                           positions=100)  # more than the answer's positions: every one
    again = NoisyOracle(target, noise=0.4, seed=1)  # the same noise draws, in the same order
    want = []
    for t in reversed([t for t in range(len(ids) - 1) if mask[t + 1]]):  # descending, as it runs
        draft = again.propose(DecodeState(tokens=torch.tensor(ids[:t + 1])), 4, GREEDY).tokens
        prefix, n = torch.tensor(ids[:t + 1]), 0
        for tok in draft.tolist():  # a fresh forward per draft: the target's own verdict
            if greedy_next(target, prefix) != tok:
                break
            prefix, n = torch.cat([prefix, torch.tensor([tok])]), n + 1
        want.append((n, len(draft)))
    assert got == want
    assert {0, 4} <= {a for a, _ in got} and len({a for a, _ in got}) > 2  # teeth: mixed counts


def test_the_eval_splits_by_the_context_before_each_position():
    """simulate_acceptance's by_context: each drafted position counted in the bucket of the tokens
    before it (0-512, 512-2k, ...; empty buckets left out), with its own acceptance summary, and
    the buckets add up to the whole eval."""
    from specdistill.decode.simulate import by_context, sampled_positions, simulate_acceptance

    pairs = [(2, 3), (0, 3), (3, 3), (1, 2), (3, 3)]
    got = by_context(pairs, [10, 511, 512, 3000, 9000], k=3)
    assert [(b["bucket"], b["positions"], b["drafted"], b["accepted"]) for b in got] == [
        ("0-512", 2, 6, 2), ("512-2k", 1, 3, 3), ("2k-8k", 1, 2, 1), ("8k+", 1, 3, 3)]
    assert got[0]["acceptance"] == [0.5, 1.0, 0.0] and got[1]["sim_tau"] == 4.0
    target = make_target(max_pos=1024)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 60, (700,), generator=g).tolist(),
             "loss_mask": [0] * 100 + [1] * 600}, {"input_ids": [5] * 40, "loss_mask": [0] * 40}]
    res = simulate_acceptance(target, NoisyOracle(target, noise=0.4, seed=1), rows, k=3, positions=6)
    at = sampled_positions(rows[0]["loss_mask"], 6).tolist()  # 99 .. 698: 4 below 512, 2 above
    assert [b["bucket"] for b in res["by_context"]] == ["0-512", "512-2k"]
    assert [b["positions"] for b in res["by_context"]] == [sum(t < 512 for t in at),
                                                           sum(t >= 512 for t in at)] == [4, 2]
    assert sum(b["positions"] for b in res["by_context"]) == res["positions"]
    assert sum(b["drafted"] for b in res["by_context"]) == 6 * 3  # NoisyOracle drafts all k
    total = sum(b["accepted"] for b in res["by_context"])
    assert total == pytest.approx(res["mean_accepted"] * res["positions"])
