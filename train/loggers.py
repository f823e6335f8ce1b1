"""Metric loggers, rank 0 only: console lines, metrics.jsonl, Weights & Biases and TensorBoard.

    loggers = Loggers(cfg.logger, run_dir, is_main, config=cfg)   # kinds: any of KINDS, several at once
    loggers.progress(step, total, loss=...)   # tqdm bar over the steps (quiet off a terminal / in CI)
    loggers.log({"loss": 2.3, "lr": 3e-4}, step)                   # training and simulated-eval scalars
    loggers.log_decoder_eval(summary, step)   # the real decoder's result (decode/evaluate.py summary)
    loggers.close()

Names: metrics.jsonl and the console keep the recipe's keys unchanged (loss, lr, grad_norm,
eval/sim_tau, eval/acc_1, final/tau, ...); W&B and TensorBoard put bare keys under `train/` so their
dashboards group them. At a decoder eval W&B also gets the accepted-length distribution as a
`wandb.Histogram` and as a `wandb.plot.bar` chart over a `wandb.Table`, plus per-position acceptance
as a bar chart: the panels appear in every run of a project with no manual chart building.

W&B mode (LoggerConfig.wandb_mode): an explicit online/offline/disabled wins; otherwise tests
(pytest) and CI are offline, then an explicit WANDB_MODE in the environment, then online when an API
key is configured (WANDB_API_KEY or a ~/.netrc entry for the W&B host) and offline when not, so a
run on a machine without a key still records everything under <run_dir>/wandb/ for `wandb sync`.
"""
from __future__ import annotations

import json
import logging
import math
import netrc
import os
import secrets
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tqdm import tqdm

from specdistill.data import quiet

log = logging.getLogger(__name__)


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _plain(v: Any) -> Any:
    """A JSON-ready value: tensors to lists, non-finite floats to strings."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _dashboard_key(key: str) -> str:
    """W&B/TensorBoard name: bare training keys go under train/ (eval/ and final/ keep theirs)."""
    return key if "/" in key else f"train/{key}"


def decoder_eval_scalars(summary: dict[str, Any], prefix: str = "final") -> dict[str, float]:
    """The headline numbers of a decoder-eval summary, named for dashboards."""
    pick = {"tau": "tau", "tau_draft": "tau_draft", "tokens_per_s": "spec_tokens_per_s",
            "plain_tokens_per_s": "plain_tokens_per_s", "speedup": "speedup",
            "rounds": "spec_rounds", "new_tokens": "spec_new_tokens",
            "mismatched_generations": "mismatched_generations"}
    out = {f"{prefix}/{name}": float(summary[key]) for name, key in pick.items()
           if _scalar(summary.get(key))}
    if isinstance(summary.get("outputs_identical_to_plain"), bool):
        out[f"{prefix}/outputs_identical_to_plain"] = float(summary["outputs_identical_to_plain"])
    for i, a in enumerate(summary.get("spec_accept_cond") or []):
        if _scalar(a):  # None: a position no round reached, not measured
            out[f"{prefix}/acc_{i + 1}"] = float(a)
    return out


def not_measured_line(summary: dict[str, Any], prefix: str) -> str | None:
    """What a decoder eval could not measure, said in words (None when it measured everything)."""
    why = summary.get("not_measured")
    return f"{prefix}: tau, acceptance and speedup not measured ({why})" if why else None


class ConsoleLogger:
    """One line per call (scalars only), written through tqdm so a progress bar stays intact."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        parts = [f"{k}={_fmt(v)}" for k, v in metrics.items() if _scalar(v)]
        tqdm.write(f"[step {step}] " + " ".join(parts))

    def log_decoder_eval(self, summary: dict[str, Any], step: int, prefix: str) -> None:
        self.log(decoder_eval_scalars(summary, prefix), step)
        line = not_measured_line(summary, prefix)
        if line:
            tqdm.write(f"[step {step}] {line}")

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON object per call to <run_dir>/metrics.jsonl (resumed runs keep appending).
    train/report.py reads this file back for the loss and tau curves."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = open(self.path, "a", buffering=1)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")

    def log_decoder_eval(self, summary: dict[str, Any], step: int, prefix: str) -> None:
        self.log({f"{prefix}/{k}": v for k, v in summary.items()}, step)  # everything, lists included

    def close(self) -> None:
        self.file.close()

    def rewind(self, step: int) -> None:
        """Drop rows logged after `step` (a resumed run redoes those steps: no row twice)."""
        self.file.close()
        rows = self.path.read_text().splitlines(keepends=True) if self.path.is_file() else []
        keep = [r for r in rows if r.strip() and json.loads(r).get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.path)
        self.file = open(self.path, "a", buffering=1)


def wandb_key_configured() -> bool:
    """Whether W&B could authenticate: WANDB_API_KEY, or a netrc entry for the W&B API host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _test_or_ci() -> bool:
    return bool(os.environ.get("CI")) or "PYTEST_CURRENT_TEST" in os.environ


def wandb_mode(requested: str = "auto") -> str:
    """online | offline | disabled, by the rule in the module docstring."""
    if requested not in ("auto", "online", "offline", "disabled"):
        raise ValueError(f"logger.wandb_mode must be auto, online, offline or disabled, "
                         f"not {requested!r}")
    if requested != "auto":
        return requested
    if _test_or_ci():
        return "offline"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if wandb_key_configured() else "offline"


class WandbLogger:
    """A W&B run under <run_dir>/wandb/. Its id is kept in <run_dir>/wandb_run_id, so a resumed
    training run (resume=true) continues the same W&B run instead of starting a new one."""

    def __init__(self, cfg, run_dir: Path, config: dict[str, Any] | None) -> None:
        import wandb

        self.wandb = wandb
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        mode = wandb_mode(cfg.wandb_mode)
        fast = _test_or_ci()  # no console capture or system stats in tests and CI: init stays < 1 s
        settings = wandb.Settings(silent=True, console="off" if fast else "auto",
                                  x_disable_stats=fast, disable_git=fast, save_code=False)
        tags = list(cfg.wandb_tags) + _auto_tags(config)
        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity,
                              name=cfg.wandb_run_name or run_dir.name, dir=str(run_dir), id=run_id,
                              resume="allow", mode=mode, config=config or {}, tags=tags,
                              settings=settings)
        if mode == "offline":
            log.info("W&B runs offline (no API key configured); sync later with "
                     "`wandb sync %s`", Path(self.run.dir).parent)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        scalars = {_dashboard_key(k): v for k, v in metrics.items() if _scalar(v)}
        if scalars:
            self.run.log(scalars, step=step)

    def log_decoder_eval(self, summary: dict[str, Any], step: int, prefix: str) -> None:
        wandb = self.wandb
        scalars = decoder_eval_scalars(summary, prefix)
        hist = [int(c) for c in summary.get("spec_accept_hist") or []]
        acc = [float(a) for a in summary.get("spec_accept_cond") or [] if _scalar(a)]
        payload: dict[str, Any] = dict(scalars)
        if hist:  # bins centred on 0, 1, 2, ... accepted drafts
            import numpy as np

            edges = np.arange(len(hist) + 1) - 0.5
            payload[f"{prefix}/accepted_length_hist"] = wandb.Histogram(
                np_histogram=(np.asarray(hist), edges))
            lengths = wandb.Table(columns=["accepted drafts", "rounds"],
                                  data=[[n, c] for n, c in enumerate(hist)])
            payload[f"{prefix}/accepted_length"] = wandb.plot.bar(
                lengths, "accepted drafts", "rounds", title="accepted drafts per round")
        if acc:
            positions = wandb.Table(columns=["draft position", "acceptance"],
                                    data=[[i + 1, a] for i, a in enumerate(acc)])
            payload[f"{prefix}/acceptance_by_position"] = wandb.plot.bar(
                positions, "draft position", "acceptance",
                title="P(draft i accepted | drafts before it accepted)")
        self.run.log(payload, step=step)
        self.run.summary.update(scalars)
        if summary.get("not_measured"):  # no number where nothing was measured: the reason
            self.run.summary[f"{prefix}/not_measured"] = summary["not_measured"]

    def close(self) -> None:
        self.run.finish()


def _auto_tags(config: dict[str, Any] | None) -> list[str]:
    """drafter:<name> and target:<path> tags, so a W&B project filters runs by them."""
    if not config:
        return []
    tags = []
    if isinstance(config.get("drafter"), dict) and config["drafter"].get("name"):
        tags.append(f"drafter:{config['drafter']['name']}")
    if isinstance(config.get("target"), dict) and config["target"].get("path"):
        tags.append(f"target:{config['target']['path']}"[:64])  # W&B limits tags to 64 chars
    return tags


class TensorboardLogger:
    """Event files under logger.tensorboard_dir (default <run_dir>/tensorboard)."""

    def __init__(self, cfg, run_dir: Path, config: dict[str, Any] | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(cfg.tensorboard_dir or Path(run_dir) / "tensorboard"))
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in metrics.items():
            if _scalar(v):
                self.writer.add_scalar(_dashboard_key(k), v, step)

    def log_decoder_eval(self, summary: dict[str, Any], step: int, prefix: str) -> None:
        self.log(decoder_eval_scalars(summary, prefix), step)
        hist = [int(c) for c in summary.get("spec_accept_hist") or []]
        if sum(hist):  # exact counts: one bucket per accepted length n, right edge n + 0.5
            n = range(len(hist))
            self.writer.add_histogram_raw(
                f"{prefix}/accepted_length_hist", min=0, max=max(i for i in n if hist[i]),
                num=sum(hist), sum=sum(i * c for i, c in zip(n, hist)),
                sum_squares=sum(i * i * c for i, c in zip(n, hist)),
                bucket_limits=[i + 0.5 for i in n], bucket_counts=hist, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Loggers:
    """Fan-out to the configured loggers; a no-op on ranks other than 0."""

    KINDS = {"console": lambda cfg, run_dir, config: ConsoleLogger(),
             "jsonl": lambda cfg, run_dir, config: JsonlLogger(run_dir),
             "wandb": WandbLogger, "tensorboard": TensorboardLogger}

    def __init__(self, cfg, run_dir: Path, is_main: bool, config=None) -> None:
        """cfg: a LoggerConfig (or DictConfig of one), or just a list of kinds. config: the run's
        full config (DictConfig or dict), logged as the W&B run config and TensorBoard text."""
        from omegaconf import OmegaConf

        from specdistill.train.config import LoggerConfig

        if isinstance(cfg, (list, tuple)) or OmegaConf.is_list(cfg):
            cfg = LoggerConfig(kinds=list(cfg))
        unknown = set(cfg.kinds) - set(self.KINDS)
        if unknown:
            raise ValueError(f"unknown logger kind(s) {sorted(unknown)}; known: {sorted(self.KINDS)}")
        if config is not None and OmegaConf.is_config(config):
            config = OmegaConf.to_container(config, resolve=True)
        self.is_main = is_main
        self.bar = None
        self.loggers = [self.KINDS[k](cfg, Path(run_dir), config) for k in cfg.kinds] if is_main else []

    def progress(self, step: int, total: int, **postfix: float) -> None:
        """Advance the training progress bar to `step` of `total` (rank 0, terminal only)."""
        if not self.is_main or quiet():
            return
        if self.bar is None:
            self.bar = tqdm(total=total, initial=step, desc="train", dynamic_ncols=True)
        self.bar.n = step
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def rewind(self, step: int) -> None:
        """After a resume from `step`: forget what was logged after it (files that can)."""
        for lg in self.loggers:
            if hasattr(lg, "rewind"):
                lg.rewind(step)

    def log_decoder_eval(self, summary: dict[str, Any], step: int, prefix: str = "final") -> None:
        """A real-decoder eval (decode/evaluate.py summary): scalars, accepted-length histogram and
        bar chart, per-position acceptance."""
        for lg in self.loggers:
            lg.log_decoder_eval(summary, step, prefix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for lg in self.loggers:
            lg.close()
        self.loggers = []
