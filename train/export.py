"""`python -m train.export ...`: the export job. Run dir -> its best checkpoint -> an export layout
(export/folder.py) + a model card with the run's measurements + optional train/serve parity.

    python -m train.export run=runs/train/<run> format=hf out=exports/my-eagle
    python -m train.export run=<run> format=vllm out=exports/eagle-vllm push_to_hub=org/name
    python -m train.export run=<run> format=hf out=exports/eagle parity=true parity_limit=10

`run` is a training run dir (its best/ drafter, else the latest complete checkpoint: the one the
final eval measured) or a checkpoint / drafter folder, verified against its MANIFEST.json first
(store/rundir.py). A run dir whose best/ is damaged exports the newest checkpoint that
verifies, with a warning, and the model card says which checkpoint it is and that the card's
numbers were not measured with it (parity is then refused). The formats are the layouts the
drafter's module registered (drafters/parts/layouts.py ExportLayout).

Parity: before the export is committed, its folder is loaded back by our decoder (load_export) and
decodes the run's final-eval prompts with the final eval's settings (eval set, k, budget, greedy).
It is compared, prompt by prompt, with final_eval/result.json written at training end: the generated
tokens and the accepted drafts of every round must be identical (greedy decoding is deterministic),
so tau matches exactly. A mismatch fails the export; the model card shows both taus. This job lives
in train/ because it reads run dirs and needs decode/, which drafters/ never imports.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import MISSING, OmegaConf

from specdistill.cli.ranges import MAX_COUNT, MAX_DRAFT, check_ranges, rng
from specdistill.export.card import CardFacts
from specdistill.export.folder import (
    ExportError,
    export_drafter,
    full_config,
    layout_for,
    load_export,
    load_resolved,
)
from specdistill.store.rundir import reference_drafter, resolve_drafter
from specdistill.target.model import TargetConfig, load_target
from specdistill.train.hub import PushError, push_to_hub

HF_IDS = {"packaged:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # packaged target -> Hub id


@dataclass
class ExportConfig:
    """`python -m train.export` (conf/export.yaml)."""

    run: str = MISSING  # training run dir (best/, else latest checkpoint) or a checkpoint folder
    # a layout the drafter registered: hf (all), vllm, sglang, speculators, medusa, causal_lm
    format: str = "hf"
    out: str = MISSING  # export folder, written atomically
    overwrite: bool = False  # replace an existing `out`
    dtype: str = "float32"  # float32 | bfloat16 | float16 (float32 keeps greedy parity exact)
    base_model: Optional[str] = None  # card/Hub base_model (None = the target's Hub id, if it has one)
    license: str = "apache-2.0"  # card license
    # speculative tokens in configs and usage lines (None = the run's eval_k)
    k: Optional[int] = rng(None, 1, MAX_DRAFT)
    push_to_hub: Optional[str] = None  # org/name: upload after exporting (token: HF_TOKEN)
    private: bool = True  # create the Hub repo private
    parity: bool = False  # decode MT-bench with the reloaded export before committing it
    # parity prompts (None = all of the run's final eval)
    parity_limit: Optional[int] = rng(None, 1, MAX_COUNT)
    # load the export in this serving engine before committing it (decode/engine/: vllm) and
    # refuse it unless the engine's acceptance equals our decoder's on the same text
    engine_check: Optional[str] = None
    # prompts (None = the run's final eval's, else 20)
    engine_check_limit: Optional[int] = rng(None, 1, MAX_COUNT)
    target: Optional[TargetConfig] = None  # the target (None = the run's config.yaml target)


@dataclass
class RunInfo:
    """What the export job knows about the training run it exports from."""

    drafter_dir: Path  # the saved drafter exported (drafter.json + drafter.safetensors)
    source: Any = None  # how `run` resolved (store/rundir.py DrafterSource)
    run_dir: Optional[Path] = None  # the training run dir, when the drafter lies in one
    config: Optional[dict] = None  # the run's config.yaml
    final_rows: Optional[list] = None  # final_eval/result.json per-prompt rows
    is_reference: bool = False  # drafter_dir is the drafter the final eval measured
    facts: CardFacts = field(default_factory=CardFacts)  # the card's measurements


def hub_id(tcfg) -> Optional[str]:
    """The target's Hugging Face id (the card's base_model), None for local/GGUF/random targets."""
    path = str(tcfg.path)
    if path in HF_IDS:
        return HF_IDS[path]
    local = tcfg.random_init or tcfg.gguf_file or path.endswith(".gguf") or ":" in path
    return None if local or Path(path).expanduser().exists() else path


def last_simulated_eval(metrics: Path) -> Optional[dict[str, Any]]:
    """The latest simulated eval in a run's metrics.jsonl: {"step", "tau", "acceptance"}."""
    if not metrics.is_file():
        return None
    last = None
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row.get("eval/sim_tau"), (int, float)):  # null: that eval measured nothing
            last = row
    if last is None:
        return None
    acc = sorted((k for k in last if k.startswith("eval/acc_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    return {"step": last["step"], "tau": last["eval/sim_tau"], "acceptance": [last[k] for k in acc]}


def read_run(path) -> RunInfo:
    """A run dir or drafter folder -> the drafter to export and its run's config and results."""
    try:
        source = resolve_drafter(path, setting="run")
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    if source.is_export:
        raise ExportError(f"run={path} is already an export: export from the training run dir or "
                          f"a checkpoint folder")
    drafter_dir, run_dir = source.folder, source.run_dir
    info = RunInfo(drafter_dir=drafter_dir, source=source, run_dir=run_dir)
    if run_dir is None:
        return info
    info.config = source.run_config
    info.facts = CardFacts(training_config=info.config, fallback=source.fallback,
                           simulated=last_simulated_eval(run_dir / "metrics.jsonl"),
                           trained_length=((info.config or {}).get("data") or {}).get("max_length"))
    if (run_dir / "final_eval" / "result.json").is_file():
        result = json.loads((run_dir / "final_eval" / "result.json").read_text())
        info.facts.final, info.final_rows = result["summary"], result["prompts"]
        md = run_dir / "final_eval" / "result.md"
        info.facts.final_table = md.read_text().strip() if md.is_file() else None
    engine_md = run_dir / "final_eval" / "engine" / "engine_check.md"
    if engine_md.is_file():  # the job's own engine check (train/recipe.py engine_check)
        info.facts.engine_table = engine_md.read_text().strip()
    ref = reference_drafter(run_dir)
    info.is_reference = ref is not None and ref.resolve() == drafter_dir.resolve()
    return info


def _tau(rows: list[dict]) -> float | None:
    """Tokens per target forward over rows of result.json (bonus included, as decode/metrics.py);
    None when nothing was measured (no decode round, or no draft token)."""
    accepted = [n for r in rows for n in r["accepted"]]
    if not accepted or not sum(n for r in rows for n in r["drafted"]):
        return None
    return (sum(accepted) + len(accepted)) / len(accepted)


def _tau_text(tau: float | None) -> str:
    return "not measured" if tau is None else f"{tau:.3f}"


def measure_parity(folder: Path, target, info: RunInfo, limit: int | None = None) -> dict:
    """Decode with the export in `folder` and compare with the training-end final eval."""
    from specdistill.decode.evaluate import evaluate_drafter

    ref, rows = info.facts.final, info.final_rows
    if ref is None:
        raise ExportError(f"parity needs the run's final_eval/result.json (the tau at training end); "
                          f"{info.run_dir or info.drafter_dir} has none. Export without parity=true.")
    if not info.is_reference and info.facts.fallback:  # best/ damaged: rerunning cannot help
        raise ExportError(f"parity compares with the drafter the final eval measured, and "
                          f"{info.facts.fallback}: restore that drafter's files (a backup, or "
                          f"retrain) for parity, or export without parity=true")
    if not info.is_reference:
        raise ExportError(f"parity compares with the drafter the final eval measured (the run's "
                          f"best/, else its latest checkpoint), not {info.drafter_dir}: export "
                          f"run=<run dir> for parity")
    if ref.get("temperature", 0.0) != 0.0 or ref.get("tree"):
        raise ExportError("parity is defined for the greedy chain final eval; this run's differs")
    first_turns = [r for r in rows if r["turn"] == 1]
    n = min(limit or len(first_turns), len(first_turns))
    drafter = load_export(folder, target).eval()
    got = evaluate_drafter(target, drafter, eval_kind=ref["eval"], limit=n, turns=1,
                           max_new_tokens=ref["max_new_tokens"], k=ref["k"], compare_plain=False)
    want = first_turns[:n]
    same = [a["generated_ids"] == b["generated_ids"] and a["accepted"] == b["accepted"]
            for a, b in zip(got["prompts"], want)]
    tau_export, tau_train = got["summary"]["tau"], _tau(want)
    result = {"prompts": n, "tau_export": tau_export, "tau_training_end": tau_train,
              "identical": all(same), "mismatched_prompts": [r["id"] for r, s in zip(want, same) if not s]}
    result["markdown"] = "\n".join([
        f"The exported folder, loaded back by specdistill's decoder, decoded the first {n} prompts "
        f"of the training-end evaluation ({ref['eval']}, greedy, k={ref['k']}, "
        f"{ref['max_new_tokens']} new tokens):", "",
        "| | tau | outputs and accepted drafts |", "|---|---:|:---:|",
        f"| training end (final_eval) | {_tau_text(tau_train)} | reference |",
        f"| this export | {_tau_text(tau_export)} | {'identical' if result['identical'] else 'DIFFERENT'} |"])
    if not result["identical"]:
        bad = len(result['mismatched_prompts'])
        raise ExportError(f"train/serve parity failed: the export decodes {bad} "
                          f"of {n} prompts differently (tau {_tau_text(tau_export)} vs "
                          f"{_tau_text(tau_train)} at training end); use dtype=float32 and the "
                          f"run's own target")
    return result


def measure_in_engine(folder: Path, target, info: RunInfo, drafter, cfg) -> dict:
    """Load the staged export in a real serving engine (decode/engine/check.py) on the run's
    final-eval prompts and compare with the trained drafter; ExportError (nothing committed)
    unless the engine serves it as our decoder decodes it. Returns the card's section."""
    import tempfile

    from specdistill.decode.engine.check import engine_check
    from specdistill.target.model import cache_root

    ref = info.facts.final or {}
    meta = json.loads((folder / "config.json").read_text())["specdistill"]
    with tempfile.TemporaryDirectory(prefix="engine-check-") as work:
        res = engine_check(folder, target, drafter, engine=cfg.engine_check,
                           eval_kind=ref.get("eval", "mtbench"),
                           limit=cfg.engine_check_limit or ref.get("prompts") or 20,
                           max_new_tokens=ref.get("max_new_tokens", 128),
                           k=int(meta.get("speculative_tokens") or 2), out_dir=Path(work),
                           cache=cache_root(target_config(cfg, info)), ours=info.final_rows,
                           ours_dtype=ref.get("target_dtype"))
        for name in ("engine_check.json", "engine_check.md"):  # shipped with the export
            shutil.copy(Path(work) / name, folder / name)
    s = res["summary"]
    if s.get("verdict") != "pass":
        raise ExportError(f"the {cfg.engine_check} engine check failed ({s.get('verdict')}: "
                          f"{s.get('error') or '; '.join(s.get('problems', []))}); the export was "
                          f"not written. Without engine_check= it would be.")
    return {"markdown": "Loaded in a real serving engine before it was written "
                        "(`python -m decode.engine`, decode/engine/check.py):\n\n" + res["markdown"]}


def target_config(cfg, info: RunInfo):
    """The target of an export job: cfg.target, else the run's; a TargetConfig."""
    tcfg = cfg.target if cfg.target is not None else (info.config or {}).get("target")
    if tcfg is None:
        raise ExportError(f"{cfg.run} is not inside a training run (no config.yaml): name the "
                          f"target, e.g. target=smollm2 or target.path=<id or folder>")
    return OmegaConf.merge(OmegaConf.structured(TargetConfig), tcfg)


def run_export(cfg, check: Callable | None = None) -> dict:
    """The export job: resolve the run, load target and drafter, export (+ parity), optionally push.
    check(folder, target, info) -> parity dict; None = measure_parity when cfg.parity."""
    check_ranges(cfg, ExportConfig)  # before any work
    info = read_run(cfg.run)
    dcfg = json.loads((info.drafter_dir / "drafter.json").read_text())
    layout_for(cfg.format, full_config(dcfg))  # refuse an unsupported format before loading anything
    run_cfg = info.config or {}
    tcfg = target_config(cfg, info)
    target = load_target(tcfg, training=True)  # auto = float32: exports copy target weights exactly
    drafter = load_resolved(info.source, target).eval()
    if check is None and (cfg.parity or cfg.get("engine_check")):
        def check(folder, target, info):  # parity, then the engine: one card section each
            parts = [measure_parity(folder, target, info, cfg.parity_limit)] if cfg.parity else []
            if cfg.get("engine_check"):
                parts.append(measure_in_engine(folder, target, info, drafter, cfg))
            return {"markdown": "\n\n".join(p["markdown"] for p in parts)}
    hook = (lambda folder: check(folder, target, info)) if check is not None else None
    result = export_drafter(drafter, dcfg, target, cfg.format, cfg.out, dtype=cfg.dtype,
                            base_model=cfg.base_model or hub_id(tcfg), license=cfg.license,
                            facts=info.facts, overwrite=cfg.overwrite, check=hook,
                            k=cfg.k or run_cfg.get("trainer", {}).get("eval_k") or 5)
    print(f"exported {info.drafter_dir} as {cfg.format} to {result['path']}")
    for w in result["warnings"]:
        print(f"warning: {w}")
    if result["parity"] is not None:
        print(result["parity"]["markdown"])
    if cfg.push_to_hub:
        print(f"pushed: {push_to_hub(result['path'], cfg.push_to_hub, private=cfg.private)}")
    return result


def store_schema() -> None:
    """Put ExportConfig in Hydra's ConfigStore (conf/export.yaml starts from it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="export_schema", node=ExportConfig)


def main() -> None:
    import sys

    import hydra

    from specdistill.cli.paths import CONF_DIR
    from specdistill.cli.start import check_start

    store_schema()
    check_start("python -m train.export", "export", sys.argv[1:], ExportConfig)  # every key, before any work

    @hydra.main(config_path=CONF_DIR, config_name="export", version_base="1.3")
    def _run(cfg) -> None:
        from specdistill.cli.errors import user_errors

        with user_errors("python -m train.export"):  # ExportError is a ValueError
            try:
                run_export(cfg)
            except PushError as e:
                raise ValueError(str(e)) from e

    _run()


if __name__ == "__main__":
    main()
