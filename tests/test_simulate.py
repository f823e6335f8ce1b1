"""The trainer's simulated eval (decode/simulate.py): at each sampled assistant position the
accepted count is the longest prefix of the drafter's chain that the target's greedy continuation
agrees with, as one round of the decoder would count it."""
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
