"""`python -m decode ...`: run a drafter through the lossless decoder on an eval set (Hydra entry)."""
import hydra
from omegaconf import DictConfig

from decode.config import DecodeConfig, store_schemas

store_schemas("decode_schema", DecodeConfig)


@hydra.main(config_path="../conf", config_name="decode", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from drafters.cli import user_errors

    with user_errors("python -m decode"):
        if cfg.batch_size > 1:  # B sequences per target forward (batch_size=1: today's path)
            from decode.batch_eval import run_batched

            run_batched(cfg)
        else:
            from decode.evaluate import run

            run(cfg)


if __name__ == "__main__":
    import sys

    from drafters.cli import check_out_dir_arg

    check_out_dir_arg("python -m decode", sys.argv[1:])
    main()
