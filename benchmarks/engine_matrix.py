"""Every export layout a serving engine could serve, through the real engine check, in one table.

    python -m benchmarks.engine_matrix --out runs/engine/matrix --prompts 20 --tokens 128 --k 2 3
    python -m benchmarks.engine_matrix --layouts eagle3:vllm dflash:vllm --k 2   # a subset
    python -m benchmarks.engine_matrix --drafter eagle3=<run dir> ...           # a trained one

For each drafter of LAYOUTS:
  1. train-or-load it: a drafter given with --drafter NAME=<run dir | checkpoint | saved drafter>
     is loaded; otherwise `overfit` trains one on the target's own greedy answers to the check's
     prompts (about a minute on 2 cores), so that most of its drafts are right and a layout the
     engine reads differently shows as lost acceptance. Saved under <out>/drafters/<name>/ and
     reused by a later run with the same settings;
  2. export it in each of its formats (export/folder.py, the exporter's own validation and
     read-back included) under <out>/exports/<name>-<format>/;
  3. run the engine check (decode/engine/check.py: the engine's outputs plain and speculative,
     its acceptance counters against our decoder replayed on its text) at each k, under
     <out>/checks/<name>-<format>-k<k>/;
  4. write one table of every check: <out>/matrix.md and matrix.json.
An export the engine refuses is a row with the engine's own error, verbatim; the matrix goes on.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

# drafter -> (its config for the overfit drafter, the formats an engine could serve it in). The
# settings are the engines' own (EAGLE-1 without input norm and with the target's head) and the
# default job's sizes elsewhere (pruned 8192-token heads); block / chain lengths cover k <= 3.
LAYOUTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "eagle": ({"name": "eagle", "input_norm": False, "draft_vocab_size": None}, ("vllm",)),
    "eagle3": ({"name": "eagle3", "draft_vocab_size": 8192, "ttt_length": 3},
               ("vllm", "speculators")),
    "peagle": ({"name": "peagle", "draft_vocab_size": 8192, "ttt_length": 4}, ("vllm",)),
    "dflash": ({"name": "dflash", "draft_vocab_size": 8192, "block_size": 4},
               ("vllm", "speculators")),
    "medusa": ({"name": "medusa", "num_heads": 3}, ("vllm",)),
    "small_lm": ({"name": "small_lm"}, ("causal_lm",)),
}


def greedy_answers(target, prompts: list[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    """The target's own greedy answers: prompt + answer ids, (1, T) each."""
    from specdistill.decode.spec import generate

    return [torch.cat([x, generate(target, None, x, max_new_tokens=tokens).tokens])[None]
            for x in prompts]


def overfit(target, cfg: dict, seqs: list[torch.Tensor], steps: int, lr: float = 3e-3,
            seed: int = 0):
    """A drafter of config `cfg` trained on `seqs` (the target's own greedy answers, whole
    sequences) for `steps` AdamW steps, one sequence per step: it learns those answers nearly by
    heart, so an engine that computes it as we do accepts most of its drafts on them."""
    from specdistill.drafters.base import build_drafter
    from specdistill.drafters.parts.head import fit_draft_vocab
    from specdistill.train.losses import distill_loss
    from specdistill.train.teacher import train_batch

    torch.manual_seed(seed)
    d = build_drafter(cfg, target)
    if cfg.get("draft_vocab_size"):  # the answers' own tokens first, as the recipe's counts do
        counts = torch.bincount(torch.cat([s[0] for s in seqs]), minlength=target.vocab_size)
        fit_draft_vocab(d, counts.float(), always_include=target.eos_token_ids)
    H, layers, batches = target.hidden_size, tuple(d.feature_layers), []
    for s in seqs:
        with torch.no_grad():
            out = target.forward(s, layers=(*layers, -1), logits=False)
        feats, final = out.features[..., :-H], out.features[..., -H:]  # (1, T, F), (1, T, H)
        ones = torch.ones_like(s)
        features = None if not layers else final if layers == (-1,) else feats
        raw = {"input_ids": s, "attention_mask": ones, "loss_mask": ones}
        batches.append(train_batch(raw, features, target, final, d.d2t, s.device, d))
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        b = batches[step % len(batches)]
        loss, _ = distill_loss(d.forward_train(b), b)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


def drafter_for(name: str, target, seqs, steps: int, out: Path, given: Optional[str]):
    """(drafter, its config, where it came from): loaded from --drafter NAME=<path>, from an
    earlier run's <out>/drafters/<name>/ with the same settings, or trained now (overfit)."""
    from specdistill.store.drafter import load_drafter, save_drafter

    if given:
        from specdistill.store.rundir import resolve_drafter

        folder, _ = resolve_drafter(given)
        d = load_drafter(folder, target).eval()
        return d, json.loads((folder / "drafter.json").read_text()), str(folder)
    cfg = LAYOUTS[name][0]
    folder, stamp = out / "drafters" / name, {"cfg": cfg, "steps": steps, "seqs": len(seqs),
                                                "tokens": sum(s.shape[1] for s in seqs)}
    if (folder / "overfit.json").is_file() and json.loads((folder / "overfit.json").read_text()) == stamp:
        return load_drafter(folder, target).eval(), cfg, f"overfit, reused ({folder})"
    t0 = time.perf_counter()
    d = overfit(target, cfg, seqs, steps)
    save_drafter(d, cfg, folder)
    (folder / "overfit.json").write_text(json.dumps(stamp, indent=1))
    log.info("%s: overfit in %.0f s", name, time.perf_counter() - t0)
    return d, cfg, f"overfit, {steps} steps in {time.perf_counter() - t0:.0f} s"


def run_matrix(target, pairs: list[tuple[str, str]], ks: list[int], prompts: int, tokens: int,
               steps: int, out: Path, cache: Path, given: dict[str, str],
               threads: Optional[int] = None, timeout: float = 1800) -> list[dict]:
    """Steps 1-3 of the module docstring for every (drafter, format) of `pairs` at every k."""
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.engine.check import engine_check, served_target
    from specdistill.decode.evaluate import render
    from specdistill.export.folder import export_drafter

    ids = [render(target, p.turns[:1], []) for p in load_prompts("mtbench", limit=prompts)]
    seqs, served = None, served_target(target, out / "target")  # the target folder engines load
    rows, drafters = [], {}
    for name, fmt in pairs:
        if name not in drafters:  # 1.
            if seqs is None and name not in given:
                seqs = greedy_answers(target, ids, tokens)
            drafters[name] = drafter_for(name, target, seqs, steps, out, given.get(name))
        d, cfg, source = drafters[name]
        folder = out / "exports" / f"{name}-{fmt}"
        base = {"drafter": name, "format": fmt, "source": source}
        try:  # 2.
            export_drafter(d, cfg, target, fmt, folder, k=max(ks), overwrite=True)
        except Exception as e:  # our exporter refusing is a row too: say why
            rows += [{**base, "k": k, "exported": False, "error": f"{type(e).__name__}: {e}"}
                     for k in ks]
            write_table(rows, out, prompts, tokens)
            continue
        for k in ks:  # 3.
            log.info("engine check: %s as %s, k=%d", name, fmt, k)
            res = engine_check(folder, target, d, limit=prompts, max_new_tokens=tokens, k=k,
                               out_dir=out / "checks" / f"{name}-{fmt}-k{k}", cache=cache,
                               target_dir=served, threads=threads, timeout=timeout)
            rows.append({**base, "k": k, "exported": True, **res["summary"]})
            write_table(rows, out, prompts, tokens)
    return rows


def _f(x, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def _cell(text) -> str:
    """Text as one markdown table cell: one line, no column breaks (the full text is in the JSON)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def table_row(r: dict) -> str:
    """One check as a markdown table row."""
    from specdistill.decode.engine.check import spec_plain_cell

    head = f"| {r['drafter']} | `{r['format']}` | {r['k']} |"
    if not r.get("exported"):
        return f"{head} not exported: {_cell(r['error'])} | | | | | | |"
    if not r.get("loaded"):
        return f"{head} **no**: {_cell(r.get('error'))} | | | | | | |"
    if r.get("verdict") == "failed while decoding":
        return (f"{head} yes, then the {r.get('failed_engine')} engine failed: "
                f"{_cell(r.get('error'))} | | | | | | |")
    same = spec_plain_cell(r)
    pos = " / ".join(f"{_f(a, '.2f')}:{_f(b, '.2f')}"
                     for a, b in zip(r["accept_per_pos_engine"], r["accept_per_pos_replay"]))
    speed = (f"{_f(r['engine_plain_tokens_per_s'], '.1f')} / {_f(r['engine_spec_tokens_per_s'], '.1f')}"
             f" ({_f(r.get('engine_speedup'), '.2f')}x)")
    verdict = r["verdict"] + ("" if not r["problems"] else ": " + "; ".join(r["problems"]))
    return (f"{head} yes | {same} | {_f(r['tau_engine'])} | {_f(r['tau_replay'])} | "
            f"{_f(r['tau_ratio'])} | {pos} | {speed} | {_cell(verdict)} |")


def write_table(rows: list[dict], out: Path, prompts: int, tokens: int) -> str:
    """<out>/matrix.md and matrix.json (step 4); returns the markdown."""
    version = next((r.get("engine_version") for r in rows if r.get("engine_version")), None)
    md = "\n".join([
        f"vLLM {version or '(not loaded)'} CPU, {prompts} MT-bench first turns x {tokens} new tokens, "
        f"greedy, {rows[0].get('dtype', 'float32') if rows else ''}; acceptance per position as "
        f"engine:replay",
        "",
        "| drafter | format | k | loaded | engine spec == plain | tau engine | tau replayed | ratio "
        "| acceptance per position | tokens/s plain / spec | verdict |",
        "|---|---|---:|---|---|---:|---:|---:|---|---|---|",
        *[table_row(r) for r in rows]])
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text(md + "\n")
    (out / "matrix.json").write_text(json.dumps(rows, indent=1))
    return md


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/engine/matrix", help="drafters, exports, checks, table")
    ap.add_argument("--layouts", nargs="*", metavar="DRAFTER:FORMAT",
                    help="the (drafter, format) pairs to check (default: every one of LAYOUTS)")
    ap.add_argument("--drafter", nargs="*", default=[], metavar="NAME=PATH",
                    help="use this trained drafter (run dir, checkpoint or saved drafter) for NAME")
    ap.add_argument("--k", nargs="+", type=int, default=[2, 3], help="draft tokens per round")
    ap.add_argument("--prompts", type=int, default=20, help="MT-bench first turns")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--steps", type=int, default=None,
                    help="overfit steps (default: 20 passes over the prompts' answers)")
    ap.add_argument("--target", default="packaged:smollm2", help="target path (target.path)")
    ap.add_argument("--dtype", default="float32", help="target dtype, in our decoder and the engine")
    ap.add_argument("--threads", type=int, default=None, help="engine compute threads")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds an engine step may take")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from specdistill.target.model import TargetConfig, cache_root, load_target

    pairs = [tuple(p.split(":", 1)) for p in args.layouts] if args.layouts else \
        [(n, f) for n, (_, fmts) in LAYOUTS.items() for f in fmts]
    unknown = [f"{n}:{f}" for n, f in pairs if n not in LAYOUTS or f not in LAYOUTS[n][1]]
    if unknown:
        raise SystemExit(f"--layouts {' '.join(unknown)}: not in the matrix; pairs: " + " ".join(
            f"{n}:{f}" for n, (_, fmts) in LAYOUTS.items() for f in fmts))
    given = dict(x.split("=", 1) for x in args.drafter)
    tcfg = TargetConfig(path=args.target, dtype=args.dtype)
    target = load_target(tcfg)
    rows = run_matrix(target, pairs, args.k, args.prompts, args.tokens,
                      args.steps or 20 * args.prompts, Path(args.out), cache_root(tcfg), given,
                      args.threads, args.timeout)
    md = write_table(rows, Path(args.out), args.prompts, args.tokens)
    print(md, flush=True)
    return md


if __name__ == "__main__":
    main()
