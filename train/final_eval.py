"""The job's final eval: the best drafter in the real decoder, and in a serving engine.

    result = final_eval(cfg, run_dir, target, drafter, loggers, step)
    # {"summary", "markdown", "prompts"} of decode/evaluate.py, + "engine" when
    # trainer.engine_check names an engine (decode/engine/check.py)

The drafter is measured as `python -m decode` would measure it: `best/` reloaded onto the target at
the decoder's dtype (auto: bf16 on native-bf16 CPUs), not the training copy at float32.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specdistill.drafters.parts.head import cast_drafter
from specdistill.store.drafter import load_drafter
from specdistill.target.model import cache_root, load_target
from specdistill.train.memory import release_free_memory
from specdistill.train.report import write_report

log = logging.getLogger(__name__)


def prepare_engine(cfg: DictConfig, run_dir: Path, drafter, is_main: bool) -> None:
    """At the job's start (on its main process): when its final eval will check the drafter in
    vLLM and vLLM is not installed yet, install it now in a child process (decode/engine/envs.py),
    beside the capture and the training, instead of after them. Not for llama.cpp: its build is a
    compile that would take the training's cores."""
    tcfg = cfg.trainer
    if not (is_main and tcfg.get("final_eval") and tcfg.get("engine_check") == "vllm"):
        return  # other ranks and jobs without the check import nothing of the engines
    from specdistill.decode.engine.check import engine_format
    from specdistill.decode.engine.envs import install_in_background

    if engine_format(drafter)[0]:
        install_in_background(cache_root(cfg.target), run_dir / "engine_install.log")


def final_eval(cfg: DictConfig, run_dir: Path, target, drafter, loggers, step: int) -> dict:
    """The real decoder on trainer.final_eval's prompts with the best drafter, vs plain decoding;
    logged, written under run_dir/final_eval/ and into the run's report."""
    from specdistill.decode.engine.envs import wait_background
    from specdistill.decode.evaluate import evaluate_drafter

    tcfg = cfg.trainer
    wait_background(cache_root(cfg.target))  # prepare_engine's install: never beside the timed decode
    best, trained, trained_drafter = run_dir / "best", target, drafter
    if best.is_dir():
        target = decode_target(cfg, trained)
        drafter = cast_drafter(load_drafter(best, target).to(target.device), target, target.dtype)
    result = evaluate_drafter(target, drafter.eval(), eval_kind=tcfg.final_eval,
                              limit=tcfg.final_eval_limit,
                              max_new_tokens=tcfg.final_eval_max_new_tokens,
                              k=tcfg.eval_k, out_dir=run_dir / "final_eval")
    loggers.log_decoder_eval(result["summary"], step)  # + histogram, bar charts
    if tcfg.get("engine_check"):
        del target, drafter  # the decoder's bf16 copies: their memory goes to the engines
        release_free_memory(collect=True)
        result["engine"] = engine_eval(cfg, run_dir, trained, trained_drafter, result["prompts"],
                                       loggers, step, result["summary"].get("target_dtype"))
    write_report(run_dir)
    return result


def publish(result: dict, run_dir: Path) -> None:
    """Print the final eval's tables (our decoder's, then the serving engine's check beside it)
    and write <run_dir>/summary.json."""
    print(result["markdown"], flush=True)
    summary = dict(result["summary"])
    if result.get("engine"):
        print(result["engine"]["markdown"], flush=True)
        summary["engine_check"] = {k: v for k, v in result["engine"]["summary"].items()
                                   if k != "error_detail"}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def engine_eval(cfg: DictConfig, run_dir: Path, target, drafter, ours: list[dict], loggers,
                step: int, ours_dtype: str | None = None) -> dict | None:
    """The best drafter exported in a layout the serving engine reads and loaded there
    (decode/engine/check.py): its outputs and acceptance against ours (`ours`: our decoder's
    result rows) on the final eval's prompts, at float32 (the training target). Skipped, with the
    reason logged, when the drafter has no such layout or the engine cannot be installed here.
    `drafter`: the training copy, used when the run has no best/ checkpoint."""
    from specdistill.decode.engine.check import engine_check, engine_format
    from specdistill.export.folder import export_drafter

    tcfg = cfg.trainer
    engine, best = tcfg.engine_check, run_dir / "best"
    fmt, why = engine_format(drafter, engine)  # best/ has the training copy's config: no read yet
    if fmt is None:
        log.warning("engine check skipped: %s", why)
        return None
    drafter = (load_drafter(best, target) if best.is_dir() else drafter).eval()
    out = run_dir / "final_eval" / "engine"
    if out.exists():  # a resumed job's earlier check: measured again
        shutil.rmtree(out)
    folder = export_drafter(drafter, cfg.drafter, target, fmt, out / f"export-{fmt}",
                            k=tcfg.eval_k)["path"]
    result = engine_check(folder, target, drafter, engine=engine, eval_kind=tcfg.final_eval,
                          limit=tcfg.engine_check_limit or tcfg.final_eval_limit,
                          max_new_tokens=tcfg.final_eval_max_new_tokens, k=tcfg.eval_k,
                          out_dir=out, cache=cache_root(cfg.target), ours=ours,
                          ours_dtype=ours_dtype)
    s = result["summary"]
    if s.get("verdict") == "engine unavailable":
        log.warning("engine check skipped: %s", s["error"])
    elif s.get("verdict") != "pass":
        log.error("engine check FAILED (%s, format %s): %s; see %s", engine, fmt,
                  s.get("error") or "; ".join(s.get("problems", [])), out / "engine_check.json")
    loggers.log({f"engine/{key}": s[key] for key in ("tau_engine", "tau_replay", "engine_speedup")
                 if isinstance(s.get(key), (int, float))}, step)
    return result


def decode_target(cfg: DictConfig, target):
    """The target as decoding loads it: training resolves target.dtype=auto to float32, the
    decoder to the machine's fastest lossless dtype; reload only when they differ. Kept, the
    training target gets decoding's kernels: fp32 CPU linear layers packed (target/prepack.py;
    frozen weights, and forwards needing a gradient keep F.linear)."""
    from specdistill.target.precision import resolve_dtype
    from specdistill.target.prepack import use_prepacked_linear

    want = resolve_dtype(str(cfg.target.dtype), str(cfg.target.device)).dtype
    if want == str(target.dtype).removeprefix("torch."):
        if cfg.target.get("prepack", True):
            use_prepacked_linear(target.model)
        return target
    # target.threads=0 would lower the threads to the cores the 1-minute load average leaves
    # idle, and that load is this job's own training: keep the threads training ran with
    threads = int(cfg.target.get("threads", 0) or 0) or torch.get_num_threads()
    return load_target(OmegaConf.merge(cfg.target, {"threads": threads}))
