"""The tokenised chat dataset: read -> normalise -> render + mask -> cache -> train/eval split.

`load_chat_dataset(cfg, tokenizer)` returns `ChatData` whose `.train` / `.eval` are
`datasets.Dataset`s with columns
    id         str         conversation id (record `id`, else a content hash)
    input_ids  list[int32] (T,) T <= max_length, the rendered conversation
    loss_mask  list[int8]  (T,) 1 on assistant content + end-of-turn tokens (see data/chat.py)
    length     int32       T
and `.counts` (what was read, kept and dropped, and why).

First run, in two `datasets` passes that keep memory low (rows stream to Arrow files on disk):
  1. `Dataset.from_generator` streams normalised conversations out of the file (data/sharegpt.py);
  2. a batched `map` (num_proc workers) renders, tokenises and masks them (data/chat.py).
The result is saved with `save_to_disk` into `<cache>/data/<key>`: written to a temporary folder
first and renamed into place, so a crash never leaves a half-written cache. The key hashes everything
the rows depend on (tokenizer vocab + special tokens, chat template, max_length, max_conversations,
the data file's sha256, LOADER_VERSION); a later run with the same key loads it and does no work.

The eval split is chosen by a hash of the conversation id (salted with `seed`), so it is the same
on every machine and run, never overlaps train, and does not depend on file order or the cache.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import datasets
import torch

from specdistill.cli.ranges import MAX_BATCH, MAX_COUNT, MAX_TEMPERATURE, MAX_THREADS, MAX_TOKENS, SEED, rng
from specdistill.data import quiet
from specdistill.data.assets import asset_path
from specdistill.data.chat import Template, encode_chats, trains
from specdistill.data.report import REPORT_FILE, DataReport
from specdistill.data.sharegpt import Counts, DataFormatError, iter_conversations
from specdistill.target.model import cache_root, file_sha256

log = logging.getLogger(__name__)

# bump when a change to data/ changes the rows or what the cache holds; old caches are then ignored
# (2: rows as served, several per conversation; messages in every OpenAI form; the data report)
LOADER_VERSION = 2
SPLIT_BUCKETS = 10_000  # eval_fraction resolution of the id-hash split
# messages and tools travel as JSON: every OpenAI message form (parts, tool_calls, ...) intact
RAW_FEATURES = datasets.Features({"id": datasets.Value("string"), "messages": datasets.Value("string"),
                                  "tools": datasets.Value("string")})
FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
    "length": datasets.Value("int32"),
})


@dataclass
class RegenerateSettings:
    """Self-distillation: the target writes the assistant answers itself (data/regenerate.py)."""

    # source conversations to regenerate (None = all)
    limit: Optional[int] = rng(1000, 1, MAX_COUNT)
    # assistant answers regenerated per conversation (later turns are cut)
    max_turns: int = rng(1, 1, 1000)
    batch_size: int = rng(8, 1, MAX_BATCH)  # conversations per generate call
    max_new_tokens: int = rng(512, 1, MAX_TOKENS)  # budget per answer
    # conversations whose context is longer are skipped (counted)
    max_prompt_tokens: int = rng(1536, 1, MAX_TOKENS)
    temperature: float = rng(0.0, 0, MAX_TEMPERATURE)  # 0 = greedy answers; > 0 samples (diversity)
    seed: int = rng(0, *SEED)  # sampling seed
    dtype: Optional[str] = None  # generate with a copy of the target in this dtype (None = target.dtype);
    # bfloat16: ~2.6x faster than float32 on CPUs with AVX512-BF16 (answers are bf16 greedy)


@dataclass
class SelfGenSettings:
    """data.selfgen: train on the target's own answers to the data's first user turns."""

    # conversations whose first user turn is answered (None = all)
    prompts: Optional[int] = rng(1500, 1, MAX_COUNT)
    max_new_tokens: int = rng(256, 1, MAX_TOKENS)  # answer budget (SmolLM2 often loops to it)
    max_prompt_tokens: int = rng(384, 1, MAX_TOKENS)  # longer prompts are skipped (counted), not cut
    # prompts per generation batch (one shard each); 128: 1.5x the tokens/s of 32 on 2 CPU cores
    # (BENCHMARKS.md "The target's own answers at batch 128"), prefilled 32 at a time
    batch_size: int = rng(128, 1, MAX_BATCH)
    # the dtype the target generates in: auto = bfloat16 where the CPU/GPU runs it natively (what
    # `python -m decode` serves at, so the answers are the ones the drafter will be asked to draft)
    dtype: str = "auto"
    # 0 = greedy answers (the eval decodes greedily); > 0 samples
    temperature: float = rng(0.0, 0, MAX_TEMPERATURE)
    seed: int = rng(0, *SEED)  # sampling seed (row i of the store samples with seed + i)
    compact_below: float = rng(0.75, 0, 1)  # finished rows leave the batch once fewer than this share write
    features_dtype: str = "bfloat16"  # storage of the hidden states: bfloat16 | float32
    # True: a mix. Train on the file's own answers too (its first max_conversations conversations cut
    # at max_length, their features captured as with data=sharegpt), then on the target's answers
    # to the first turns of the conversations after those (data/mix.py)
    mix: bool = False
    # records of the file passed over before the first answered prompt; None: none, or in a mix the
    # records the file's answers came from (so no prompt is trained on twice)
    skip: Optional[int] = rng(None, 0, MAX_COUNT)


@dataclass
class DataConfig:
    """Which chat data to train on and how to tokenise it (Hydra schema of the `data` group)."""

    kind: str = "sharegpt"  # "sharegpt" (packaged ShareGPT V3, or `path`) | "file" (needs `path`)
    path: Optional[str] = None  # .json/.jsonl/.parquet with ShareGPT or OpenAI records; None = packaged
    # tokens per conversation; longer ones are cut, all-cut ones dropped
    max_length: int = rng(2048, 2, MAX_TOKENS)
    # share of conversations held out for eval, chosen by id hash
    eval_fraction: float = rng(0.02, 0, 1, hi_open=True)
    # use only the first N kept conversations in file order
    max_conversations: Optional[int] = rng(None, 1, MAX_COUNT)
    cache_dir: str = "~/.cache/specdistill"  # tokenised cache root (env SPECDISTILL_CACHE wins)
    # processes for tokenisation (the Rust tokenizer already uses every core)
    num_proc: int = rng(1, 1, MAX_THREADS)
    seed: int = rng(0, *SEED)  # salt of the id hash that picks the eval split
    # set: train on the target's own answers to these conversations' user turns (regenerated once
    # into the cache, resumable) instead of the answers in the file; None: the file as written
    regenerate: Optional[RegenerateSettings] = None
    # set: train on the target's own answers to the first user turns, generated with their
    # features in one pass (data/selfgen.py; cached, resumable); None: the file's answers
    selfgen: Optional[SelfGenSettings] = None
    # extra arguments of every apply_chat_template call (training rows, regeneration, self-
    # generation), e.g. +data.template_kwargs.enable_thinking=false for a Qwen3 target served without
    # thinking (the + adds a key to the mapping)
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # the job stops when more than this share of the records is dropped for a reason other than
    # length (bad records, unknown roles, forms the template cannot render); 1 = never
    max_drop_fraction: float = rng(0.25, 0, 1)


@dataclass
class ChatData:
    train: datasets.Dataset  # columns id, input_ids, loss_mask, length
    eval: datasets.Dataset  # same columns; disjoint from train
    counts: Counts  # read / kept / dropped by reason / truncated tail of the source
    cache_path: Path  # the saved tokenised dataset (train + eval, before the split)
    report: Optional[DataReport] = None  # turns and trained tokens by kind (data/report.py)


# ---------------------------------------------------------------------------------------------
# Cache key
# ---------------------------------------------------------------------------------------------
def data_file(cfg: DataConfig) -> Path:
    """The file `cfg` reads."""
    if cfg.kind not in ("sharegpt", "file"):
        raise ValueError(f"data.kind={cfg.kind!r}: use 'sharegpt' or 'file'.")
    if cfg.path:
        return Path(cfg.path).expanduser()
    if cfg.kind == "file":
        raise ValueError("data.kind=file needs data.path (a .json, .jsonl or .parquet file).")
    return asset_path("sharegpt")


def cached_file_sha256(path: Path, root: Path) -> str:
    """sha256 of a data file, remembered by (path, size, mtime) so 125 MB is hashed once."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo = root / "filehash" / hashlib.sha1(stamp.encode()).hexdigest()
    if memo.is_file():
        return memo.read_text().strip()
    digest = file_sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides the token ids: vocab, merges, special tokens and the chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # vocab, merges, normaliser, pre-tokeniser, added tokens; not the
        # truncation / padding state, which the last call that truncated or padded leaves behind
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        h.update(json.dumps(state, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([str(t) for t in tokenizer.all_special_tokens]).encode())
    h.update(json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()},
                        sort_keys=True).encode())
    h.update(str(tokenizer.chat_template).encode())
    return h.hexdigest()


def cache_key(cfg: DataConfig, tokenizer, file_sha256: str) -> str:
    parts = {"version": LOADER_VERSION, "tokenizer": tokenizer_fingerprint(tokenizer),
             "max_length": cfg.max_length, "max_conversations": cfg.max_conversations,
             "data": file_sha256, "template_kwargs": template_kwargs(cfg)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# Building the cache
# ---------------------------------------------------------------------------------------------
def template_kwargs(cfg) -> dict[str, Any]:
    """data.template_kwargs as a plain dict (a DictConfig or a dataclass field; {} when unset)."""
    kwargs = getattr(cfg, "template_kwargs", None)
    if kwargs is None:
        return {}
    if not hasattr(kwargs, "items"):
        raise ValueError(f"data.template_kwargs={kwargs!r}: give a mapping, e.g. "
                         f"+data.template_kwargs.enable_thinking=false")
    from omegaconf import OmegaConf

    return OmegaConf.to_container(kwargs) if OmegaConf.is_config(kwargs) else dict(kwargs)


def _conversation_rows(path: str, limit: Optional[int], counts_file: str):
    """Generator for pass 1: normalised conversations; writes the reader's Counts at the end."""
    counts = Counts()
    for conv in iter_conversations(path, counts, limit=limit):
        yield {"id": conv.id, "messages": json.dumps(conv.messages, ensure_ascii=False),
               "tools": json.dumps(conv.tools, ensure_ascii=False) if conv.tools else ""}
    Path(counts_file).write_text(json.dumps(counts.to_dict()))


def _encode_batch(batch: dict[str, list], tokenizer, max_length: int, kwargs: dict) -> dict[str, list]:
    """Pass 2 (batched map): render, tokenise and mask a batch of conversations. A conversation
    gives one row per context (data/chat.py), or one empty row carrying its drop reason; its first
    row carries its stats (JSON) for the data report."""
    conversations = [json.loads(m) for m in batch["messages"]]
    templates = [Template(json.loads(t) if t else None, kwargs) for t in batch["tools"]]
    encoded = encode_chats(tokenizer, conversations, max_length, templates)
    out: dict[str, list] = {k: [] for k in ("id", "input_ids", "loss_mask", "length", "drop_reason",
                                            "stats")}
    for cid, conv, e in zip(batch["id"], conversations, encoded):
        stats = {**e.stats, "rows": len(e.rows), "detail": e.detail,
                 "trainable": sum(trains(m) for m in conv)}
        for r, row in enumerate(e.rows or [None]):
            out["id"].append(cid)
            out["input_ids"].append(row.input_ids if row else [])
            out["loss_mask"].append(row.loss_mask if row else [])
            out["length"].append(len(row.input_ids) if row else 0)
            out["drop_reason"].append(e.drop_reason or "")
            out["stats"].append(json.dumps(stats) if r == 0 else "")
    return out


@contextlib.contextmanager
def _progress_bars():
    """datasets' tqdm bars on for an interactive terminal, off when logged to a file or in CI."""
    was_on = datasets.is_progress_bar_enabled()
    if not quiet():
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was_on else datasets.disable_progress_bars)()


def _read(path: Path, cfg: DataConfig, key: str, work: Path) -> tuple[datasets.Dataset, Counts]:
    """Pass 1: stream normalised conversations to an Arrow file; the reader's counts."""
    counts_file = work / "reader_counts.json"
    try:
        raw = datasets.Dataset.from_generator(
            _conversation_rows, features=RAW_FEATURES, cache_dir=str(work / "gen"),
            fingerprint=f"{key}-raw",
            gen_kwargs={"path": str(path), "limit": cfg.max_conversations,
                        "counts_file": str(counts_file)})
    except Exception as e:  # datasets wraps the generator's errors, and fails on zero rows
        cause = e.__cause__ if isinstance(e, datasets.exceptions.DatasetGenerationError) else None
        if isinstance(cause, DataFormatError):  # say what is wrong with the file
            raise cause from None
        if not counts_file.is_file():
            raise
        raw = None
    counts = Counts.from_dict(json.loads(counts_file.read_text()))
    if raw is None or counts.kept == 0:
        raise ValueError(f"{path}: no usable conversation ({counts.describe()}); fix the records "
                         f"or point data.path at a chat file (see docs/data.md)")
    return raw, counts


def _tally(encoded: datasets.Dataset, counts: Counts) -> tuple[list[int], DataReport]:
    """The rows kept, and the data report; moves conversations dropped when encoding into counts."""
    keep: list[int] = []
    drops: list[tuple[str, str, dict]] = []
    stats_all = []
    for i, (cid, reason, stats) in enumerate(zip(encoded["id"], encoded["drop_reason"],
                                                 encoded["stats"])):
        if reason:
            drops.append((cid, reason, json.loads(stats)))
            continue
        keep.append(i)
        if stats:
            stats_all.append(json.loads(stats))
    for cid, reason, stats in drops:
        counts.drop(reason, was_kept=True, where=f"id {cid}: {stats['detail']}")
    report = DataReport.from_counts(counts)
    for stats in stats_all:
        report.add(stats, stats["rows"])
    for _, reason, stats in drops:
        report.drop_turns(reason, stats["trainable"])
    return keep, report


def _build(path: Path, tokenizer, cfg: DataConfig, key: str, out: Path, work: Path) -> Counts:
    """Tokenise `path` into the dataset folder `out` (+ counts.json, data_report.json), using `work`
    for scratch."""
    with _progress_bars():
        raw, counts = _read(path, cfg, key, work)  # 1. normalised conversations, streamed
        # 2. render + tokenise + mask, in num_proc workers, order kept
        enc_features = datasets.Features({**FEATURES, "drop_reason": datasets.Value("string"),
                                          "stats": datasets.Value("string")})
        encoded = raw.map(
            _encode_batch, batched=True, batch_size=256, remove_columns=["messages", "tools"],
            fn_kwargs={"tokenizer": tokenizer, "max_length": cfg.max_length,
                       "kwargs": template_kwargs(cfg)},
            features=enc_features, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
            cache_file_name=str(work / "encoded.arrow"), load_from_cache_file=False,
            new_fingerprint=f"{key}-enc", desc="tokenising chats")
        # 3. count the drops, keep the rest, save
        keep, report = _tally(encoded, counts)
        if not keep:
            raise ValueError(f"{path}: every conversation was dropped after tokenisation "
                             f"({counts.describe()}); see docs/data.md")
        encoded.select(keep).remove_columns(["drop_reason", "stats"]).save_to_disk(str(out))
    (out / "counts.json").write_text(json.dumps(counts.to_dict(), indent=1))
    report.save(out / REPORT_FILE)
    return counts


def check_drops(path: Path, counts: Counts, max_drop_fraction: float) -> None:
    """Say every drop (WARNING: reasons, counts, first record of each); stop when more than
    `max_drop_fraction` of the records went for a reason other than length."""
    if not counts.dropped and not counts.truncated_tail_bytes:
        return
    log.warning("data %s: %s", path, counts.describe())
    other = {r: n for r, n in counts.dropped.items() if r != "too_long"}
    share = sum(other.values()) / max(counts.read, 1)
    if share > max_drop_fraction:
        reasons = ", ".join(f"{r} {n} (first: {counts.first.get(r, '?')})" for r, n in sorted(other.items()))
        raise ValueError(f"{path}: {sum(other.values())} of {counts.read} records ({100 * share:.0f}%) "
                         f"were dropped for reasons other than length, more than "
                         f"data.max_drop_fraction={max_drop_fraction}: {reasons}; fix the records "
                         f"(docs/data.md) or allow it with data.max_drop_fraction=1")


def split_by_id(ds: datasets.Dataset, eval_fraction: float, seed: int):
    """(train, eval) by a salted hash of each id: stable, disjoint, independent of order."""
    threshold = round(eval_fraction * SPLIT_BUCKETS)
    train_idx, eval_idx = [], []
    for i, cid in enumerate(ds["id"]):
        bucket = int(hashlib.sha1(f"{seed}:{cid}".encode()).hexdigest(), 16) % SPLIT_BUCKETS
        (eval_idx if bucket < threshold else train_idx).append(i)
    return ds.select(train_idx), ds.select(eval_idx)


def load_chat_dataset(cfg: DataConfig, tokenizer) -> ChatData:
    """Tokenised, masked, split chat data for `tokenizer`'s chat template (cached on disk)."""
    if cfg.max_length < 1:
        raise ValueError(f"data.max_length={cfg.max_length}: must be >= 1.")
    if not 0.0 <= cfg.eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction={cfg.eval_fraction}: must be in [0, 1).")
    if cfg.max_conversations is not None and cfg.max_conversations < 1:
        raise ValueError(f"data.max_conversations={cfg.max_conversations}: must be >= 1 or null.")
    path = data_file(cfg)
    if path.is_dir():
        raise IsADirectoryError(f"data.path={cfg.path} is a folder: give one .json/.jsonl/.parquet file")
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist (data.path={cfg.path!r}).")
    root = cache_root(cfg)
    key = cache_key(cfg, tokenizer, cached_file_sha256(path, root))
    dest = root / "data" / key
    t0 = time.perf_counter()
    if (dest / "counts.json").is_file():
        ds = datasets.Dataset.load_from_disk(str(dest))
        counts = Counts.from_dict(json.loads((dest / "counts.json").read_text()))
        from specdistill.data.reuse import reuse_line
        log.info(reuse_line("tokenised data: loaded from cache", dest, dest / "counts.json", {
            "path": path, "max_length": cfg.max_length, "max_conversations": cfg.max_conversations},
            "data.cache_dir=<another folder> tokenises afresh") + f"; {len(ds)} rows")
    else:
        log.info("tokenising %s into %s (first use of this data + tokenizer)", path, dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=dest.parent))
        try:
            counts = _build(path, tokenizer, cfg, key, work / "final", work)
            try:
                os.replace(work / "final", dest)  # atomic: the cache appears complete or not at all
            except OSError:
                if not (dest / "counts.json").is_file():  # not a lost race with another process
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        ds = datasets.Dataset.load_from_disk(str(dest))
        log.info("tokenised %d conversations into %d rows in %.1f s", counts.kept, len(ds),
                 time.perf_counter() - t0)
    if not counts.dropped:
        log.info("data %s: %s", path, counts)
    corrupt = counts.dropped.get("corrupt_json", 0)
    if corrupt or counts.truncated_tail_bytes:  # said on every run, not only the first
        log.warning("data %s: %d corrupt record(s) skipped and %d bytes of a cut-off tail unread; "
                    "training uses the %d conversations kept", path, corrupt,
                    counts.truncated_tail_bytes, counts.kept)
    check_drops(path, counts, getattr(cfg, "max_drop_fraction", 0.25))
    report = DataReport.load(dest / REPORT_FILE)
    log.info("data report: %s", report.summary())
    train, eval_ = split_by_id(ds, cfg.eval_fraction, cfg.seed)
    return ChatData(train=train, eval=eval_, counts=counts, cache_path=dest, report=report)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m specdistill.data.dataset`: prepare (or load) the tokenised data and print counts + time."""
    import argparse

    from specdistill.target.model import TargetConfig, load_tokenizer

    p = argparse.ArgumentParser(prog="python -m specdistill.data.dataset", description=main.__doc__)
    p.add_argument("--tokenizer", default="packaged:smollm2", help="target tokenizer source")
    p.add_argument("--kind", default="sharegpt")
    p.add_argument("--path", default=None)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--max-conversations", type=int, default=None)
    p.add_argument("--num-proc", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tokenizer = load_tokenizer(args.tokenizer, TargetConfig(path=args.tokenizer))
    cfg = DataConfig(kind=args.kind, path=args.path, max_length=args.max_length,
                     max_conversations=args.max_conversations, num_proc=args.num_proc)
    t0 = time.perf_counter()
    data = load_chat_dataset(cfg, tokenizer)
    seconds = time.perf_counter() - t0
    tokens = sum(data.train["length"]) + sum(data.eval["length"])
    print(f"{data.counts}\n{data.report.summary()}\ntrain {len(data.train)}, eval {len(data.eval)} rows, "
          f"{tokens} tokens, {seconds:.1f} s ({data.cache_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def pad_batch(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of {input_ids, loss_mask} rows into (B, T) tensors."""
    T = max(len(r["input_ids"]) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.as_tensor(r["input_ids"])
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.as_tensor(r["loss_mask"])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
