"""llama.cpp in the engine check (decode/engine/llamacpp_*.py), against stand-ins.

A stand-in llama-server and converter (tests/fake_llamacpp/) drive the whole protocol: the
command line (fixed k, p-min off, f32 caches), readiness, /completion, the /metrics counters
differenced per request and cross-checked with the response's timings, the A B A B interleaving,
and a refusal by the server or the converter as a result in the engine's own words. The bookkeeping
the replay follows (llama.cpp's drafts capped by the budget, plain steps not counted, accepts
past an EOS counted) is checked on a toy target in tests/test_replay.py (past_eos) and here.

No test builds the real llama.cpp: its build takes ~25+ min on 2 cores, too slow for CI. The real
run is the benchmark `python -m benchmarks.llamacpp_matrix` (BENCHMARKS.md).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_engine import _export_config  # an export folder's config.json only

from specdistill.decode.engine import check as chk
from specdistill.decode.engine import llamacpp_build as lb
from specdistill.decode.engine import llamacpp_engine as le
from specdistill.decode.engine.envs import EngineUnavailable

FAKE = Path(__file__).with_name("fake_llamacpp")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A LlamaCpp of the stand-ins, with the request order logged to tmp_path/logs."""
    (tmp_path / "logs").mkdir()
    monkeypatch.setenv("FAKE_LLAMACPP_LOGS", str(tmp_path / "logs"))
    return lb.LlamaCpp(FAKE, FAKE / "llama-server", FAKE / "convert_hf_to_gguf.py",
                       Path(sys.executable), "version: 0 (fake)")


@pytest.mark.parametrize("drafter, fmt, want", [
    ("eagle3", "vllm", ("draft-eagle3", True)), ("eagle3", "speculators", ("draft-eagle3", True)),
    ("dflash", "vllm", ("draft-dflash", True)), ("dspark", "vllm", ("draft-dspark", True)),
    ("dspark", "speculators", ("draft-dspark", True)), ("small_lm", "causal_lm", ("draft-simple", False))])
def test_each_export_is_served_with_the_spec_type_llamacpp_reads_it_by(tmp_path, drafter, fmt, want):
    assert le.spec_type(_export_config(tmp_path, drafter, fmt)) == want


def test_a_format_llamacpp_is_not_given_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="it serves: .*eagle3 as format=vllm"):
        le.spec_type(_export_config(tmp_path, "eagle", "vllm"))


def test_the_speculative_server_drafts_a_fixed_k_with_f32_caches():
    args = le.server_args(Path("t.gguf"), Path("d.gguf"), "draft-eagle3", 3, 512)
    flag = {a: b for a, b in zip(args, args[1:])}
    assert flag["--spec-draft-n-max"] == "3" and flag["--spec-draft-p-min"] == "0"  # no early stop
    assert flag["--spec-draft-n-min"] == "0" and flag["--spec-type"] == "draft-eagle3"
    assert flag["-ctkd"] == flag["-ctvd"] == "f32" and flag["-md"] == "d.gguf"
    assert "-md" not in le.server_args(Path("t.gguf"), None, None, 3, 512)


def test_plain_and_speculative_servers_take_the_prompts_in_turn(fake, tmp_path):
    prompts, budgets = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [9, 2, 12]
    run = le.run_llamacpp(fake, tmp_path / "t.gguf", tmp_path / "d.gguf", "draft-eagle3", 3,
                          prompts, budgets, 64, tmp_path / "logs", threads=1, timeout=60)
    assert run["loaded"], run.get("error")
    assert run["version"] == "version: 0 (fake)" and set(run["load_s"]) == {"plain", "spec"}
    for ids, n, plain, spec in zip(prompts, budgets, run["plain"], run["spec"]):
        assert plain.ids == spec.ids == [(ids[-1] + i + 1) % 97 for i in range(n)]
        assert plain.drafts == plain.accepted == 0
        assert spec.accepted == sum(spec.accepted_per_pos)  # each request's own counts
    # n=2: one round left with no room (n - 1 - 1 = 0 drafts) is a plain step, not a round
    assert run["spec"][1].drafts == 0 and run["spec"][1].draft_tokens == 0
    # n=9, k=3, round r accepts r mod 4: drafts capped at the room left, the last one at 1
    assert run["spec"][0].drafts == 4 and run["spec"][0].draft_tokens == 3 + 3 + 3 + 1
    order = [json.loads(x) for x in (tmp_path / "logs" / "order.jsonl").read_text().splitlines()]
    assert [o["engine"] for o in order] == ["plain", "spec"] * 4  # warm-up, then A B A B


def test_counters_that_disagree_with_the_response_are_an_error(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMACPP_LIE", "1")
    with pytest.raises(EngineUnavailable, match="disagree on one request"):
        le.run_llamacpp(fake, tmp_path / "t.gguf", tmp_path / "d.gguf", "draft-eagle3", 2,
                        [[1, 2, 3]], [8], 64, tmp_path / "logs", plain=False, threads=1, timeout=60)


def test_a_draft_the_server_refuses_is_a_result_with_its_own_words(fake, tmp_path):
    draft = tmp_path / "d.gguf"
    draft.write_text("REFUSE")
    run = le.run_llamacpp(fake, tmp_path / "t.gguf", draft, "draft-eagle3", 2, [[1, 2]], [4], 64,
                          tmp_path / "logs", threads=1, timeout=60)
    assert not run["loaded"] and run["failed_engine"] == "spec"
    assert run["error"] == ("llama_model_load: error loading model: fake refusal: unknown tensor "
                            "'fc.weight'")


def test_the_export_and_the_target_go_through_the_converter(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(lb, "llamacpp_build", lambda cache: fake)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    export = _export_config(tmp_path, "eagle3", "vllm")
    run = le.run_export(export, target, tmp_path / "cache", 2, [[1, 2, 3]], [6], 64,
                        tmp_path / "out", threads=1, timeout=60)
    assert run["loaded"] and len(run["spec"]) == 1
    draft = (tmp_path / "out" / "gguf" / "draft.gguf").read_text()
    assert f"target={target}" in draft  # EAGLE-3 converts with --target-model-dir
    cached = list((tmp_path / "cache" / "engines" / "llamacpp-gguf").glob("target-*-f32.gguf"))
    assert len(cached) == 1  # converted once, reused by the next check
    (export / "REFUSE").write_text("EAGLE-3 d2t contains duplicate target ids")
    refused = le.run_export(export, target, tmp_path / "cache", 2, [[1, 2, 3]], [6], 64,
                            tmp_path / "out2", threads=1, timeout=60)
    assert not refused["loaded"] and refused["failed_engine"] == "converter"
    assert refused["error"] == ("convert_hf_to_gguf.py: ValueError: EAGLE-3 d2t contains "
                                "duplicate target ids")


def test_a_given_llamacpp_dir_without_the_engine_is_a_one_line_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDISTILL_LLAMACPP_DIR", str(tmp_path))
    with pytest.raises(EngineUnavailable, match="holds no convert_hf_to_gguf.py and llama-server"):
        lb.llamacpp_build(tmp_path)


def test_a_machine_without_a_compiler_is_a_one_line_reason(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDISTILL_LLAMACPP_DIR", raising=False)
    monkeypatch.setattr(lb.shutil, "which", lambda tool: None if tool == "c++" else "/bin/" + tool)
    with pytest.raises(EngineUnavailable, match=r"needs `c\+\+`.*apt-get install g\+\+"):
        lb.llamacpp_build(tmp_path)
    assert not (tmp_path / "engines" / "llamacpp-b11434").exists()  # nothing half-built


@pytest.mark.parametrize("name, want", [("eagle3", "vllm"), ("small_lm", "causal_lm"),
                                        ("dspark", "vllm"), ("medusa", None)])
def test_the_check_exports_each_drafter_in_a_layout_llamacpp_reads(tiny_target_cfg, name, want):
    from specdistill.drafters.base import build_drafter
    from specdistill.target.model import load_target

    drafter = build_drafter({"name": name}, load_target(tiny_target_cfg))
    fmt, why = chk.engine_format(drafter, "llamacpp")
    assert fmt == want and (why == "" if want else "llamacpp serves no export layout" in why)
