"""`python -m train.export ...`: drafters/export.py's job plus train/serve parity (parity=true).

    python -m train.export run=runs/train/<run> format=hf out=exports/eagle parity=true parity_limit=10

Parity: before the export is committed, its folder is loaded back by our decoder (load_export) and
decodes the run's final-eval prompts with the final eval's settings (eval set, k, budget, greedy).
It is compared, prompt by prompt, with final_eval/result.json written at training end: the generated
tokens and the accepted drafts of every round must be identical (greedy decoding is deterministic),
so tau matches exactly. A mismatch fails the export; the model card shows both taus. This module
lives in train/ because it needs decode/, which drafters/ never imports.
"""
from __future__ import annotations

import sys
from pathlib import Path

from drafters.export import ExportError, PushError, RunInfo, load_export, run_export, store_schema


def _tau(rows: list[dict]) -> float:
    """Tokens per target forward over rows of result.json (bonus included, as decode/metrics.py)."""
    accepted = [n for r in rows for n in r["accepted"]]
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else 0.0


def measure_parity(folder: Path, target, info: RunInfo, limit: int | None = None) -> dict:
    """Decode with the export in `folder` and compare with the training-end final eval."""
    from decode.evaluate import evaluate_drafter

    ref, rows = info.final, info.final_rows
    if ref is None:
        raise ExportError(f"parity needs the run's final_eval/result.json (the tau at training end); "
                          f"{info.run_dir or info.drafter_dir} has none. Export without parity=true.")
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
        f"| training end (final_eval) | {tau_train:.3f} | reference |",
        f"| this export | {tau_export:.3f} | {'identical' if result['identical'] else 'DIFFERENT'} |"])
    if not result["identical"]:
        raise ExportError(f"train/serve parity failed: the export decodes {len(result['mismatched_prompts'])} "
                          f"of {n} prompts differently (tau {tau_export:.3f} vs {tau_train:.3f} at "
                          f"training end); use dtype=float32 and the run's own target")
    return result


def main() -> None:
    import hydra

    store_schema()

    @hydra.main(config_path="../conf", config_name="export", version_base="1.3")
    def _run(cfg) -> None:
        check = (lambda folder, target, info: measure_parity(folder, target, info, cfg.parity_limit)
                 ) if cfg.parity else None
        try:
            result = run_export(cfg, check=check)
        except (ExportError, PushError) as e:
            sys.exit(f"error: {e}")
        if result["parity"] is not None:
            print(result["parity"]["markdown"])

    _run()


if __name__ == "__main__":
    main()
