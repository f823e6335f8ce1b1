"""Ranges on their fields (cli/ranges.py): every numeric setting of every command has one (or
says why not), the shipped configs lie inside them, and every command refuses each out-of-range
value at its start, naming the key, before it reads a file or loads a target."""
import ast
import dataclasses
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import benchmarks.decode_speed as bench
import specdistill.decode.__main__ as decode_main
import specdistill.decode.engine.__main__ as engine_main
import specdistill.train.__main__  # noqa: F401  (stores the train schemas)
from specdistill.cli.errors import UserError
from specdistill.cli.ranges import (
    Range,
    check_ranges,
    range_problems,
    rng,
    schema_fields,
    strip_optional,
    unranged,
)
from specdistill.data import capture, regenerate
from specdistill.decode.config import BenchConfig, DecodeConfig
from specdistill.decode.engine.__main__ import EngineCheckConfig
from specdistill.drafters.base import CONFIGS
from specdistill.train import export, recipe
from specdistill.train.config import TrainConfig, TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
for _module in (capture, regenerate, export):
    _module.store_schema()
# every command's schema; a drafter's is reached through `drafter` by its name
ROOTS = {"train": TrainConfig, "decode": DecodeConfig, "bench": BenchConfig,
         "engine": EngineCheckConfig, "export": export.ExportConfig,
         "capture": capture.CLISchema, "regenerate": regenerate.CLISchema,
         **{f"drafter {n}": c for n, c in CONFIGS.items()}}


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _numeric_fields(schema):
    return [(key, f) for key, f, kind, _ in schema_fields(schema) if kind in ("number", "numbers")]


def test_every_numeric_setting_has_a_range_or_says_why():
    missing, open_ended, default_outside = [], [], []
    for name, schema in ROOTS.items():
        for key, f in _numeric_fields(schema):
            r = f.metadata.get("range")
            if r is None:
                if not f.metadata.get("unranged"):
                    missing.append(f"{name}: {key}")
                continue
            if not (math.isfinite(r.lo) and math.isfinite(r.hi)):
                open_ended.append(f"{name}: {key} {r}")
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            values = default if isinstance(default, list) else [default]
            if any(v is not None and not r.holds(v) for v in values):
                default_outside.append(f"{name}: {key}={default} outside {r}")
    assert not missing, "numeric settings without a range (rng) or a reason (unranged): " + ", ".join(missing)
    assert not open_ended, "ranges need a number on both sides: " + ", ".join(open_ended)
    assert not default_outside, ", ".join(default_outside)


def test_a_field_without_a_range_must_say_why():
    @dataclasses.dataclass
    class Toy:
        steps: int = rng(3, 1, 10)  # in range
        seed: int = unranged(0, "any integer seeds the toy")  # said why
        forgot: float = 0.5  # neither: the coverage test above would name it

    kinds = {k: ("range" in f.metadata, f.metadata.get("unranged")) for k, f in _numeric_fields(Toy)}
    assert kinds == {"steps": (True, None), "seed": (False, "any integer seeds the toy"),
                     "forgot": (False, None)}
    assert range_problems({"steps": 11, "seed": -5, "forgot": 1e9}, Toy) == ["steps=11 is outside [1, 10]"]


def test_every_settings_dataclass_is_reached_from_a_command():
    """A *Config / *Settings dataclass anywhere in the package is part of some command's schema,
    so the range test above walks it (a new schema cannot be forgotten)."""
    types = [*ROOTS.values()] + [strip_optional(t) for schema in ROOTS.values()
                                 for _, _, kind, t in schema_fields(schema) if kind == "schema"]
    reached = {c.__name__ for t in types for c in getattr(t, "__mro__", [t])}  # bases included
    defined = set()
    for folder in ("data", "decode", "drafters", "train"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Config", "Settings")) \
                        and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                    defined.add(node.name)
    assert len(defined) > 15 and defined - reached == set()


def test_the_shipped_configs_lie_inside_the_ranges():
    for group in ("drafter", "trainer", "data", "target", "deepspeed", "logger"):
        for yaml in sorted((ROOT / "conf" / group).glob("*.yaml")):
            assert range_problems(_compose("train", [f"{group}={yaml.stem}"]), TrainConfig) == [], yaml
    for group in ("drafter", "eval", "target"):
        for yaml in sorted((ROOT / "conf" / group).glob("*.yaml")):
            assert range_problems(_compose("decode", [f"{group}={yaml.stem}"]), DecodeConfig) == [], yaml
    assert range_problems(_compose("capture", ["out=x"]), capture.CLISchema) == []
    assert range_problems(_compose("regenerate", ["out=x"]), regenerate.CLISchema) == []
    assert range_problems(_compose("engine", ["export=x"]), EngineCheckConfig) == []
    assert range_problems(vars(bench.parse_args([])), BenchConfig) == []


def test_the_checker_names_key_value_and_range():
    cfg = OmegaConf.create({"trainer": {"lr": 5.0, "batch_size": 4}, "drafter": {
        "name": "dflash", "block_size": 10**6, "loss_weights": [1.0, -0.5], "anchors": None}})
    bad = range_problems(cfg, TrainConfig)
    assert bad == ["drafter.block_size=1000000 is outside [2, 64]",  # schema order: drafter first
                   "drafter.loss_weights[1]=-0.5 is outside [0, 1000]", "trainer.lr=5.0 is outside (0, 1]"]
    assert range_problems({"lr": float("nan")}, TrainerConfig) == ["lr=nan is outside (0, 1]"]
    assert range_problems({"limit": "ten"}, BenchConfig) == ["limit='ten' is not a number in [1, 1000000000]"]
    assert range_problems({"drafter": {"name": "nonesuch", "k": -1}}, TrainConfig) == []  # unknown
    with pytest.raises(UserError, match=r"^invalid settings: trainer\.lr=5\.0 is outside \(0, 1\]: "):
        check_ranges({"trainer": {"lr": 5.0}}, TrainConfig)
    assert str(Range(0, 1, lo_open=True, hi_open=True)) == "(0, 1)"


def _bad_values(r: Range, is_int: bool) -> list:
    """Just outside each end of a range."""
    step = 1 if is_int else 0.5
    below = r.lo if r.lo_open else r.lo - step
    above = r.hi if r.hi_open else (r.hi + step if r.hi < 1e6 else r.hi * 10)
    return [int(below), int(above)] if is_int else [float(below), float(above)]


def _cases(cfg, schema):
    """(key, value) just outside every numeric field's range that the composed cfg holds."""
    from specdistill.drafters.base import drafter_schema

    out = []
    walked = [(k, f, t) for k, f, kind, t in schema_fields(schema) if kind in ("number", "numbers")]
    if "drafter" in cfg:
        walked += [(f"drafter.{k}", f, t) for k, f, kind, t in schema_fields(drafter_schema(cfg.drafter))
                   if kind in ("number", "numbers")]
    for key, f, tp in walked:
        if OmegaConf.select(cfg, key, default="<absent>") == "<absent>":
            continue  # e.g. data.regenerate.* while data.regenerate is null
        is_int = "int" in str(tp) and "float" not in str(tp)
        for v in _bad_values(f.metadata["range"], is_int):
            out.append((key, [v] if "list" in str(tp) else v))
    return out


def _refused_at_start(start, cfg, cases, written: Path):
    """start(cfg with one bad value) raises UserError naming that key, and writes nothing."""
    assert cases
    for key, value in cases:
        bad = cfg.copy()
        OmegaConf.update(bad, key, value, merge=False)
        with pytest.raises(UserError) as e:
            start(bad)
        shown = f"{key}[0]=" if isinstance(value, list) else f"{key}="
        assert shown in str(e.value) and "is outside" in str(e.value), (key, value, str(e.value))
    assert not written.exists()


@pytest.mark.parametrize("drafter", sorted(CONFIGS))
def test_train_refuses_every_out_of_range_value_at_start(tmp_path, drafter):
    cfg = _compose("train", ["target=tiny", "data=sharegpt_regen",  # data.regenerate.* too
                             f"data.path={tmp_path / 'none.jsonl'}", f"run_dir={tmp_path / 'run'}",
                             f"drafter={drafter}"])
    cases = _cases(cfg, TrainConfig)
    if drafter != "eagle":  # the shared settings once, every drafter's own
        cases = [c for c in cases if c[0].startswith("drafter.")]
    _refused_at_start(recipe.run, cfg, cases, tmp_path / "run")


@pytest.mark.parametrize("drafter", ["ngram", "eagle3", "dflash"])
def test_decode_refuses_every_out_of_range_value_at_start(tmp_path, drafter):
    cfg = _compose("decode", ["target=tiny", "eval=jsonl", f"eval.path={tmp_path / 'none.jsonl'}",
                              f"ckpt={tmp_path / 'none'}", f"run_dir={tmp_path / 'run'}",
                              f"drafter={drafter}"])
    _refused_at_start(decode_main.run, cfg, _cases(cfg, DecodeConfig), tmp_path / "run")


def test_the_other_commands_refuse_every_out_of_range_value_at_start(tmp_path):
    out = tmp_path / "out"
    data = ["target=tiny", "data=jsonl", f"data.path={tmp_path / 'none.jsonl'}", f"out={out}"]
    cfg = _compose("capture", data)
    _refused_at_start(capture.run, cfg, _cases(cfg, capture.CLISchema), out)
    cfg = _compose("regenerate", data)
    _refused_at_start(regenerate.run, cfg, _cases(cfg, regenerate.CLISchema), out)
    cfg = _compose("engine", ["target=tiny", f"export={tmp_path / 'none'}", f"out={out}"])
    _refused_at_start(engine_main.run, cfg, _cases(cfg, EngineCheckConfig), out)
    cfg = OmegaConf.merge(OmegaConf.structured(export.ExportConfig),
                          {"run": str(tmp_path / "none"), "out": str(out)})
    _refused_at_start(export.run_export, cfg, _cases(cfg, export.ExportConfig), out)


def test_bench_refuses_every_out_of_range_value_at_start(tmp_path, capsys):
    flags = {"limit": "--limit", "max_new_tokens": "--max-new-tokens", "k": "--k",
             "prompt_lookup": "--prompt-lookup", "ks": "--ks", "confidences": "--confidences",
             "curve_rounds": "--curve-rounds", "curve_ns": "--curve-ns",
             "curve_context": "--curve-context", "threads": "--threads",
             "batch_sizes": "--batch-sizes", "batch_repeats": "--batch-repeats"}
    assert set(flags) == {k for k, _ in _numeric_fields(BenchConfig)}
    for key, f in _numeric_fields(BenchConfig):
        for v in _bad_values(f.metadata["range"], "int" in str(f.type)):
            with pytest.raises(SystemExit) as e:
                bench.main([flags[key], str(v), "--ckpt", str(tmp_path / "none"),
                            "--out", str(tmp_path / "out")])
            err = capsys.readouterr().err
            assert e.value.code == 2
            assert f"python -m benchmarks.decode_speed: error: invalid settings: {key}" in err
    assert not (tmp_path / "out").exists()
