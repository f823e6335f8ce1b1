"""Target feature capture: what the frozen target says about a batch of conversations.

Online (inside the training loop) and offline (`python -m specdistill.data.capture`, sharded to disk) capture
both go through `capture` and `target_logits` (train/teacher.py in training: only where a loss
reads them), so they produce the same batches.

Only the features a drafter reads and the final-normed hidden state are kept; the target's logits
are recomputed from the final hidden state with the LM head when needed (restricted to the draft
vocabulary when the drafter has one), so nothing of size T x V is ever stored.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from omegaconf import MISSING
from safetensors import safe_open
from safetensors.torch import save_file

from specdistill.cli.ranges import MAX_BATCH, MAX_COUNT, MAX_LAYERS, MAX_TOKENS, rng
from specdistill.data import quiet
from specdistill.data.dataset import DataConfig, pad_batch
from specdistill.target.identity import differences
from specdistill.data.reuse import reuse_line
from specdistill.target.model import TargetConfig

log = logging.getLogger(__name__)


@torch.inference_mode()
def capture(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            layers: Sequence[int], chunk: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Return (features (B, T, F) of `layers` or None, final hidden (B, T, H)).

    chunk: rows longer than this many tokens go through the target `chunk` tokens at a time, each
    chunk attending to the ones before it through a KV cache (as a chunked prefill), so the
    forward holds every layer's hidden states of one chunk instead of the whole row; the
    features equal the whole row's within float rounding (rows are right-padded, so positions
    count from each row's first token either way). None: the whole row in one forward."""
    layers = tuple(layers)
    ids, mask = input_ids.to(target.device), attention_mask.to(target.device)
    T, H = ids.shape[1], target.hidden_size
    if chunk is None or T <= chunk:
        out = target.forward(ids, layers=(*layers, -1), logits=False, attention_mask=mask).features
    else:
        from transformers import DynamicCache

        cache = DynamicCache(config=target.config)
        out = torch.cat([target.forward(ids[:, a:a + chunk], layers=(*layers, -1), logits=False,
                                        cache=cache, attention_mask=mask[:, :a + chunk]).features
                         for a in range(0, T, chunk)], dim=1)  # (B, T, F + H)
    feats = out[..., :-H] if layers else None  # (B, T, F)
    return feats, out[..., -H:]  # (B, T, H)


@torch.inference_mode()
def target_logits(target, final_hidden: torch.Tensor, d2t: torch.Tensor | None = None) -> torch.Tensor:
    """Target logits (B, T, V) from the final hidden state, or (B, T, Vd) over the draft vocabulary
    (the rows d2t of the LM head): softmax of those equals the target distribution restricted to
    the draft vocabulary and renormalised."""
    head = target.lm_head()
    weight = head.weight if d2t is None else head.weight[d2t.to(head.weight.device)]  # (V|Vd, H)
    bias = getattr(head, "bias", None)
    if bias is not None and d2t is not None:
        bias = bias[d2t]
    return torch.nn.functional.linear(final_hidden.to(weight.dtype), weight, bias)



# ---------------------------------------------------------------------------------------------
# Offline capture: `python -m specdistill.data.capture` writes the features of a split to sharded safetensors
# files; the trainer reads them back with `OfflineFeatures` (trainer.features=offline).
# ---------------------------------------------------------------------------------------------
MANIFEST = "manifest.json"
# 2: the target is recorded by its identity (target/identity.py), not its description;
# a format-1 capture is refused (it cannot say which target it came from)
FORMAT_VERSION = 2
STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the dtypes a capture stores


@dataclass
class CaptureConfig:
    """`python -m specdistill.data.capture`: write target features of a data split to disk."""

    target: Any = MISSING  # the target (conf/target/*.yaml)
    data: Any = MISSING  # the chat data (conf/data/*.yaml)
    out: str = MISSING  # output folder of the shards (give it to the trainer as trainer.features_dir)
    layers: list[int] = rng([-1], -1, MAX_LAYERS)  # must equal the drafter's feature_layers
    split: str = "train"  # train | eval
    shard_size: int = rng(64, 1, MAX_COUNT)  # conversations per shard file
    batch_size: int = rng(4, 1, MAX_BATCH)  # conversations per target forward
    limit: Optional[int] = rng(None, 1, MAX_COUNT)  # only the first N conversations of the split
    dtype: str = "float32"  # storage dtype: float32 | bfloat16 (halves the disk)
    features_dtype: Optional[str] = None  # of the layers' features alone (None: dtype); final: dtype
    # run the target's forward under torch.autocast in this dtype (None = the target's own dtype):
    # bfloat16 is ~2.8x faster on CPUs with AVX512-BF16/AMX, features within ~1% of fp32
    autocast: Optional[str] = None
    # rows longer than this many tokens go through the target in chunks of it, over a KV cache
    # (None = whole rows): the forward then holds one chunk's hidden states of every layer, not
    # the row's (capture's docstring); the features are the same within float rounding
    chunk: Optional[int] = rng(None, 16, MAX_TOKENS)


def _manifest(cfg, target, n: int) -> dict:
    """What a capture depends on: the target's identity (weights + architecture + dtype, never a
    path), the layers, the split and its size, the storage layout, the forward's autocast."""
    return {"version": FORMAT_VERSION, "target": target.identity, "layers": list(cfg.layers),
            "split": cfg.split, "conversations": n, "shard_size": cfg.shard_size,
            "dtype": cfg.dtype, "autocast": cfg.autocast,
            **({"features_dtype": cfg.features_dtype} if cfg.features_dtype not in (None, cfg.dtype) else {})}


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a capture folder (None when it has none); a manifest of an older format,
    or one that is not ours, is refused with what to do."""
    mpath = Path(folder) / MANIFEST
    if not mpath.is_file():
        return None
    try:
        man = json.loads(mpath.read_text())
    except ValueError as e:
        raise ValueError(f"{mpath} is not a capture manifest ({e}); give another folder") from None
    if not isinstance(man, dict) or "version" not in man:
        raise ValueError(f"{mpath} is not a capture manifest (no `version`); give another folder")
    if man["version"] != FORMAT_VERSION:
        raise ValueError(f"capture {folder} was made by an older version of specdistill (manifest "
                         f"format {man['version']}, which does not record the target's identity): "
                         f"capture again: delete {folder} (or give another folder)")
    return man


def check_target(man: dict, folder: Path, target, **expect) -> None:
    """Refuse a capture made from another target (any key of its identity differs, named with
    both values) or with other `expect` settings (e.g. autocast="bfloat16")."""
    diffs = differences({"target": man["target"], **{k: man.get(k) for k in expect}},
                        {"target": target.identity, **expect})
    if diffs:
        raise ValueError(f"capture {folder} was made from another target or setting: "
                         + "; ".join(diffs) + ". Capture again for this target (another "
                         "trainer.features_dir=, or none for the automatic folder)")


def autocast(target, dtype: Optional[str]):
    """torch.autocast on the target's device in `dtype` (a no-op context for None)."""
    if dtype is None:
        return contextlib.nullcontext()
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"autocast dtype must be bfloat16 or float16, not {dtype!r}")
    return torch.autocast(device_type=target.device.type, dtype=getattr(torch, dtype))


def write_shard(path: Path, rows: list[dict], feats: list, finals: list, dtype: torch.dtype,
                features_dtype: torch.dtype | None = None) -> None:
    """One shard: rows concatenated along time, with offsets (features at `features_dtype`, None:
    `dtype`); written atomically."""
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    tensors = {"offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
               "input_ids": torch.cat([torch.as_tensor(r["input_ids"]) for r in rows]),
               "final": torch.cat(finals).to(dtype).contiguous()}
    if feats and feats[0] is not None:  # absent when the features are the final hidden state
        tensors["features"] = torch.cat(feats).to(features_dtype or dtype).contiguous()
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def length_batches(chunk: list[dict], batch_size: int) -> list[list[int]]:
    """A shard's forwards: indices into `chunk`, longest rows first, `batch_size` at a time, so each
    forward pads little (~2% on the default data, ~17% in data order)."""
    order = sorted(range(len(chunk)), key=lambda j: (-len(chunk[j]["input_ids"]), j))
    return [order[b:b + batch_size] for b in range(0, len(order), batch_size)]


# the setting that names a capture folder -> how the user selects another capture (or makes one)
OTHER_CAPTURE = {
    "out": "give another out= for these settings (or capture with the settings it holds)",
    "trainer.features_dir": "set trainer.features_dir= to a capture made with these settings, or "
                            "drop it (a capture keyed by these settings is made in the cache)",
}


def capture_split(target, rows, cfg, out: Path, progress: bool = True,
                  setting: str = "trainer.features_dir") -> Path:
    """Capture `rows` (input_ids, loss_mask) in shards under `out`; completed shards are skipped,
    so an interrupted capture resumes where it stopped. `setting`: the key that named `out` (a
    capture made with other settings is kept as it is, and the message says how to pick another)."""
    from tqdm import tqdm

    n = len(rows)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{setting}={out} is a file, not a folder: give a folder for the "
                                 f"capture (a new one, or one a capture wrote)")
    manifest = _manifest(cfg, target, n)
    old = read_manifest(out)
    if old is not None:
        diffs = differences(old, manifest)
        if diffs:
            raise ValueError(f"{setting}={out} holds a capture made with other settings ("
                             + "; ".join(diffs) + f"); it is kept as it is: "
                             + OTHER_CAPTURE.get(setting, OTHER_CAPTURE["out"]))
        if all((out / f"shard-{s // cfg.shard_size:05d}.safetensors").is_file()
               for s in range(0, n, cfg.shard_size)):
            log.info(reuse_line("the capture", out, out / MANIFEST,
                                {k: v for k, v in old.items() if k not in ("version", "target")},
                                f"{setting}=<another folder> (or other capture settings) makes a "
                                f"fresh one"))
    else:  # never into a folder of someone else's files (Hydra's .hydra-run/ log is ours)
        foreign = sorted(p.name for p in out.iterdir() if p.name != ".hydra-run") if out.is_dir() else []
        if foreign:
            raise FileExistsError(f"{out} is not empty and holds no capture ({', '.join(foreign[:5])}"
                                  f"{', ...' if len(foreign) > 5 else ''}): capture into a new or "
                                  f"empty folder")
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, out / MANIFEST)
    if not {cfg.dtype, cfg.features_dtype or cfg.dtype} <= STORAGE.keys():
        raise ValueError(f"capture dtype={cfg.dtype!r} features_dtype={cfg.features_dtype!r}: "
                         f"storage dtypes are {sorted(STORAGE)}")
    dtype, features_dtype = STORAGE[cfg.dtype], STORAGE[cfg.features_dtype or cfg.dtype]
    only_final = list(cfg.layers) == [-1]  # EAGLE-1: the features ARE the final state
    shards = range(0, n, cfg.shard_size)
    t0 = time.perf_counter()
    for s in tqdm(shards, desc="capture", disable=not progress):
        path = out / f"shard-{s // cfg.shard_size:05d}.safetensors"
        if path.is_file():
            continue
        chunk = [rows[i] for i in range(s, min(n, s + cfg.shard_size))]
        feats, finals = [None] * len(chunk), [None] * len(chunk)
        for part in length_batches(chunk, cfg.batch_size):
            batch = pad_batch([chunk[j] for j in part], pad_id=0)
            with autocast(target, cfg.autocast):
                f, h = capture(target, batch["input_ids"], batch["attention_mask"],
                               () if only_final else cfg.layers, cfg.chunk)
            for i, j in enumerate(part):  # drop the padding again; stored in the rows' order
                T = len(chunk[j]["input_ids"])
                feats[j] = None if f is None else f[i, :T].cpu()
                finals[j] = h[i, :T].cpu()
        write_shard(path, chunk, feats, finals, dtype, features_dtype)
        if not progress:  # a line per shard where there is no progress bar (logs, CI)
            done = sum(len(r["input_ids"]) for r in chunk)
            log.info("captured shard %d/%d (%d tokens, %.0f s so far)", s // cfg.shard_size + 1,
                     len(shards), done, time.perf_counter() - t0)
    return out


def serves(captured, layers) -> bool:
    """Whether a capture of `captured` layers holds what a drafter reading `layers` needs: the same
    layers, or only the final hidden state (EAGLE-1: [-1]) or nothing (small_lm: []), which every
    capture stores."""
    return list(layers) in ([-1], []) or list(layers) == list(captured)


class OfflineFeatures:
    """Reads a capture back: features and final hidden state of conversation i of the split."""

    def __init__(self, folder: str | Path, layers, target, **expect) -> None:
        """Open a capture for a drafter reading `layers` on `target` (its identity must be the
        capture's); `expect`: manifest settings that must match too (autocast=...)."""
        self.folder = Path(folder)
        man = read_manifest(self.folder)
        if man is None:
            raise FileNotFoundError(f"no {MANIFEST} in {self.folder}; run "
                                    f"`python -m specdistill.data.capture out={self.folder} ...` first")
        self.manifest = man
        check_target(man, self.folder, target, **expect)
        if not serves(man["layers"], layers):
            raise ValueError(f"capture {self.folder} has layers {man['layers']}; the drafter needs "
                             f"{list(layers)}: capture again with layers={list(layers)}")
        self.layers = list(layers)
        self._open: dict[int, Any] = {}  # shard id -> safe_open handle (memory-mapped reads)

    def __len__(self) -> int:
        return self.manifest["conversations"]

    def _shard(self, k: int):
        if k not in self._open:
            path = self.folder / f"shard-{k:05d}.safetensors"
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: the capture is incomplete; rerun "
                                        "`python -m specdistill.data.capture` with the same settings "
                                        "to finish it")
            self._open[k] = safe_open(str(path), framework="pt")
        return self._open[k]

    def release(self) -> None:
        """Unmap the shards read so far (reopened on the next read): their touched pages count as the
        process's resident memory until then (the job's whole ~4 GB capture by its second epoch)."""
        self._open.clear()

    def get(self, i: int, input_ids: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(features (T, F) or None, final hidden (T, H)) of conversation i, checked against its ids."""
        size = self.manifest["shard_size"]
        sh, j = self._shard(i // size), i % size
        offsets = sh.get_slice("offsets")
        a, b = int(offsets[j:j + 1][0]), int(offsets[j + 1:j + 2][0])
        if sh.get_slice("input_ids")[a:b].tolist() != list(input_ids):
            raise ValueError(f"capture {self.folder} does not match the data (conversation {i} "
                             f"differs): the data or tokenizer changed since the capture; capture again")
        final = sh.get_slice("final")[a:b].float()
        if not self.layers:  # the drafter reads no features (small_lm): logits only
            return None, final
        feats = final if self.layers == [-1] else sh.get_slice("features")[a:b].float()
        return feats, final

    def batch(self, indices: list[int], rows: list[dict], T: int):
        """Right-padded (B, T, F) features and (B, T, H) final hidden states of a batch."""
        return pad_features([self.get(i, r["input_ids"]) for i, r in zip(indices, rows)], T)


def pad_features(got: list[tuple[torch.Tensor | None, torch.Tensor]], T: int):
    """[(features (T_i, F) or None, final (T_i, H))] -> right-padded (B, T, F) or None, (B, T, H)."""
    final = torch.zeros(len(got), T, got[0][1].shape[-1])
    feats = None if got[0][0] is None else torch.zeros(len(got), T, got[0][0].shape[-1])
    for j, (f, h) in enumerate(got):
        final[j, :len(h)] = h
        if feats is not None:
            feats[j, :len(f)] = f
    return feats, final


def capture_dir(root: Path, target, rows, data_cache: str, layers, autocast_dtype: Optional[str],
                features_dtype: Optional[str] = None) -> Path:
    """Where offline features of this (target, data split, layers, autocast, features' storage) live
    when no folder is given: under the cache root, so a second run on the same data skips the
    capture. `rows`: the train split (its ids pin eval_fraction and seed); `data_cache` names the
    tokenised data cache. Default settings stay out of the key (older folders keep theirs)."""
    split = hashlib.sha1("\n".join(rows["id"]).encode()).hexdigest()
    key = [target.identity, data_cache, split, list(layers)]  # the identity holds the dtype
    if autocast_dtype:
        key.append(autocast_dtype)
    if features_dtype not in (None, "float32"):
        key.append({"features_dtype": features_dtype})
    return Path(root) / "features" / hashlib.sha1(json.dumps(key).encode()).hexdigest()[:20]


def offline_features(target, rows, folder: Path, cfg: CaptureConfig, *, is_main: bool = True,
                     barrier: Callable[[], None] = lambda: None,
                     progress: bool = True) -> OfflineFeatures:
    """The training loop's offline features: rank 0 captures `rows` into `folder` (resumable; a
    no-op when complete), every rank waits at `barrier`, then opens it and checks it holds `rows`."""
    # a capture made for OTHER layers that serves these is reused as is (the same layers resume);
    # either way its target and autocast must be these (OfflineFeatures checks)
    man = read_manifest(folder)
    if man is not None:  # a capture keeps the storage it was made with (reads are fp32 either way)
        cfg = replace(cfg, dtype=man["dtype"], features_dtype=man.get("features_dtype"))
    captured = man["layers"] if man is not None else None
    reuse = captured not in (None, list(cfg.layers)) and serves(captured, cfg.layers)
    if is_main and not reuse:
        capture_split(target, rows, cfg, folder, progress=progress)
    elif is_main:
        log.info(reuse_line(f"the capture of layers {captured} (serves {list(cfg.layers)})", folder,
                            folder / MANIFEST, {k: v for k, v in man.items() if k not in ("version",
                                                                                          "target")},
                            "trainer.features_dir=<another folder> makes a fresh one"))
    barrier()
    features = OfflineFeatures(folder, cfg.layers, target, autocast=cfg.autocast)
    if len(features) != len(rows):
        raise ValueError(f"capture {folder} holds {len(features)} conversations, the train split "
                         f"{len(rows)}: capture the same data (or drop trainer.features_dir)")
    return features


@dataclass
class CLISchema(CaptureConfig):
    """The command line's schema: the target and data groups typed (at module level, where the
    `from __future__ import annotations` strings resolve)."""

    target: TargetConfig = MISSING
    data: DataConfig = MISSING


def check_layers(layers, target, key: str = "layers") -> None:
    """Refuse hidden-state indices the target does not have (0 = embeddings .. L = its last
    layer, -1 = the final-normed state), naming the setting and the target's range."""
    L = target.num_layers
    bad = [i for i in layers if not (i == -1 or 0 <= i <= L)]
    if bad:
        raise ValueError(f"{key}={list(layers)}: {bad} are not hidden states of target "
                         f"{target.source.split(' (')[0]} (0 = embeddings .. {L} = layer {L}, or "
                         f"-1 = the final-normed state); use the drafter's feature layers")


def run(cfg) -> Path:
    """`python -m specdistill.data.capture` on a composed config: the settings and the data file
    are checked before the target loads; then the split is captured into cfg.out."""
    from specdistill.cli.ranges import check_ranges
    from specdistill.data.dataset import data_file, load_chat_dataset
    from specdistill.target.model import load_target

    check_ranges(cfg, CLISchema)
    if cfg.split not in ("train", "eval"):
        raise ValueError(f"split={cfg.split!r}: use train or eval")
    if not data_file(cfg.data).is_file():
        raise FileNotFoundError(f"data file {data_file(cfg.data)} does not exist "
                                f"(data.path={cfg.data.path!r})")
    target = load_target(cfg.target, training=True)  # features for training: auto = float32
    check_layers(cfg.layers, target)
    data = load_chat_dataset(cfg.data, target.tokenizer)
    rows = data.train if cfg.split == "train" else data.eval
    if cfg.limit is not None:
        rows = rows.select(range(min(cfg.limit, len(rows))))
    out = capture_split(target, rows, cfg, Path(cfg.out), progress=not quiet(), setting="out")
    print(f"captured {len(rows)} conversations of the {cfg.split} split into {out}")
    return out


def store_schema() -> None:
    """Put the command line's schema in Hydra's ConfigStore (conf/capture.yaml starts from it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="capture_schema", node=CLISchema)


def main() -> None:
    """The command line: the `out=` folder checked before Hydra creates it, user errors in one
    line (cli/errors.py)."""
    import sys

    import hydra

    from specdistill.cli.errors import user_errors
    from specdistill.cli.paths import CONF_DIR, check_out_dir_arg
    from specdistill.cli.start import check_start

    check_out_dir_arg("python -m specdistill.data.capture", sys.argv[1:], key="out")
    store_schema()
    check_start("python -m specdistill.data.capture", "capture", sys.argv[1:], CLISchema)

    @hydra.main(config_path=CONF_DIR, config_name="capture", version_base="1.3")
    def _run(cfg) -> None:
        with user_errors("python -m specdistill.data.capture"):
            run(cfg)

    _run()


if __name__ == "__main__":
    main()
