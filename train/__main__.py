"""`python -m train ...`: distil a drafter from a frozen target (Hydra entry point).

The config path is relative to this file, so the job composes from conf/ both from the repo root
and after `pip install -e .`.
"""
import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from drafters.schemas import store_drafter_schemas
from train.config import TrainConfig

store_drafter_schemas()
ConfigStore.instance().store(name="train_schema", node=TrainConfig)


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from drafters.cli import user_errors
    from train.recipe import run

    with user_errors("python -m train", interrupt_hint=f"Continue this run with: python -m train "
                     f"run_dir={cfg.run_dir} resume=true (plus the same overrides)"):
        run(cfg)


if __name__ == "__main__":
    import sys

    from drafters.cli import check_out_dir_arg

    check_out_dir_arg("python -m train", sys.argv[1:])
    main()
