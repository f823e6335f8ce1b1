"""`python -m train ...`: distil a drafter from a frozen target (Hydra entry point).

conf/ is found by absolute path (cli/errors.py CONF_DIR), so the job composes from any folder,
under `python -m train`, `python -m specdistill.train` and `specdistill train` alike.
"""
from specdistill.train.memory import large_tensors_in_huge_pages

large_tensors_in_huge_pages()  # before any tensor is allocated (train/memory.py)

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from specdistill.cli.paths import CONF_DIR  # noqa: E402
from specdistill.drafters.base import store_drafter_schemas  # noqa: E402
from specdistill.train.config import TrainConfig  # noqa: E402

store_drafter_schemas()
ConfigStore.instance().store(name="train_schema", node=TrainConfig)


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import logging
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from specdistill.cli.errors import user_errors
    from specdistill.train.recipe import run
    from specdistill.train.rundir import interrupt_hint

    choices = HydraConfig.get().runtime.choices
    # conf/train.yaml's `optional budget: ${trainer}_${drafter}`: said when its file exists
    if choices.get("budget") and (Path(CONF_DIR) / "budget" / f"{choices['budget']}.yaml").is_file():
        logging.getLogger(__name__).info(
            "recipe of drafter=%s at trainer=%s: conf/budget/%s.yaml (`~budget` drops it)",
            cfg.drafter.name, choices.get("trainer"), choices["budget"])
    with user_errors("python -m train", interrupt_hint=lambda: interrupt_hint(cfg.run_dir)):
        run(cfg)


def cli() -> None:
    """The command line (also `specdistill <verb>`, cli/main.py): argument checks, then main."""
    import sys

    from specdistill.cli.errors import user_errors
    from specdistill.cli.paths import check_out_dir_arg
    from specdistill.cli.start import check_start
    from specdistill.train.rundir import check_run_dir_arg

    check_out_dir_arg("python -m train", sys.argv[1:])
    check_start("python -m train", "train", sys.argv[1:], TrainConfig)  # every key, before work
    with user_errors("python -m train"):  # before Hydra writes into the run dir: locked, not ours
        check_run_dir_arg(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
