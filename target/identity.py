"""What a target IS, as a dict that caches can be keyed on: its weights' source and the
architecture facts, never a log string or a cache path.

Captured features, regenerated answers and every other cache derived from a target are only
valid for the same weights run at the same dtype. A description such as "x.gguf (de-quantised,
cached at /home/u/.cache/...)" changes between the first and later loads and when the cache
moves; this identity does not:

    kind         how the weights were made, and what pins them:
      gguf         gguf_sha256: the GGUF file's sha256 (also the de-quantised cache's key)
      hub          hf_id, revision (as asked) and commit (the resolved one, when known)
      folder       config_sha256 of config.json and a fingerprint of the weight files (name, size
                   and the sha256 of a few 1 MiB chunks each: cheap for 16 GB, and a fine-tune
                   changes every chunk it touches)
      random_init  model_config, seed and the tokenizer source (the weights follow from them)
      model        a model handed over in memory: the sha256 of every parameter
    architecture, hidden_size, num_layers, vocab_size, dtype   the facts features depend on

`differences(old, new)` names every key that differs ("target.num_layers: 2 -> 3"), so a refused
cache says exactly why.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNK = 1 << 20  # bytes per sampled chunk of a weight file
CHUNKS = 4  # chunks sampled per weight file (first, evenly spaced, last)


def architecture(model) -> dict[str, Any]:
    """The facts of a model that captured features depend on, besides its weights."""
    cfg = model.config
    names = getattr(cfg, "architectures", None) or [type(model).__name__]
    return {"architecture": str(names[0]), "hidden_size": int(cfg.hidden_size),
            "num_layers": int(cfg.num_hidden_layers),
            "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def file_fingerprint(path: Path) -> str:
    """sha256 over a file's size and CHUNKS chunks of CHUNK bytes spread over it (the whole
    file when it is smaller than that)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= CHUNK * CHUNKS:
            h.update(f.read())
        else:
            for i in range(CHUNKS):
                f.seek((size - CHUNK) * i // (CHUNKS - 1))
                h.update(f.read(CHUNK))
    return h.hexdigest()


def folder_identity(folder: Path) -> dict[str, Any]:
    """A local HF folder: its config.json's sha256 and its weight files' fingerprints."""
    folder = Path(folder).expanduser()
    config = folder / "config.json"
    weights = {p.name: file_fingerprint(p) for p in sorted(folder.iterdir())
               if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)}
    return {"kind": "folder",
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
            "weights": weights}


def parameters_sha256(model) -> str:
    """sha256 of every parameter (name, shape, bytes): for a model handed over in memory."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def identity_key(identity: dict[str, Any]) -> str:
    """A short stable hash of an identity (for folder names)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every (dotted) key whose value differs; `<unset>` where absent."""
    a, b = _flatten(old, ""), _flatten(new, "")
    return [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, "<unset>") != b.get(k, "<unset>")]
