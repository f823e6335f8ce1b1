"""Deterministic, resumable, rank-sharded batches of tokenised conversations.

The order of an epoch is a permutation seeded by (seed, epoch); a global batch of
batch_size * world_size conversations is cut from it and each rank takes its own disjoint slice,
so no conversation is seen twice per epoch across ranks. The position (epoch, cursor) goes into the
checkpoint, so a resumed run sees exactly the batches an uninterrupted run would.

group_by_length = G > 0: each run of G global batches of the permutation is sorted by length and
cut again, and the batches are shuffled (as transformers' LengthGroupedSampler), so a batch pads to
rows of similar length: less padding computed for nothing, the same conversations per epoch (a
ragged remainder of each run waits for a later epoch, as the epoch's tail does).
"""
from __future__ import annotations

import torch

from specdistill.data.dataset import pad_batch


class BatchIterator:
    def __init__(self, dataset, batch_size: int, seed: int, pad_id: int,
                 rank: int = 0, world_size: int = 1, group_by_length: int = 0) -> None:
        if len(dataset) < batch_size * world_size:
            raise ValueError(f"the training split has {len(dataset)} conversations, fewer than one "
                             f"global batch ({batch_size} x {world_size} ranks); use more data "
                             f"(data.max_conversations) or a smaller trainer.batch_size")
        self.dataset, self.batch_size, self.seed, self.pad_id = dataset, batch_size, seed, pad_id
        self.rank, self.world_size = rank, world_size
        self.group = group_by_length
        self.lengths = None
        if group_by_length:  # a datasets.Dataset's length column, else each row's ids
            self.lengths = (dataset["length"] if "length" in getattr(dataset, "column_names", ())
                            else [len(dataset[i]["input_ids"]) for i in range(len(dataset))])
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(len(self.dataset), generator=g).tolist()
        if not self.group:
            return order
        gb = self.batch_size * self.world_size
        batches = []
        for m in range(0, len(order), gb * self.group):  # runs of G global batches
            run = sorted(order[m:m + gb * self.group], key=lambda i: -self.lengths[i])
            batches += [run[b:b + gb] for b in range(0, len(run) - len(run) % gb, gb)]
        return [i for b in torch.randperm(len(batches), generator=g).tolist() for i in batches[b]]

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        global_bs = self.batch_size * self.world_size
        if self.cursor + global_bs > len(self._order):  # drop the ragged tail, start a new epoch
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        start = self.cursor + self.rank * self.batch_size
        idx = self._order[start:start + self.batch_size]
        self.cursor += global_bs
        rows = [self.dataset[i] for i in idx]
        batch = pad_batch(rows, self.pad_id)
        batch["index"] = torch.tensor(idx)  # dataset rows, for features captured offline
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)


def first_conversations(dataset, n: int | None):
    """The first n conversations of a split (None = all of it): what a data-scaling study trains
    on while the split's one capture (offline features, indexed by row) serves every n."""
    if n is None or n == len(dataset):
        return dataset
    if n > len(dataset):
        raise ValueError(f"trainer.train_conversations={n} but the train split has {len(dataset)} "
                         f"conversations; lower it, or raise data.max_conversations")
    return dataset.select(range(n))


def row_windows(trained: torch.Tensor, window: int | None) -> list[tuple[slice, float]]:
    """trainer.window: the consecutive spans of at most `window` positions a (B, T) micro-batch
    trains in, each with its share of the batch's trained positions (`trained`: 1 where a loss
    reads the token), so the windows' losses weighted by their shares average as the whole rows'
    would; spans with nothing trained are left out. One span, share 1, when the rows fit (or
    window is None). A drafter's anchors within its draft depth of a window's end lose the steps
    past it (a few per window)."""
    T = trained.shape[1]
    if window is None or T <= window:
        return [(slice(0, T), 1.0)]
    cuts = [slice(a, min(a + window, T)) for a in range(0, T, window)]
    counts = [float(trained[:, c].sum()) for c in cuts]
    total = sum(counts)
    if not total:  # nothing trained (a loss of 0 either way): one forward of the first window
        return [(cuts[0], 1.0)]
    return [(c, n / total) for c, n in zip(cuts, counts) if n]  # a span with no loss: skipped
