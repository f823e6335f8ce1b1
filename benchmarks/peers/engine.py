"""Step 6 (--engine): each arm's drafter in our vLLM CPU engine check (decode/engine/check.py), the
one the train job runs after its final eval: vLLM loads the target with the drafter, decodes the
replay's MT-bench prompts greedily with and without it, and our decoder is replayed on its text.

What is loaded is what each arm ships for vLLM: ours, its best checkpoint exported in the layout
vLLM serves (export/folder.py, as the job's check does); the peers, their own export folders
as they wrote them (speculators' format, SpecForge's LlamaForCausalLMEagle3), loaded with vLLM's
EAGLE-3 reader and replayed through our reading of them (imports.py). Per arm: whether vLLM loads
it (its own words when not), speculative == plain, tau in vLLM beside our replay's on its text,
and vLLM's tokens/s plain and speculative.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)
PEER_SERVING = {"method": "eagle3"}  # vLLM's reader of both peers' EAGLE-3 exports
KEEP = ("loaded", "error", "verdict", "problems", "prompts", "spec_equals_plain",
        "spec_differs_at_near_tie", "spec_differs_at_engine_tie", "tau_engine", "tau_replay", "tau_ratio",
        "engine_plain_tokens_per_s", "engine_spec_tokens_per_s", "engine_speedup",
        "engine_version", "format")


def engine_result(summary: dict) -> dict:
    """What peers.json keeps of an engine check's summary."""
    return {k: summary[k] for k in KEEP if k in summary}


def arm_export(name: str, res: dict, drafter, target, out: Path, k: int) -> tuple[Path, dict | None]:
    """(the folder vLLM loads for arm `name`, vLLM's entry for it: None = ours, read from the
    export's own config)."""
    if name != "ours":
        return Path(res["train"]["drafter"]), PEER_SERVING
    from specdistill.decode.engine.check import engine_format
    from specdistill.export.folder import export_drafter
    from specdistill.store.drafter import CONFIG_FILE

    fmt, why = engine_format(drafter, "vllm")
    if fmt is None:
        raise ValueError(f"vLLM serves no layout of our drafter: {why}")
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
            got = engine_check(folder, target, drafter, engine="vllm", limit=args.engine_prompts,
                               max_new_tokens=args.tokens, k=args.k, out_dir=out, cache=cache,
                               target_dir=served, serving=serving)
            res["engine"] = engine_result(got["summary"])
        except Exception as e:  # recorded in the table, the other arms go on
            res["engine"] = {"loaded": False, "error": f"{type(e).__name__}: {e}",
                             "verdict": "not run"}


def engine_cells(e: dict | None) -> list[str]:
    """The table's engine cells of one arm: loads, spec == plain, tau (vLLM / our replay on its
    text), tokens/s plain / speculative."""
    if not e:
        return ["—"] * 4
    if not e.get("loaded"):
        why = " ".join(str(e.get("error") or e.get("verdict") or "").split()).replace("|", "\\|")
        return [f"no: {why[:200]}", "—", "—", "—"]

    def f(x, nd):
        return "—" if x is None else f"{x:.{nd}f}"

    same = e.get("spec_equals_plain")
    same = "—" if same is None else f"{same}/{e.get('prompts')}"
    return [("yes" if e.get("verdict") == "pass" else f"yes, {e.get('verdict')}"), same,
            f"{f(e.get('tau_engine'), 3)} / {f(e.get('tau_replay'), 3)}",
            f"{f(e.get('engine_plain_tokens_per_s'), 1)} / {f(e.get('engine_spec_tokens_per_s'), 1)}"]
