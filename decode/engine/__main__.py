"""`python -m decode.engine export=<dir> ...`: load an export in a real serving engine and compare
what it does with our decoder (decode/engine/check.py). Schema: EngineCheckConfig below."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from specdistill.drafters.cli import CONF_DIR
from specdistill.decode.config import EvalConfig
from specdistill.drafters.target import TargetConfig


@dataclass
class EngineCheckConfig:
    """`python -m decode.engine` (conf/engine.yaml)."""

    export: str = MISSING  # an export folder written by `python -m train.export`
    engine: str = "vllm"  # the serving engine: vllm | llamacpp
    target: TargetConfig = MISSING  # the export's target (conf/target/*.yaml)
    eval: EvalConfig = MISSING  # the prompts (first turns)
    max_new_tokens: int = 128  # generation budget per prompt
    k: Optional[int] = None  # draft tokens per round (None = the export's speculative_tokens)
    # also decode with our own decoder (its tau and outputs beside the engine's; a replay of our
    # decoder on the engine's text is always measured)
    ours: bool = True
    threads: Optional[int] = None  # engine compute threads (None = every core this process may use)
    timeout_s: int = 1800  # an engine step (install, load, one prompt) taking longer fails the check
    out: str = "runs/engine/${now:%Y-%m-%d_%H-%M-%S}"  # engine_check.json + .md, the engines' logs


ConfigStore.instance().store(name="engine_schema", node=EngineCheckConfig)

ENGINE_RULES = {"max_new_tokens": (1, None), "k": (1, None), "eval.limit": (1, None),
                "threads": (1, None), "timeout_s": (1, None)}


@hydra.main(config_path=CONF_DIR, config_name="engine", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from specdistill.drafters.cli import check_ranges, user_errors

    with user_errors("python -m decode.engine"):
        check_ranges(cfg, ENGINE_RULES)
        from specdistill.decode.engine.check import run

        run(cfg)


def cli() -> None:
    """The command line (also the `specdistill-*` console script): argument checks, then main."""
    import sys

    from specdistill.drafters.cli import check_out_dir_arg

    check_out_dir_arg("python -m decode.engine", sys.argv[1:], key="out")
    main()


if __name__ == "__main__":
    cli()
