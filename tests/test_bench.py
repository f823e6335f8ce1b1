"""train/benchmarks/throughput.py without running it: every mode's job composes as the same
training job (only the per-rank batch differs), launch commands, and the median-over-rounds
summary."""
from argparse import Namespace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import specdistill.train.__main__  # noqa: F401  (stores the schemas)
from specdistill.train.benchmarks import throughput as bench

CONF = Path(__file__).resolve().parents[1] / "conf"
ARGS = Namespace(device="cpu", conversations=50, max_length=256, global_batch=4, steps=3)


@pytest.mark.parametrize("mode", list(bench.MODES))
def test_every_mode_trains_the_same_global_batch(mode, tmp_path):
    cmd, world = bench.command(mode, 2, bench.job_overrides("tiny", 2 if mode != "single" else 1,
                                                            tmp_path, ARGS))
    overrides = cmd[cmd.index("train") + 1:]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    assert cfg.trainer.batch_size * world == 4
    assert cfg.trainer.features == "online" and cfg.trainer.max_steps == 2 * cfg.trainer.log_every
    assert cfg.trainer.backend == ("deepspeed" if mode == "zero2" else "torch")
    assert ("torch.distributed.run" in cmd) == (world == 2)


def test_uneven_split_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="does not split"):
        bench.job_overrides("tiny", 3, tmp_path, ARGS)


def test_summary_is_the_median_over_rounds_relative_to_single():
    runs = [{"target": "tiny", "mode": m, "ranks": r, "round": i, "tokens_per_s": t,
             "peak_mem_gib": 1.0}
            for i, (s, d) in enumerate([(100, 150), (300, 210), (200, 600)])
            for m, r, t in (("single", 1, s), ("ddp", 2, d))]
    rows = {r["mode"]: r for r in bench.summarize(runs)}
    assert rows["single"]["tokens_per_s"] == 200 and rows["ddp"]["tokens_per_s"] == 210
    assert rows["ddp"]["vs_single"] == pytest.approx(1.05)
    assert "| tiny | ddp | 2 | 210 | 150, 210, 600 | 1.05x |" in bench.markdown(list(rows.values()))
