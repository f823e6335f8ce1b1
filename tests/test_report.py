"""The local report: plots and report.md rebuilt from a run dir's files, on synthetic runs (every
number known) and on a real tiny training run."""
from __future__ import annotations

import json

import pytest

from specdistill.train.report import implied_length_distribution, simulated_evals, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(tmp_path, final: bool):
    rows = [{"step": s, "loss": 3.0 / s, "div/s1": 2.0 / s, "lr": 1e-3} for s in range(1, 7)]
    rows.insert(3, {"step": 3, "eval/sim_tau": 1.5, "eval/acc_1": 0.5, "eval/acc_2": 0.25})
    rows.append({"step": 6, "eval/sim_tau": 9.0, "eval/acc_1": 0.1, "eval/acc_2": 0.1})
    rows.append({"step": 6, "eval/sim_tau": 1.75, "eval/acc_1": 0.5, "eval/acc_2": 0.5})  # re-logged
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"step": 7, "loss": 0.'  # torn by a crash
    (tmp_path / "metrics.jsonl").write_text(text)
    if final:
        (tmp_path / "final_eval").mkdir()
        summary = {"tau": 1.9, "spec_accept_hist": [4, 3, 3], "spec_accept_cond": [0.6, 0.5]}
        (tmp_path / "final_eval" / "result.json").write_text(json.dumps({"summary": summary,
                                                                          "prompts": []}))
        (tmp_path / "final_eval" / "result.md").write_text("| run | |\n|---|---|\n| tau | 1.900 |\n")
    return tmp_path


def test_implied_length_distribution():
    assert implied_length_distribution([0.5, 0.5]) == [0.5, 0.25, 0.25]
    assert implied_length_distribution([1.0, 0.0]) == [0.0, 1.0, 0.0]
    assert sum(implied_length_distribution([0.9, 0.7, 0.3, 0.2])) == pytest.approx(1.0)


def test_report_from_files_with_a_final_eval(tmp_path):
    run = fake_run(tmp_path, final=True)
    assert [(s, t) for s, t, _ in simulated_evals(json.loads(line) for line in
                                                  (run / "metrics.jsonl").read_text().splitlines()[:-1])] \
        == [(3, 1.5), (6, 1.75)]  # the last record of a step wins
    report = write_report(run).read_text()
    for name in ("acceptance_by_position", "accepted_length", "tau", "loss"):
        png = run / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5000, name
        assert f"(plots/{name}.png)" in report
    assert "## Decoder evaluation (final_eval)" in report and "| tau | 1.900 |" in report
    assert "| 3 | 1.500 | 0.500 | 0.250 |" in report and "| 6 | 1.750 | 0.500 | 0.500 |" in report
    assert "9.000" not in report
    assert "accepted length (decoder final eval, 10 rounds)" in report
    assert not list(run.glob("**/*.tmp-*"))  # written atomically


def test_report_without_a_final_eval_uses_the_simulated_acceptance(tmp_path):
    report = write_report(fake_run(tmp_path, final=False)).read_text()
    assert "Decoder evaluation" not in report
    assert "implied by the simulated acceptance at step 6" in report
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "## Plots" not in write_report(empty).read_text()  # a run that logged nothing yet


def test_training_run_writes_the_report(tiny_run):
    report = (tiny_run / "report.md").read_text()
    final = (tiny_run / "final_eval" / "result.md").read_text().strip()
    assert final in report  # rewritten after final_eval()
    assert "| 2 | " in report and "| 4 | " in report  # both periodic evals
    # what was trained on: the data report written at the job's start
    assert "## Training data" in report and "| turns trained |" in report
    assert (tiny_run / "data_report.json").is_file()
    # the latest eval by context length: rows of <= 96 tokens put every position in 0-512
    ctx = json.loads((tiny_run / "eval_by_context.json").read_text())
    assert ctx["step"] == 4 and [b["bucket"] for b in ctx["buckets"]] == ["0-512"]
    rows = [json.loads(line) for line in open(tiny_run / "metrics.jsonl")]
    sim = [r for r in rows if r.get("step") == 4 and "eval/sim_tau" in r][-1]
    assert ctx["buckets"][0]["sim_tau"] == pytest.approx(sim["eval/sim_tau"])
    assert "## Simulated acceptance by context length (step 4, k=3)" in report
    assert f"| 0-512 | {ctx['buckets'][0]['positions']} | " in report
    for name in ("acceptance_by_position", "accepted_length", "tau", "loss"):
        assert (tiny_run / "plots" / f"{name}.png").read_bytes()[:8] == PNG


def test_the_report_leads_with_the_verdict_and_how_to_serve(tmp_path):
    """Our decoder's and the serving engine's tau, speedup and losslessness first, then the export
    command for the layout the engine served and that layout's serving command."""
    (tmp_path / "run").mkdir()
    run = fake_run(tmp_path / "run", final=False)
    (run / "final_eval").mkdir()
    summary = {"tau": 1.401, "speedup": 1.263, "k": 2, "eval": "mtbench", "generations": 20,
               "target_dtype": "bfloat16", "lossless_check": "passed",
               "outputs_identical_to_plain": True}
    (run / "final_eval" / "result.json").write_text(json.dumps({"summary": summary, "prompts": []}))
    (run / "final_eval" / "engine").mkdir()
    engine = {"engine": "vllm", "format": "vllm", "k": 2, "tau_engine": 1.371, "tau_replay": 1.372,
              "engine_speedup": 1.27, "spec_equals_plain": 19, "spec_differs_at_near_tie": 1, "prompts": 20,
              "verdict": "pass"}
    (run / "final_eval" / "engine" / "engine_check.json").write_text(
        json.dumps({"summary": engine, "prompts": []}))
    (run / "config.yaml").write_text("target:\n  path: packaged:smollm2\ndrafter:\n  name: eagle3\n")
    report = write_report(run).read_text()
    head = report.split("## Verdict", 1)[1].split("\n## ", 1)[0]
    assert report.index("## Verdict") < report.index("## Simulated acceptance")
    assert "| ours (bfloat16, k=2) | 1.401 | 1.26x | yes |" in head
    assert "| vllm (vllm) | 1.371 (ours replayed 1.372) | 1.27x | 19/20 (+1 near-tie) |" in head
    assert "check: **pass**" in head
    assert f"specdistill export run={run} format=vllm out=exports/run-vllm" in head
    assert "vllm serve packaged:smollm2 --speculative-config" in head and '"method": "eagle3"' in head


def test_the_report_gives_a_confidence_heads_calibration(tmp_path):
    """A drafter with a trained confidence head: one line with its ECE and per-slot predicted vs
    observed acceptance; none for draft-probability confidences."""
    run = fake_run(tmp_path, final=True)
    path = run / "final_eval" / "result.json"
    res = json.loads(path.read_text())
    cal = {"source": "head", "pairs": 12, "bins": 10, "ece": 0.042,
           "slots": [{"slot": 1, "count": 8, "predicted": 0.71, "observed": 0.75},
                     {"slot": 2, "count": 4, "predicted": 0.5, "observed": None}]}
    res["summary"]["spec_calibration"] = cal
    path.write_text(json.dumps(res))
    report = write_report(run).read_text()
    assert ("Confidence head calibration: ECE 0.042 over 12 verified slots (predicted vs observed "
            "acceptance per slot: 1: 0.71 vs 0.75, 2: 0.50 vs -).") in report
    res["summary"]["spec_calibration"] = {**cal, "source": "draft_prob"}
    path.write_text(json.dumps(res))
    assert "Confidence head calibration" not in write_report(run).read_text()
