"""Drafter <-> export folder: write a drafter in one of the layouts its module registered, validate
an export folder, load one back. Serving engines and the Hub load these folders; the export job
that finds a run's best checkpoint, writes the card's metrics and measures parity is
`python -m train.export` (train/export.py).

This module holds no drafter names: the layouts (drafters/parts/layouts.py ExportLayout) come from the
registry, so an unsupported (drafter, format) pair is refused naming the formats the drafter has.
Every tensor-layout export is
  1. written into a staging folder next to `out` (store/atomic.py);
  2. validated (validate_export): config.json keys and values, tensor names, shapes and dtypes
     against the layout of a freshly built drafter of the same config on the same target, the
     draft vocab maps against each other and the target's tokenizer, and the layout's own checks;
  3. read back (load_export) and compared with the source drafter's weights, exactly;
  4. given a model card (export/card.py) and a MANIFEST.json (size and sha256 of every file,
     checked whenever the folder is read back: store/manifest.py), then renamed to `out`:
     a crash never leaves half an export. A self-saving layout (e.g. small_lm's causal_lm) does 2-3
     itself in its `save`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from specdistill.drafters.base import (
    Drafter,
    build_drafter,
    config_dict,
    drafter_class,
    parse_config,
)
from specdistill.drafters.parts.layouts import (
    EXPORT_DTYPES,
    ExportContext,
    ExportError,
    ExportLayout,
    cast,
    torch_dtype,
)
from specdistill.export.card import CardFacts, context_warning, model_card
from specdistill.store.atomic import write_folder
from specdistill.store.drafter import TargetMismatch, load_drafter
from specdistill.store.manifest import verify, write_manifest
from specdistill.store.rundir import DrafterSource

VERSION = "0.1.0"

log = logging.getLogger(__name__)


def layout_for(fmt: str, dcfg: dict[str, Any]) -> tuple[type[Drafter], ExportLayout]:
    """The drafter class and the layout `fmt` it registered for config dcfg; ExportError naming
    the formats it has when it has no such layout or dcfg cannot use it."""
    name = dcfg.get("name")
    try:
        cls = drafter_class(name)
    except KeyError as e:
        raise ExportError(e.args[0]) from None
    if not cls.layouts:
        raise ExportError(f"drafter {name!r} registers no export layouts (it has no weights)")
    if fmt not in cls.layouts:
        raise ExportError(f"unknown format {fmt!r} for drafter {name!r}; its formats: "
                          f"{', '.join(sorted(cls.layouts))}")
    reason = cls.layouts[fmt].refusal(dcfg)
    if reason:
        raise ExportError(reason)
    return cls, cls.layouts[fmt]


def full_config(drafter_cfg) -> dict[str, Any]:
    """Every field of a drafter config (defaults filled in), as plain JSON-ready data."""
    d = config_dict(drafter_cfg)
    return config_dict(parse_config(d, drafter_class(d["name"]).config_class))


def read_export(folder) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """config.json and every weights file (*.safetensors, *.pt) of an export folder, verified
    against its MANIFEST.json first (an export written before manifests: unreadable files named)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ExportError(f"{folder} has no config.json: not an export folder")
    damage = verify(folder)
    if damage:
        raise ExportError(f"export {folder} is damaged: {'; '.join(damage)}; export it again")
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{folder}/config.json is not valid JSON: {e}") from e
    files = {}
    for f in sorted([*folder.glob("*.safetensors"), *folder.glob("*.pt")]):
        try:
            files[f.name] = load_file(str(f)) if f.suffix == ".safetensors" else \
                torch.load(f, weights_only=True)
        except Exception as e:  # safetensors' SafetensorError, torch's RuntimeError / pickle errors
            raise ExportError(f"export {folder}: {f.name} cannot be read ({type(e).__name__}: "
                              f"{e}); it is damaged: export it again") from e
    return config, files


def _meta(folder: Path, config: dict, target) -> tuple[dict, ExportLayout]:
    """config.json's `specdistill` section and the layout it names, checked against `target`."""
    meta = config.get("specdistill")
    if not isinstance(meta, dict) or not {"format", "drafter", "target"} <= set(meta):
        raise ExportError(f"{folder}/config.json has no `specdistill` section (format, drafter, "
                          f"target): not an export written by export.folder")
    layout = layout_for(meta["format"], meta["drafter"])[1]
    t = meta["target"]
    if (t.get("vocab_size"), t.get("hidden_size")) != (target.vocab_size, target.hidden_size):
        raise ExportError(f"{folder} was exported for target {t.get('source')} (vocab "
                          f"{t.get('vocab_size')}, hidden {t.get('hidden_size')}); this target "
                          f"{target.source} has vocab {target.vocab_size}, hidden {target.hidden_size}")
    return meta, layout


def _vocab_problems(dcfg, state, target) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the draft vocab maps (read back into our state dict) against each
    other and the target's tokenizer."""
    errors, warnings = [], []
    ids, t2d = state.get("draft_vocab.d2t"), state.get("draft_vocab.t2d")
    Vd, V = dcfg.get("draft_vocab_size"), target.vocab_size
    if Vd is None:
        return (["draft vocab maps present but draft_vocab_size is null"] if ids is not None else []), []
    if ids is None:
        return [f"no draft vocab map (d2t / token_map) for draft_vocab_size={Vd}"], []
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


def _layout_problems(want_config, want_files, config, files) -> list[str]:
    """config.json values and tensor names / shapes / dtypes against the expected layout."""
    problems = []
    for key, value in json.loads(json.dumps(want_config)).items():
        if key not in config:
            problems.append(f"config.json: required key {key!r} is missing")
        elif config[key] != value:
            problems.append(f"config.json: {key} = {config[key]!r}, expected {value!r}")
    for fname, tensors in want_files.items():
        got = files.get(fname)
        if got is None:
            problems.append(f"weights file {fname} is missing")
            continue
        problems += [f"{fname}: required tensor {n!r} is missing" for n in sorted(set(tensors) - set(got))]
        problems += [f"{fname}: unexpected tensor {n!r}" for n in sorted(set(got) - set(tensors))]
        for name in sorted(set(tensors) & set(got)):
            a, b = got[name], tensors[name]
            if tuple(a.shape) != tuple(b.shape):
                problems.append(f"{fname}: {name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
            elif a.dtype != b.dtype:
                problems.append(f"{fname}: {name} has dtype {a.dtype}, expected {b.dtype}")
    return problems


def _cast_state(drafter: Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: cast(v, dtype) for k, v in drafter.state_dict().items()}


def _validate(folder: Path, config, files, target):
    """Raise ExportError listing every problem; return (meta, layout, our state dict, warnings)."""
    meta, layout = _meta(folder, config, target)
    dcfg, dtype = meta["drafter"], config.get("torch_dtype")
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"{folder}/config.json: torch_dtype {dtype!r} is not one of {list(EXPORT_DTYPES)}")
    fresh = build_drafter(dcfg, target)
    ctx = ExportContext(target, dcfg, dtype, meta, meta.get("speculative_tokens", 5))
    problems = _layout_problems(*layout.write(fresh, _cast_state(fresh, torch_dtype(dtype)), ctx),
                                config, files)
    state, warnings = {}, []
    if not problems:
        try:
            state = layout.read(files, dcfg, target.vocab_size)
        except (KeyError, IndexError, RuntimeError) as e:
            problems.append(f"the {layout.format} files cannot be read back: {type(e).__name__}: {e}")
        else:
            problems, warnings = _vocab_problems(dcfg, state, target)
        if layout.verify is not None and not problems:
            problems += layout.verify(files, dcfg, target, torch_dtype(dtype))
    if problems:
        raise ExportError(f"export {folder} is invalid:\n  - " + "\n  - ".join(problems))
    return meta, layout, state, warnings


def validate_export(folder, target) -> list[str]:
    """Check an export folder against its layout and `target`; raise ExportError with every
    problem, return warnings (e.g. EOS outside the draft vocab)."""
    return _load(folder, target)[1]


def load_export(folder, target) -> Drafter:
    """Rebuild the drafter of an export folder (any layout) on `target`, validated first."""
    return _load(folder, target)[0]


def _load(folder, target) -> tuple[Drafter, list[str]]:
    folder = Path(folder)
    config, files = read_export(folder)
    meta, layout = _meta(folder, config, target)
    if layout.load is not None:  # a self-saving layout reads (and checks) its own folder
        return layout.load(folder, target), []
    meta, layout, state, warnings = _validate(folder, config, files, target)
    drafter = build_drafter(meta["drafter"], target)
    drafter.load_state_dict(state, strict=True)
    return drafter, warnings


def _write(folder: Path, config: dict, files: dict) -> None:
    from safetensors.torch import save_file

    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, tensors in files.items():
        if name.endswith(".safetensors"):
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
        else:
            torch.save(tensors, folder / name)


def target_meta(target) -> dict[str, Any]:
    """What an export records of its target (checked when it is loaded)."""
    return {"source": target.source, "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers,
            "architectures": list(getattr(target.config, "architectures", None) or [])}


def _round_trip(tmp: Path, drafter: Drafter, target, fmt: str, dtype: torch.dtype) -> list[str]:
    """Steps 2-3: validate and read back; every weight must survive exactly (through dtype)."""
    back, warnings = _load(tmp, target)
    back = back.state_dict()
    for name, v in drafter.state_dict().items():
        ref = v.detach().cpu()
        ref = ref.to(dtype).to(ref.dtype) if ref.is_floating_point() else ref
        if name not in back or not torch.equal(back[name].cpu(), ref):
            raise ExportError(f"round trip changed {name}: the {fmt} layout lost information")
    return warnings


def export_drafter(drafter: Drafter, drafter_cfg, target, fmt: str, out, *, dtype: str = "float32",
                   base_model: str | None = None, license: str = "apache-2.0",
                   facts: CardFacts | None = None, k: int = 5,
                   overwrite: bool = False, check: Callable[[Path], dict] | None = None) -> dict:
    """Write `drafter` in layout fmt into `out` (steps in the module docstring). facts: the run's
    measurements for the card; check(staging folder) may measure the export before it is
    committed and returns the card's parity section. Returns {"path", "warnings", "parity",
    "context"}: context is config.json's record of the lengths trained and served (None when
    facts do not say what was trained), with the warning logged when the target serves longer."""
    dcfg, out = full_config(drafter_cfg), Path(out).expanduser()
    dt = torch_dtype(dtype)
    cls, layout = layout_for(fmt, dcfg)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} exists; pass overwrite=true or another out=")
    _check_replaceable(out)
    meta = {"format": fmt, "drafter": dcfg, "target": target_meta(target), "base_model": base_model,
            "speculative_tokens": k, "specdistill_version": VERSION}
    trained = facts.trained_length if facts is not None else None
    if trained is not None:  # what the drafter's max_position_embeddings (the target's) rests on
        meta["context"] = {"trained_max_length": int(trained), "target_max_length": target.max_length}
    ctx = ExportContext(target, dcfg, dtype, meta, k)
    result: dict[str, Any] = {"path": out, "warnings": [], "parity": None,
                              "context": meta.get("context")}

    def fill(tmp: Path) -> None:
        if layout.save is not None:  # 1-3 in the layout's own save
            layout.save(drafter, tmp, ctx)
        else:
            _write(tmp, *layout.write(drafter, _cast_state(drafter, dt), ctx))  # 1
            result["warnings"] = _round_trip(tmp, drafter, target, fmt, dt)  # 2, 3
        result["parity"] = check(tmp) if check is not None else None
        files = sorted((f.name, f.stat().st_size) for f in tmp.iterdir())
        (tmp / "README.md").write_text(model_card(layout, cls, meta, facts, result["parity"],
                                                  files, license))  # 4
        write_manifest(tmp)

    try:
        write_folder(out, fill)
    except OSError as e:  # the staging folder sits next to out: name out, not the temp folder
        raise ExportError(f"cannot write the export to out={out}: {e.strerror} ({e.filename}); "
                          f"pick a writable out=") from e
    short = context_warning(trained, target.max_length)
    if short:  # one line; the card says it too
        log.warning("export %s: %s", out, short)
    return result


def _check_replaceable(out: Path) -> None:
    """overwrite=true replaces an earlier export of ours (its config.json says specdistill) or an
    empty folder; a folder holding anything else is refused, so no unrelated file is deleted."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"out={out} is a file, not a folder; pick another out=")
    try:
        ours = "specdistill" in json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        ours = False
    if any(out.iterdir()) and not ours:
        names = sorted(f.name for f in out.iterdir())[:5]
        raise ExportError(f"out={out} holds files that are not a specdistill export ({', '.join(names)}"
                          f"{', ...' if len(names) == 5 else ''}); overwrite=true replaces only an "
                          f"earlier export: pick another out= or empty the folder")


def load_resolved(source: DrafterSource, target, decode_overrides: dict | None = None):
    """The drafter of a resolved source on `target` (an export through load_export). A drafter
    that does not fit the target is refused naming both targets (store/drafter.py load_drafter);
    for a folder saved before drafters recorded their target, the run's config names it."""
    if source.is_export:
        return load_export(source.folder, target)
    try:
        return load_drafter(source.folder, target, decode_overrides)
    except TargetMismatch as e:
        trained = ((source.run_config or {}).get("target") or {}).get("path")
        if trained is None or "trained for target" in str(e):
            raise
        raise TargetMismatch(f"{e}; its run {source.run_dir} trained it for target {trained}, "
                             f"the given target is {target.source}") from e
