"""The engine check: does a real serving engine run an export as we trained it?

    result = engine_check(export_dir, target, engine="vllm", eval_kind="mtbench", limit=20,
                          max_new_tokens=128, k=2, out_dir=Path("runs/engine/x"), cache=cache)

1. Render the prompts with the target's chat template (our decoder's exact prompt ids).
2. Start the engine in its own environment (decode/engine/envs.py) and decode every prompt
   greedily, plainly and with the export (interleaved, same k): the engine's own outputs,
   tokens/s and acceptance counters. An export the engine refuses is a result ("loaded": false,
   the engine's own error verbatim), not a crash.
3. Replay our decoder on the engine's speculative text (decode/replay.py): the export read back
   into our decoder (export/folder.py load_export), the same k and max_new_tokens, gives the
   accepted drafts our decoder commits on exactly that text, round by round. Engine tau / replay
   tau is the like-for-like measure of whether the engine computes the drafter we trained: a wrong
   aux layer, a stale d2t, a head tied by mistake or a block read in another layout all show up
   here as acceptance the engine does not reach, whatever the training metric said.
4. Compare outputs: engine speculative == engine plain (the engine's own losslessness), engine
   plain == our plain decoding (first difference with the target's logit margin there, as our
   lossless check reports it), and, when given, our decoder's own tau on the same prompts.
   A speculative output that parts from the engine's plain one counts as lossy unless it is a
   near-tie of our target's dtype, or an engine tie: the engine's plain output parts from our
   decoder's at that very token too, both margins within ENGINE_TIE_REL of the top logit (the
   engine's own numerics cannot settle it; said apart in the table).

Bookkeeping, so numbers compare like for like: vLLM counts one draft round per target verify
forward after the prefill (num_drafts) and k drafts per round; tau = 1 + accepted / rounds, the
bonus token included, exactly our decoder's definition (decode/metrics.py). Two differences at
an answer's end: vLLM drafts k even when fewer tokens are left to generate, and after an EOS, and
counts a draft accepted when the target agrees with it there, though it is never emitted; our
decoder never drafts past its room. The replay therefore runs with vLLM's bookkeeping
(replay_greedy past_end=True: k drafts every round, compared past the end with the target's
greedy continuation), and our decoder's own tau, with its own bookkeeping, is reported beside it.
Acceptance per position i = rounds whose drafts 1..i were all accepted / rounds: vLLM's
accepted_per_pos[i] / num_drafts, our replay's unconditional rate at position i.

llama.cpp (engine=llamacpp, decode/engine/llamacpp_engine.py) keeps our decoder's room instead:
a draft is capped at the tokens still to generate minus one, a round with no room drafts nothing
and is not counted (num_drafts counts verification steps), and a round's accepted drafts are
counted before the output is cut at an EOS. Its replay therefore runs with our room, compares
past an EOS with the target's greedy continuation (past_eos=True) and counts the rounds that
drafted; llama-server's p-min early stop is off, so every such round drafts min(k, room) tokens.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from specdistill.data.prompts import load_prompts
from specdistill.decode.engine.envs import EngineUnavailable, vllm_python
from specdistill.decode.engine.vllm_engine import Generation, run_vllm
from specdistill.decode.evaluate import is_near_tie, render
from specdistill.decode.replay import replay_greedy

log = logging.getLogger(__name__)

ENGINES = ("vllm", "llamacpp")
# how each engine counts rounds and drafts, as replay_greedy options (module docstring)
REPLAY = {"vllm": {"past_end": True}, "llamacpp": {"past_eos": True}}
TAU_TOLERANCE = 0.02  # |engine tau / replay tau - 1| allowed (the serving issue's goal)
ACCEPT_TOLERANCE = 0.10  # engine accepted drafts >= (1 - this) x the replay's, when it has >= 20
MIN_ACCEPTED = 20
# A speculative output that leaves the engine's plain one where the engine's plain output also
# leaves our decoder's, at the same token, with both margins within this fraction of the top
# logit, is a tie the engine's own numerics cannot settle (llama.cpp's quantised matmuls round
# activations to 8 bits; a batch of k + 1 tokens takes other kernels than one): three
# implementations, three picks among near-equal logits. A bug moves whole logits, not 0.1%.
ENGINE_TIE_REL = 1e-3


def engine_tie(spec_vs_plain: dict | None, plain_vs_ours: dict | None) -> bool:
    """True when the speculative output parts from the engine's plain output at the very token
    where the engine's plain output parts from our decoder's, both within ENGINE_TIE_REL of the
    top logit (the differences as _first_difference gives them)."""
    if not spec_vs_plain or not plain_vs_ours or spec_vs_plain.get("near_tie"):
        return False
    if spec_vs_plain.get("position") != plain_vs_ours.get("position"):
        return False
    top = abs(spec_vs_plain.get("top_logit") or 0.0)
    margins = (spec_vs_plain.get("margin"), plain_vs_ours.get("margin"))
    return top > 0 and all(m is not None and abs(m) <= ENGINE_TIE_REL * top for m in margins)


def target_tokens(accepted: list[int]) -> set[int]:
    """The answer positions the target produced itself, by a replay's rounds (decode/replay.py
    replay_greedy: the prefill commits position 0, each round its accepted drafts and then the
    target's own token): where no accepted draft stands."""
    out, t = {0}, 1
    for n in accepted:
        t += n
        out.add(t)
        t += 1
    return out


def verify_tie(spec_vs_plain: dict | None, own: set[int]) -> bool:
    """True when the speculative output parts from the engine's plain output at a token the target
    produced itself in a verify batch (`own`: target_tokens; no draft was accepted there, so the
    drafter had no say in it), both within ENGINE_TIE_REL of the top logit: the engine scores a
    (k + 1)-token verify batch with other kernels than its one-token plain step, and a near-equal
    pair can flip whatever the drafter (llama.cpp b11434, fp32: the same token of one prompt with
    four different DSpark drafters, BENCHMARKS.md "DSpark side by side with speculators' dspark")."""
    if not spec_vs_plain or spec_vs_plain.get("near_tie") or spec_vs_plain.get("engine_tie"):
        return False
    top, margin = abs(spec_vs_plain.get("top_logit") or 0.0), spec_vs_plain.get("margin")
    return (spec_vs_plain.get("position") in own and top > 0 and margin is not None
            and abs(margin) <= ENGINE_TIE_REL * top)


def _first_difference(target, prompt: torch.Tensor, ref: list[int], got: list[int]) -> dict | None:
    """None when equal; else where `got` first leaves `ref`, with our target's margin there."""
    if ref == got:
        return None
    where = target.first_difference(prompt, torch.tensor(ref, dtype=torch.long),
                                    torch.tensor(got, dtype=torch.long))
    where["near_tie"] = is_near_tie(where)
    return where


def _rates(accepted: list[int], k: int) -> list[Optional[float]]:
    """Unconditional acceptance per draft position: rounds whose drafts 1..i were accepted / rounds."""
    rounds = len(accepted)
    return [sum(n > i for n in accepted) / rounds if rounds else None for i in range(k)]


def _tau(accepted: int, rounds: int) -> Optional[float]:
    return (accepted + rounds) / rounds if rounds else None  # no round: not measured


def engine_check(export_dir: Path, target, drafter=None, *, engine: str = "vllm",
                 eval_kind: str = "mtbench", path: Optional[str] = None, limit: Optional[int] = 20,
                 max_new_tokens: int = 128, k: int = 2, out_dir: Path, cache: Path,
                 target_dir: Optional[Path] = None, ours: Optional[list[dict]] = None,
                 ours_dtype: Optional[str] = None,
                 plain: bool = True, threads: Optional[int] = None,
                 timeout: float = 1800, serving: Optional[dict] = None,
                 offset: int = 0) -> dict[str, Any]:
    """Run the engine check (module docstring); write engine_check.json + engine_check.md into
    out_dir and return {"summary", "markdown", "prompts"}.

    drafter: the drafter as trained (a checkpoint's), replayed as our decoder; None = the export
    read back, which checks the engine's reading of the layout but not the exporter's writing of
    it. ours: our decoder's result rows on the same prompts (evaluate_drafter's "prompts") for its
    own tau beside the engine's; ours_dtype: the target dtype they were decoded at, when not
    `target`'s (the job decodes at bf16 and checks at float32: its outputs then part at ties).
    plain=False skips the engine's plain decode (no speed, no losslessness; acceptance only).
    target_dir: the target as an HF folder the engine loads (default: the target's own folder,
    else written from `target`). serving: the engine's entry for an export another trainer wrote
    (a peer's: no `specdistill` block in its config.json), vLLM's e.g. {"method": "eagle3"},
    llama.cpp's its layout's (drafters/dspark.py LLAMACPP); `drafter` is then required (our
    reading of that export)."""
    from specdistill.export.folder import load_export

    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: engines this check runs: {', '.join(ENGINES)}")
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if serving is not None and drafter is None:
        raise ValueError(f"another trainer's export (serving={serving}) is checked with our reading "
                         f"of it given as drafter=")
    if drafter is None:  # 3. what the engine reads, read back by our decoder
        drafter = load_export(export_dir, target).to(target.device).eval()
    prompts = load_prompts(eval_kind, path=path, limit=limit, offset=offset)
    ids = [render(target, p.turns[:1], []) for p in prompts]  # 1.
    max_new = [min(max_new_tokens, target.max_length - len(x)) for x in ids]  # what fits
    stop = sorted(target.eos_token_ids)
    dtype = str(target.dtype).removeprefix("torch.")
    summary: dict[str, Any] = {"engine": engine, "export": str(export_dir), "k": k, "dtype": dtype,
                               "eval": eval_kind, "prompts": len(prompts),
                               "max_new_tokens": max_new_tokens}
    meta = json.loads((export_dir / "config.json").read_text()).get("specdistill")
    if meta is None and serving is None:
        raise ValueError(f"{export_dir}/config.json has no specdistill block: not written by "
                         f"`python -m train.export`; pass serving= for another trainer's export")
    summary.update(drafter=meta["drafter"]["name"] if meta else drafter.name,
                   format=meta["format"] if meta else
                   f"its own ({serving.get('method') or serving.get('spec_type')})")
    if ours:
        summary["ours_dtype"] = ours_dtype or dtype
    n_ctx = max(len(x) for x in ids) + max_new_tokens + 2 * k + 16
    try:  # 2.
        folder = target_dir or served_target(target, out_dir / "target")
        if engine == "vllm":
            run = run_vllm(vllm_python(cache), folder, export_dir, k, [x.tolist() for x in ids],
                           max_new, stop, dtype, max_model_len=n_ctx, logs=out_dir, plain=plain,
                           threads=threads, timeout=timeout, serving=serving)
        else:
            from specdistill.decode.engine.llamacpp_engine import run_export

            run = run_export(export_dir, folder, cache, k, [x.tolist() for x in ids], max_new,
                             n_ctx, out_dir, plain=plain, threads=threads, timeout=timeout,
                             entry=serving)
    except EngineUnavailable as e:
        summary.update(loaded=False, error=str(e), verdict="engine unavailable")
        return _write(summary, [], out_dir)
    summary.update(loaded=run["loaded"], error=run["error"], engine_version=run["version"],
                   speculative_config=run["speculative_config"], load_s=run["load_s"],
                   engine_threads=run.get("threads", threads))
    if not run["loaded"] or run["error"]:  # refused, or loaded and then failed while decoding
        summary.update(error_detail=run.get("error_detail"), failed_engine=run.get("failed_engine"),
                       verdict="refused by the engine" if not run["loaded"]
                       else "failed while decoding")
        return _write(summary, [], out_dir)
    mine = {r["id"]: r for r in (ours or []) if r.get("turn", 1) == 1}  # first turns, by prompt
    plains = run["plain"] or [None] * len(prompts)
    rows = [_compare(target, drafter, p, x, n, a, b, k, mine.get(p.id), engine)
            for p, x, n, a, b in zip(prompts, ids, max_new, plains, run["spec"])]
    summary.update(_summarise(rows, k, mine))
    return _write(summary, rows, out_dir)


def _compare(target, drafter, prompt, ids: torch.Tensor, max_new_tokens: int,
             plain: Optional[Generation], spec: Generation, k: int, mine: Optional[dict],
             engine: str = "vllm") -> dict:
    """One prompt: engine outputs against each other, against our decoder's (`mine`: its result
    row, when given), and the replay of our decoder on the engine's speculative text (3.)."""
    replay = replay_greedy(target, drafter, ids, torch.tensor(spec.ids, dtype=torch.long), k=k,
                           max_new_tokens=max_new_tokens,
                           **REPLAY[engine])  # the engine's bookkeeping
    # the engines count a round only when it drafted (vLLM's always do: past_end)
    per_round = [n for n, m in zip(replay.accepted, replay.drafted) if m > 0]
    row = {"id": prompt.id, "prompt_tokens": len(ids), "engine_spec_ids": spec.ids,
           "engine_spec_s": spec.seconds,
           "engine": {"rounds": spec.drafts, "draft_tokens": spec.draft_tokens,
                      "accepted": spec.accepted, "accepted_per_pos": spec.accepted_per_pos},
           "replay": {"rounds": len(per_round), "accepted": sum(per_round),
                      "drafted": sum(replay.drafted), "per_round": per_round}}
    if plain is None:  # acceptance only (plain=False)
        return row
    row.update(engine_plain_ids=plain.ids, engine_plain_s=plain.seconds,
               spec_equals_plain=spec.ids == plain.ids)
    diff = _first_difference(target, ids, plain.ids, spec.ids)
    if diff:
        row["spec_vs_plain_difference"] = diff
    if mine is not None:
        row["ours_spec_ids_equal_engine_plain"] = mine["generated_ids"] == plain.ids
        d = _first_difference(target, ids, mine["generated_ids"], plain.ids)
        if d:
            row["engine_plain_vs_ours_difference"] = d
        if diff and engine_tie(diff, d):
            diff["engine_tie"] = True
    if diff and verify_tie(diff, target_tokens(replay.accepted)):
        diff["verify_tie"] = True
    return row


def _summarise(rows: list[dict], k: int, ours: dict[str, dict]) -> dict:
    """The check's numbers over all prompts, and its verdict."""
    e_rounds = sum(r["engine"]["rounds"] for r in rows)
    e_acc = sum(r["engine"]["accepted"] for r in rows)
    r_rounds = sum(r["replay"]["rounds"] for r in rows)
    r_acc = sum(r["replay"]["accepted"] for r in rows)
    pos = [sum(r["engine"]["accepted_per_pos"][i] if i < len(r["engine"]["accepted_per_pos"]) else 0
               for r in rows) for i in range(k)]
    replay_rounds = [n for r in rows for n in r["replay"]["per_round"]]
    with_plain = all("engine_plain_ids" in r for r in rows)
    plain_s = sum(r.get("engine_plain_s", 0.0) for r in rows)
    spec_s = sum(r["engine_spec_s"] for r in rows)
    tokens = sum(len(r["engine_spec_ids"]) for r in rows)
    plain_tokens = sum(len(r.get("engine_plain_ids", ())) for r in rows)
    out: dict[str, Any] = {
        "spec_equals_plain": sum(r["spec_equals_plain"] for r in rows) if with_plain else None,
        "spec_differs_at_near_tie": sum(bool(r.get("spec_vs_plain_difference", {}).get("near_tie"))
                                        for r in rows) if with_plain else None,
        "spec_differs_at_engine_tie": sum(bool(r.get("spec_vs_plain_difference", {}).get(
            "engine_tie")) for r in rows) if with_plain else None,
        "spec_differs_at_verify_tie": sum(bool(r.get("spec_vs_plain_difference", {}).get(
            "verify_tie")) for r in rows) if with_plain else None,
        "engine_rounds": e_rounds, "engine_accepted": e_acc, "tau_engine": _tau(e_acc, e_rounds),
        "accept_per_pos_engine": [p / e_rounds if e_rounds else None for p in pos],
        "replay_rounds": r_rounds, "replay_accepted": r_acc, "tau_replay": _tau(r_acc, r_rounds),
        "accept_per_pos_replay": _rates(replay_rounds, k),
        "engine_plain_tokens_per_s": plain_tokens / plain_s if plain_s else None,
        "engine_spec_tokens_per_s": tokens / spec_s if spec_s else None,
    }
    if out["engine_plain_tokens_per_s"] and out["engine_spec_tokens_per_s"]:
        out["engine_speedup"] = out["engine_spec_tokens_per_s"] / out["engine_plain_tokens_per_s"]
    if ours:
        mine = [ours[r["id"]] for r in rows if r["id"] in ours]
        o_rounds = sum(len(m["accepted"]) for m in mine)
        out["tau_ours_decoder"] = _tau(sum(sum(m["accepted"]) for m in mine), o_rounds)
        out["engine_plain_equals_ours"] = sum(bool(r.get("ours_spec_ids_equal_engine_plain"))
                                              for r in rows)
    out["tau_ratio"] = (out["tau_engine"] / out["tau_replay"]
                        if out["tau_engine"] and out["tau_replay"] else None)
    problems = []
    if out["tau_ratio"] is None:
        problems.append("no speculative round was measured")
    elif abs(out["tau_ratio"] - 1) > TAU_TOLERANCE:
        problems.append(f"engine tau {out['tau_engine']:.3f} vs {out['tau_replay']:.3f} replayed "
                        f"(ratio {out['tau_ratio']:.3f}, allowed 1 +- {TAU_TOLERANCE})")
    if r_acc >= MIN_ACCEPTED and e_acc < (1 - ACCEPT_TOLERANCE) * r_acc:
        problems.append(f"the engine accepted {e_acc} drafts where our decoder accepts {r_acc} "
                        f"on the same text: it does not run the drafter we trained")
    lossy = (len(rows) - out["spec_equals_plain"] - out["spec_differs_at_near_tie"]
             - out["spec_differs_at_engine_tie"] - out["spec_differs_at_verify_tie"]) if with_plain else 0
    if lossy:
        problems.append(f"{lossy} engine speculative outputs differ from its plain output beyond "
                        f"a near-tie")
    out["problems"] = problems
    out["verdict"] = "pass" if not problems else "fail"
    return out


def served_target(target, folder: Path) -> Path:
    """The target as an HF folder an engine loads: its own folder when it came from one (or the
    de-quantised GGUF cache), else written once to `folder` (a random-init test target)."""
    own = getattr(target, "folder", None)
    if own is not None and (Path(own) / "config.json").is_file():
        return Path(own)
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(folder.name + ".tmp")
        target.model.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        tmp.rename(folder)
    return folder


def _write(summary: dict, rows: list[dict], out_dir: Path) -> dict:
    markdown = check_markdown(summary)
    (out_dir / "engine_check.json").write_text(json.dumps({"summary": summary, "prompts": rows},
                                                          indent=1))
    (out_dir / "engine_check.md").write_text(markdown + "\n")
    return {"summary": summary, "markdown": markdown, "prompts": rows}


def _f(x, fmt: str = ".3f") -> str:
    return "not measured" if x is None else format(x, fmt)


def spec_plain_cell(s: dict) -> str:
    """The check's losslessness in one table cell, the same in every table that quotes a check
    (engine and llama.cpp matrices, the run report): "n/N" outputs where the engine's speculative
    decoding equals its plain decoding, then "+t near-tie", "+e engine tie" and "+v verify tie"
    where there are any (outputs that part only there: not lossy); "-" when plain decoding was not
    run."""
    n = s.get("spec_equals_plain")
    if n is None:
        return "-"
    more = [f"+{c} {what}" for c, what in ((s.get("spec_differs_at_near_tie") or 0, "near-tie"),
                                           (s.get("spec_differs_at_engine_tie") or 0, "engine tie"),
                                           (s.get("spec_differs_at_verify_tie") or 0, "verify tie")) if c]
    return f"{n}/{s['prompts']}" + (f" ({', '.join(more)})" if more else "")


def check_markdown(s: dict) -> str:
    """The check as a table: loaded, losslessness, tau engine vs ours, speed."""
    head = (f"### {s['engine']} {s.get('engine_version') or ''}: {s.get('drafter')} as "
            f"format={s.get('format')} (k={s['k']}, {s['dtype']}, {s['prompts']} {s['eval']} prompts "
            f"x {s['max_new_tokens']} tokens)")
    if not s.get("loaded"):
        return f"{head}\n\nnot loaded: {s.get('error')}"
    if s.get("verdict") == "failed while decoding":
        return f"{head}\n\nloaded, then the {s.get('failed_engine')} engine failed: {s.get('error')}"
    rows = [("verdict", s["verdict"] + ("" if not s["problems"] else ": " + "; ".join(s["problems"]))),
            ("engine speculative == engine plain", "not measured" if s["spec_equals_plain"] is None
             else f"{s['spec_equals_plain']}/{s['prompts']} ({s['spec_differs_at_near_tie']} more "
                  f"at near-ties" + (f", {s['spec_differs_at_engine_tie']} more where the engine's "
                                     f"plain output also parts from ours at that token, within "
                                     f"{ENGINE_TIE_REL:g} of the top logit"
                                     if s.get("spec_differs_at_engine_tie") else "")
                  + (f", {s['spec_differs_at_verify_tie']} more at a token the target produced "
                     f"itself in a verify batch, within {ENGINE_TIE_REL:g} of the top logit"
                     if s.get("spec_differs_at_verify_tie") else "") + ")"),
            ("tau in the engine", _f(s["tau_engine"])),
            ("tau of our decoder replayed on the engine's text", _f(s["tau_replay"])),
            ("ratio", _f(s["tau_ratio"])),
            ("acceptance per position, engine", " / ".join(_f(a) for a in s["accept_per_pos_engine"])),
            ("acceptance per position, ours", " / ".join(_f(a) for a in s["accept_per_pos_replay"])),
            ("engine tokens/s plain / speculative", f"{_f(s['engine_plain_tokens_per_s'], '.1f')} / "
             f"{_f(s['engine_spec_tokens_per_s'], '.1f')} ({_f(s.get('engine_speedup'), '.2f')}x)")]
    if "tau_ours_decoder" in s:
        rows.insert(4, ("tau in our decoder (its own run)", _f(s["tau_ours_decoder"])))
        apart = s.get("ours_dtype") not in (None, s["dtype"])  # two dtypes: two greedy paths
        rows.insert(2, ("engine plain == our decoder's output" + (
            f" (engine {s['dtype']}, ours {s['ours_dtype']}: they part at near-ties)" if apart else ""),
            f"{s['engine_plain_equals_ours']}/{s['prompts']}"))
    return "\n".join([head, "", "| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def run(cfg) -> None:
    """`python -m decode.engine`: load the target, decode the prompts with our decoder (cfg.ours),
    run the engine check, print its table; a failed check fails the command."""
    from specdistill.decode.evaluate import evaluate_drafter
    from specdistill.export.folder import load_export
    from specdistill.target.model import cache_root, load_target

    export = Path(cfg.export).expanduser()
    if not (export / "config.json").is_file():
        raise FileNotFoundError(f"export={cfg.export} holds no config.json: give a folder written "
                                f"by `python -m train.export`")
    meta = json.loads((export / "config.json").read_text()).get("specdistill") or {}
    k = cfg.k or int(meta.get("speculative_tokens") or 2)
    target = load_target(cfg.target)
    out = Path(cfg.out)
    ours = None
    if cfg.ours:  # our decoder on the same prompts, at the same k and dtype
        drafter = load_export(export, target).to(target.device).eval()
        ours = evaluate_drafter(target, drafter, eval_kind=cfg.eval.kind, path=cfg.eval.path,
                                limit=cfg.eval.limit, max_new_tokens=cfg.max_new_tokens, k=k,
                                exact_verify=False, out_dir=out / "ours",
                                offset=cfg.eval.offset)["prompts"]
    result = engine_check(export, target, engine=cfg.engine, eval_kind=cfg.eval.kind,
                          path=cfg.eval.path, limit=cfg.eval.limit, offset=cfg.eval.offset,
                          max_new_tokens=cfg.max_new_tokens, k=k, out_dir=out,
                          cache=cache_root(cfg.target), ours=ours, threads=cfg.threads,
                          timeout=cfg.timeout_s)
    print(result["markdown"], flush=True)
    print(f"results: {out / 'engine_check.json'}", flush=True)
    if result["summary"].get("verdict") == "engine unavailable":  # a damaged or missing install
        from specdistill.cli.errors import UserError

        raise UserError(f"the {cfg.engine} engine is unavailable: {result['summary'].get('error')}")
    if result["summary"].get("verdict") != "pass":
        raise SystemExit(1)


def engine_format(drafter, engine: str = "vllm") -> tuple[Optional[str], str]:
    """(the export format of this trained drafter that `engine` serves, or None; why not). The
    first of the drafter's registered layouts the engine reads whose requirements the drafter's
    config meets (an EAGLE-1 head trained with the pruned vocabulary has none, say why)."""
    import dataclasses

    from specdistill.decode.engine import served_layouts

    if engine not in ENGINES:
        return None, f"engine={engine!r}: engines this check runs: {', '.join(ENGINES)}"
    dcfg = dataclasses.asdict(drafter.cfg)
    readers = served_layouts(engine)
    served = [fmt for (name, fmt) in readers if name == drafter.name and fmt in drafter.layouts]
    reasons = []
    for fmt in served:
        why = drafter.layouts[fmt].refusal(dcfg)
        if why is None:
            return fmt, ""
        reasons.append(why)
    if not served:
        return None, f"{engine} serves no export layout of drafter {drafter.name!r}"
    return None, "; ".join(reasons)
