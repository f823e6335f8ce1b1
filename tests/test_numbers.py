"""No number where nothing was measured: max_new_tokens=1 once reported tau 0.000 and a
3.02x "speedup" without drafting once, and an empty prompt file ended with exit 0 and tau 0.000.
Through the decoder (one sequence and batched), the loggers, the report and the command line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdistill.decode.batched.evaluate import evaluate_batched
from specdistill.decode.evaluate import evaluate_drafter
from specdistill.decode.simulate import acceptance_summary
from specdistill.drafters.base import build_drafter
from specdistill.target.model import load_target
from specdistill.train.loggers import JsonlLogger, decoder_eval_scalars
from specdistill.train.report import write_report

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    from conftest import TINY_MODEL

    from specdistill.target.model import TargetConfig

    return load_target(TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                                    model_config=dict(TINY_MODEL), dtype="float32"))


def test_max_new_tokens_1_measures_no_tau_and_no_speedup(target, tmp_path):
    ngram = build_drafter({"name": "ngram"}, target)
    out = tmp_path / "run" / "final_eval"
    res = evaluate_drafter(target, ngram, limit=2, max_new_tokens=1, k=3, out_dir=out)
    s = res["summary"]
    assert s["tau"] is None and s["tau_draft"] is None and s["speedup"] is None
    assert "no decode rounds" in s["not_measured"] and s["spec_rounds"] == 0
    saved = json.loads((out / "result.json").read_text())["summary"]
    assert saved["tau"] is None and saved["speedup"] is None  # null in JSON
    assert "| tau (tokens per target forward) | not measured (no decode rounds" in res["markdown"]
    assert "| not measured |" in res["markdown"] and "x |" not in res["markdown"].split("speedup")[-1]
    batched = evaluate_batched(target, ngram, batch_size=2, batch_mode="verify_all", limit=2,
                               max_new_tokens=1, k=3)["summary"]
    assert batched["tau"] is None and batched["speedup"] is None
    assert "no decode rounds" in batched["not_measured"]
    # the loggers and the report: no number, the reason said
    assert not {"final/tau", "final/speedup", "final/tau_draft"} & set(decoder_eval_scalars(s))
    jsonl = JsonlLogger(tmp_path / "run")
    jsonl.log_decoder_eval(s, 4, "final")
    jsonl.log({"eval/sim_tau": None, "eval/acc_1": None}, 4)
    jsonl.close()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["final/tau"] is None and "no decode rounds" in row["final/not_measured"]
    report = write_report(tmp_path / "run").read_text()
    assert "not measured" in report and "sim tau" not in report  # no simulated tau of nothing


def runs_with_and_without_warm_up(monkeypatch, module, name: str, warm: int, record, evaluate) -> dict:
    """{0: evaluate(0), warm: evaluate(warm)}, each result with "calls": what `record(drafter, ids,
    kwargs)` kept of every call of module.<name> (the decoder) it made."""
    calls, real = [], getattr(module, name)

    def counted(target_, drafter, ids, **kw):
        calls.append(record(drafter, ids, kw))
        return real(target_, drafter, ids, **kw)

    monkeypatch.setattr(module, name, counted)
    runs = {}
    for w in (0, warm):
        calls.clear()
        runs[w] = evaluate(w)
        runs[w]["calls"] = list(calls)
    return runs


def assert_same_measured_numbers(a: dict, b: dict) -> None:
    """Two eval results that sampled the same tokens and counted the same rounds, forwards,
    tokens, drafts and acceptances (a warm-up changes none of them)."""
    assert [r["generated_ids"] for r in a["prompts"]] == [r["generated_ids"] for r in b["prompts"]]
    counts = [key for key in a["summary"] if key.endswith(("rounds", "forwards", "tokens", "tau",
                                                             "drafted", "accepted"))]
    assert {"tau", "spec_rounds"} <= set(counts)
    assert {key: a["summary"][key] for key in counts} == {key: b["summary"][key] for key in counts}


def test_the_warm_up_decodes_both_modes_first_and_changes_no_measured_number(target, monkeypatch):
    """warmup_tokens: the first prompt decoded plainly and speculatively before the timed loop, on
    its own random stream: at T=1 the measured prompts sample exactly what they sample without it,
    and no count (rounds, forwards, tokens) includes the warm-up."""
    import specdistill.decode.evaluate as ev
    from specdistill.drafters.parts.sampling import SamplingParams

    ngram = build_drafter({"name": "ngram"}, target)
    runs = runs_with_and_without_warm_up(
        monkeypatch, ev, "generate", 5, lambda drafter, ids, kw: (drafter is None, kw["max_new_tokens"]),
        lambda warm: evaluate_drafter(target, ngram, limit=2, max_new_tokens=12, k=3, seed=3,
                                      sampling=SamplingParams(temperature=1.0), warmup_tokens=warm))
    assert runs[0]["calls"] == [(True, 12), (False, 12)] * 2
    assert runs[5]["calls"] == [(True, 5), (False, 5)] + [(True, 12), (False, 12)] * 2
    assert_same_measured_numbers(runs[0], runs[5])


@pytest.mark.parametrize("mode", ["verify_all", "budgeted"])
def test_the_batched_warm_up_decodes_one_batch_first_and_changes_no_measured_number(target, mode,
                                                                                   monkeypatch):
    """Batched (decode/batched/evaluate.py): the warm-up is one batch of the first batch_size
    prompts, plain then speculative, warmup_tokens each; at T=1 the measured prompts sample the same
    tokens and every count is unchanged (verify_all); budgeted, the measured planner is not the
    warm-up's (its choices depend on measured times: no identity of counts to check there)."""
    import specdistill.decode.batched.evaluate as bev
    from specdistill.drafters.parts.sampling import SamplingParams

    ngram = build_drafter({"name": "ngram"}, target)
    runs = runs_with_and_without_warm_up(
        monkeypatch, bev, "generate_batch", 4,
        lambda drafter, ids, kw: (drafter is None, len(ids), kw["max_new_tokens"], id(kw.get("planner"))),
        lambda warm: evaluate_batched(target, ngram, batch_size=2, batch_mode=mode, limit=3,
                                      max_new_tokens=10, k=3, seed=5, warmup_tokens=warm,
                                      sampling=SamplingParams(temperature=1.0)))
    measured = [(plain, n, tokens) for plain, n, tokens, _ in runs[0]["calls"]]
    assert measured == [(True, 3, [10] * 3), (False, 3, [10] * 3)]
    warm_calls = [(plain, n, tokens) for plain, n, tokens, _ in runs[4]["calls"]]
    assert warm_calls == [(True, 2, [4, 4]), (False, 2, [4, 4])] + measured
    if mode == "budgeted":  # the warm-up's planner is its own; its choices depend on measured times
        assert runs[4]["calls"][1][3] != runs[4]["calls"][3][3]
        return
    assert_same_measured_numbers(runs[0], runs[4])


def test_a_simulated_eval_of_nothing_is_not_measured():
    res = acceptance_summary([], k=3)
    assert res["sim_tau"] is None and res["acceptance"] == [None, None, None]
    assert acceptance_summary([(1, 2), (0, 2)], k=2)["sim_tau"] == pytest.approx(1 + 0.5)  # 0.5, then 0 of 1


def test_an_empty_prompt_file_is_refused_with_one_line(tmp_path):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CI": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    env.pop("SPECDISTILL_DEBUG", None)
    res = subprocess.run([sys.executable, "-m", "decode", "target=tiny", "eval=jsonl",
                          f"eval.path={empty}", f"run_dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip() and "Loading weights" not in x]
    assert lines[-1].startswith(f"python -m decode: error: {empty}: no prompt to decode")
    assert "Traceback" not in res.stderr and not (tmp_path / "run" / "result.json").exists()
