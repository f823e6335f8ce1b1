"""Export a trained drafter as the folders serving engines and the Hub load: validated, atomic.

    python -m drafters.export run=runs/train/<run> format=hf out=exports/my-eagle
    python -m drafters.export run=<run> format=vllm out=exports/eagle-vllm push_to_hub=org/name
    python -m train.export run=<run> format=hf out=... parity=true   # + MT-bench train/serve parity

`run` is a training run dir (its best/ drafter, else the latest checkpoint: the one the final eval
measured) or a checkpoint / drafter folder. Formats and the engine sources they follow are in
drafters/export_formats.py. Every export is
  1. written into a temporary folder next to `out`;
  2. validated (validate_export): config.json keys and values, tensor names, shapes and dtypes
     against the layout of a freshly built drafter of the same config on the same target, and the
     draft vocab maps against each other and the target's tokenizer;
  3. read back (load_export) and compared with the source drafter's weights, exactly;
  4. given a model card (drafters/card.py), then renamed to `out`: a crash never leaves half an export.
Measuring parity needs the decoder, and drafters/ never imports decode/ or train/: train/export.py
runs this same job with a parity hook (`check`).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import MISSING, OmegaConf

from drafters.base import CONFIGS, Drafter, build_drafter, config_dict, load_drafter, parse_config
from drafters.card import model_card
from drafters.export_formats import (DTYPES, MEDUSA_ORIGINAL, WEIGHTS, ExportError,
                                     from_layout, to_layout, unsupported, vocab_maps)
from drafters.hub import PushError, push_to_hub
from drafters.target import TargetConfig, load_target

VERSION = "0.1.0"
HF_IDS = {"packaged:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # packaged target -> Hub id


@dataclass
class ExportConfig:
    """`python -m drafters.export` / `python -m train.export` (conf/export.yaml)."""

    run: str = MISSING  # training run dir (best/, else latest checkpoint) or a checkpoint folder
    format: str = "hf"  # hf | vllm | sglang | speculators | medusa | eagle3 (drafters/export_formats.py)
    out: str = MISSING  # export folder, written atomically
    overwrite: bool = False  # replace an existing `out`
    dtype: str = "float32"  # float32 | bfloat16 | float16 (float32 keeps greedy parity exact)
    base_model: Optional[str] = None  # card/Hub base_model (None = the target's Hub id, if it has one)
    license: str = "apache-2.0"  # card license
    k: Optional[int] = None  # speculative tokens in configs and usage lines (None = the run's eval_k)
    push_to_hub: Optional[str] = None  # org/name: upload after exporting (token: HF_TOKEN)
    private: bool = True  # create the Hub repo private
    parity: bool = False  # decode MT-bench with the reloaded export (python -m train.export only)
    parity_limit: Optional[int] = None  # parity prompts (None = all of the run's final eval)
    target: Optional[TargetConfig] = None  # the target (None = the run's config.yaml target)


@dataclass
class RunInfo:
    """What an export knows about the training run it comes from."""

    drafter_dir: Path  # the saved drafter exported (drafter.json + drafter.safetensors)
    run_dir: Optional[Path] = None  # the training run dir, when the drafter lies in one
    config: Optional[dict] = None  # the run's resolved config.yaml
    final: Optional[dict] = None  # final_eval/result.json summary
    final_md: Optional[str] = None  # final_eval/result.md
    final_rows: Optional[list] = None  # final_eval/result.json per-prompt rows
    is_reference: bool = False  # drafter_dir is the drafter the final eval measured


def hub_id(tcfg) -> Optional[str]:
    """The target's Hugging Face id (the card's base_model), None for local/GGUF/random targets."""
    path = str(tcfg.path)
    if path in HF_IDS:
        return HF_IDS[path]
    local = tcfg.random_init or tcfg.gguf_file or path.endswith(".gguf") or ":" in path
    return None if local or Path(path).expanduser().exists() else path


def _latest(run_dir: Path) -> Optional[Path]:
    steps = [c for c in (run_dir / "checkpoints").glob("step-*") if (c / "drafter.json").is_file()]
    return max(steps, key=lambda c: int(c.name.split("-")[1]), default=None)


def resolve_run(path) -> RunInfo:
    """A run dir or drafter folder -> the drafter to export and its run's config and results."""
    p = Path(path).expanduser()
    if (p / "drafter.json").is_file():
        drafter_dir = p
        run_dir = p.parent if p.name == "best" else (
            p.parent.parent if p.parent.name == "checkpoints" else None)
    else:
        run_dir = p
        drafter_dir = p / "best" if (p / "best" / "drafter.json").is_file() else _latest(p)
        if drafter_dir is None:
            raise ExportError(f"{p} holds no drafter: expected a training run dir (best/ or "
                              f"checkpoints/step-*/) or a folder with drafter.json")
    if run_dir is not None and not (run_dir / "config.yaml").is_file():
        run_dir = None
    info = RunInfo(drafter_dir=drafter_dir, run_dir=run_dir)
    if run_dir is None:
        return info
    info.config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=False)
    if (run_dir / "final_eval" / "result.json").is_file():
        result = json.loads((run_dir / "final_eval" / "result.json").read_text())
        info.final, info.final_rows = result["summary"], result["prompts"]
        md = run_dir / "final_eval" / "result.md"
        info.final_md = md.read_text().strip() if md.is_file() else None
    ref = run_dir / "best" if (run_dir / "best" / "drafter.json").is_file() else _latest(run_dir)
    info.is_reference = ref is not None and ref.resolve() == drafter_dir.resolve()
    return info


def read_export(folder) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """config.json and every weights file of an export folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ExportError(f"{folder} has no config.json: not an export folder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{folder}/config.json is not valid JSON: {e}") from e
    files = {f.name: load_file(str(f)) for f in folder.glob("*.safetensors")}
    if (folder / MEDUSA_ORIGINAL).is_file():
        files[MEDUSA_ORIGINAL] = torch.load(folder / MEDUSA_ORIGINAL, weights_only=True)
    return config, files


def _vocab_problems(dcfg, files, target) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the draft vocab maps against each other and the target's tokenizer."""
    errors, warnings = [], []
    maps, Vd, V = vocab_maps(files), dcfg.get("draft_vocab_size"), target.vocab_size
    if Vd is None:
        return (["draft vocab maps present but draft_vocab_size is null"] if maps else []), []
    if maps is None:
        return [f"no draft vocab map (d2t / token_map) for draft_vocab_size={Vd}"], []
    ids, t2d = maps["d2t"], maps["t2d"]
    if ids.numel() != Vd:
        return [f"the vocab map holds {ids.numel()} ids, draft_vocab_size is {Vd}"], []
    if bool((ids < 0).any() or (ids >= V).any()):
        errors.append(f"d2t maps draft ids to target ids outside [0, {V}) (target_id = i + d2t[i])")
    elif not bool((ids[1:] > ids[:-1]).all()):
        errors.append("d2t target ids are not strictly increasing (a target token twice, or "
                      "offsets stored as target ids)")
    elif t2d is not None and (t2d.shape != (V,) or int(t2d.sum()) != Vd or not bool(t2d[ids].all())):
        errors.append("t2d disagrees with d2t (t2d must be True exactly at the target ids of d2t)")
    n_tok = len(target.tokenizer) if hasattr(target.tokenizer, "__len__") else None
    if n_tok is not None and n_tok > V:
        errors.append(f"the target's tokenizer has {n_tok} tokens but its LM head only {V}")
    if not errors:
        if n_tok is not None and bool((ids >= n_tok).any()):
            warnings.append(f"the draft vocab holds ids >= the tokenizer's {n_tok} tokens (padding rows)")
        missing = sorted(set(target.eos_token_ids) - set(ids.tolist()))
        if missing:
            warnings.append(f"EOS ids {missing} are not in the draft vocab: the drafter cannot "
                            f"propose the end of a turn")
    return errors, warnings


def _validate(folder: Path, config, files, target) -> tuple[dict, list[str]]:
    """Raise ExportError listing every problem; return (meta, warnings)."""
    meta = config.get("specdistill")
    if not isinstance(meta, dict) or not {"format", "drafter", "target"} <= set(meta):
        raise ExportError(f"{folder}/config.json has no `specdistill` section (format, drafter, "
                          f"target): not an export written by drafters.export")
    fmt, dcfg = meta["format"], meta["drafter"]
    reason = unsupported(fmt, dcfg)
    if reason:
        raise ExportError(f"{folder}: {reason}")
    t = meta["target"]
    if (t.get("vocab_size"), t.get("hidden_size")) != (target.vocab_size, target.hidden_size):
        raise ExportError(f"{folder} was exported for target {t.get('source')} (vocab "
                          f"{t.get('vocab_size')}, hidden {t.get('hidden_size')}); this target "
                          f"{target.source} has vocab {target.vocab_size}, hidden {target.hidden_size}")
    dtype = config.get("torch_dtype")
    if dtype not in DTYPES:
        raise ExportError(f"{folder}/config.json: torch_dtype {dtype!r} is not one of {sorted(DTYPES)}")
    want = to_layout(fmt, build_drafter(dcfg, target), dcfg, target, meta, dtype,
                     meta.get("speculative_tokens", 5))
    problems = []
    for key, value in json.loads(json.dumps(want.config)).items():
        if key not in config:
            problems.append(f"config.json: required key {key!r} is missing")
        elif config[key] != value:
            problems.append(f"config.json: {key} = {config[key]!r}, expected {value!r}")
    for fname, tensors in want.files.items():
        got = files.get(fname)
        if got is None:
            problems.append(f"weights file {fname} is missing")
            continue
        for name in sorted(set(tensors) - set(got)):
            problems.append(f"{fname}: required tensor {name!r} is missing")
        for name in sorted(set(got) - set(tensors)):
            problems.append(f"{fname}: unexpected tensor {name!r}")
        for name in sorted(set(tensors) & set(got)):
            a, b = got[name], tensors[name]
            if tuple(a.shape) != tuple(b.shape):
                problems.append(f"{fname}: {name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
            elif a.dtype != b.dtype:
                problems.append(f"{fname}: {name} has dtype {a.dtype}, expected {b.dtype}")
    errors, warnings = _vocab_problems(dcfg, files, target)
    problems += errors + _content_problems(fmt, dcfg, files, target, DTYPES[dtype])
    if problems:
        raise ExportError(f"export {folder} is invalid:\n  - " + "\n  - ".join(problems))
    return meta, warnings


def _content_problems(fmt, dcfg, files, target, dt) -> list[str]:
    """Values a shape check cannot see: shared target weights, zero biases, duplicate files."""
    out, w = [], files.get(WEIGHTS, {})
    if fmt == "sglang" and "fc.bias" in w and bool(w["fc.bias"].any()):
        out.append("fc.bias must be zero (our fc has no bias; SGLang's adds it)")
    head = w.get("lm_heads.0.weight")
    if dcfg["name"] == "medusa" and dcfg.get("draft_vocab_size") is None and head is not None \
            and head.shape == target.lm_head().weight.shape \
            and not torch.equal(head, target.lm_head().weight.detach().cpu().to(dt)):
        out.append("lm_heads.0.weight differs from the target's LM head, which a full-vocab Medusa "
                   "drafter shares: exported for another target?")
    orig = files.get(MEDUSA_ORIGINAL)
    if orig is not None and head is not None and not out:
        L = dcfg["num_layers"]
        for name, v in orig.items():  # {i}.{j}.linear.{kind} or {i}.{L}.weight
            i, rest = name.split(".", 1)
            twin = head if rest == f"{L}.weight" else w.get(f"blocks.{i}.layers.{rest.replace('.linear', '')}")
            if twin is not None and twin.shape == v.shape and not torch.equal(twin, v):
                out.append(f"{MEDUSA_ORIGINAL}: {name} differs from its copy in {WEIGHTS}")
    return out


def validate_export(folder, target) -> list[str]:
    """Check an export folder against its format and `target`; raise ExportError with every
    problem, return warnings (e.g. EOS outside the draft vocab)."""
    config, files = read_export(folder)
    return _validate(Path(folder), config, files, target)[1]


def load_export(folder, target) -> Drafter:
    """Rebuild the drafter of an export folder (any format) on `target`, validated first."""
    return _load(folder, target)[0]


def _load(folder, target) -> tuple[Drafter, list[str]]:
    cfg_file = Path(folder) / "config.json"
    if cfg_file.is_file():  # a small_lm export is a standalone HF causal LM (drafters/hf_export.py)
        hf_cfg = json.loads(cfg_file.read_text())
        if hf_cfg.get("specdistill", {}).get("drafter", {}).get("name") == "small_lm":
            from drafters.hf_export import load_hf_export
            return load_hf_export(folder, target), []
    config, files = read_export(folder)
    meta, warnings = _validate(Path(folder), config, files, target)
    dcfg = meta["drafter"]
    drafter = build_drafter(dcfg, target)
    drafter.load_state_dict(from_layout(meta["format"], dcfg, files, target.vocab_size), strict=True)
    return drafter, warnings


def full_config(drafter_cfg) -> dict[str, Any]:
    """Every field of a drafter config (defaults filled in), as plain JSON-ready data."""
    d = config_dict(drafter_cfg)
    return config_dict(parse_config(d, CONFIGS[d["name"]]))


def _target_meta(target) -> dict[str, Any]:
    return {"source": target.source, "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers,
            "architectures": list(getattr(target.config, "architectures", None) or [])}


def _write(folder: Path, layout) -> None:
    from safetensors.torch import save_file

    (folder / "config.json").write_text(json.dumps(layout.config, indent=2) + "\n")
    for name, tensors in layout.files.items():
        if name.endswith(".safetensors"):
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
        else:
            torch.save(tensors, folder / name)


def _replace(tmp: Path, out: Path) -> None:
    """fsync tmp's files, then rename it to out (an existing out is moved aside, then removed)."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = out.parent / f".old-{out.name}-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def export_drafter(drafter: Drafter, drafter_cfg, target, fmt: str, out, *, dtype: str = "float32",
                   base_model: str | None = None, license: str = "apache-2.0",
                   info: RunInfo | None = None, speculative_tokens: int = 5,
                   overwrite: bool = False, check: Callable[[Path], dict] | None = None) -> dict:
    """Write `drafter` as format fmt into `out` (steps in the module docstring). check(tmp_folder)
    may measure the export before it is committed and returns the card's parity section.
    Returns {"path", "warnings", "parity"}."""
    dcfg, out = full_config(drafter_cfg), Path(out).expanduser()
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    if dcfg["name"] == "small_lm":  # a standalone HF causal LM, checked by its own logits test
        if fmt != "hf":
            raise ExportError("small_lm exports as format=hf (a standalone HF causal LM) only; "
                              "serving engines load it as a draft model")
        from drafters.hf_export import export_hf
        res: dict = {}
        hook = (lambda f: res.setdefault("parity", check(f))) if check else None
        path = export_hf(drafter, out, target.tokenizer, run_dir=info.run_dir if info else None,
                         base_model=base_model, dtype=dtype, k=speculative_tokens,
                         overwrite=overwrite, check=hook)
        return {"path": path, "warnings": [], "parity": res.get("parity")}
    reason = unsupported(fmt, dcfg)
    if reason:
        raise ExportError(reason)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} exists; pass overwrite=true or another out=")
    meta = {"format": fmt, "drafter": dcfg, "target": _target_meta(target), "base_model": base_model,
            "speculative_tokens": speculative_tokens, "specdistill_version": VERSION}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write(tmp, to_layout(fmt, drafter, dcfg, target, meta, dtype, speculative_tokens))
        back, warnings = _load(tmp, target)  # 2. validated, 3. read back
        back = back.state_dict()
        for name, v in drafter.state_dict().items():  # 3. exact round trip (through dtype)
            ref = v.detach().cpu()
            ref = ref.to(DTYPES[dtype]).to(ref.dtype) if ref.is_floating_point() else ref
            if name not in back or not torch.equal(back[name].cpu(), ref):
                raise ExportError(f"round trip changed {name}: the {fmt} layout lost information")
        parity = check(tmp) if check is not None else None
        files = sorted((f.name, f.stat().st_size) for f in tmp.iterdir())
        (tmp / "README.md").write_text(model_card(fmt, meta, info, parity, files, license))
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"path": out, "warnings": warnings, "parity": parity}


def run_export(cfg, check: Callable | None = None) -> dict:
    """The export job: resolve the run, load target and drafter, export, optionally push.
    check(folder, target, info) -> parity dict (train/export.py passes one)."""
    info = resolve_run(cfg.run)
    dcfg = json.loads((info.drafter_dir / "drafter.json").read_text())
    reason = unsupported(cfg.format, full_config(dcfg))
    if reason:  # before loading anything
        raise ExportError(reason)
    run_cfg = info.config or {}
    tcfg = cfg.target if cfg.target is not None else run_cfg.get("target")
    if tcfg is None:
        raise ExportError(f"{cfg.run} is not inside a training run (no config.yaml): name the "
                          f"target, e.g. target=smollm2 or target.path=<id or folder>")
    tcfg = OmegaConf.merge(OmegaConf.structured(TargetConfig), tcfg)
    target = load_target(tcfg)
    drafter = load_drafter(info.drafter_dir, target).eval()
    k = cfg.k or run_cfg.get("trainer", {}).get("eval_k") or 5
    base = cfg.base_model or hub_id(tcfg)
    hook = (lambda folder: check(folder, target, info)) if check is not None else None
    result = export_drafter(drafter, dcfg, target, cfg.format, cfg.out, dtype=cfg.dtype,
                            base_model=base, license=cfg.license, info=info,
                            speculative_tokens=k, overwrite=cfg.overwrite, check=hook)
    print(f"exported {info.drafter_dir} as {cfg.format} to {result['path']}")
    for w in result["warnings"]:
        print(f"warning: {w}")
    if cfg.push_to_hub:
        print(f"pushed: {push_to_hub(result['path'], cfg.push_to_hub, private=cfg.private)}")
    return result


def store_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="export_schema", node=ExportConfig)


def main() -> None:
    import hydra

    store_schema()

    @hydra.main(config_path="../conf", config_name="export", version_base="1.3")
    def _run(cfg) -> None:
        if cfg.parity:
            sys.exit("parity=true decodes with the export, which needs decode/: run "
                     "`python -m train.export ...` with the same arguments")
        try:
            run_export(cfg)
        except (ExportError, PushError) as e:
            sys.exit(f"error: {e}")

    _run()


if __name__ == "__main__":
    main()
