"""`python -m decode ...`: run a drafter through the lossless decoder on an eval set (Hydra entry).

The run dir must be new or empty (checked before Hydra writes into it): a decode never writes its
config, results or Hydra record into a training run's folder or any other job's."""
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specdistill.cli.paths import CONF_DIR
from specdistill.decode.config import DecodeConfig, store_schemas

store_schemas("decode_schema", DecodeConfig)
OUTPUTS = "config.yaml, result.json, result.md, .hydra/ and its log"  # what a decode writes


def run(cfg: DictConfig) -> None:
    """The job on a composed config: settings, ranges and the checkpoint are checked first
    (decode/evaluate.py setup_run), then one sequence at a time or batch_size together
    (batch_mode=budgeted or adaptive at batch_size 1 too: the planner picks each round's depth,
    up to k)."""
    if cfg.batch_size > 1 or cfg.batch_mode in ("budgeted", "adaptive"):  # the batched decoder
        from specdistill.decode.batched.evaluate import run_batched

        run_batched(cfg)
    else:
        from specdistill.decode.evaluate import run as run_one

        run_one(cfg)


@hydra.main(config_path=CONF_DIR, config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from specdistill.cli.errors import user_errors

    with user_errors("python -m decode"):
        run(cfg)


def cli() -> None:
    """The command line (also `specdistill <verb>`, cli/main.py): argument checks, then main."""
    import sys

    from specdistill.cli.errors import user_errors
    from specdistill.cli.paths import check_out_dir_arg, override, refuse_nonempty

    check_out_dir_arg("python -m decode", sys.argv[1:])
    run_dir = override(sys.argv[1:], "run_dir")
    if run_dir is not None:  # before Hydra writes .hydra/ and its log there (a training run dir...)
        with user_errors("python -m decode"):
            refuse_nonempty(Path(run_dir), "run_dir", OUTPUTS)
    main()


if __name__ == "__main__":
    cli()
