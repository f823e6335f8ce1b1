"""Step 6 (--engine): each arm's drafter in our engine check (decode/engine/check.py), the one the
train job runs after its final eval: the engine loads the target with the drafter, decodes the
replay's MT-bench prompts greedily with and without it, and our decoder is replayed on its text.
The engine: vLLM CPU for the EAGLE-3 arms, llama.cpp for the DSpark arms (`arm_engine`); a DSpark
peer's export (speculators' `dspark`) goes to llama.cpp's converter as written, our layout's
llama.cpp check (drafters/dspark.py llamacpp_refusal) saying first what it would read otherwise.

What is loaded is what each arm ships for its engine: ours, its best checkpoint exported in the
layout the engine serves (export/folder.py, as the job's check does); the peers, their own export
folders as they wrote them (speculators' format, SpecForge's LlamaForCausalLMEagle3), loaded with
the engine's reader and replayed through our reading of them (imports.py). Per arm: whether the
engine loads it (its own words when not), speculative == plain, tau in the engine beside our
replay's on its text, and the engine's tokens/s plain and speculative.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)
PEER_SERVING = {"method": "eagle3"}  # vLLM's reader of both peers' EAGLE-3 exports
ENGINE_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}
KEEP = ("engine", "loaded", "error", "verdict", "problems", "prompts", "spec_equals_plain",
        "spec_differs_at_near_tie", "spec_differs_at_engine_tie", "spec_differs_at_verify_tie",
        "tau_engine", "tau_replay", "tau_ratio",
        "engine_plain_tokens_per_s", "engine_spec_tokens_per_s", "engine_speedup",
        "engine_version", "format")


def engine_result(summary: dict) -> dict:
    """What peers.json keeps of an engine check's summary."""
    return {k: summary[k] for k in KEEP if k in summary}


def arm_engine(name: str) -> str:
    """The engine an arm is checked in: vLLM CPU for EAGLE-3; llama.cpp for DSpark (vLLM 0.32.0's
    CPU build refuses it: "Model Runner V1 does not support: dspark speculative decoding")."""
    from benchmarks.peers.arms import ArmName

    return "llamacpp" if ArmName.parse(name).algo == "dspark" else "vllm"


def arm_export(name: str, res: dict, drafter, target, out: Path, k: int) -> tuple[Path, dict | None]:
    """(the folder the engine loads for arm `name`, the engine's entry for it: None = ours, read
    from the export's own config)."""
    from benchmarks.peers.arms import ArmName

    engine = arm_engine(name)
    if ArmName.parse(name).peer is not None:
        if engine == "vllm":
            return Path(res["train"]["drafter"]), PEER_SERVING
        return Path(res["train"]["drafter"]), drafter.layouts["speculators"].serving["llamacpp"]
    from specdistill.decode.engine.check import engine_format
    from specdistill.export.folder import export_drafter
    from specdistill.store.drafter import CONFIG_FILE

    fmt, why = engine_format(drafter, engine)
    if fmt is None:
        raise ValueError(f"{engine} serves no layout of our drafter: {why}")
    dcfg = json.loads((Path(res["train"]["drafter"]) / CONFIG_FILE).read_text())
    return Path(export_drafter(drafter, dcfg, target, fmt, out / f"export-{fmt}", k=k,
                               overwrite=True)["path"]), None


def engine_all(args, results: dict, data: dict) -> None:
    """The engine check of every arm of args.arms with a drafter and no engine result yet, into
    results[arm]["engine"]; an arm that fails before the engine ran records why and the others
    go on."""
    from specdistill.decode.engine.check import engine_check, served_target
    from specdistill.target.model import cache_root, load_target

    from benchmarks.peers.replay import load_arm_drafter
    from benchmarks.replaying import compose

    tcfg = compose(list(args.set)).target
    target, cache = load_target(tcfg, training=True), cache_root(tcfg)  # the replay's target
    served = served_target(target, args.out / "engine" / "target")
    for name, res in results.items():
        if name not in args.arms or "engine" in res or not res.get("train", {}).get("drafter"):
            continue
        out = args.out / "engine" / name
        try:
            drafter = load_arm_drafter(name, res, target, data["aux_layers"])
            folder, serving = arm_export(name, res, drafter, target, out, args.k)
            log.info("engine check: %s (%s)", name, folder)
            got = engine_check(folder, target, drafter, engine=arm_engine(name), limit=args.engine_prompts,
                               max_new_tokens=args.tokens, k=args.k, out_dir=out, cache=cache,
                               target_dir=served, serving=serving)
            res["engine"] = engine_result(got["summary"])
        except Exception as e:  # recorded in the table, the other arms go on
            res["engine"] = {"loaded": False, "error": f"{type(e).__name__}: {e}",
                             "verdict": "not run"}


def engine_cells(e: dict | None) -> list[str]:
    """The table's engine cells of one arm: loads (in which engine), spec == plain (check.py
    spec_plain_cell), tau (the engine's / our replay on its text), tokens/s plain / speculative."""
    from specdistill.decode.engine.check import spec_plain_cell

    if not e:
        return ["—"] * 4
    if not e.get("loaded"):
        why = " ".join(str(e.get("error") or e.get("verdict") or "").split()).replace("|", "\\|")
        return [f"no: {why[:200]}", "—", "—", "—"]

    def f(x, nd):
        return "—" if x is None else f"{x:.{nd}f}"

    where = f" ({ENGINE_NAMES.get(e.get('engine'), e.get('engine'))})" if e.get("engine") else ""
    same = spec_plain_cell(e)
    return [("yes" if e.get("verdict") == "pass" else f"yes, {e.get('verdict')}") + where,
            "—" if same == "-" else same,
            f"{f(e.get('tau_engine'), 3)} / {f(e.get('tau_replay'), 3)}",
            f"{f(e.get('engine_plain_tokens_per_s'), 1)} / {f(e.get('engine_spec_tokens_per_s'), 1)}"]
