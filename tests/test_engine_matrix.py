"""The engine matrix (benchmarks/engine_matrix.py): every (drafter, format) pair trained or
reused, exported and checked, one table. Driven against the stand-in vllm of tests/fake_vllm on
the tiny target, so the plumbing is tested in seconds; the real engine's numbers are the
matrix's own output (BENCHMARKS.md)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import engine_matrix as em
from specdistill.decode.engine import vllm_engine as ve

FAKE = Path(__file__).with_name("fake_vllm")


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """The engine check runs vllm_worker.py in this python with the stand-in vllm module."""
    real = ve.worker_env
    monkeypatch.setenv("SPECDISTILL_VLLM_PYTHON", sys.executable)
    monkeypatch.setattr(ve, "worker_env", lambda threads, timeout=1800: {
        **real(threads, timeout), "PYTHONPATH": str(FAKE), "FAKE_VLLM_LOGS": str(tmp_path)})


def test_the_matrix_trains_exports_checks_and_tabulates_every_pair(fake_vllm, monkeypatch,
                                                                   tmp_path, tiny_target_cfg):
    from specdistill.target.model import load_target

    tiny_target_cfg.model_config["num_hidden_layers"] = 4  # 3 distinct aux layers an engine names
    target = load_target(tiny_target_cfg)
    monkeypatch.setattr(em, "LAYOUTS", {
        "eagle3": ({"name": "eagle3", "draft_vocab_size": 512, "ttt_length": 2,
                    "aux_layers": [1, 2, 3]},
                   ("vllm", "speculators")),
        "medusa": ({"name": "medusa", "num_heads": 2}, ("vllm",)),
        # reads the embeddings (hidden_states[0]), which vLLM's DFlash cannot capture
        "dflash": ({"name": "dflash", "aux_layers": [0, 1, 2], "block_size": 3}, ("vllm",))})
    pairs = [("eagle3", "vllm"), ("eagle3", "speculators"), ("medusa", "vllm"), ("dflash", "vllm")]
    out = tmp_path / "matrix"
    rows = em.run_matrix(target, pairs, [1, 2], prompts=2, tokens=6, steps=2, out=out,
                         cache=tmp_path / "cache", given={})
    assert [(r["drafter"], r["format"], r["k"]) for r in rows] == [
        (d, f, k) for d, f in pairs for k in (1, 2)]
    checked = [r for r in rows if r["drafter"] != "dflash"]
    assert all(r["exported"] and r["loaded"] and r["engine_version"] == "fake" for r in checked), rows
    assert all(r["engine_rounds"] > 0 and r["replay_rounds"] > 0 for r in checked)
    # our exporter's own refusal is a row with its reason, and the matrix goes on
    refused = [r for r in rows if r["drafter"] == "dflash"]
    assert all(not r["exported"] and "captures hidden_states in [1, 3]" in r["error"]
               for r in refused)
    md = (out / "matrix.md").read_text()
    assert md.count("\n| eagle3 | `vllm` |") == 2 and "not exported: ExportError" in md
    assert json.loads((out / "matrix.json").read_text()) == json.loads(json.dumps(rows))
    for d, f in pairs[:3]:  # each export and each check in its own folder
        assert (out / "exports" / f"{d}-{f}" / "config.json").is_file()
        assert (out / "checks" / f"{d}-{f}-k2" / "engine_check.json").is_file()
    # a second run with the same settings reuses the drafters instead of training them again
    again = em.run_matrix(target, pairs[2:3], [1], prompts=2, tokens=6, steps=2, out=out,
                          cache=tmp_path / "cache", given={})
    assert again[0]["source"].startswith("overfit, reused")


def test_a_refused_export_is_a_row_with_the_engines_own_words():
    row = {"drafter": "medusa", "format": "vllm", "k": 2, "exported": True, "loaded": False,
           "error": "ValueError: Medusa is not supported on CPU"}
    assert em.table_row(row) == ("| medusa | `vllm` | 2 | **no**: ValueError: Medusa is not "
                                 "supported on CPU | | | | | | |")


def test_an_unknown_pair_is_refused_naming_the_pairs(capsys):
    with pytest.raises(SystemExit, match="--layouts eagle:hf: not in the matrix; pairs: eagle:vllm"):
        em.main(["--layouts", "eagle:hf"])
