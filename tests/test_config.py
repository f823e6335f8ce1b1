"""Every shipped YAML composes against its schema; typos and wrong types fail at start."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

import specdistill.decode.__main__  # noqa: F401  (stores the decode schemas)
import specdistill.train.__main__  # noqa: F401  (stores the train schemas)

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {"train": ["target", "data", "drafter", "trainer", "logger", "deepspeed", "budget"],
          "decode": ["target", "drafter", "eval"]}
TRAIN_ONLY_DRAFTERS = set()  # every drafter YAML must compose in both jobs


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _options():
    for job, groups in GROUPS.items():
        for group in groups:
            for yaml in sorted((CONF / group).glob("*.yaml")):
                yield job, group, yaml.stem


@pytest.mark.parametrize("job,group,option", list(_options()))
def test_every_yaml_composes(job, group, option):
    cfg = _compose(job, [f"{group}={option}"])
    container = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    if group == "budget":  # a <trainer>_<drafter> specialization: global keys of those two groups
        trainer, drafter = option.split("_", 1)
        spec = OmegaConf.load(CONF / group / f"{option}.yaml")
        assert set(spec) <= {"trainer", "drafter"} and (CONF / "trainer" / f"{trainer}.yaml").is_file()
        cfg = _compose(job, [f"trainer={trainer}", f"drafter={drafter}"])  # picked by itself
        assert cfg.drafter.name == drafter
        for g, keys in spec.items():
            for key, value in keys.items():
                assert cfg[g][key] == value, f"{option}: {g}.{key}"
        return
    assert container[group] is not None
    if group == "drafter":
        assert cfg.drafter.name == option  # the schema named in the YAML is the drafter's own


def test_every_group_file_is_tested():
    groups = {g for gs in GROUPS.values() for g in gs}
    on_disk = {p.name for p in CONF.iterdir() if p.is_dir()}
    # hydra/launcher/*.yaml: tests/test_launch.py
    assert on_disk <= groups | {"hydra"}, f"untested config groups: {on_disk - groups}"


def test_defaults_are_the_embedded_default():
    cfg = _compose("train", [])
    assert cfg.target.path == "packaged:smollm2"
    assert cfg.data.kind == "sharegpt"
    # EAGLE-3 (an engine-loadable layout) with its budget recipe (conf/budget/default_eagle3.yaml)
    assert cfg.drafter.name == "eagle3" and cfg.drafter.ttt_length == 1
    assert (cfg.trainer.on_policy_heads_start, cfg.trainer.on_policy_heads_rows,
            cfg.trainer.on_policy_heads_anchors) == (0.9, 1, 1.0)
    full = _compose("train", ["trainer=full"])  # other budgets: EAGLE-3's own recipe
    assert full.drafter.ttt_length == 7 and full.trainer.on_policy_heads_start is None
    eagle = _compose("train", ["drafter=eagle"])  # the specialization follows the drafter
    assert eagle.drafter.name == "eagle" and eagle.trainer.on_policy_heads_start is None
    assert _compose("train", ["drafter.ttt_length=2"]).drafter.ttt_length == 2  # the command wins
    assert cfg.trainer.engine_check == "vllm"  # skipped, the reason logged, where no layout serves
    assert _compose("train", ["trainer=smoke"]).trainer.engine_check is None  # tests stay engine-free
    assert cfg.trainer.backend == "torch"
    # bf16 only where the machine runs it natively (train/recipe.py _resolve_precision)
    assert (cfg.trainer.precision, cfg.trainer.capture_autocast) == ("auto", "auto")
    dec = _compose("decode", [])
    assert dec.drafter.name == "ngram" and dec.eval.kind == "mtbench"


@pytest.mark.parametrize("job,override", [
    ("train", "trainer.max_stepz=3"),
    ("train", "target.pathh=x"),
    ("decode", "eval.limitt=3"),
    ("decode", "drafter.max_ngramm=2"),
])
def test_typo_fails(job, override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        _compose(job, [override])


@pytest.mark.parametrize("job,override", [
    ("train", "trainer.max_steps=many"),
    ("decode", "temperature=hot"),
    ("decode", "eval.limit=ten"),
])
def test_wrong_type_fails(job, override):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(job, [override])


def test_user_facing_names_exist():
    cfg = _compose("train", ["trainer.max_steps=7", "trainer.eval_every=3", "trainer.save_every=2",
                             "resume=true", "seed=3", "run_dir=/tmp/x", "trainer.backend=deepspeed"])
    assert (cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.trainer.save_every) == (7, 3, 2)
    assert cfg.resume and cfg.seed == 3 and cfg.run_dir == "/tmp/x"
    dec = _compose("decode", ["eval=humaneval", "eval.limit=4", "max_new_tokens=9", "temperature=0.7",
                              "ckpt=/tmp/c"])
    assert (dec.eval.kind, dec.eval.limit, dec.max_new_tokens, dec.temperature, dec.ckpt) == \
        ("humaneval", 4, 9, 0.7, "/tmp/c")


def _cli(*args, cwd=None):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          cwd=cwd or CONF.parent, timeout=300)


def test_cli_cfg_job_and_help(tmp_path):
    # from another directory through the one command (`specdistill train`): the config path is
    # the package's, not the cwd's
    out = _cli("specdistill.cli.main", "train", "--cfg", "job", "drafter=eagle", "target=llama",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "meta-llama/Llama-3.1-8B-Instruct" in out.stdout and "name: eagle" in out.stdout
    out = _cli("decode", "--help")
    assert out.returncode == 0 and "eval: humaneval, jsonl, mtbench" in out.stdout


def test_cli_typo_is_a_clear_error():
    out = _cli("train", "--cfg", "job", "trainer.max_stepz=3")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "trainer.max_stepz is not a setting of TrainerConfig" in out.stderr
