"""Run a drafter through the lossless decoder on an eval set and write the results.

Used by `python -m decode` and by the trainer's final eval. With compare_plain=True every prompt is
also decoded plainly by the target, interleaved prompt by prompt (plain, speculative, plain, ...)
so load from other processes hits both alike; the speedup is measured in the same run and, for
greedy decoding, every speculative output is checked token-for-token against the plain one.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from specdistill.data import quiet
from specdistill.data.prompts import Prompt, load_prompts
from specdistill.decode.exact import resolve_exact
from specdistill.decode.metrics import RunMetrics
from specdistill.decode.spec import GenerationResult, generate
from specdistill.drafters.base import Drafter
from specdistill.drafters.parts.sampling import SamplingParams

log = logging.getLogger(__name__)


# A first difference whose logit margin is within this many spacings (ulps) of the target's dtype at
# its top logit is a near-tie: a verify forward over several tokens and one-token steps sum in
# different orders (MLP down-projection and SDPA results depend on how many rows run together).
# Measured on SmolLM2 at bf16 (BENCHMARKS.md): the same 24 tokens as one-token steps vs 6-token
# chunks give logits up to 1.0 apart at |logit| 16-32 (ulp 0.125), i.e. up to 8 ulps; every first
# difference seen on MT-bench had a margin of 0-2 ulps. A bug moves whole logits, far beyond this.
NEAR_TIE_ULPS = 8


def is_near_tie(diff: dict) -> bool:
    """True when a first difference (Target.first_difference) is a near-tie of the target's dtype:
    the two tokens' logits within NEAR_TIE_ULPS spacings of the dtype at the top logit."""
    return diff.get("margin") is not None and abs(diff["margin"]) <= NEAR_TIE_ULPS * diff["ulp"]


def render(target, turns: list[str], answers: list[list[int]]) -> torch.Tensor:
    """Chat-template prompt ids for the next turn, given the model's own earlier answers."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            text = target.tokenizer.decode(answers[i], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
    enc = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               return_tensors="pt")
    return enc["input_ids"][0]


def fit_max_new_tokens(target, ids: torch.Tensor, max_new_tokens: int, what: str) -> int:
    """max_new_tokens, or what the target's context leaves after the prompt ids (the row records
    it as capped: `result_row`)."""
    fitted = min(max_new_tokens, target.max_length - len(ids))
    if fitted < 1:
        raise ValueError(f"{what} has {len(ids)} tokens: no room left in the target's context "
                         f"({target.max_length}); shorten it or use a target with a longer context")
    return fitted


def lossless_check(rows: list[dict]) -> dict:
    """Greedy: every output must equal plain decoding's, except at floating-point near-ties of
    the target's logits (first_difference); anything else fails the check (and the command)."""
    mismatches = sum(r["identical_to_plain"] is False for r in rows)
    ties = sum(bool(r.get("first_difference", {}).get("near_tie")) for r in rows)
    if mismatches > ties:
        log.error("%d greedy generations differ from plain decoding beyond a floating-point near-tie: "
                  "the decoder is not lossless here; see first_difference in result.json",
                  mismatches - ties)
    elif mismatches:
        log.warning("%d greedy generations differ from plain decoding, each at a near-tie of the "
                    "target's logits (first_difference.margin in result.json): a floating-point "
                    "tie-break, not a loss of exactness", mismatches)
    return {"outputs_identical_to_plain": mismatches == 0, "mismatched_generations": mismatches,
            "mismatches_near_ties": ties,  # floating-point tie-breaks, not bugs
            "lossless_check": "passed" if mismatches == ties else "failed"}


def compare_greedy(target, ids, plain, spec, greedy: bool, bit_exact: bool = False
                   ) -> tuple[bool | None, dict | None]:
    """Greedy: is spec's output plain's, and where it first differs (a near-tie of the target's
    logits, or a bug; bit_exact: the decode promised bit-identity, so no tie allowance). (None,
    None) without a plain decode or when sampling."""
    if plain is None or not greedy:
        return None, None
    if torch.equal(plain.tokens, spec.tokens):
        return True, None
    where = target.first_difference(ids, plain.tokens, spec.tokens)
    where["near_tie"] = is_near_tie(where) and not bit_exact
    return False, where


def result_row(target, prompt: Prompt, turn: int, ids: torch.Tensor, spec: GenerationResult,
               plain: GenerationResult | None, greedy: bool, bit_exact: bool, fitted: int,
               max_new_tokens: int, **extra) -> dict:
    """One generation's row of result.json, the single and the batched evaluators alike: turn
    (from 0) of `prompt` from ids, the speculative result, its comparison with the plain one
    (`compare_greedy`), whether max_new_tokens was capped to `fitted` (`fit_max_new_tokens`);
    extra: what only one evaluator measures (the batched one's latency_s)."""
    same, where = compare_greedy(target, ids, plain, spec, greedy, bit_exact)
    out = spec.tokens.tolist()
    return {"id": prompt.id, "turn": turn + 1, "category": prompt.category,
            "prompt_tokens": len(ids), "generated_ids": out,
            "text": target.tokenizer.decode(out, skip_special_tokens=False),
            "new_tokens": len(out), "target_forwards": spec.target_forwards,
            "accepted": spec.accepted, "drafted": spec.drafted, "stop_reason": spec.stop_reason,
            "identical_to_plain": same, **extra, "max_new_tokens_capped": fitted < max_new_tokens,
            **({"first_difference": where} if where else {})}


def summarise(target, drafter: Drafter | None, rows: list[dict], spec_m: RunMetrics,
              plain_m: RunMetrics | None, *, eval_kind: str, n_prompts: int, k: int, tree: bool,
              sampling: SamplingParams, max_new_tokens: int, exact_verify: bool,
              extra: dict | None = None) -> dict:
    """A decode run's summary, the single and the batched evaluators alike: its settings (extra:
    what only one evaluator has), the speculative metrics (spec_*), the dtypes, with a plain
    decode its metrics, the lossless check (greedy) and the speedup; tau; the capped generations.
    """
    summary = {"eval": eval_kind, "prompts": n_prompts, "generations": len(rows),
               "drafter": drafter.name if drafter is not None else "none", "k": k, "tree": tree,
               "temperature": sampling.temperature, "max_new_tokens": max_new_tokens,
               "exact_verify": exact_verify, **(extra or {}),
               **{f"spec_{n}": v for n, v in asdict(spec_m).items()}}
    # "lossless" = identical to plain decoding with the same target at the same dtype: record which
    summary.update(target.dtype_choice.as_dict() if hasattr(target, "dtype_choice") else
                   {"target_dtype": str(target.dtype).removeprefix("torch.")})
    own = [t.dtype for t in (drafter.parameters() if drafter is not None else ())
           if t.is_floating_point()]
    summary["drafter_dtype"] = str(own[0]).removeprefix("torch.") if own else None
    if plain_m is not None:
        summary["plain_tokens_per_s"] = plain_m.tokens_per_s
        summary["plain_target_forwards"] = plain_m.target_forwards
        if sampling.greedy:
            summary.update(lossless_check(rows))
    summary.update(headline(spec_m, plain_m.tokens_per_s if plain_m is not None else None))
    capped = sum(r["max_new_tokens_capped"] for r in rows)
    if capped:
        summary["max_new_tokens_capped"] = capped  # generations whose max_new_tokens the context cut
        log.warning("max_new_tokens=%d does not fit the target's context (max_length %d) for %d of "
                    "%d generations: they were capped to what fits (max_new_tokens_capped in "
                    "result.json)", max_new_tokens, target.max_length, capped, len(rows))
    return summary


def evaluate_drafter(target, drafter: Drafter | None, *, eval_kind: str = "mtbench",
                     path: str | None = None, limit: int | None = None, turns: int = 1,
                     max_new_tokens: int = 256, k: int = 5, tree: bool = False,
                     sampling: SamplingParams | None = None, min_confidence: float = 0.0,
                     compare_plain: bool = True, seed: int = 0,
                     exact_verify: bool | str = "auto", out_dir: Path | None = None,
                     warmup_tokens: int = 16, verify_survival: float = 0.0,
                     survival_fallback: str = "none", offset: int = 0) -> dict:
    """Decode every prompt (and turn) speculatively, and plainly when compare_plain; return
    {"summary", "markdown", "prompts"} and write result.json + result.md into out_dir.
    exact_verify: both decodes with decode/exact.py's exact kernels (greedy chains then match
    plain decoding bit for bit at any dtype); auto = on for chains at a 16-bit target dtype.
    warmup_tokens: first, both modes decode that many tokens of the first prompt, untimed and
    discarded (first-use costs: a GPU's kernel loading and library handles, CPU prepacking), with
    their own random stream, so the measured prompts and their samples are the same as without.
    verify_survival, survival_fallback: confidence-driven chain cuts (decode/survival.py).
    The result also holds "slot_confidence": every round's (verified slots' confidences, drafts
    accepted), the pairs a confidence calibration is fitted to (not written to result.json)."""
    sampling = sampling or SamplingParams()
    exact_verify = resolve_exact(exact_verify, target.dtype, tree)
    cut = dict(verify_survival=verify_survival, survival_fallback=survival_fallback)
    prompts = load_prompts(eval_kind, path=path, limit=limit, turns=turns, offset=offset)
    spec_results, plain_results, rows = [], [], []

    def decode_both(ids: torch.Tensor, n: int, generator: torch.Generator):
        """Plain (when compare_plain) then speculative decoding of ids, n new tokens at most."""
        kwargs = dict(max_new_tokens=n, sampling=sampling, exact_verify=exact_verify,
                      generator=generator)
        plain = generate(target, None, ids, **kwargs) if compare_plain else None
        return plain, generate(target, drafter, ids, k=k, tree=tree, min_confidence=min_confidence,
                               **cut, **kwargs)

    if warmup_tokens > 0 and prompts:
        ids = render(target, prompts[0].turns[:1], [])
        n = fit_max_new_tokens(target, ids, warmup_tokens, f"prompt {prompts[0].id} (turn 1)")
        decode_both(ids, n, torch.Generator(device=target.device).manual_seed(seed + 1))
    gen = torch.Generator(device=target.device).manual_seed(seed)
    for p in tqdm(prompts, desc=f"decode {eval_kind}", disable=quiet()):
        answers: list[list[int]] = []
        for turn in range(len(p.turns)):
            ids = render(target, p.turns[:turn + 1], answers)
            fitted = fit_max_new_tokens(target, ids, max_new_tokens,
                                        f"prompt {p.id} (turn {turn + 1})")
            plain, spec = decode_both(ids, fitted, gen)
            spec_results.append(spec)
            if plain is not None:
                plain_results.append(plain)
            # exact chains promise bit-identity: no tie allowance (trees keep it)
            rows.append(result_row(target, p, turn, ids, spec, plain, sampling.greedy,
                                   exact_verify and not tree, fitted, max_new_tokens))
            answers.append(rows[-1]["generated_ids"])
    spec_m = RunMetrics.from_results(spec_results)
    plain_m = RunMetrics.from_results(plain_results) if plain_results else None
    summary = summarise(target, drafter, rows, spec_m, plain_m, eval_kind=eval_kind,
                        n_prompts=len(prompts), k=k, tree=tree, sampling=sampling,
                        max_new_tokens=max_new_tokens, exact_verify=exact_verify,
                        extra={**cut, **({"offset": offset} if offset else {})})
    result = write_results(summary, rows, results_markdown(summary, spec_m), out_dir)
    result["slot_confidence"] = [x for r in spec_results for x in r.slot_confidence]
    return result


def headline(spec_m: RunMetrics, plain_tokens_per_s: float | None) -> dict:
    """tau, tau_draft and the speedup over plain decoding (when it ran): None where nothing was
    measured (no prompts, no decode rounds, no draft token), with `not_measured` saying why."""
    why = spec_m.not_measured()
    out = {"tau": spec_m.tau, "tau_draft": spec_m.tau_draft}
    if plain_tokens_per_s is not None:
        out["speedup"] = (spec_m.tokens_per_s / plain_tokens_per_s
                          if why is None and plain_tokens_per_s > 0 else None)
    if why is not None:
        out["not_measured"] = why
        log.warning("tau%s not measured: %s", " and speedup" if "speedup" in out else "", why)
    return out


def write_results(summary: dict, rows: list[dict], markdown: str, out_dir) -> dict:
    """A decode run's result: result.json (summary + per-prompt rows) and result.md in out_dir
    (None: not written); returned as {"summary", "markdown", "prompts"}."""
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "result.json").write_text(json.dumps({"summary": summary, "prompts": rows},
                                                         indent=1))
        (out_dir / "result.md").write_text(markdown + "\n")
    return {"summary": summary, "markdown": markdown, "prompts": rows}


def results_markdown(summary: dict, m: RunMetrics) -> str:
    lines = [f"### {summary['drafter']} on {summary['eval']} ({summary['generations']} generations, "
             f"k={summary['k']}{', tree' if summary['tree'] else ''}, "
             f"T={summary['temperature']})", "",
             m.to_markdown(), ""]
    if "speedup" in summary:
        speedup = summary["speedup"]
        lines += ["| plain tokens/s | speculative tokens/s | speedup | outputs identical |",
                  "|---:|---:|---:|:---:|",
                  f"| {summary['plain_tokens_per_s']:.1f} | {m.tokens_per_s:.1f} | "
                  f"{'not measured' if speedup is None else f'{speedup:.2f}x'} | "
                  f"{summary.get('outputs_identical_to_plain', 'n/a')} |"]
    if summary.get("not_measured"):
        lines += ["", f"tau, acceptance and speedup: not measured ({summary['not_measured']})."]
    return "\n".join(lines)


def decode_overrides(cfg: DictConfig, saved: Path) -> dict:
    """Decode-time settings (`tree_*`) of the decode config that differ from a saved drafter's,
    when the decode config names the same drafter (`drafter=eagle drafter.tree_total_tokens=16`):
    the tree is a decoding choice, not part of the trained weights."""
    import json

    from specdistill.drafters.base import DECODE_TIME_PREFIX

    saved_cfg = json.loads(saved.read_text())
    if cfg.drafter.name != saved_cfg.get("name"):
        return {}  # e.g. the default drafter=ngram: the checkpoint's own settings
    out = {k: v for k, v in OmegaConf.to_container(cfg.drafter).items()
           if k.startswith(DECODE_TIME_PREFIX) and k in saved_cfg and v != saved_cfg[k]}
    if out:
        log.info("decode-time drafter settings from the command line: %s", out)
    return out


def load_decode_drafter(cfg: DictConfig, target, source=None) -> Drafter | None:
    """The drafter of a decode job: a trained one from `ckpt` (`source`: its folder already
    resolved by cfg_source), else built from the drafter config."""
    from specdistill.drafters.base import build_drafter, trainable_drafters
    from specdistill.export.folder import load_resolved

    if cfg.ckpt:
        source = source or cfg_source(cfg)
        overrides = None if source.is_export else decode_overrides(cfg, source.folder / "drafter.json")
        return load_resolved(source, target, overrides)
    if cfg.drafter.name in trainable_drafters():
        raise ValueError(f"drafter={cfg.drafter.name} is trained: give its weights with ckpt=<run dir, "
                         f"checkpoint or export folder> (an untrained {cfg.drafter.name} would only "
                         f"measure noise)")
    return build_drafter(cfg.drafter, target)


def cfg_source(cfg: DictConfig):
    """The verified drafter folder of `ckpt` (store/rundir.py): a run dir's reference drafter
    (else the newest checkpoint that verifies, loudly), a checkpoint, drafter or export folder."""
    from specdistill.store.rundir import resolve_drafter

    return resolve_drafter(cfg.ckpt, setting="ckpt")


def decode_drafter_dtype(setting: str, target) -> torch.dtype:
    """decode's drafter_dtype: "target" = the target's dtype (bf16 drafting where the target runs
    bf16), else a dtype name."""
    from specdistill.target.precision import DTYPES

    if setting == "target":
        return target.dtype
    if setting not in DTYPES:
        raise ValueError(f"drafter_dtype={setting!r}: use target or one of {', '.join(DTYPES)}")
    return DTYPES[setting]


def setup_run(cfg: DictConfig) -> tuple[Path, Any, Drafter | None, SamplingParams, Any]:
    """A decode job's start: check the settings, make the run dir (with config.yaml), load the
    target and the drafter (cast to drafter_dtype). Returns (run_dir, target, drafter, sampling,
    the verified ckpt folder or None)."""
    from specdistill.cli.paths import present
    from specdistill.cli.ranges import check_ranges
    from specdistill.decode.config import DecodeConfig
    from specdistill.decode.survival import check_survival
    from specdistill.drafters.parts.head import cast_drafter
    from specdistill.target.model import load_target

    check_ranges(cfg, DecodeConfig)  # before any work
    # the values and tree=true now, the drafter's head once it is loaded
    check_survival(None, cfg.verify_survival, cfg.survival_fallback, cfg.tree)
    source = cfg_source(cfg) if cfg.ckpt else None  # missing or damaged: refused before any work
    if cfg.get("calibrate"):
        check_calibrate(cfg, source)
    run_dir = Path(cfg.run_dir)
    clash = present(run_dir, ("config.yaml", "result.json", "result.md", "checkpoints"))
    if clash:  # another job's folder (python -m decode refused it before Hydra ran)
        raise FileExistsError(f"run_dir={run_dir} holds another job's files ({', '.join(clash)}); "
                              f"a decode never replaces them: give a new run_dir=")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    target = load_target(cfg.target)
    drafter = load_decode_drafter(cfg, target, source)
    check_survival(drafter if cfg.k > 0 else None, cfg.verify_survival, cfg.survival_fallback)
    if cfg.get("calibrate") and not getattr(drafter, "accept_prob_head", False):
        raise ValueError(f"calibrate=true fits a trained confidence head; drafter {drafter.name!r} "
                         f"has none (DSpark's: drafter=dspark); set calibrate=false")
    if drafter is not None:
        drafter.to(target.device).eval()
        cast_drafter(drafter, target, decode_drafter_dtype(cfg.drafter_dtype, target))
    sampling = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    return run_dir, target, drafter, sampling, source


def check_calibrate(cfg: DictConfig, source) -> None:
    """calibrate=true needs a chain decode of a saved drafter folder (ValueError: what to change)."""
    if source is None or source.is_export:
        raise ValueError("calibrate=true writes a calibrated drafter folder: give ckpt= a training "
                         "run dir or one of its checkpoints (then export the calibrated folder), "
                         + ("not an export folder" if source is not None else "not ckpt=null"))
    if cfg.tree or cfg.k < 1:
        raise ValueError(f"calibrate=true fits the confidences of chain drafts: use tree=false and "
                         f"k >= 1 (got tree={cfg.tree}, k={cfg.k})")
    if cfg.get("batch_size", 1) > 1 or cfg.get("batch_mode", "verify_all") in ("budgeted",
                                                                               "adaptive"):
        raise ValueError("calibrate=true runs one sequence at a time: use batch_size=1 and "
                         "batch_mode=verify_all")


def write_calibrated(cfg: DictConfig, target, source, result: dict, run_dir: Path) -> dict:
    """Fit Platt scaling (decode/survival.py) to the decode's (confidence, accepted) pairs, fold
    it into a fresh copy of the saved drafter (its own dtype, not the decode's cast) and write it
    to <run_dir>/calibrated/ with calibration.json; returns what result.json records of it."""
    from specdistill.decode.survival import calibration_pairs, ece, fit_platt, platt
    from specdistill.export.folder import load_resolved
    from specdistill.store.drafter import save_drafter
    from specdistill.store.rundir import write_atomic

    pairs = calibration_pairs(result["slot_confidence"])
    pred, hit = [c for _, c, _ in pairs], [h for _, _, h in pairs]
    a, b = fit_platt(pred, hit)
    fresh = load_resolved(source, target, None)
    fresh.rescale_confidence(a, b)
    info = {"a": a, "b": b, "pairs": len(pairs), "accepted": int(sum(hit)),
            "temperature": cfg.temperature, "k": cfg.k, "eval": cfg.eval.kind,
            "offset": cfg.eval.offset, "prompts": result["summary"]["prompts"],
            "ece_before": ece(pred, hit), "ece_after_in_sample": ece(platt(pred, a, b), hit),
            "source": str(source.folder), "folder": str(run_dir / "calibrated")}
    meta = json.loads((source.folder / "drafter.json").read_text())

    def fill(tmp: Path) -> None:
        save_drafter(fresh, meta, tmp)
        (tmp / "calibration.json").write_text(json.dumps(info, indent=1))

    write_atomic(run_dir / "calibrated", fill)
    log.info("confidence calibration: sigmoid(%.4f * logit + %.4f) fitted to %d verified slots "
             "(%d accepted) at T=%s; ECE on them %.3f -> %.3f; the drafter with it: %s", a, b,
             len(pairs), info["accepted"], cfg.temperature, info["ece_before"],
             info["ece_after_in_sample"], info["folder"])
    return info


def calibration_markdown(info: dict) -> str:
    return (f"Confidence calibration fitted here: c' = sigmoid({info['a']:.4f} * logit(c) + "
            f"{info['b']:.4f}) on {info['pairs']} verified slots ({info['accepted']} accepted, "
            f"T={info['temperature']}, k={info['k']}); ECE on these slots {info['ece_before']:.3f} "
            f"-> {info['ece_after_in_sample']:.3f} (in sample: measure it on other prompts with "
            f"ckpt={info['folder']}). The calibrated drafter: {info['folder']}")


def finish_run(result: dict, run_dir: Path) -> None:
    """A decode job's end: print the table; fail the command when the lossless check failed."""
    print(result["markdown"], flush=True)
    print(f"results: {run_dir / 'result.json'}", flush=True)
    if result["summary"].get("lossless_check") == "failed":  # a bug, not a tie: fail the command
        raise SystemExit(f"python -m decode: error: the lossless check failed (greedy outputs differ "
                         f"from plain decoding beyond near-ties); see {run_dir / 'result.json'}")


def run(cfg: DictConfig) -> None:
    """`python -m decode` with batch_size=1: one sequence at a time (> 1: batched/evaluate.py)."""
    run_dir, target, drafter, sampling, source = setup_run(cfg)
    result = evaluate_drafter(target, drafter, eval_kind=cfg.eval.kind, path=cfg.eval.path,
                              limit=cfg.eval.limit, turns=cfg.eval.turns,
                              max_new_tokens=cfg.max_new_tokens, k=cfg.k, tree=cfg.tree,
                              sampling=sampling, min_confidence=cfg.min_confidence,
                              compare_plain=cfg.compare_plain, seed=cfg.seed,
                              exact_verify=cfg.exact_verify, out_dir=run_dir,
                              warmup_tokens=cfg.warmup_tokens,
                              verify_survival=cfg.verify_survival,
                              survival_fallback=cfg.survival_fallback, offset=cfg.eval.offset)
    if cfg.calibrate:
        summary = result["summary"]
        summary["confidence_recalibration"] = write_calibrated(cfg, target, source, result, run_dir)
        result = write_results(summary, result["prompts"], result["markdown"] + "\n\n"
                               + calibration_markdown(summary["confidence_recalibration"]), run_dir)
    finish_run(result, run_dir)
