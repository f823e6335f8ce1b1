"""`python -m decode.engine export=<dir> ...`: load an export in a real serving engine and compare
what it does with our decoder (decode/engine/check.py). Schema: EngineCheckConfig below."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from specdistill.cli.paths import CONF_DIR
from specdistill.cli.ranges import MAX_DRAFT, MAX_SECONDS, MAX_THREADS, MAX_TOKENS, rng
from specdistill.decode.config import EvalConfig
from specdistill.target.model import TargetConfig


@dataclass
class EngineCheckConfig:
    """`python -m decode.engine` (conf/engine.yaml)."""

    export: str = MISSING  # an export folder written by `python -m train.export`
    engine: str = "vllm"  # the serving engine: vllm | llamacpp
    target: TargetConfig = MISSING  # the export's target (conf/target/*.yaml)
    eval: EvalConfig = MISSING  # the prompts (first turns)
    max_new_tokens: int = rng(128, 1, MAX_TOKENS)  # tokens generated at most per prompt
    # draft tokens per round (None = the k the export was written for)
    k: Optional[int] = rng(None, 1, MAX_DRAFT)
    # also decode with our own decoder (its tau and outputs beside the engine's; a replay of our
    # decoder on the engine's text is always measured)
    ours: bool = True
    # engine compute threads (None = every core this process may use)
    threads: Optional[int] = rng(None, 1, MAX_THREADS)
    # an engine step (install, load, one prompt) taking longer fails the check
    timeout_s: int = rng(1800, 1, MAX_SECONDS)
    out: str = "runs/engine/${now:%Y-%m-%d_%H-%M-%S}"  # engine_check.json + .md, the engines' logs


ConfigStore.instance().store(name="engine_schema", node=EngineCheckConfig)


def run(cfg: DictConfig) -> None:
    """The check, after the settings' ranges and the export folder (verified against its
    manifest: store/rundir.py) pass, before anything loads."""
    from specdistill.cli.errors import UserError
    from specdistill.cli.ranges import check_ranges
    from specdistill.store.rundir import resolve_drafter

    check_ranges(cfg, EngineCheckConfig)
    if not resolve_drafter(cfg.export, setting="export").is_export:
        raise UserError(f"export={cfg.export} is a trained drafter, not an export: export it "
                        f"first (python -m train.export run={cfg.export} format=vllm out=...)")
    from specdistill.decode.engine.check import run as check

    check(cfg)


@hydra.main(config_path=CONF_DIR, config_name="engine", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from specdistill.cli.errors import user_errors

    with user_errors("python -m decode.engine"):
        from pathlib import Path

        from specdistill.cli.paths import refuse_nonempty

        # Hydra writes nothing into `out` here (no .hydra/, logs to stdout): checked before the run
        refuse_nonempty(Path(cfg.out), "out", "engine_check.json, engine_check.md, the served "
                        "target and the engines' logs")
        run(cfg)


def cli() -> None:
    """The command line (also `specdistill <verb>`, cli/main.py): argument checks, then main."""
    import sys

    from specdistill.cli.paths import check_out_dir_arg
    from specdistill.cli.start import check_start

    check_out_dir_arg("python -m decode.engine", sys.argv[1:], key="out")
    check_start("python -m decode.engine", "engine", sys.argv[1:], EngineCheckConfig)
    main()


if __name__ == "__main__":
    cli()
