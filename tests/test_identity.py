"""Captures and caches keyed on the target's identity (docs/training.md "Targets"): the same
target is recognised however it was loaded and wherever the cache lives; another target's
features are refused with the differing key named."""
import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from conftest import write_chats
from hydra import compose, initialize_config_dir
from tiny_gguf import write_tiny_gguf

import specdistill.train.__main__  # noqa: F401  (stores the schemas)
from specdistill.data import capture as capture_mod
from specdistill.data.capture import CaptureConfig, capture_split, offline_features
from specdistill.target.model import TargetConfig, load_target
from specdistill.train.recipe import DistillRecipe

CONF = Path(__file__).resolve().parents[1] / "conf"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _setup(tmp_path: Path, gguf: Path, run: str) -> DistillRecipe:
    """The default recipe (trainer=default: offline features under bf16 autocast) on the tiny
    GGUF target, set up (the capture happens in setup) and closed again."""
    chats = tmp_path / "chats.jsonl"
    if not chats.is_file():
        write_chats(chats, 12, 6)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            f"target.path={gguf}", "target.dtype=float32", "data=jsonl", f"data.path={chats}",
            "data.max_length=256", "data.eval_fraction=0.2", "trainer=default",
            "trainer.max_steps=1", "trainer.final_eval=null", f"run_dir={tmp_path / run}",
            "logger=jsonl", "drafter=eagle", "drafter.draft_vocab_size=null"])
    r = DistillRecipe(cfg)
    r.setup()
    r.cleanup()
    return r


def _stamps(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_the_default_recipe_reuses_its_capture_and_after_the_cache_moved(tmp_path, gguf_target,
                                                                          monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDISTILL_CACHE", str(cache))
    first = _setup(tmp_path, gguf_target, "run1")  # de-quantises the GGUF, captures
    folder = first.offline.folder
    assert folder.parent == cache / "features" and len(first.offline) > 0
    manifest = (folder / "manifest.json").read_text()
    assert str(tmp_path) not in manifest  # no path, no description: the identity only
    assert json.loads(manifest)["target"]["kind"] == "gguf"
    stamps = _stamps(folder)

    def no_capture(*a, **k):
        raise AssertionError("the target ran again: the capture was not reused")

    monkeypatch.setattr(capture_mod, "capture", no_capture)
    second = _setup(tmp_path, gguf_target, "run2")  # the target now loads from the cache
    assert "from cache" in second.target.source and "de-quantised" in first.target.source
    assert second.offline.folder == folder and _stamps(folder) == stamps
    moved = tmp_path / "moved"
    shutil.move(cache, moved)
    monkeypatch.setenv("SPECDISTILL_CACHE", str(moved))
    third = _setup(tmp_path, gguf_target, "run3")
    assert third.offline.folder == moved / "features" / folder.name
    assert _stamps(third.offline.folder) == stamps


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 14, 7, 11)]
    return datasets.Dataset.from_dict({"id": [f"r{i}" for i in range(4)], "input_ids": ids,
                                       "loss_mask": [[1] * len(x) for x in ids]})


def _tiny(cfg: TargetConfig, **change) -> TargetConfig:
    model_config = {**cfg.model_config, **change.pop("model_config", {})}
    return TargetConfig(**{**vars(cfg), "model_config": model_config, **change})


def test_features_of_another_target_are_refused_naming_the_key(tmp_path, tiny_target_cfg, rows):
    two = load_target(tiny_target_cfg)
    eagle = CaptureConfig(layers=[-1])
    same_layers, other_layers = tmp_path / "same", tmp_path / "other"
    capture_split(two, rows, eagle, same_layers, progress=False)
    capture_split(two, rows, CaptureConfig(layers=[0, 1]), other_layers, progress=False)
    three = load_target(_tiny(tiny_target_cfg, model_config={"num_hidden_layers": 3}))
    reseeded = load_target(_tiny(tiny_target_cfg, seed=1))
    for folder in (same_layers, other_layers):  # the capture path and the reuse path
        before = _stamps(folder)
        with pytest.raises(ValueError, match=r"target\.num_layers: 2 -> 3"):
            offline_features(three, rows, folder, eagle, progress=False)
        with pytest.raises(ValueError, match=r"target\.seed: 0 -> 1"):
            offline_features(reseeded, rows, folder, eagle, progress=False)
        assert _stamps(folder) == before  # nothing written into the refused capture
        # the same target (loaded again) is served, from either capture
        assert len(offline_features(load_target(tiny_target_cfg), rows, folder, eagle,
                                    progress=False)) == 4


def test_an_older_capture_or_a_folder_of_other_files_is_refused(tmp_path, tiny_target_cfg, rows):
    target = load_target(tiny_target_cfg)
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"version": 1, "target": "x (from cache /c)",
                                                   "layers": [-1], "hidden_size": 64}))
    with pytest.raises(ValueError, match=rf"older version.*delete {old}"):
        offline_features(target, rows, old, CaptureConfig(layers=[-1]), progress=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "shard-00000.safetensors").write_bytes(b"the user's own file")
    with pytest.raises(FileExistsError, match="not empty and holds no capture"):
        capture_split(target, rows, CaptureConfig(layers=[-1]), mine, progress=False)
    assert [p.name for p in mine.iterdir()] == ["shard-00000.safetensors"]
    assert (mine / "shard-00000.safetensors").read_bytes() == b"the user's own file"


def test_a_local_folder_target_is_known_by_its_files_not_its_path(tmp_path, tiny_target_cfg):
    tiny = load_target(tiny_target_cfg)
    tiny.model.save_pretrained(tmp_path / "a")
    tiny.tokenizer.save_pretrained(tmp_path / "a")
    first = load_target(TargetConfig(path=str(tmp_path / "a"), dtype="float32")).identity
    assert first["kind"] == "folder" and "model.safetensors" in first["weights"]
    shutil.move(tmp_path / "a", tmp_path / "b")
    assert load_target(TargetConfig(path=str(tmp_path / "b"), dtype="float32")).identity == first
    with torch.no_grad():
        tiny.model.lm_head.weight[0, 0] += 1  # a changed weight: another target
    tiny.model.save_pretrained(tmp_path / "b")
    changed = load_target(TargetConfig(path=str(tmp_path / "b"), dtype="float32")).identity
    assert changed["weights"] != first["weights"] and changed["config_sha256"] == first["config_sha256"]
