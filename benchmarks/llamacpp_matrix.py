"""llama.cpp as the judge of our exports, on SmolLM2: the real engine check as a benchmark.

    python -m benchmarks.llamacpp_matrix --out runs/engine/llamacpp --prompts 20 --tokens 128 --k 2 3
    python -m benchmarks.llamacpp_matrix --drafter eagle3=<run dir> ...     # a trained drafter

Not a CI test: the first use builds llama.cpp from source (decode/engine/llamacpp_build.py, tens of
minutes on 2 cores); later runs reuse the cached build.

For each drafter of --layouts (default: eagle3 as `vllm` and `speculators`, dflash as `vllm`, dspark
as `vllm` and `speculators`, small_lm as `causal_lm`):
  1. load it (--drafter NAME=<run dir | checkpoint | saved drafter>) or train it on the target's
     own greedy answers to the check's prompts (`overfit`, about a minute): it gets most drafts
     right, so a layout llama.cpp reads differently shows as lost acceptance. Its tau is therefore
     NOT a tau to expect from a trained drafter on unseen prompts;
  2. export it (export/folder.py), then the engine check (decode/engine/check.py,
     engine=llamacpp: llama.cpp's converter, llama-server plain and speculative interleaved,
     its counters against our decoder replayed on its text) at each k, with our decoder's own
     run on the same prompts beside it (--no-ours skips that);
  3. one table: <out>/llamacpp.md and llamacpp.json (rows of an earlier run into the same --out
     kept, unless measured again).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.engine_matrix import overfit  # one overfit drafter for both

log = logging.getLogger(__name__)

# drafter -> its config for the overfit drafter (the default job's pruned 8192-token head for
# EAGLE-3, a chain trained for k <= 3; DFlash with the full vocabulary, the only head llama.cpp's
# converter maps, and a block of 4 = k 3 + the anchor; DSpark with the pruned head (its converter
# maps d2t) and a block of 4 = k 4 (the anchor drafts too), every anchor trained, as llama.cpp
# drafts its block at k = the trained positions only; small_lm: its default, the target's layers)
CONFIGS: dict[str, dict[str, Any]] = {
    "eagle3": {"name": "eagle3", "draft_vocab_size": 8192, "ttt_length": 3},
    "dflash": {"name": "dflash", "draft_vocab_size": None, "block_size": 4},
    "dspark": {"name": "dspark", "draft_vocab_size": 8192, "block_size": 4, "anchors": None},
    "small_lm": {"name": "small_lm"},
}
LAYOUTS = ("eagle3:vllm", "eagle3:speculators", "dflash:vllm", "dspark:vllm", "dspark:speculators",
           "small_lm:causal_lm")


def drafter_for(name: str, target, seqs, steps: int, given: Optional[str], out: Path,
                stamp: dict):
    """(drafter, its config, where it came from): loaded from a given path, from an earlier run's
    <out>/drafters/<name>/ trained with the same settings (`stamp`), or trained now."""
    from specdistill.store.drafter import load_drafter, save_drafter

    if given:
        from specdistill.store.rundir import resolve_drafter

        folder, _ = resolve_drafter(given)
        return (load_drafter(folder, target).eval(),
                json.loads((folder / "drafter.json").read_text()), f"trained ({folder})")
    cfg, folder = CONFIGS[name], out / "drafters" / name
    stamp = {**stamp, "cfg": cfg, "steps": steps}
    if (folder / "overfit.json").is_file() and json.loads((folder / "overfit.json").read_text()) == stamp:
        return load_drafter(folder, target).eval(), cfg, f"overfit on the check's own answers, " \
                                                         f"{steps} steps (reused {folder})"
    t0 = time.perf_counter()
    d = overfit(target, cfg, seqs(), steps)
    save_drafter(d, cfg, folder)
    (folder / "overfit.json").write_text(json.dumps(stamp, indent=1))
    return d, cfg, f"overfit on the check's own answers, {steps} steps in " \
                   f"{time.perf_counter() - t0:.0f} s"


def run(target, pairs: list[tuple[str, str]], ks: list[int], prompts: int, tokens: int, steps: int,
        out: Path, cache: Path, given: dict[str, str], ours: bool = True,
        threads: Optional[int] = None) -> list[dict]:
    """Steps 1-2 of the module docstring for every (drafter, format) at every k; rows written
    to the table after each check."""
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.engine.check import engine_check
    from specdistill.decode.evaluate import evaluate_drafter, render
    from specdistill.decode.spec import generate
    from specdistill.export.folder import export_drafter

    ids = [render(target, p.turns[:1], []) for p in load_prompts("mtbench", limit=prompts)]
    answers: list[torch.Tensor] = []

    def seqs() -> list[torch.Tensor]:
        if not answers:
            answers.extend(torch.cat([x, generate(target, None, x, max_new_tokens=tokens).tokens])[None]
                           for x in ids)
        return answers

    done = out / "llamacpp.json"  # an earlier run's rows stay unless measured again here
    redo = {(n, f, k) for n, f in pairs for k in ks}
    rows = [r for r in (json.loads(done.read_text()) if done.is_file() else [])
            if (r["drafter"], r["format"], r["k"]) not in redo]
    drafters = {}
    for name, fmt in pairs:
        if name not in drafters:  # 1.
            drafters[name] = drafter_for(name, target, seqs, steps, given.get(name), out,
                                         {"prompts": prompts, "tokens": tokens})
        d, cfg, source = drafters[name]
        folder = out / "exports" / f"{name}-{fmt}"
        export_drafter(d, cfg, target, fmt, folder, k=max(ks), overwrite=True)
        for k in ks:  # 2.
            check_dir = out / "checks" / f"{name}-{fmt}-k{k}"
            mine = evaluate_drafter(target, d, eval_kind="mtbench", limit=prompts,
                                    max_new_tokens=tokens, k=k, exact_verify=False,
                                    out_dir=check_dir / "ours")["prompts"] if ours else None
            log.info("llama.cpp engine check: %s as %s, k=%d", name, fmt, k)
            res = engine_check(folder, target, d, engine="llamacpp", limit=prompts,
                               max_new_tokens=tokens, k=k, out_dir=check_dir, cache=cache,
                               ours=mine, threads=threads)
            rows.append({"drafter": name, "format": fmt, "source": source, "k": k,
                         **res["summary"]})
            write_table(rows, out, prompts, tokens)
    return rows


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def write_table(rows: list[dict], out: Path, prompts: int, tokens: int) -> str:
    """<out>/llamacpp.md (+ .json): one line per (drafter, format, k)."""
    from specdistill.decode.engine.check import spec_plain_cell

    lines = [f"llama.cpp engine check, SmolLM2-135M-Instruct, {prompts} MT-bench first turns x "
             f"{tokens} new tokens, greedy, f32 GGUF and KV caches", "",
             "| drafter | format | k | loaded | spec == plain | tau llama.cpp | tau replayed "
             "| ratio | tau our decoder | llama.cpp plain == ours | per position llama.cpp / ours "
             "| tok/s plain / spec | speedup |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        if not r.get("loaded"):
            lines.append(f"| {r['drafter']} | {r['format']} | {r['k']} | no: {r.get('error')} "
                         f"|" + " - |" * 9)
            continue
        pos = " ".join(f"{_f(a)}/{_f(b)}" for a, b in zip(r["accept_per_pos_engine"],
                                                          r["accept_per_pos_replay"]))
        lines.append(
            f"| {r['drafter']} | {r['format']} | {r['k']} | yes | {spec_plain_cell(r)} "
            f"| {_f(r['tau_engine'])} "
            f"| {_f(r['tau_replay'])} | {_f(r['tau_ratio'])} | {_f(r.get('tau_ours_decoder'))} "
            f"| {r.get('engine_plain_equals_ours', '-')}/{r['prompts']} | {pos} "
            f"| {_f(r['engine_plain_tokens_per_s'], '.1f')} / "
            f"{_f(r['engine_spec_tokens_per_s'], '.1f')} | {_f(r.get('engine_speedup'), '.2f')}x |")
    sources = sorted({f"{r['drafter']}: {r['source']}" for r in rows})
    text = "\n".join(lines + [""] + [f"- {s}" for s in sources])
    out.mkdir(parents=True, exist_ok=True)
    (out / "llamacpp.md").write_text(text + "\n")
    (out / "llamacpp.json").write_text(json.dumps(rows, indent=1, default=str))
    return text


def main(argv: list[str] | None = None) -> None:
    from specdistill.target.model import TargetConfig, cache_root, load_target

    p = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp_matrix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/engine/llamacpp")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), help="drafter:format pairs")
    p.add_argument("--k", nargs="+", type=int, default=[2, 3])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=200, help="overfit steps per drafter")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                   help="a trained drafter instead of the overfit one")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-ours", action="store_true", help="skip our decoder's own run")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    pairs = [tuple(x.split(":", 1)) for x in args.layouts]
    unknown = [f"{n}:{f}" for n, f in pairs if n not in CONFIGS]
    if unknown:
        p.error(f"--layouts {' '.join(unknown)}: drafters this benchmark trains: "
                f"{', '.join(CONFIGS)}")
    given = dict(x.split("=", 1) for x in args.drafter)
    tcfg = TargetConfig(path="packaged:smollm2", dtype="float32")
    target = load_target(tcfg)
    rows = run(target, pairs, args.k, args.prompts, args.tokens, args.steps, Path(args.out),
               cache_root(tcfg), given, ours=not args.no_ours, threads=args.threads)
    print(write_table(rows, Path(args.out), args.prompts, args.tokens))


if __name__ == "__main__":
    main()


