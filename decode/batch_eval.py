"""`python -m decode batch_size=B batch_mode=...` (B > 1): decode an eval set B sequences at a time
(decode/batch.py) and write the same result.json / result.md as the single-sequence path, plus the
batch size, the mode, the throughput over the batch and the per-sequence latencies.

Turn t of every prompt is decoded in one batched call (turn t + 1 needs the model's own answer to
turn t). With compare_plain, plain batched decoding at the same B runs first, turn by turn, for the
speedup and, greedy, the token-identity check of every output (plain batched decoding is itself
token-identical to decoding each prompt alone: tests/test_batch.py).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path

from specdistill.data.prompts import load_prompts
from specdistill.decode.batch import BatchResult, generate_batch
from specdistill.decode.budget import cost_curve, new_planner
from specdistill.decode.kernels import parse_exact
from specdistill.decode.evaluate import (_budget, _lossless_check, compare_greedy, finish_run, headline,
                             render, results_markdown, setup_run, write_results)
from specdistill.decode.metrics import RunMetrics
from specdistill.drafters.base import Drafter
from specdistill.drafters.sampling import SamplingParams


def _batch_metrics(results: list, batches: list[BatchResult]) -> RunMetrics:
    """Round statistics of every sequence, timed as the batches ran (wall clock, not the sum of
    the sequences' overlapping times)."""
    m = RunMetrics.from_results(results)
    m.time_total = sum(b.time_total for b in batches)
    m.time_draft = sum(b.time_draft for b in batches)
    m.time_verify = sum(b.time_verify for b in batches)
    m.time_other = m.time_total - m.time_draft - m.time_verify
    m.tokens_per_s = m.new_tokens / m.time_total if m.time_total else 0.0
    return m


def evaluate_batched(target, drafter: Drafter | None, *, batch_size: int, batch_mode: str,
                     eval_kind: str = "mtbench", path: str | None = None, limit: int | None = None,
                     turns: int = 1, max_new_tokens: int = 256, k: int = 5,
                     sampling: SamplingParams | None = None, min_confidence: float = 0.0,
                     compare_plain: bool = True, seed: int = 0, tree: bool = False,
                     exact_verify: bool | str = False, out_dir: Path | None = None,
                     cache_dir: str | None = None) -> dict:
    """Decode every prompt (and turn) batch_size at a time in `batch_mode`; return {"summary",
    "markdown", "prompts"} and write result.json + result.md into out_dir. exact_verify: both
    decodes with exact kernels per row (decode/rows_exact.py; greedy outputs then equal unbatched
    exact decoding bit for bit); auto = off here: batched, the exact rows cost 12-16% of the
    throughput at B = 2-4 and ~35% at B = 8 on a CPU (BENCHMARKS.md "Exact batched greedy")."""
    sampling = sampling or SamplingParams()
    exact_verify = bool(parse_exact(exact_verify))  # auto (None) = off when batched
    prompts = load_prompts(eval_kind, path=path, limit=limit, turns=turns)
    answers: list[list[list[int]]] = [[] for _ in prompts]
    spec_batches, plain_batches, spec_results, rows = [], [], [], []
    planner = None  # budgeted: one planner for every turn (what turn 1 learnt serves turn 2)
    if batch_mode == "budgeted" and drafter is not None and k > 0:
        planner = new_planner(cost_curve(target, cache_dir, exact=exact_verify), k, drafter, tree)
    for turn in range(max(len(p.turns) for p in prompts)):
        todo = [i for i, p in enumerate(prompts) if len(p.turns) > turn]
        ids = [render(target, prompts[i].turns[:turn + 1], answers[i]) for i in todo]
        budgets = [_budget(target, x, max_new_tokens, f"prompt {prompts[i].id} (turn {turn + 1})")
                   for i, x in zip(todo, ids)]
        kw = dict(max_new_tokens=budgets, batch_size=batch_size, sampling=sampling,
                  exact_verify=exact_verify)
        plain = generate_batch(target, None, ids, mode="plain", **kw) if compare_plain else None
        spec = generate_batch(target, drafter, ids, k=k, mode=batch_mode,
                              min_confidence=min_confidence, seed=seed + 1000 * turn,
                              cache_dir=cache_dir, planner=planner, tree=tree, **kw)
        spec_batches.append(spec)
        plain_batches += [plain] if plain is not None else []
        for j, i in enumerate(todo):
            res, p = spec.results[j], prompts[i]
            same, where = compare_greedy(target, ids[j], plain.results[j] if plain else None, res,
                                   sampling.greedy, exact_verify and not tree)
            out = res.tokens.tolist()
            answers[i].append(out)
            spec_results.append(res)
            rows.append({"id": p.id, "turn": turn + 1, "category": p.category,
                         "prompt_tokens": len(ids[j]), "generated_ids": out,
                         "text": target.tokenizer.decode(out, skip_special_tokens=False),
                         "new_tokens": len(out), "target_forwards": res.target_forwards,
                         "accepted": res.accepted, "drafted": res.drafted,
                         "stop_reason": res.stop_reason, "identical_to_plain": same,
                         "latency_s": spec.latency[j], "budget_capped": budgets[j] < max_new_tokens,
                         **({"first_difference": where} if where else {})})
    spec_m = _batch_metrics(spec_results, spec_batches)
    latency = [r["latency_s"] for r in rows]
    widths = [w for b in spec_batches for w in b.widths]
    summary = {**({"planner_probes": planner.probes} if planner else {}), "eval": eval_kind, "prompts": len(prompts), "generations": len(rows),
               "drafter": drafter.name if drafter is not None else "none", "k": k, "tree": tree,
               "temperature": sampling.temperature, "max_new_tokens": max_new_tokens,
               "batch_size": batch_size, "batch_mode": batch_mode, "exact_verify": exact_verify,
               "latency_mean_s": statistics.mean(latency),
               "latency_p90_s": sorted(latency)[int(0.9 * (len(latency) - 1))],
               # None: no verify forward ran (every answer ended with the prefill's token)
               "mean_forward_width": statistics.mean(widths) if widths else None,
               **{f"spec_{n}": v for n, v in asdict(spec_m).items()}}
    summary.update(target.dtype_choice.as_dict() if hasattr(target, "dtype_choice") else
                   {"target_dtype": str(target.dtype).removeprefix("torch.")})
    if plain_batches:
        plain_m = _batch_metrics([r for b in plain_batches for r in b.results], plain_batches)
        summary["plain_tokens_per_s"] = plain_m.tokens_per_s
        summary["plain_target_forwards"] = plain_m.target_forwards
        if sampling.greedy:
            summary.update(_lossless_check(rows))
    summary.update(headline(spec_m, plain_m.tokens_per_s if plain_batches else None))
    markdown = (results_markdown(summary, spec_m)
                + f"\n\nbatch_size={batch_size}, batch_mode={batch_mode}: throughput over the "
                  f"batch, per-sequence latency mean {summary['latency_mean_s']:.2f} s")
    return write_results(summary, rows, markdown, out_dir)


def run_batched(cfg) -> None:
    """`python -m decode batch_size=B batch_mode=...` with B > 1 (decode/__main__.py)."""
    from specdistill.decode.batch import MODES
    from specdistill.drafters.target import cache_root

    if cfg.batch_mode not in MODES:
        raise ValueError(f"batch_size={cfg.batch_size} needs batch_mode in {MODES} (got "
                         f"{cfg.batch_mode!r})")
    run_dir, target, drafter, sampling = setup_run(cfg)
    result = evaluate_batched(
        target, drafter, batch_size=cfg.batch_size, batch_mode=cfg.batch_mode,
        eval_kind=cfg.eval.kind, path=cfg.eval.path, limit=cfg.eval.limit, turns=cfg.eval.turns,
        max_new_tokens=cfg.max_new_tokens, k=cfg.k, sampling=sampling,
        min_confidence=cfg.min_confidence, compare_plain=cfg.compare_plain, seed=cfg.seed,
        tree=cfg.tree, exact_verify=cfg.exact_verify, out_dir=run_dir,
        cache_dir=str(cache_root(cfg.target)))
    finish_run(result, run_dir)
