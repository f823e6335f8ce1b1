"""A mix of answers: the data file's own (ShareGPT's) and the target's own, trained on together.

    python -m train data=sharegpt_mix                  # conf/data/sharegpt_mix.yaml
    data = mix_chat_data(file_data, store.chat_data(eval_fraction, seed))
    feats = MixedFeatures(offline_features(...), store.features(layers))

The file's conversations are many-turn and varied; the target's answers are what the drafter will
be asked to draft. A mix trains on both within one job: the file's first `max_conversations`
conversations with their own answers (features captured as for `data=sharegpt`: the same capture
folder, so a job on the file alone has already paid for it), and the target's answers to the first
user turns of the conversations after those (data/selfgen.py, features written while generating).

Rows: the file's rows first, in their order (row i of the train split is row i of the file's train
split, which is what its capture is indexed by), then the target's; every row carries
`store_index` (-1 for a file row). The eval split is the file's held-out rows, then the target's.
"""
from __future__ import annotations

import logging

import datasets

from specdistill.data.capture import pad_features
from specdistill.data.dataset import ChatData
from specdistill.data.sharegpt import Counts

log = logging.getLogger(__name__)


def _with_store_index(ds: datasets.Dataset) -> datasets.Dataset:
    """A file split with the store's column: store_index -1 (no row of a self-generated store)."""
    return ds.add_column("store_index", [-1] * len(ds), feature=datasets.Value("int64"))


def mix_chat_data(file: ChatData, own: ChatData) -> ChatData:
    """The file's rows, then the target's (train and eval each); counts of both added up."""
    both = (file.counts, own.counts)
    dropped: dict[str, int] = {}
    for c in both:
        for reason, n in c.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
    counts = Counts(read=sum(c.read for c in both), kept=sum(c.kept for c in both), dropped=dropped,
                    truncated_tail_bytes=file.counts.truncated_tail_bytes)
    train = datasets.concatenate_datasets([_with_store_index(file.train), own.train])
    eval_ = datasets.concatenate_datasets([_with_store_index(file.eval), own.eval])
    log.info("mix: %d train / %d eval conversations with the file's answers, %d / %d with the target's",
             len(file.train), len(file.eval), len(own.train), len(own.eval))
    report = file.report.merged(own.report) if file.report and own.report else file.report or own.report
    return ChatData(train=train, eval=eval_, counts=counts, cache_path=own.cache_path, report=report)


class MixedFeatures:
    """The trainer's offline features of a mix: a file row's from the file's capture (indexed by its
    row in the file's train split), a target's row's from the self-generated store."""

    def __init__(self, file, own) -> None:
        # file: offline_features() of the file's train split (it checks the capture holds every row)
        self.file, self.own, self.n_file = file, own, len(file)

    def release(self) -> None:
        self.file.release()
        self.own.release()

    def batch(self, indices: list[int], rows: list[dict], T: int):
        """Right-padded (B, T, F) features and (B, T, H) final states of train rows `indices`."""
        got = []
        for i, r in zip(indices, rows):
            if int(r["store_index"]) >= 0:
                got.append(self.own.get(int(r["store_index"]), r["input_ids"]))
            elif i < self.n_file:
                got.append(self.file.get(i, r["input_ids"]))
            else:
                raise ValueError(f"train row {i} is a file row past the mix's {self.n_file} file rows")
        return pad_features(got, T)
