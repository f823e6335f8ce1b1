"""Metric loggers (rank 0 only): console lines and a metrics.jsonl file in the run dir."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class ConsoleLogger:
    def log(self, metrics: dict[str, Any], step: int) -> None:
        parts = [f"{k}={_fmt(v)}" for k, v in metrics.items() if _scalar(v)]
        print(f"[step {step}] " + " ".join(parts), flush=True)

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON object per call to <run_dir>/metrics.jsonl (resumed runs keep appending)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = open(self.path, "a", buffering=1)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()


class Loggers:
    """Fan-out to several loggers; a no-op on ranks other than 0."""

    KINDS = {"console": lambda run_dir: ConsoleLogger(), "jsonl": JsonlLogger}

    def __init__(self, kinds: list[str], run_dir: Path, is_main: bool) -> None:
        unknown = set(kinds) - set(self.KINDS)
        if unknown:
            raise ValueError(f"unknown logger kind(s) {sorted(unknown)}; known: {sorted(self.KINDS)}")
        self.loggers = [self.KINDS[k](run_dir) for k in kinds] if is_main else []

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
