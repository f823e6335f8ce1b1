"""Self-generated training data: the target answers the data's prompts, and the features come free.

    python -m train data.selfgen.prompts=1500        # the default job's data (conf/data/sharegpt.yaml)
    store = build_selfgen(target, data_cfg, layers)   # once per (target, data, settings, layers)
    data = store.chat_data(eval_fraction, seed)       # ChatData: train / eval datasets of token rows
    feats = store.features(layers)                    # the offline features of those rows

A drafter predicts what the target writes, so the field trains on the target's own answers
(speculators, SpecForge: regenerated data). Generating them was the price (~4.4 ms per answer token
with HF generate here) and then a capture forward over every token. Here both are one pass
(data/generate.py): the target answers the first user turn of each conversation, batched at bf16 on
a static cache, and the hidden states of the prompt and of every answer token come out of the same
forwards, so the rows are written with their features, ready to train on.

The rows are the token ids the target wrote (prompt rendered with its chat template + answer), not
text to re-tokenise: re-tokenising can merge tokens differently from how the target produced them,
and a drafter is scored on the ids the target produces. loss_mask = 1 on the answer (its EOS too).

Store (under `<cache>/selfgen/<key>/`, the key hashing the target, the data file, the settings and
the layers): manifest.json (what it was made from; checked on every reuse), one safetensors shard
per generation batch (offsets, input_ids, loss_mask, final, features; row ids in the metadata),
written atomically, so an interrupted build resumes at the first missing shard; answers.jsonl (the
answers as ShareGPT text, for reading or another tool) and COMPLETE (counts, tokens/s) at the end.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdistill.data.capture import pad_features
from specdistill.data.dataset import FEATURES, ChatData, SelfGenSettings, split_by_id
from specdistill.data.sharegpt import Counts, iter_conversations
from specdistill.data.report import DataReport
from specdistill.data.reuse import reuse_line
from specdistill.target.identity import differences
from specdistill.target.prepack import prepacked

log = logging.getLogger(__name__)

# 2: the target by its identity (target/identity.py); 3: a generation copy at another dtype keeps
# fp32 RoPE frequencies (drafters/precision.cast_floats; 2's bf16 copies rounded them: not the target)
FORMAT_VERSION = 3
MANIFEST, COMPLETE, ANSWERS = "manifest.json", "COMPLETE", "answers.jsonl"
STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def first_turns(path: Path, tokenizer, limit: Optional[int], max_prompt_tokens: int, skip: int = 0,
                template_kwargs: Optional[dict] = None
                ) -> tuple[list[dict], dict[str, int]]:
    """The first `limit` conversations' prompts after the file's first `skip` records, up to their
    first user turn (system and leading assistant turns kept as context), rendered with the chat
    template and tokenised; prompts over max_prompt_tokens and conversations without a user turn are
    skipped and counted."""
    counts = {"skipped_records": skip, "read": 0, "no_user_turn": 0, "prompt_too_long": 0, "kept": 0}
    out, records = [], Counts()
    for conv in iter_conversations(path, records):
        if records.read <= skip:  # records.read: this conversation's record, counted from 1
            continue
        if limit is not None and counts["kept"] >= limit:
            break
        counts["read"] += 1
        first = next((i for i, m in enumerate(conv.messages) if m["role"] == "user"), None)
        if first is None:
            counts["no_user_turn"] += 1
            continue
        messages = conv.messages[:first + 1]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                            **(template_kwargs or {}))["input_ids"]
        if len(ids) > max_prompt_tokens:
            counts["prompt_too_long"] += 1
            continue
        counts["kept"] += 1
        out.append({"id": conv.id, "messages": messages, "prompt_ids": list(ids)})
    return out, counts


def store_key(target, src_sha: str, settings: SelfGenSettings, layers: Sequence[int], skip: int) -> dict:
    """What the store depends on: the target's identity (weights + architecture + dtype), the data
    file, the settings and the feature layers; never a path of the cache or a log phrase. `mix` is
    not in it (the store holds the target's answers either way), and `skip` only when records are
    skipped, so stores made before either setting existed keep their keys."""
    kept = {k: v for k, v in asdict(settings).items() if k not in ("mix", "skip")}
    return {"version": FORMAT_VERSION, "target": target.identity, "data_sha256": src_sha,
            "settings": {**kept, **({"skip": skip} if skip else {})}, "layers": list(layers)}


def check_dtypes(settings: SelfGenSettings) -> None:
    """Refuse a generation or storage dtype that is none, naming its own key, before the store's
    folder is made."""
    from specdistill.target.precision import resolve_dtype

    if settings.features_dtype not in STORE_DTYPES:
        raise ValueError(f"data.selfgen.features_dtype={settings.features_dtype!r} is not a storage "
                         f"dtype: use one of {', '.join(sorted(STORE_DTYPES))}")
    resolve_dtype(settings.dtype, "cpu", setting="data.selfgen.dtype")


def _generation_model(target, dtype: str):
    """The target's model in the generation dtype (a copy when it differs from the target's)."""
    from specdistill.target.precision import DTYPES, resolve_dtype
    from specdistill.target.precision import model_at

    choice = resolve_dtype(dtype, target.device.type, setting="data.selfgen.dtype")  # auto: bf16 where native
    want = DTYPES[choice.dtype]
    log.info("self-generation at %s (%s)", choice.dtype, choice.check)
    return model_at(target.model, want)


def _write_shard(path: Path, prompts: list[dict], answers, store_dtype: torch.dtype) -> int:
    """One generation batch as a shard (rows concatenated along time, with offsets); atomic.
    Returns the answer tokens written."""
    ids = [torch.cat([torch.tensor(p["prompt_ids"]), a.answer]) for p, a in zip(prompts, answers)]
    masks = [torch.cat([torch.zeros(len(p["prompt_ids"]), dtype=torch.int8),
                        torch.ones(len(a.answer), dtype=torch.int8)])
             for p, a in zip(prompts, answers)]
    lengths = torch.tensor([len(x) for x in ids])
    tensors = {"offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
               "input_ids": torch.cat(ids), "loss_mask": torch.cat(masks),
               "final": torch.cat([a.final for a in answers]).to(store_dtype).contiguous()}
    if answers[0].features is not None:
        tensors["features"] = torch.cat([a.features for a in answers]).to(store_dtype).contiguous()
    meta = {"ids": json.dumps([p["id"] for p in prompts]),
            "ended": json.dumps([bool(a.ended) for a in answers])}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return int(sum(len(a.answer) for a in answers))


def build_selfgen(target, data_cfg, layers: Sequence[int], progress: bool = True,
                  after: int = 0) -> "SelfGenStore":
    """The store of `data_cfg.selfgen` for `target` and drafter feature `layers` (built on first
    use, resumed when interrupted, reused when complete). `after`: records of the file whose own
    answers are trained on too (a mix): skipped unless data.selfgen.skip says otherwise."""
    from tqdm import tqdm

    from specdistill.data.dataset import cache_root, cached_file_sha256, data_file, template_kwargs
    from specdistill.data.generate import generate_with_features

    settings = SelfGenSettings(**dict(data_cfg.selfgen))
    check_dtypes(settings)
    src = data_file(data_cfg)
    if src.is_dir():
        raise IsADirectoryError(f"data.path={data_cfg.path} is a folder: give one "
                                f".json/.jsonl/.parquet file")
    if not src.is_file():
        raise FileNotFoundError(f"data file {src} does not exist (data.path={data_cfg.path!r}).")
    if settings.max_prompt_tokens + settings.max_new_tokens > target.max_length:
        raise ValueError(f"data.selfgen.max_prompt_tokens + max_new_tokens = "
                         f"{settings.max_prompt_tokens + settings.max_new_tokens} is more than the "
                         f"target's context ({target.max_length}); lower them")
    gen_layers = [] if list(layers) in ([-1], []) else list(layers)  # the final state: always
    root = cache_root(data_cfg)
    skip = settings.skip if settings.skip is not None else after
    kwargs = template_kwargs(data_cfg)
    key = store_key(target, cached_file_sha256(src, root), settings, layers, skip)
    if kwargs:  # prompts rendered with other template kwargs are other prompts (old keys kept)
        key["template_kwargs"] = kwargs
    folder = root / "selfgen" / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    store = SelfGenStore(folder)
    if (folder / COMPLETE).is_file():
        store.check(key)
        log.info(reuse_line("the self-generated data", folder, folder / COMPLETE,
                            {**key["settings"], "layers": key["layers"]},
                            "a change of any data.selfgen setting (or data.cache_dir=<another "
                            "folder>) makes a fresh one"))
        return store
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / MANIFEST).is_file():
        store.check(key)  # an interrupted build of the same key: resume it
    else:
        (folder / MANIFEST).write_text(json.dumps(key, indent=1))
    prompts, counts = first_turns(src, target.tokenizer, settings.prompts, settings.max_prompt_tokens,
                                  skip, kwargs)
    if not prompts:
        raise ValueError(f"data.selfgen: none of the conversations of {src} after its first {skip} "
                         f"records has a user turn within {settings.max_prompt_tokens} tokens "
                         f"({counts}); raise data.selfgen.max_prompt_tokens, lower data.selfgen.skip "
                         f"(or data.max_conversations in a mix) or check the data")
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]["prompt_ids"]), i))
    batches = [order[b:b + settings.batch_size] for b in range(0, len(order), settings.batch_size)]
    model = _generation_model(target, settings.dtype)
    store_dtype = STORE_DTYPES[settings.features_dtype]
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    t0, tokens = time.perf_counter(), 0
    bar = tqdm(total=len(batches), desc="self-generate", disable=not progress)
    with prepacked(model):  # an fp32 CPU model: oneDNN linears, packed for this phase only
        for s, idx in enumerate(batches):
            path = folder / f"shard-{s:05d}.safetensors"
            if not path.is_file():
                part = [prompts[i] for i in idx]
                gens = [torch.Generator().manual_seed(settings.seed + i) for i in idx]
                answers = generate_with_features(
                    model, [p["prompt_ids"] for p in part], max_new_tokens=settings.max_new_tokens,
                    eos_ids=target.eos_token_ids, layers=gen_layers, pad_id=pad,
                    temperature=settings.temperature, generators=gens,
                    compact_below=settings.compact_below)
                tokens += _write_shard(path, part, answers, store_dtype)
                dt = time.perf_counter() - t0
                bar.set_postfix(tok_s=f"{tokens / dt:.0f}")
                if not progress:  # a line per shard where there is no progress bar (logs, CI)
                    log.info("self-generated shard %d/%d: %d answer tokens in %.0f s (%.0f tokens/s)",
                             s + 1, len(batches), tokens, dt, tokens / dt)
            bar.update(1)
    bar.close()
    summary = {**counts, "answer_tokens_this_run": tokens,
               "seconds_this_run": round(time.perf_counter() - t0, 1)}
    store.write_answers(target.tokenizer, prompts)
    tmp = folder / f".{COMPLETE}.tmp"
    tmp.write_text(json.dumps(summary))
    os.replace(tmp, folder / COMPLETE)
    log.info("self-generated data: %s", summary)
    return store


class SelfGenStore:
    """A self-generated store read back: its rows as a dataset, its features for training."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._open: dict[int, Any] = {}

    def check(self, key: dict) -> None:
        """Refuse a store made from something else, naming what differs."""
        diffs = differences(json.loads((self.folder / MANIFEST).read_text()), key)
        if diffs:
            raise ValueError(f"{self.folder} holds self-generated data made with other settings "
                             f"({'; '.join(diffs)}): delete it to generate again")

    def shards(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.safetensors"))

    def release(self) -> None:
        """Unmap the shards read so far (OfflineFeatures.release)."""
        self._open.clear()

    def _shard(self, k: int):
        if k not in self._open:
            self._open[k] = safe_open(str(self.folder / f"shard-{k:05d}.safetensors"), framework="pt")
        return self._open[k]

    def rows(self):
        """Every row: (store_index, id, input_ids, loss_mask, ended), in shard order."""
        n = 0
        for k, _ in enumerate(self.shards()):
            sh = self._shard(k)
            meta = sh.metadata()
            ids, ended = json.loads(meta["ids"]), json.loads(meta["ended"])
            off = sh.get_tensor("offsets").tolist()
            all_ids, all_mask = sh.get_tensor("input_ids"), sh.get_tensor("loss_mask")
            for j, cid in enumerate(ids):
                a, b = off[j], off[j + 1]
                yield n, cid, all_ids[a:b], all_mask[a:b], ended[j]
                n += 1

    def chat_data(self, eval_fraction: float, seed: int) -> ChatData:
        """The rows as ChatData (split by id hash like every data source), with `store_index`."""
        recs = {"id": [], "input_ids": [], "loss_mask": [], "length": [], "store_index": []}
        trained = []
        for n, cid, ids, mask, _ in self.rows():
            trained.append(int(mask.sum()))
            recs["id"].append(cid)
            recs["input_ids"].append(ids.tolist())
            recs["loss_mask"].append(mask.tolist())
            recs["length"].append(len(ids))
            recs["store_index"].append(n)
        feats = datasets.Features({**FEATURES, "store_index": datasets.Value("int64")})
        ds = datasets.Dataset.from_dict(recs, features=feats)
        train, eval_ = split_by_id(ds, eval_fraction, seed)
        counts = Counts(read=len(ds), kept=len(ds))
        return ChatData(train=train, eval=eval_, counts=counts, cache_path=self.folder,
                        report=DataReport.generated(trained))

    def features(self, layers: Sequence[int]) -> "SelfGenFeatures":
        return SelfGenFeatures(self, layers)

    def write_answers(self, tokenizer, prompts: list[dict]) -> None:
        """answers.jsonl: every answer as ShareGPT text after its prompt's messages."""
        by_id = {p["id"]: p for p in prompts}
        role = {"user": "human", "assistant": "gpt", "system": "system"}
        tmp = self.folder / f".{ANSWERS}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for _, cid, ids, mask, _ in self.rows():
                text = tokenizer.decode(ids[mask.bool()], skip_special_tokens=True).strip()
                conv = [{"from": role[m["role"]], "value": m["content"]} for m in by_id[cid]["messages"]]
                f.write(json.dumps({"id": cid, "conversations": conv + [{"from": "gpt", "value": text}]},
                                   ensure_ascii=False) + "\n")
        os.replace(tmp, self.folder / ANSWERS)


class SelfGenFeatures:
    """The trainer's offline features of self-generated rows (rows carry their `store_index`)."""

    def __init__(self, store: SelfGenStore, layers: Sequence[int]) -> None:
        self.store, self.layers = store, list(layers)
        self._where: list[tuple[int, int, int]] = []  # store_index -> (shard, start, end)
        for k, path in enumerate(store.shards()):
            off = store._shard(k).get_tensor("offsets").tolist()
            self._where += [(k, off[j], off[j + 1]) for j in range(len(off) - 1)]

    def release(self) -> None:
        self.store.release()

    def get(self, store_index: int, input_ids) -> tuple[torch.Tensor | None, torch.Tensor]:
        k, a, b = self._where[store_index]
        sh = self.store._shard(k)
        if sh.get_slice("input_ids")[a:b].tolist() != list(input_ids):
            raise ValueError(f"self-generated store {self.store.folder} does not match row "
                             f"{store_index}: the store changed under the run; delete it")
        final = sh.get_slice("final")[a:b].float()
        if not self.layers:
            return None, final
        feats = final if self.layers == [-1] else sh.get_slice("features")[a:b].float()
        return feats, final

    def batch(self, indices: list[int], rows: list[dict], T: int):
        """Right-padded (B, T, F) features and (B, T, H) final states of dataset rows `rows`."""
        return pad_features([self.get(int(r["store_index"]), r["input_ids"]) for r in rows], T)
