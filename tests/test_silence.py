"""Nothing ignored in silence, by class (cli/start.py, cli/settings.py, cli/errors.py):

- every config group of every command set to a choice that names no file: exit 2, one line naming
  the group and its files (no `schema_*` names);
- every ranged field of every command just outside its range: exit 2, one line naming each key;
- Hydra's own errors (a key that is no setting, a wrong type, a budget for another drafter): one line;
- settings another setting makes void: refused or warned in one line naming both keys;
- a full disk at every writer (capture, checkpoint, export, decode result, regenerate), injected
  as ENOSPC, bare or wrapped: one line, exit 2, nothing half-written;
- a damaged engine install: said as damaged, where, and the command that redoes it;
- every reused cache entry: which, made when, from which settings, and how to get a fresh one.

The checks run in-process (the command's own start check, under its own one-line error path);
a few cases run the real command lines.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import specdistill.data.capture as capture_mod
import specdistill.data.regenerate as regenerate_mod
import specdistill.decode.__main__  # noqa: F401  (stores the decode schemas)
import specdistill.train.__main__  # noqa: F401  (stores the train schemas)
from specdistill.cli.errors import user_errors
from specdistill.cli.paths import CONF_DIR
from specdistill.cli.ranges import schema_fields, strip_optional
from specdistill.cli.start import check_start, groups, start_check
from specdistill.decode.config import DecodeConfig
from specdistill.decode.engine.__main__ import EngineCheckConfig
from specdistill.train.config import TrainConfig
from specdistill.train.export import ExportConfig
from specdistill.train.export import store_schema as store_export

ROOT = Path(__file__).resolve().parents[1]
capture_mod.store_schema()
regenerate_mod.store_schema()
store_export()

# command -> (its config, its schema); the schemas are stored above, as each command's main does
COMMANDS = {
    "python -m train": ("train", TrainConfig),
    "python -m decode": ("decode", DecodeConfig),
    "python -m decode.engine": ("engine", EngineCheckConfig),
    "python -m train.export": ("export", ExportConfig),
    "python -m specdistill.data.capture": ("capture", capture_mod.CLISchema),
    "python -m specdistill.data.regenerate": ("regenerate", regenerate_mod.CLISchema),
}


# the settings each command requires (its `???`), given so that the other checks are reached
REQUIRED = {"python -m decode.engine": ["export=e"], "python -m train.export": ["run=r", "out=o"],
            "python -m specdistill.data.capture": ["out=o"],
            "python -m specdistill.data.regenerate": ["out=o.jsonl"]}


def _one_line(capsys, fn) -> str:
    """fn() must end the command: exit 2 and exactly one line on stderr, which is returned."""
    with pytest.raises(SystemExit) as e:
        fn()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def _start(capsys, command: str, *args: str) -> str:
    config, schema = COMMANDS[command]
    args = [*REQUIRED.get(command, []), *args]
    return _one_line(capsys, lambda: check_start(command, config, args, schema))


def _groups_of(config: str) -> list[str]:
    """The groups conf/<config>.yaml's defaults list picks from (hydra's own left out)."""
    defaults = yaml.safe_load((Path(CONF_DIR) / f"{config}.yaml").read_text())["defaults"]
    names = [next(iter(d)) if isinstance(d, dict) else d for d in defaults]
    return [n.removeprefix("optional ") for n in names
            if not n.startswith(("override", "hydra")) and n.removeprefix("optional ") in groups()]


# -- every group, every command: a choice that names no file ---------------------------------------
@pytest.mark.parametrize("command,group", [(c, g) for c, (config, _) in COMMANDS.items()
                                           for g in _groups_of(config)])
def test_a_group_choice_that_names_no_file_is_one_line_naming_the_group(capsys, command, group):
    err = _start(capsys, command, f"{group}=bogus")
    assert f"{group}=bogus names no file conf/{group}/bogus.yaml" in err
    files = sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))
    assert f"the choices of {group}: {', '.join(files)}" in err and "schema_" not in err


def test_the_optional_budget_group_is_checked_too(capsys):
    """`optional budget` would skip a missing file in silence and train with no recipe."""
    err = _start(capsys, "python -m train", "budget=bogus")
    assert "budget=bogus names no file" in err and "default_eagle3" in err and "~budget" in err


# -- every ranged field, every command: just outside its range -------------------------------------
def _outside(field: dataclasses.Field, kind: str) -> str:
    r = field.metadata["range"]
    if r.hi != float("inf"):
        v = r.hi if r.hi_open else r.hi + 1
    else:
        v = r.lo if r.lo_open else r.lo - 1
    v = int(v) if float(v).is_integer() and abs(v) < 2**62 else v
    return f"[{v}]" if kind == "numbers" else str(v)


def _ranged(command: str) -> list[tuple[str, str]]:
    """(key, a value just outside its range) of every ranged field the command's default config
    holds (a field under a group that is off by default, e.g. data.selfgen, is left out)."""
    from omegaconf import OmegaConf

    config, schema = COMMANDS[command]
    cfg = start_check(command, config, REQUIRED.get(command, []), schema)
    out = []
    for key, field, kind, tp in schema_fields(schema):
        parent = key.rpartition(".")[0]
        if "range" not in field.metadata or (parent and OmegaConf.select(cfg, parent) is None):
            continue
        out.append((key, _outside(field, kind)))
    if "drafter" in cfg:  # the drafter's own schema, chosen by its name
        sub = {f.name: f for f in dataclasses.fields(schema)}["drafter"].metadata["schema_of"]
        out += [(f"drafter.{k}", _outside(f, kind)) for k, f, kind, _ in
                schema_fields(strip_optional(sub(cfg.drafter))) if "range" in f.metadata]
    return out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_ranged_setting_just_outside_its_range_is_one_line_naming_it(capsys, command):
    """All of a command's ranged settings at once (one composition): the one line names each."""
    cases = _ranged(command)
    assert cases, command
    err = _start(capsys, command, *[f"{key}={value}" for key, value in cases])
    for key, value in cases:
        assert f"{key}=" in err or f"{key}[0]=" in err, key
    assert err.count(" is outside ") == len(cases), err


# -- Hydra's own errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("args,says", [
    (["drafter=eagle", "budget=default_eagle3"],
     "drafter.ttt_length is not a setting of EagleConfig (set by conf/budget/default_eagle3.yaml)"),
    (["trainer.max_stepz=3"], "trainer.max_stepz is not a setting of TrainerConfig"),
    (["trainer.max_steps=many"], "trainer.max_steps=many: Value 'many' of type 'str' could not be"),
    (["+trainer.max_stepz=3"], "+trainer.max_stepz adds a key that is no setting of TrainerConfig"),
    (["trainer.lr"], "Error parsing override 'trainer.lr'"),
    (["bogus=3"], "bogus is not a setting of TrainConfig"),
])
def test_hydras_errors_are_our_one_line(capsys, args, says):
    assert says in _start(capsys, "python -m train", *args)


def test_a_free_form_dict_takes_added_keys():
    cfg = start_check("python -m train", "train", ["+deepspeed.extra.steps_per_print=5"], TrainConfig)
    assert cfg.deepspeed.extra.steps_per_print == 5


@pytest.mark.parametrize("args,says", [
    (["python", "-m", "train", "drafter=eagle", "budget=default_eagle3"], "drafter.ttt_length"),
    (["python", "-m", "specdistill.cli.main", "decode", "eval=bogus"], "eval=bogus names no file"),
])
def test_the_real_command_lines_exit_2_in_one_line(args, says):
    out = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr


# -- void settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args,says", [
    (["trainer.on_policy_heads_start=1.0"],
     "trainer.on_policy_heads_start=1.0 with trainer.max_steps=600: the on-policy heads phase"),
    (["drafter=eagle", "trainer.on_policy_fraction=0.5", "trainer.on_policy_start_step=1000"],
     "trainer.on_policy_fraction=0.5 with trainer.on_policy_start_step=1000"),
    (["data=sharegpt_selfgen", "trainer.features=offline", "trainer.features_dir=/x"],
     "data.selfgen=(set) with trainer.features_dir=/x: self-generation writes the features"),
    (["trainer.features=online", "trainer.features_dir=/x"],
     "trainer.features=online with trainer.features_dir=/x"),
    (["data.regenerate.limit=5"], "a key under a setting that is null (off) cannot be set alone"),
])
def test_a_setting_another_makes_void_is_refused_naming_both(capsys, args, says):
    assert says in _start(capsys, "python -m train", *args)


@pytest.mark.parametrize("command,args,says", [
    ("python -m train", ["trainer.final_eval=null", "trainer.final_eval_limit=3"],
     "trainer.final_eval_limit=3 does nothing with trainer.final_eval=null"),
    ("python -m train", ["trainer.on_policy_temperature=0.5"],
     "trainer.on_policy_temperature=0.5 does nothing with trainer.on_policy_fraction=0.0"),
    ("python -m train", ["logger=jsonl", "logger.wandb_project=p"],
     "logger.wandb_project=p does nothing with logger.kinds="),
    ("python -m train", ["data=sharegpt_selfgen", "trainer.features=offline",
                         "trainer.capture_features_dtype=bfloat16"],
     "trainer.capture_features_dtype=bfloat16 does nothing with data.selfgen=(set)"),
    ("python -m train", ["trainer.backend=torch", "deepspeed=zero3"],
     "deepspeed=(set) does nothing with trainer.backend=torch"),
    ("python -m decode", ["seed=3"], "seed=3 does nothing with temperature=0.0"),
    ("python -m decode", ["k=0", "tree=true"], "tree=True does nothing with k=0"),
    ("python -m specdistill.data.regenerate", ["seed=4"], "seed=4 does nothing with temperature=0.0"),
])
def test_a_void_setting_the_user_typed_is_warned_naming_both(capsys, command, args, says):
    config, schema = COMMANDS[command]
    start_check(command, config, [*REQUIRED.get(command, []), *args], schema)
    err = capsys.readouterr().err
    assert f"{command}: warning: {says}" in err, err


def test_a_shipped_recipe_under_a_short_run_is_warned_not_refused(capsys):
    """default_eagle3's on-policy phase (the last tenth) never starts in 5 steps: said, and the
    user's short run still runs (the budget came from a YAML, not the command line)."""
    start_check("python -m train", "train", ["trainer.max_steps=5"], TrainConfig)
    err = capsys.readouterr().err
    assert ("python -m train: warning: trainer.on_policy_heads_start=0.9 with trainer.max_steps=5: "
            "the on-policy heads phase starts at or after the last step") in err


def test_self_generation_and_regeneration_together_are_refused():
    """Both in one data config (a user's own data YAML): the regenerated answers would never be
    made."""
    from omegaconf import OmegaConf

    from specdistill.cli.settings import REFUSE, void_settings

    cfg = OmegaConf.create({"data": {"selfgen": {"prompts": 5}, "regenerate": {"limit": 5}}})
    [(level, msg)] = void_settings(cfg, ["data=mine"])
    assert level == REFUSE and msg.startswith("data.selfgen=(set) with data.regenerate=(set): ")


def test_defaults_say_nothing(capsys):
    for command, (config, schema) in COMMANDS.items():
        start_check(command, config, REQUIRED.get(command, []), schema)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", list(REQUIRED))
def test_a_required_setting_left_out_is_one_line_naming_it(capsys, command):
    config, schema = COMMANDS[command]
    err = _one_line(capsys, lambda: check_start(command, config, [], schema))
    for arg in REQUIRED[command]:
        assert arg.split("=")[0] + "=" in err and "not given" in err, err



@pytest.mark.parametrize("command", list(REQUIRED))
def test_printing_the_config_leaves_required_settings_unset(command):
    """`--cfg job` prints the config (a `???` shows as such) and runs nothing: no refusal."""
    config, schema = COMMANDS[command]
    from omegaconf import OmegaConf

    cfg = start_check(command, config, ["--cfg", "job"], schema)
    missing = OmegaConf.missing_keys(cfg)
    assert all(a.split("=")[0] in missing for a in REQUIRED[command]), missing

# -- value domains named as themselves ---------------------------------------------------------------
def test_selfgen_dtypes_are_named_as_their_own_keys():
    from specdistill.data.dataset import SelfGenSettings
    from specdistill.data.selfgen import check_dtypes

    with pytest.raises(ValueError, match=r"data.selfgen.features_dtype='int8' is not a storage dtype: "
                                         r"use one of bfloat16, float32"):
        check_dtypes(SelfGenSettings(features_dtype="int8"))
    with pytest.raises(ValueError, match=r"unknown data.selfgen.dtype 'int3'"):
        check_dtypes(SelfGenSettings(dtype="int3"))


# -- a full disk at every writer ---------------------------------------------------------------------
def _enospc(path="/data/out"):
    return OSError(errno.ENOSPC, "No space left on device", path)


def _raises(exc):
    def fn(*a, **k):
        raise exc
    return fn


def _wrapped(*a, **k):  # as torch.save / safetensors may: the OSError only on the chain
    try:
        raise _enospc("/data/out/shard")
    except OSError as e:
        raise RuntimeError("file write failed") from e


@pytest.fixture(scope="module")
def tiny():
    from specdistill.target.model import TargetConfig, load_target

    from conftest import TINY_MODEL
    return load_target(TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                                    model_config=dict(TINY_MODEL), seed=0, dtype="float32"))


def _rows(n=3):
    import datasets
    ids = [[1, 5, 7, 9, 11][: 3 + i % 3] for i in range(n)]
    return datasets.Dataset.from_dict({"id": [f"c{i}" for i in range(n)], "input_ids": ids,
                                       "loss_mask": [[0] + [1] * (len(x) - 1) for x in ids],
                                       "length": [len(x) for x in ids]})


@pytest.mark.parametrize("inject", [_raises(_enospc()), _wrapped], ids=["bare", "wrapped"])
def test_a_full_disk_at_a_capture_is_one_line(tiny, tmp_path, capsys, monkeypatch, inject):
    monkeypatch.setattr(capture_mod, "save_file", inject)
    cfg = capture_mod.CaptureConfig(layers=[-1], shard_size=8)
    out = tmp_path / "feats"
    err = _one_line(capsys, lambda: _under("cmd", lambda: capture_mod.capture_split(
        tiny, _rows(), cfg, out, progress=False)))
    assert "no space left on the disk of /data/out" in err
    assert not list(out.glob("shard-*.safetensors"))  # no half shard


def _under(command, fn):
    with user_errors(command):
        fn()


class _Backend:  # one process: what save_checkpoint asks of a backend
    is_main = True

    def barrier(self):
        pass

    def full_weights(self):
        return contextlib.nullcontext()

    def save_state(self, folder, optimizer):
        torch.save(optimizer.state_dict(), Path(folder) / "optimizer.pt")


def test_a_full_disk_at_a_checkpoint_is_one_line_and_leaves_none_half_written(tiny, tmp_path, capsys,
                                                                              monkeypatch):
    import safetensors.torch

    from specdistill.drafters.base import build_drafter
    from specdistill.train.checkpoint import save_checkpoint

    cfg = {"name": "eagle", "draft_vocab_size": None}
    drafter = build_drafter(cfg, tiny)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    save_checkpoint(tmp_path, 1, _Backend(), drafter, cfg, opt, {})  # a good one first
    monkeypatch.setattr(safetensors.torch, "save_file", _raises(_enospc(str(tmp_path / "x"))))
    err = _one_line(capsys, lambda: _under("python -m train", lambda: save_checkpoint(
        tmp_path, 2, _Backend(), drafter, cfg, opt, {})))
    assert err.startswith("python -m train: error: no space left on the disk of") and "run_dir=" in err
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith("."))
    assert names == ["step-0000001"]  # the earlier checkpoint intact, no step-2 committed


def test_a_full_disk_at_an_export_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    from specdistill.drafters.base import build_drafter
    from specdistill.export.folder import export_drafter

    cfg = {"name": "eagle", "draft_vocab_size": None, "input_norm": False}
    drafter = build_drafter(cfg, tiny)
    monkeypatch.setattr(safetensors.torch, "save_file", _raises(_enospc("/data/e")))
    err = _one_line(capsys, lambda: _under("python -m train.export", lambda: export_drafter(
        drafter, cfg, tiny, "hf", tmp_path / "e")))
    assert "no space left on the disk of /data/e" in err and not (tmp_path / "e").exists()


def test_a_full_disk_at_a_decode_result_is_one_line(tmp_path, capsys, monkeypatch):
    from specdistill.decode.evaluate import write_results

    monkeypatch.setattr(Path, "write_text", _raises(_enospc(str(tmp_path / "result.json"))))
    err = _one_line(capsys, lambda: _under("python -m decode", lambda: write_results(
        {}, [], "", tmp_path)))
    assert f"no space left on the disk of {tmp_path / 'result.json'}" in err


def test_a_full_disk_at_a_regeneration_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    cfg = regenerate_mod.RegenerateConfig(target=None, data=None, out=str(tmp_path / "r.jsonl"))
    monkeypatch.setattr(regenerate_mod.os, "replace", _raises(_enospc(str(tmp_path / "r.jsonl"))))
    err = _one_line(capsys, lambda: _under("python -m specdistill.data.regenerate", lambda:
                                           regenerate_mod.claim_out(tmp_path / "r.jsonl", tiny, cfg,
                                                                    "float32")))
    assert "no space left on the disk of" in err and "r.jsonl" in err


def test_other_os_errors_are_not_taken_for_a_full_disk():
    """Only the errno decides: a missing file is not a full disk, wrapped or not."""
    from specdistill.cli.errors import disk_full

    try:
        raise RuntimeError("write failed") from FileNotFoundError(errno.ENOENT, "gone", "/proc/x")
    except RuntimeError as e:
        assert disk_full(e) is None
    with pytest.raises(RuntimeError):
        with user_errors("cmd"):
            raise RuntimeError("a bug") from OSError(errno.EIO, "I/O error")
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", "/home/u/run")
    assert disk_full(RuntimeError("x")) is None and disk_full(quota) is quota


# -- a damaged engine install -----------------------------------------------------------------------
def test_a_damaged_vllm_install_says_where_and_the_command_that_redoes_it(tmp_path, monkeypatch):
    """vllm does not import in its environment (here: this python, which has no vllm): not the
    export's fault, and not "refused by the engine"."""
    from specdistill.decode.engine import vllm_engine as ve
    from specdistill.decode.engine.envs import REINSTALL, EngineUnavailable, vllm_python, vllm_venv

    monkeypatch.delenv("SPECDISTILL_VLLM_PYTHON", raising=False)
    export = tmp_path / "e"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"specdistill": {"drafter": {"name": "eagle3"},
                                                                    "format": "vllm"}}))
    with pytest.raises(EngineUnavailable, match=rf"is damaged \(.*No module named 'vllm'.*\); redo it "
                                                rf"with `{REINSTALL}`"):
        ve.run_vllm(Path(sys.executable), tmp_path, export, 2, [[1, 2]], [4], [0], "float32", 64,
                    tmp_path / "logs", plain=False)
    venv = vllm_venv(tmp_path)  # marked complete, its interpreter gone
    venv.mkdir(parents=True)
    (venv / "COMPLETE").write_text("vllm 0.0\n")
    with pytest.raises(EngineUnavailable, match=rf"vLLM install in {venv} is damaged \(.* is missing"):
        ve.run_vllm(vllm_python(tmp_path), tmp_path, export, 2, [[1, 2]], [4], [0], "float32", 64,
                    tmp_path / "logs", plain=False)


# -- every reuse said --------------------------------------------------------------------------------
def test_a_reused_capture_says_which_when_from_what_and_how_to_get_a_fresh_one(tiny, tmp_path, caplog):
    cfg = capture_mod.CaptureConfig(layers=[-1], shard_size=8)
    out = tmp_path / "feats"
    with caplog.at_level(logging.INFO, logger="specdistill.data.capture"):
        capture_mod.capture_split(tiny, _rows(), cfg, out, progress=False)
        assert "reusing" not in caplog.text  # a fresh capture
        capture_mod.capture_split(tiny, _rows(), cfg, out, progress=False, setting="out")
    line = next(r.getMessage() for r in caplog.records if "reusing" in r.getMessage())
    assert line.startswith(f"reusing the capture {out} (made 20") and "UTC, from layers=[-1]" in line
    assert "out=<another folder> (or other capture settings) makes a fresh one" in line


def test_a_capture_with_other_settings_names_the_key_and_keeps_it(tiny, tmp_path):
    out = tmp_path / "feats"
    capture_mod.capture_split(tiny, _rows(), capture_mod.CaptureConfig(layers=[-1]), out, progress=False)
    with pytest.raises(ValueError, match=r"trainer.features_dir=.* holds a capture made with other "
                                         r"settings \(.*layers.*\); it is kept as it is: set "
                                         r"trainer.features_dir= to a capture"):
        capture_mod.capture_split(tiny, _rows(), capture_mod.CaptureConfig(layers=[0]), out,
                                  progress=False)
    assert (out / "shard-00000.safetensors").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="trainer.features_dir=.*file is a file, not a folder"):
        capture_mod.capture_split(tiny, _rows(), capture_mod.CaptureConfig(layers=[-1]),
                                  tmp_path / "file", progress=False)


def test_a_reused_regeneration_and_tokenisation_are_said(tiny, tmp_path, caplog, monkeypatch):
    """The regenerated data set (a second job finds it done) and the tokenised cache."""
    from omegaconf import OmegaConf

    from conftest import write_chats
    from specdistill.data.dataset import DataConfig, RegenerateSettings, load_chat_dataset

    target = tiny
    chats = write_chats(tmp_path / "c.jsonl", 6, 40)
    data = OmegaConf.structured(DataConfig(kind="file", path=str(chats), cache_dir=str(tmp_path / "cache"),
                                           max_length=64, regenerate=RegenerateSettings(
                                               limit=2, max_new_tokens=2, batch_size=2)))
    monkeypatch.delenv("SPECDISTILL_CACHE", raising=False)
    with caplog.at_level(logging.INFO):
        regenerate_mod.self_distilled(target, data, progress=False)
        assert "reusing the regenerated data" not in caplog.text
        new = regenerate_mod.self_distilled(target, data, progress=False)
        load_chat_dataset(new, target.tokenizer)  # the same tokenizer object twice: its truncation
        load_chat_dataset(new, target.tokenizer)  # state after the first is not in the cache key
    text = caplog.text
    assert "reusing the regenerated data" in text and "made 20" in text and "limit=2" in text
    assert "a change of any data.regenerate setting (or data.cache_dir=<another folder>) regenerates" in text
    assert "reusing tokenised data: loaded from cache" in text
    assert "data.cache_dir=<another folder> tokenises afresh" in text


# -- the bench downloads nothing for the tiny target -------------------------------------------------
def test_the_bench_takes_a_conf_target_by_name(monkeypatch):
    from benchmarks.decode_speed import target_config

    cfg = target_config("tiny", dtype="float32", threads=0)
    assert cfg.path == "tiny" and cfg.random_init and cfg.model_config["num_hidden_layers"] == 2
    assert target_config("some/hf-id", dtype="auto").path == "some/hf-id"


def test_a_data_path_that_is_a_folder_is_said_as_such(tmp_path):
    from specdistill.data.dataset import DataConfig, load_chat_dataset

    with pytest.raises(IsADirectoryError, match=rf"data.path={tmp_path} is a folder: give one "):
        load_chat_dataset(DataConfig(kind="file", path=str(tmp_path)), tokenizer=None)


def test_a_plugin_searchpath_adds_its_group_choices(tmp_path):
    """`hydra.searchpath=[file://<plugin>/conf]` (a drafter in a plugin folder): its YAMLs are
    choices of their groups for the start check, and the check composes with them."""
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "mine.yaml").write_text("defaults:\n  - schema_eagle\n  - _self_\n")
    args = [f"hydra.searchpath=[file://{tmp_path}]", "drafter=mine", "target=tiny"]
    cfg = start_check("python -m train", "train", args, TrainConfig)
    assert cfg.drafter.name == "eagle"  # composed from the plugin's file
    with pytest.raises(Exception, match=r"drafter=nothere names no file .*mine"):
        start_check("python -m train", "train", [args[0], "drafter=nothere"], TrainConfig)
