"""The engine check (decode/engine/): a real vLLM loads our exports and must do what our decoder does.

Fast tests drive the whole worker protocol against a stand-in `vllm` module (tests/fake_vllm/), so
the bookkeeping, the interleaving and the verdicts are checked without an engine. The slow tests
install vLLM CPU into its cached virtualenv (decode/engine/envs.py; ~2-3 min the first time) and
load real exports of a drafter trained on SmolLM2's own answers to three MT-bench prompts (so it
gets most drafts right and any misreading of the layout shows): the engine's output must equal
its plain output, its tau the tau of our decoder replayed on its text; and every known way of
shipping an export that serves at ~0 acceptance (wrong aux layer ids, a missing or stale d2t, a
head the engine swaps for the target's) must fail the check.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from procs import installed_vllm_cache

from specdistill.decode.engine import check as chk
from specdistill.decode.engine import vllm_engine as ve
from specdistill.decode.engine.envs import EngineUnavailable, vllm_python

FAKE = Path(__file__).with_name("fake_vllm")


# -- bookkeeping and verdicts ----------------------------------------------------------------------
def _row(rounds, accepted, replay_rounds, replay_accepted, same=True):
    per_round = [1] * replay_accepted + [0] * (replay_rounds - replay_accepted)
    return {"id": "p", "engine_spec_ids": [1] * 10, "engine_plain_ids": [1] * 10,
            "engine_spec_s": 1.0, "engine_plain_s": 2.0, "spec_equals_plain": same,
            "engine": {"rounds": rounds, "accepted": accepted, "draft_tokens": 2 * rounds,
                       "accepted_per_pos": [accepted, 0]},
            "replay": {"rounds": replay_rounds, "accepted": replay_accepted,
                       "drafted": 2 * replay_rounds, "per_round": per_round}}


def test_the_verdict_passes_equal_acceptance_and_fails_an_engine_that_accepts_less():
    same = chk._summarise([_row(40, 30, 40, 30)], k=2, ours={})
    assert same["verdict"] == "pass" and same["tau_engine"] == same["tau_replay"] == 70 / 40
    assert same["accept_per_pos_engine"] == [0.75, 0.0] == same["accept_per_pos_replay"]
    assert same["engine_speedup"] == 2.0  # 10 tokens in 1 s against 2 s
    low = chk._summarise([_row(60, 10, 40, 30)], k=2, ours={})
    assert low["verdict"] == "fail" and any("does not run the drafter" in p for p in low["problems"])
    lossy = chk._summarise([_row(40, 30, 40, 30, same=False)], k=2, ours={})
    assert lossy["verdict"] == "fail" and any("beyond a near-tie" in p for p in lossy["problems"])


def _diff(position, margin, top=26.6, near_tie=False):
    return {"position": position, "margin": margin, "top_logit": top, "ulp": 1.9e-6,
            "near_tie": near_tie}


def test_a_difference_where_the_engines_plain_output_also_parts_from_ours_is_an_engine_tie():
    """Seen with llama.cpp (quantised matmuls): at one token the engine's speculative, the
    engine's plain and our decoder's outputs picked three tokens 0.003 apart at logit 26.6. The
    same token and margins within 0.1% of the top logit is an engine tie, said apart; another
    token, a wider margin, or no difference from ours is lossy."""
    tie = chk.engine_tie(_diff(29, -0.0030), _diff(29, 0.0035))
    assert tie
    assert not chk.engine_tie(_diff(29, -0.0030), _diff(30, 0.0035))  # another token
    assert not chk.engine_tie(_diff(29, -0.5), _diff(29, 0.0035))  # a bug moves whole logits
    assert not chk.engine_tie(_diff(29, -0.0030), None)  # the engine's plain output is ours
    assert not chk.engine_tie(_diff(29, 1e-6, near_tie=True), _diff(29, 0.0035))  # counted there
    row = _row(40, 30, 40, 30, same=False)
    row["spec_vs_plain_difference"] = {**_diff(29, -0.0030), "engine_tie": True}
    s = chk._summarise([row, _row(40, 30, 40, 30)], k=2, ours={})
    assert s["verdict"] == "pass" and s["spec_differs_at_engine_tie"] == 1
    assert s["spec_equals_plain"] == 1 and s["spec_differs_at_near_tie"] == 0
    md = chk.check_markdown({**s, "engine": "llamacpp", "drafter": "dspark", "format": "vllm",
                             "k": 2, "dtype": "float32", "prompts": 2, "eval": "mtbench",
                             "max_new_tokens": 8, "loaded": True})
    assert "1/2 (0 more at near-ties, 1 more where the engine's plain output also parts" in md
    assert chk.spec_plain_cell({**s, "prompts": 2}) == "1/2 (+1 engine tie)"  # every table's cell
    assert chk.spec_plain_cell({"spec_equals_plain": 18, "prompts": 20, "spec_differs_at_near_tie": 1,
                                "spec_differs_at_engine_tie": 1}) == "18/20 (+1 near-tie, +1 engine tie)"
    assert chk.spec_plain_cell({"spec_equals_plain": None, "prompts": 20}) == "-"  # plain not run
    del row["spec_vs_plain_difference"]["engine_tie"]
    assert chk._summarise([row], k=2, ours={})["verdict"] == "fail"


def test_a_difference_at_a_token_the_target_made_itself_in_a_verify_batch_is_a_verify_tie():
    """Seen with llama.cpp b11434 at fp32: four DSpark drafters, one of them with every draft
    rejected there, all gave token 418 where the engine's plain decoding gave 429, 0.003 apart at
    logit 12.8. Where no accepted draft stands (the replay's own tokens) and the margin is within
    0.1% of the top logit, the drafter had no say: a verify tie, said apart; at an accepted draft,
    or with a wider margin, it is lossy."""
    assert chk.target_tokens([0, 2, 0, 1]) == {0, 1, 4, 5, 7}  # prefill, then each round's own
    own = chk.target_tokens([0] * 10)  # every draft rejected: every token the target's
    assert chk.verify_tie(_diff(6, 0.0031, top=12.81), own)
    assert not chk.verify_tie(_diff(6, 0.0031, top=12.81), {0, 1, 4})  # an accepted draft stood there
    assert not chk.verify_tie(_diff(6, 0.5, top=12.81), own)  # a bug moves whole logits
    assert not chk.verify_tie(_diff(6, 1e-6, near_tie=True), own)  # counted as a near-tie
    row = _row(40, 30, 40, 30, same=False)
    row["spec_vs_plain_difference"] = {**_diff(6, 0.0031, top=12.81), "verify_tie": True}
    s = chk._summarise([row, _row(40, 30, 40, 30)], k=2, ours={})
    assert s["verdict"] == "pass" and s["spec_differs_at_verify_tie"] == 1
    assert chk.spec_plain_cell({**s, "prompts": 2}) == "1/2 (+1 verify tie)"
    md = chk.check_markdown({**s, "engine": "llamacpp", "drafter": "dspark", "format": "vllm",
                             "k": 2, "dtype": "float32", "prompts": 2, "eval": "mtbench",
                             "max_new_tokens": 8, "loaded": True})
    assert "1 more at a token the target produced itself in a verify batch" in md
    del row["spec_vs_plain_difference"]["verify_tie"]
    assert chk._summarise([row], k=2, ours={})["verdict"] == "fail"


def test_nothing_measured_is_not_a_number():
    s = chk._summarise([_row(0, 0, 0, 0)], k=2, ours={})
    assert s["tau_engine"] is None and s["tau_replay"] is None and s["verdict"] == "fail"
    assert "not measured" in chk.check_markdown({**s, "engine": "vllm", "drafter": "eagle3",
                                                  "format": "vllm", "k": 2, "dtype": "float32",
                                                  "prompts": 1, "eval": "mtbench",
                                                  "max_new_tokens": 8, "loaded": True})


def test_the_table_says_when_our_decoder_ran_at_another_dtype_than_the_engine():
    """The job decodes at bf16 and checks the engine at float32: their plain outputs part at
    near-ties, and the table says so instead of a bare 1/20."""
    mine = {"p": {"accepted": [1, 0], "generated_ids": [1] * 10}}
    s = {**chk._summarise([_row(40, 30, 40, 30)], k=2, ours=mine), "engine": "vllm",
         "drafter": "eagle3", "format": "vllm", "k": 2, "dtype": "float32", "prompts": 1,
         "eval": "mtbench", "max_new_tokens": 8, "loaded": True}
    same = chk.check_markdown({**s, "ours_dtype": "float32"})
    assert "| engine plain == our decoder's output | 0/1 |" in same
    apart = chk.check_markdown({**s, "ours_dtype": "bfloat16"})
    assert "our decoder's output (engine float32, ours bfloat16: they part at near-ties) | 0/1 |" in apart


def _export_config(tmp_path, drafter: str, fmt: str) -> Path:
    folder = tmp_path / f"{drafter}-{fmt}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"specdistill": {"drafter": {"name": drafter},
                                                                    "format": fmt}}))
    return folder


@pytest.mark.parametrize("drafter, fmt, want", [
    ("eagle3", "vllm", {"method": "eagle3"}), ("eagle3", "speculators", {"method": "eagle3"}),
    ("peagle", "vllm", {"method": "eagle3", "parallel_drafting": True}),
    ("dflash", "vllm", {"method": "dflash"}), ("eagle", "vllm", {"method": "eagle"}),
    ("small_lm", "causal_lm", {"method": "draft_model"})])
def test_each_export_is_loaded_with_the_method_vllm_reads_it_by(tmp_path, drafter, fmt, want):
    got = ve.speculative_config(_export_config(tmp_path, drafter, fmt), k=3)
    assert got == {**want, "model": str((tmp_path / f"{drafter}-{fmt}").resolve()),
                   "num_speculative_tokens": 3}


def test_a_format_vllm_does_not_serve_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="vLLM serves: .*eagle3 as format=vllm"):
        ve.speculative_config(_export_config(tmp_path, "eagle", "hf"), k=2)


def test_another_trainers_export_is_loaded_with_the_reader_it_is_given(tmp_path, fake_env):
    """A peer's export (benchmarks/peers: no specdistill block) goes to vLLM with the entry the
    caller names, through the same worker protocol; without one it is refused, and our check
    needs the drafter to replay on it."""
    peer = tmp_path / "peer"
    peer.mkdir()
    (peer / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    with pytest.raises(ValueError, match="is drafter None in format None, which vLLM does not serve"):
        ve.speculative_config(peer, k=2)
    assert ve.speculative_config(peer, 2, {"method": "eagle3"}) == {
        "method": "eagle3", "model": str(peer.resolve()), "num_speculative_tokens": 2}
    run = ve.run_vllm(Path(sys.executable), tmp_path, peer, 2, [[5, 6]], [4], [0], "float32", 64,
                      tmp_path / "logs", serving={"method": "eagle3"})
    assert run["loaded"] and run["speculative_config"]["method"] == "eagle3"
    assert run["spec"][0].drafts > 0
    with pytest.raises(ValueError, match="checked with our reading of it given as drafter="):
        chk.engine_check(peer, None, engine="vllm", out_dir=tmp_path / "o", cache=tmp_path,
                         serving={"method": "eagle3"})


def test_the_default_drafter_is_one_vllm_loads_and_eagle1s_pruned_head_says_why(tiny_target_cfg):
    """The main job checks its drafter in vLLM (trainer.engine_check=vllm): the default drafter
    (EAGLE-3 with a pruned head, conf/train.yaml) has a layout vLLM reads; EAGLE-1 with the pruned
    head and input norm (conf/drafter/eagle.yaml's defaults) has none, so such a job logs the
    settings that would have one instead of installing an engine it cannot use."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import specdistill.train.__main__  # noqa: F401  (stores the schemas conf/train.yaml composes)
    from specdistill.decode.engine.check import engine_format
    from specdistill.drafters.base import build_drafter
    from specdistill.target.model import load_target

    target = load_target(tiny_target_cfg)
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"),
                               version_base="1.3"):
        default = OmegaConf.to_container(compose(config_name="train").drafter)
    assert default["name"] == "eagle3" and default["draft_vocab_size"]
    fmt, why = engine_format(build_drafter({**default, "draft_vocab_size": 64}, target))
    assert (fmt, why) == ("vllm", "")
    fmt, why = engine_format(build_drafter({"name": "eagle", "draft_vocab_size": 64}, target))
    assert fmt is None and "draft_vocab_size=null" in why and "input_norm=false" in why
    fmt, why = engine_format(build_drafter({"name": "eagle", "draft_vocab_size": None,
                                            "input_norm": False}, target))
    assert (fmt, why) == ("vllm", "")


def test_a_given_vllm_python_that_does_not_exist_is_a_one_line_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDISTILL_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(EngineUnavailable, match="SPECDISTILL_VLLM_PYTHON=.* is not a file"):
        vllm_python(tmp_path)


# -- the worker protocol, against a stand-in vllm module -------------------------------------------
@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    real = ve.worker_env
    monkeypatch.setattr(ve, "worker_env", lambda threads, timeout=1800: {
        **real(threads, timeout), "PYTHONPATH": str(FAKE), "FAKE_VLLM_LOGS": str(tmp_path / "logs")})


def test_plain_and_speculative_engines_take_the_prompts_in_turn(fake_env, tmp_path):
    export = _export_config(tmp_path, "eagle3", "vllm")
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    run = ve.run_vllm(Path(sys.executable), tmp_path, export, 2, prompts, [6, 6, 3], [0],
                      "float32", 64, tmp_path / "logs")
    assert run["loaded"] and run["version"] == "fake" and len(run["spec"]) == 3
    for ids, n, plain, spec in zip(prompts, [6, 6, 3], run["plain"], run["spec"]):
        assert plain.ids == spec.ids == [(ids[-1] + i + 1) % 97 for i in range(n)]
        assert plain.drafts == 0 and spec.drafts > 0  # the plain engine never drafts
        assert spec.accepted == sum(spec.accepted_per_pos)  # each request's own counts
    # the speculative engine saw every prompt right after the plain one (warm-up first)
    order = [json.loads(x) for x in (tmp_path / "logs" / "order.jsonl").read_text().splitlines()]
    assert [o["engine"] for o in order] == ["plain", "spec"] + ["plain", "spec"] * 3
    assert {o["kv"] for o in order} == {1 << 30}  # no config.json to size it from: 1 GiB


def test_each_engine_gets_the_kv_cache_its_sequence_needs(tmp_path, monkeypatch):
    """vLLM's CPU backend zeroes the whole KV cache it is given: sized to the check's sequence
    (x2, >= 64 MiB) from the target's and the drafter's layers, not a fixed GiB; a user's
    VLLM_CPU_KVCACHE_SPACE is passed on (vLLM lets it win)."""
    export = _export_config(tmp_path, "eagle3", "vllm")
    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "head_dim": 64, "hidden_size": 576}
    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096}
    for name, cfg in (("smollm2", smollm2), ("llama8b", llama8b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    assert ve.kv_cache_bytes(tmp_path / "smollm2", export, "float32", 286) == 64 << 20  # the floor
    # 2 x (32 + 1 layers) x 8 heads x 128 x 2 bytes = 132 KiB a token; 4,096 + 256 tokens, twice
    assert ve.kv_cache_bytes(tmp_path / "llama8b", export, "bfloat16", 4096) == 135168 * 4352 * 2
    assert ve.kv_cache_bytes(tmp_path / "llama8b", export, "bfloat16", 4096) > 1 << 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert "VLLM_CPU_KVCACHE_SPACE" not in ve.worker_env(None)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert ve.worker_env(None)["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_an_export_the_engine_refuses_is_a_result_with_its_own_words(fake_env, tmp_path):
    export = _export_config(tmp_path, "eagle3", "vllm")
    (export / "REFUSE").write_text("fake refusal: unknown weight midlayer.foo")
    run = ve.run_vllm(Path(sys.executable), tmp_path, export, 2, [[1, 2]], [4], [0], "float32",
                      64, tmp_path / "logs", plain=False)
    assert not run["loaded"] and "fake refusal: unknown weight midlayer.foo" in run["error"]


def test_an_engine_that_dies_while_decoding_is_a_result_with_its_own_words(fake_env, tmp_path):
    export = _export_config(tmp_path, "eagle3", "vllm")
    (export / "DIE").write_text("TimeoutError: RPC call to execute_model timed out.")
    run = ve.run_vllm(Path(sys.executable), tmp_path, export, 2, [[1, 2]], [4], [0], "float32",
                      64, tmp_path / "logs")
    assert run["loaded"] and run["failed_engine"] == "spec"
    assert "RPC call to execute_model timed out" in run["error"]
    # an engine step may take as long as the check allows (vLLM's own default: 300 s)
    assert ve.worker_env(None, 900)["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "900"


# -- the real engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm():
    """The specdistill cache with vLLM CPU installed (a missing engine fails, tests/procs.py)."""
    return installed_vllm_cache()


@pytest.fixture(scope="module")
def smollm2():
    from specdistill.target.model import TargetConfig, load_target

    return load_target(TargetConfig(path="packaged:smollm2", dtype="float32"))


PROMPTS, TOKENS, K = 3, 48, 3


def overfit(target, cfg: dict, steps: int = 60):
    """A drafter trained on the target's own greedy answers to the check's prompts (the engine
    matrix's overfit): it gets most drafts right, so a layout the engine reads differently shows
    as lost acceptance."""
    from benchmarks.engine_matrix import greedy_answers
    from benchmarks.engine_matrix import overfit as fit
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.evaluate import render

    prompts = [render(target, p.turns[:1], []) for p in load_prompts("mtbench", limit=PROMPTS)]
    return fit(target, cfg, greedy_answers(target, prompts, TOKENS), steps)


def export(d, cfg, target, fmt, folder):
    from specdistill.export.folder import export_drafter

    export_drafter(d, cfg, target, fmt, folder, k=K)
    return folder


@pytest.fixture(scope="module")
def eagle3(smollm2, tmp_path_factory):
    # aux layers other than the engines' default (2, 15, 27): an export that loses them is read
    # with the default, which the check must catch
    cfg = {"name": "eagle3", "draft_vocab_size": 4096, "ttt_length": 2, "aux_layers": [1, 10, 20]}
    d = overfit(smollm2, cfg)
    return d, export(d, cfg, smollm2, "vllm", tmp_path_factory.mktemp("e3") / "vllm")


def check(folder, target, drafter, cache, out, plain=True):
    return chk.engine_check(folder, target, drafter, limit=PROMPTS, max_new_tokens=TOKENS, k=K,
                            out_dir=out, cache=cache, plain=plain, timeout=900)["summary"]


@pytest.mark.slow
def test_vllm_serves_our_eagle3_export_as_our_decoder_decodes_it(smollm2, eagle3, vllm, tmp_path):
    d, folder = eagle3
    s = check(folder, smollm2, d, vllm, tmp_path)
    assert s["loaded"], s.get("error")
    assert s["verdict"] == "pass", s["problems"]
    assert s["spec_equals_plain"] == PROMPTS  # fp32: the engine is lossless on every prompt
    assert s["tau_replay"] > 1.8  # the drafter gets most drafts right: mistakes would show
    # the same rounds, and the same accepted drafts but for a float tie or two
    assert s["engine_rounds"] == s["replay_rounds"]
    assert abs(s["engine_accepted"] - s["replay_accepted"]) <= 2
    assert (tmp_path / "engine_check.json").is_file() and (tmp_path / "engine_check.md").is_file()


def _edit(folder: Path, tmp_path: Path, config=None, tensors=None) -> Path:
    """A copy of an export with config.json and model.safetensors edited (the mistake)."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    c = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config(c) if config else c))
    if tensors is not None:
        w = load_file(str(bad / "model.safetensors"))
        save_file(tensors(w), str(bad / "model.safetensors"))
    return bad


def _roll_d2t(w):  # the d2t of another vocabulary: the same shape, other target ids
    ids = torch.arange(len(w["d2t"])) + w["d2t"]
    other = ids.roll(1)
    return {**w, "d2t": (other - torch.arange(len(other))).contiguous()}


MISTAKES = {
    # the aux ids lost: vLLM reads its default layers (2, L//2, L-3) instead of the trained ones
    "aux_ids_missing": dict(config=lambda c: {k: v for k, v in c.items()
                                              if k != "eagle_aux_hidden_state_layer_ids"}),
    # the d2t of another vocabulary: the right name, shape and dtype, the wrong ids
    "d2t_stale": dict(tensors=_roll_d2t),
}
# Two mistakes vLLM loads without a word, one in config.json, one in the tensors (each costs an
# engine start, ~45 s of CI). A required tensor the folder lacks (d2t, lm_head.weight) is refused by
# name by the export's validation (tests/test_export.py, "required tensor"): not run through vLLM.


@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_an_export_that_would_serve_at_low_acceptance_fails_the_check(smollm2, eagle3, vllm,
                                                                     tmp_path, mistake):
    d, folder = eagle3
    bad = _edit(folder, tmp_path, **MISTAKES[mistake])
    s = check(bad, smollm2, d, vllm, tmp_path / "check", plain=False)
    assert s["verdict"] != "pass", (mistake, s)


@pytest.mark.slow
def test_the_job_checks_its_drafter_in_vllm_and_the_export_card_says_so(vllm, tmp_path):
    """`python -m train ... trainer.engine_check=vllm`: the final eval exports the best drafter in
    vLLM's layout, loads it there and writes the check beside our table; `python -m train.export
    engine_check=vllm` loads the staged export again before writing it, and its card says where
    it was loaded and what tau the engine measured."""
    import subprocess

    from conftest import write_chats

    chats = write_chats(tmp_path / "chats.jsonl", 24, 10)
    run = tmp_path / "run"
    common = ["target=tiny", "target.model_config.num_hidden_layers=4",
              "target.model_config.hidden_size=128", f"data.cache_dir={tmp_path / 'cache'}"]
    job = subprocess.run([sys.executable, "-m", "train", *common, "data=jsonl",
                          f"data.path={chats}", "data.max_length=96", "data.eval_fraction=0.2",
                          "trainer=smoke", "trainer.eval_k=2", "trainer.engine_check=vllm",
                          "drafter=eagle3", "drafter.draft_vocab_size=256", "logger=jsonl",
                          f"run_dir={run}"], capture_output=True, text=True, timeout=1500)
    assert job.returncode == 0, job.stderr[-3000:]
    s = json.loads((run / "final_eval" / "engine" / "engine_check.json").read_text())["summary"]
    assert s["loaded"] and s["verdict"] == "pass", s
    assert json.loads((run / "summary.json").read_text())["engine_check"]["verdict"] == "pass"
    assert "tau in the engine" in job.stdout  # the table beside ours
    out = tmp_path / "export"
    exp = subprocess.run([sys.executable, "-m", "train.export", f"run={run}", "format=vllm",
                          f"out={out}", "engine_check=vllm"], capture_output=True, text=True,
                         timeout=1500)
    assert exp.returncode == 0, exp.stderr[-3000:]
    card = (out / "README.md").read_text()
    assert "Loaded in a real serving engine before it was written" in card
    assert f"vllm {s['engine_version']}" in card and "tau in the engine" in card
    assert json.loads((out / "engine_check.json").read_text())["summary"]["verdict"] == "pass"
