"""`python -m decode batch_size=B batch_mode=...` (B > 1, or batch_mode=budgeted / adaptive at any
B): decode an eval set B sequences at a time (decode/batched/spec.py) and write the same
result.json / result.md as the single-sequence path, plus the batch size, the mode, the throughput
over the batch and the per-sequence latencies.

Turn t of every prompt is decoded in one batched call (turn t + 1 needs the model's own answer to
turn t). With compare_plain, plain batched decoding at the same B runs first, turn by turn, for the
speedup and, greedy, the token-identity check of every output (plain batched decoding is itself
token-identical to decoding each prompt alone: tests/test_batch.py).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from specdistill.data.prompts import load_prompts
from specdistill.decode.batched.cost import cost_curve
from specdistill.decode.batched.planner import new_planner
from specdistill.decode.batched.spec import PLANNED, BatchResult, generate_batch
from specdistill.decode.evaluate import (
    finish_run,
    fit_max_new_tokens,
    render,
    result_row,
    results_markdown,
    setup_run,
    summarise,
    write_results,
)
from specdistill.decode.exact import parse_exact
from specdistill.decode.metrics import RunMetrics
from specdistill.drafters.base import Drafter
from specdistill.drafters.parts.sampling import SamplingParams


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
                     cache_dir: str | None = None, warmup_tokens: int = 16,
                     verify_survival: float = 0.0, survival_fallback: str = "none",
                     offset: int = 0) -> dict:
    """Decode every prompt (and turn) batch_size at a time in `batch_mode`; return {"summary",
    "markdown", "prompts"} and write result.json + result.md into out_dir. exact_verify: both
    decodes with exact kernels per row (decode/batched/exact.py; greedy outputs then equal unbatched
    exact decoding bit for bit); auto = off here: batched, the exact rows cost 12-16% of the
    throughput at B = 2-4 and ~35% at B = 8 on a CPU (BENCHMARKS.md "Exact batched greedy").
    warmup_tokens: first, both modes decode that many tokens of the first batch_size prompts'
    first turns as one batch, untimed and discarded (first-use costs, as the single-sequence eval
    does); budgeted, with a planner of its own, so the measured planner learns nothing from it;
    every generate_batch call samples with generators of its own, so the measured prompts sample
    as they would without it. verify_survival, survival_fallback: each row's chain cut by survival
    (decode/survival.py); batch_mode=adaptive scores widths by it."""
    sampling = sampling or SamplingParams()
    exact_verify = bool(parse_exact(exact_verify))  # auto (None) = off when batched
    prompts = load_prompts(eval_kind, path=path, limit=limit, turns=turns, offset=offset)
    answers: list[list[list[int]]] = [[] for _ in prompts]
    spec_batches, plain_batches, spec_results, rows = [], [], [], []
    cut = dict(verify_survival=verify_survival, survival_fallback=survival_fallback)
    planner = warm_planner = None  # budgeted: one planner for every turn (turn 1's lessons serve turn 2)
    if batch_mode in PLANNED and drafter is not None and k > 0:
        curve = cost_curve(target, cache_dir, exact=exact_verify)
        planner, warm_planner = (new_planner(curve, k, drafter, tree) for _ in range(2))

    def decode_both(ids: list, fitted: list[int], seed_: int, planner_) -> tuple:
        """Plain batched decoding (when compare_plain) then speculative, of every row of ids."""
        kw = dict(max_new_tokens=fitted, batch_size=batch_size, sampling=sampling,
                  exact_verify=exact_verify)
        plain = generate_batch(target, None, ids, mode="plain", **kw) if compare_plain else None
        return plain, generate_batch(target, drafter, ids, k=k, mode=batch_mode,
                                     min_confidence=min_confidence, seed=seed_, cache_dir=cache_dir,
                                     planner=planner_, tree=tree, **cut, **kw)

    if warmup_tokens > 0 and prompts:
        ids = [render(target, p.turns[:1], []) for p in prompts[:batch_size]]
        decode_both(ids, [fit_max_new_tokens(target, x, warmup_tokens, f"prompt {p.id} (turn 1)")
                          for p, x in zip(prompts, ids)], seed + 1, warm_planner)
    for turn in range(max(len(p.turns) for p in prompts)):
        todo = [i for i, p in enumerate(prompts) if len(p.turns) > turn]
        ids = [render(target, prompts[i].turns[:turn + 1], answers[i]) for i in todo]
        fitted = [fit_max_new_tokens(target, x, max_new_tokens,
                                     f"prompt {prompts[i].id} (turn {turn + 1})")
                  for i, x in zip(todo, ids)]
        plain, spec = decode_both(ids, fitted, seed + 1000 * turn, planner)
        spec_batches.append(spec)
        plain_batches += [plain] if plain is not None else []
        for j, i in enumerate(todo):
            spec_results.append(spec.results[j])
            # exact chains promise bit-identity: no tie allowance (trees keep it)
            rows.append(result_row(target, prompts[i], turn, ids[j], spec.results[j],
                                   plain.results[j] if plain else None, sampling.greedy,
                                   exact_verify and not tree, fitted[j], max_new_tokens,
                                   latency_s=spec.latency[j]))
            answers[i].append(rows[-1]["generated_ids"])
    spec_m = _batch_metrics(spec_results, spec_batches)
    plain_m = (_batch_metrics([r for b in plain_batches for r in b.results], plain_batches)
               if plain_batches else None)
    latency = [r["latency_s"] for r in rows]
    widths = [w for b in spec_batches for w in b.widths]
    extra = {"batch_size": batch_size, "batch_mode": batch_mode,
             "latency_mean_s": statistics.mean(latency),
             "latency_p90_s": sorted(latency)[int(0.9 * (len(latency) - 1))],
             # None: no verify forward ran (every answer ended with the prefill's token)
             "mean_forward_width": statistics.mean(widths) if widths else None,
             **cut, **({"planner_probes": planner.probes} if planner else {})}
    summary = summarise(target, drafter, rows, spec_m, plain_m, eval_kind=eval_kind,
                        n_prompts=len(prompts), k=k, tree=tree, sampling=sampling,
                        max_new_tokens=max_new_tokens, exact_verify=exact_verify, extra=extra)
    markdown = (results_markdown(summary, spec_m)
                + f"\n\nbatch_size={batch_size}, batch_mode={batch_mode}: throughput over the "
                  f"batch, per-sequence latency mean {summary['latency_mean_s']:.2f} s")
    return write_results(summary, rows, markdown, out_dir)


def run_batched(cfg) -> None:
    """`python -m decode batch_size=B batch_mode=...` with B > 1 or budgeted (decode/__main__.py)."""
    from specdistill.decode.batched.spec import MODES
    from specdistill.target.model import cache_root

    if cfg.batch_mode not in MODES:
        raise ValueError(f"batch_size={cfg.batch_size} needs batch_mode in {MODES} (got "
                         f"{cfg.batch_mode!r})")
    run_dir, target, drafter, sampling, _ = setup_run(cfg)
    result = evaluate_batched(
        target, drafter, batch_size=cfg.batch_size, batch_mode=cfg.batch_mode,
        eval_kind=cfg.eval.kind, path=cfg.eval.path, limit=cfg.eval.limit, turns=cfg.eval.turns,
        max_new_tokens=cfg.max_new_tokens, k=cfg.k, sampling=sampling,
        min_confidence=cfg.min_confidence, compare_plain=cfg.compare_plain, seed=cfg.seed,
        tree=cfg.tree, exact_verify=cfg.exact_verify, out_dir=run_dir,
        cache_dir=str(cache_root(cfg.target)), warmup_tokens=cfg.warmup_tokens,
        verify_survival=cfg.verify_survival, survival_fallback=cfg.survival_fallback,
        offset=cfg.eval.offset)
    finish_run(result, run_dir)
