"""benchmarks/throughput.py without running it: every mode's job composes as the same
training job (only the per-rank batch differs), launch commands, and the median-over-rounds
summary."""
from argparse import Namespace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import specdistill.train.__main__  # noqa: F401  (stores the schemas)
from benchmarks import throughput as bench

CONF = Path(__file__).resolve().parents[1] / "conf"
ARGS = Namespace(device="cpu", conversations=50, max_length=256, global_batch=4, steps=3)


@pytest.mark.parametrize("mode", list(bench.MODES))
def test_every_mode_trains_the_same_global_batch(mode, tmp_path):
    cmd, world = bench.command(mode, 2, bench.job_overrides("tiny", 2 if mode != "single" else 1,
                                                            tmp_path, ARGS))
    overrides = cmd[cmd.index("specdistill.train") + 1:]
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


def test_capture_benchmark_times_each_batch_size_on_the_stored_conversations(tmp_path, monkeypatch):
    """python -m benchmarks.capture_speed on the tiny target: every size timed in every round, the
    padding of capture_split's length-sorted batches, nothing left behind; another target refused."""
    import json

    import torch

    from benchmarks import capture_speed as cap_bench
    from specdistill.data.capture import CaptureConfig, capture_split
    from specdistill.target.model import load_target

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["target=tiny"])
    target = load_target(cfg.target, training=True)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 1000, (n,), generator=g).tolist(), "loss_mask": [1] * n}
            for n in (9, 30, 7, 12, 21, 5)]
    source = capture_split(target, rows, CaptureConfig(layers=[0, 1]), tmp_path / "src", progress=False)
    assert [len(r["input_ids"]) for r in cap_bench.stored_rows(source, 6)] == [9, 30, 7, 12, 21, 5]
    out = tmp_path / "bench"
    cap_bench.main(["--features-dir", str(source), "--conversations", "6", "--batch-sizes", "1", "4",
                    "--rounds", "2", "--set", "target=tiny", "--out", str(out)])
    res = json.loads((out / "capture.json").read_text())
    assert res["tokens"] == 84 and res["layers"] == [0, 1]
    assert {k: len(v) for k, v in res["rounds"].items()} == {"1": 2, "4": 2}
    # one row per forward: no padding; four: (30, 21, 12, 9) -> 4 x 30, then (7, 5) -> 2 x 7
    assert res["padding"]["1"] == 0 and res["padding"]["4"] == pytest.approx(1 - 84 / 134)
    assert not list(out.glob("scratch-*"))
    # --engine-install: "after" installs in the foreground, "beside" in the background (stand-ins)
    from specdistill.decode.engine import envs

    made = []

    def run_step(cmd, what, timeout):
        if what.startswith("creating"):
            made.append(cmd[-1])
            Path(cmd[-1]).mkdir(parents=True)
        return "0.32.0\n"

    venv = envs.vllm_venv(tmp_path / "engines-cache")
    monkeypatch.delenv(envs.VLLM_PYTHON_ENV, raising=False)
    monkeypatch.setattr(envs, "run_step", run_step)
    monkeypatch.setattr(envs, "BACKGROUND", {})
    monkeypatch.setattr(envs, "INSTALL_CMD",
                        ["bash", "-c", f"sleep 0.3; mkdir -p {venv}; touch {venv}/COMPLETE"])
    cap_bench.main(["--features-dir", str(source), "--conversations", "6", "--batch-sizes", "4",
                    "--rounds", "2", "--set", "target=tiny", "--out", str(out),
                    "--engine-install", str(tmp_path / "engines-cache")])
    runs = json.loads((out / "install_overlap.json").read_text())["rounds"]
    assert {arm: len(rs) for arm, rs in runs.items()} == {"after": 2, "beside": 2}
    assert made == [str(venv)] * 2  # only "after" installed in the foreground; "beside" waited
    assert all(r["total_s"] >= r["capture_s"] for rs in runs.values() for r in rs)
    with pytest.raises(SystemExit, match="another target"):
        cap_bench.main(["--features-dir", str(source), "--conversations", "2", "--rounds", "1",
                        "--set", "target=tiny", "target.seed=1", "--out", str(out)])
    with pytest.raises(ValueError, match="holds 6 conversations"):
        cap_bench.main(["--features-dir", str(source), "--conversations", "7", "--set", "target=tiny",
                        "--out", str(out)])


def test_op_count_counts_each_call_of_a_real_decode_and_restores_the_decoder(tmp_path):
    """benchmarks.op_count on the tiny target: ops per target forward and per draft round,
    a round of k=3 drafts dispatching more than one of k=1, and the decoder's methods put back."""
    import json

    from benchmarks import op_count
    from specdistill.decode import spec
    from specdistill.drafters.eagle3 import Eagle3

    before = (spec.SequenceState.forward, Eagle3.propose)
    res = {k: op_count.main(["--tiny", "--k", str(k), "--prompts", "1", "--max-new-tokens", "10",
                             "--out", str(tmp_path / str(k))]) for k in (1, 3)}
    assert (spec.SequenceState.forward, Eagle3.propose) == before
    for r in res.values():
        assert r["forward"]["calls"] >= 1 and r["propose"]["calls"] >= 1
        linear = sum(n for op, n in r["forward"]["top"].items() if "linear" in op)  # or prepacked
        assert linear >= 2 * 4  # 2 layers x q, k, v, o at least
        assert r["forward"]["ops_median"] > 0 and r["propose"]["ops_median"] > 0
    assert res[3]["propose"]["ops_median"] > res[1]["propose"]["ops_median"]
    saved = json.loads((tmp_path / "3" / "op_count.json").read_text())
    assert saved["k"] == 3 and saved["round_over_forward"] == pytest.approx(
        saved["propose"]["ops_median"] / saved["forward"]["ops_median"])


def test_selfgen_benchmark_answers_the_same_spread_groups_in_every_mode(tmp_path):
    """benchmarks.selfgen_speed on the tiny target: groups spread from the shortest prompts to the
    longest, each answered by two_pass and one_pass at every batch size, ratios against two_pass."""
    import json

    from benchmarks import selfgen_speed as selfgen

    assert selfgen.group_starts(1200, 128, 3) == [0, 536, 1072]
    assert selfgen.group_starts(10, 4, 1) == [3] and selfgen.group_starts(4, 4, 3) == [0]
    with pytest.raises(SystemExit, match="raise --pool"):
        selfgen.group_starts(3, 4, 2)
    res = selfgen.main(["--tiny", "--pool", "12", "--batches", "2", "--batch-sizes", "2", "4",
                        "--two-pass-batch-size", "3", "--max-new-tokens", "3", "--out", str(tmp_path)])
    runs, summary = res["runs"], res["summary"]
    assert list(runs) == ["two_pass@3", "one_pass@2", "one_pass@4"]
    for rs in runs.values():  # the same prompts in every mode: the shortest 4, then the longest 4
        assert [(r["start"], r["prompts"]) for r in rs] == [(0, 4), (8, 4)]
        assert rs[0]["prompt_tokens"][1] <= rs[1]["prompt_tokens"][0]
        assert all(4 <= r["tokens"] <= 12 for r in rs)  # 1-3 answer tokens per prompt
    assert summary["two_pass@3"]["vs_two_pass@3"] == pytest.approx(1.0)
    for name, s in summary.items():
        assert s["tokens_per_s"] == pytest.approx(s["answer_tokens"] / s["seconds"])
        assert len(s["vs_two_pass@3_per_group"]) == 2
    two = summary["two_pass@3"]  # its answers timed apart from the capture: faster than the whole
    assert two["answers_only_tokens_per_s"] > two["tokens_per_s"]
    assert "answers_only_tokens_per_s" not in summary["one_pass@2"]
    assert json.loads((tmp_path / "selfgen_bench.json").read_text())["usable_prompts"] == 12


def test_cfg_walk_counts_stops_climbs_and_upward_reads():
    """benchmarks/cfg_walk.py: consecutive reads by one module are one stop, a stop on a higher
    floor right after a lower one is a climb, a section read below its owner's floor is upward
    (the range check excepted); the tracer sees reads made from our modules only."""
    from omegaconf import OmegaConf

    from benchmarks import cfg_walk

    reads = [("specdistill.train.recipe", "trainer.lr"), ("specdistill.train.recipe", "data"),
             ("specdistill.target.model", "data.cache_dir"), ("specdistill.data.dataset", "data.x"),
             ("specdistill.train.recipe", "trainer.seed"), ("specdistill.cli.ranges", "trainer.lr")]
    got = cfg_walk.summarise(reads)
    assert (got["reads"], got["stops"], got["climbs"]) == (6, 5, 2)
    assert got["upward_reads"] == ["specdistill.target.model reads data.cache_dir"]
    traced: list = []
    undo = cfg_walk.trace(traced)
    try:
        cfg = OmegaConf.create({"a": {"b": 1}, "c": 2})
        assert cfg.c == 2  # read from a test module: not one of ours, not traced
        exec("cfg.a.b; cfg.get('c')", {"__name__": "specdistill.train.fake", "cfg": cfg})
    finally:
        undo()
    assert traced == [("specdistill.train.fake", "a"), ("specdistill.train.fake", "a.b"),
                      ("specdistill.train.fake", "c")]


def test_long_context_benchmark_trains_one_long_conversation_in_each_arm(tmp_path):
    """benchmarks.long_context at a small length: each arm (whole rows, a window) is the real job
    on one conversation cut at --tokens, in its own process, its peak memory read after the
    setup and after the steps; the table's JSON says whether each arm kept to the goal."""
    import json

    from benchmarks import long_context

    res = long_context.main(["--tokens", "300", "--windows", "none", "128", "--steps", "1",
                             "--goal-gb", "100", "--out", str(tmp_path)])
    runs = res["runs"]
    assert [r["window"] for r in runs] == [None, 128]
    for r in runs:
        assert r["tokens"] == 300 and r["steps"] == 1 and r["drafter"] == "eagle3"
        assert 0 < r["setup_peak_gb"] <= r["peak_gb"] < 100 and r["within_goal"]
        metrics = tmp_path / f"window-{r['window'] or 'none'}" / "run" / "metrics.jsonl"
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1]
    assert json.loads((tmp_path / "long_context.json").read_text())["runs"] == runs
