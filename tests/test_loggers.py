"""Loggers write what the recipe logs, and it can be read back: W&B's offline run file (parsed
record by record), TensorBoard event files (EventAccumulator), metrics.jsonl; the W&B mode rule;
rank != 0 writes nothing; and a real training run logs losses, lr, grad norm, tokens/s, simulated
acceptance and the decoder eval (histogram + bar charts) to every backend."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from specdistill.train.config import LoggerConfig
from specdistill.train.loggers import Loggers, wandb_mode

SUMMARY = {"eval": "mtbench", "tau": 2.1, "tau_draft": 1.1, "spec_tokens_per_s": 40.0,
           "plain_tokens_per_s": 20.0, "speedup": 2.0, "spec_rounds": 10, "spec_new_tokens": 21,
           "spec_accept_hist": [3, 5, 2], "spec_accept_cond": [0.7, 0.4],
           "outputs_identical_to_plain": True, "mismatched_generations": 0}
CONFIG = {"drafter": {"name": "eagle"}, "target": {"path": "tiny"}, "trainer": {"lr": 0.001}}


def wandb_records(run_dir: Path, until: str | None = None, timeout: float = 15.0) -> list:
    """Every record of the offline W&B run(s) under run_dir, parsed from run-*.wandb. run.finish()
    returns before W&B's writer process has always flushed on a loaded machine, so this re-reads
    until some history row holds the key `until` (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = _read_wandb(run_dir)
        done = until is None or any(until in row for row in history(recs).values())
        if done or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def _read_wandb(run_dir: Path) -> list:
    """Records of run-*.wandb files: a W&B header, then a LevelDB-style log (32 KiB blocks of
    [crc32 u32, length u16, type u8, data] fragments, the crc32 over the type byte then the data),
    each record a protobuf `Record`. W&B's writer may be mid-record when this reads: a fragment cut
    short or failing its checksum ends the read there, and the caller reads again."""
    import zlib

    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        raw, pos, buf = f.read_bytes(), 7, b""
        assert raw[:4] == b":W&B"
        while pos + 7 <= len(raw):
            if 32768 - pos % 32768 < 7:  # block trailer too short for a header: skip it
                pos += 32768 - pos % 32768
                continue
            crc, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
            data = raw[pos + 7:pos + 7 + n]
            if (kind == 0 and n == 0) or len(data) < n or zlib.crc32(data, zlib.crc32(bytes([kind]))) != crc:
                break  # the end, or a fragment still being written
            buf += data
            pos += 7 + n
            if kind in (1, 4):  # FULL or LAST fragment
                rec = pb.Record()
                rec.ParseFromString(buf)
                out.append(rec)
                buf = b""
    return out


def history(records) -> dict[int, dict]:
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row: dict = {}
            for i in r.history.item:  # media values arrive as nested keys: (name, field)
                *path, leaf = [i.key] if i.key else list(i.nested_key)
                node = row
                for p in path:
                    node = node.setdefault(p, {})
                node[leaf] = json.loads(i.value_json)
            rows.setdefault(row["_step"], {}).update(row)
    return rows


def run_config(records) -> dict:
    for r in records:
        if r.WhichOneof("record_type") == "run":
            return {i.key: json.loads(i.value_json) for i in r.run.config.update}
    raise AssertionError("no run record")


def panels(records) -> list[dict]:
    """Custom chart definitions (wandb.plot.bar) registered in the run's config."""
    out = []
    for r in records:
        if r.WhichOneof("record_type") == "config":
            out += [json.loads(i.value_json) for i in r.config.update if "panel_type" in i.value_json]
    return out


def test_wandb_offline_run_holds_scalars_config_histogram_and_bar_charts(tmp_path):
    lg = Loggers(LoggerConfig(kinds=["wandb"], wandb_tags=["unit"]), tmp_path, True, config=CONFIG)
    lg.log({"loss": 2.5, "lr": 1e-3, "div/s1": 2.0, "note": "text"}, 1)
    lg.log({"eval/sim_tau": 1.8, "eval/acc_1": 0.6}, 2)
    lg.log_decoder_eval(SUMMARY, 3)
    lg.close()
    recs = wandb_records(tmp_path, until="final/accepted_length_hist")
    rows = history(recs)
    assert rows[1]["train/loss"] == 2.5 and rows[1]["train/lr"] == 1e-3 and rows[1]["div/s1"] == 2.0
    assert "train/note" not in rows[1]  # only numbers go to the dashboards
    assert rows[2]["eval/sim_tau"] == 1.8
    assert rows[3]["final/tau"] == 2.1 and rows[3]["final/speedup"] == 2.0 and rows[3]["final/acc_2"] == 0.4
    assert rows[3]["final/accepted_length_hist"]["values"] == [3, 5, 2]
    assert rows[3]["final/accepted_length_hist"]["bins"] == [-0.5, 0.5, 1.5, 2.5]
    assert run_config(recs)["trainer"] == {"lr": 0.001}  # the run config is logged
    bars = {p["panel_config"]["userQuery"]["queryFields"][0]["fields"][3]["args"][0]["value"]: p
            for p in panels(recs)}
    assert set(bars) == {"final/accepted_length_table", "final/acceptance_by_position_table"}
    assert bars["final/accepted_length_table"]["panel_config"]["panelDefId"] == "wandb/bar/v0"
    table = next(tmp_path.glob("wandb/offline-run-*/files/media/table/final/accepted_length_table_*.json"))
    assert json.loads(table.read_text())["data"] == [[0, 3], [1, 5], [2, 2]]
    tags = next(r.run.tags for r in recs if r.WhichOneof("record_type") == "run")
    assert set(tags) == {"unit", "drafter:eagle", "target:tiny"}


def test_wandb_reader_stops_at_a_record_still_being_written(tmp_path):
    """The file as a reader may catch it while W&B writes: cut anywhere, it reads a prefix of the
    whole file's records and never fails on the half-written one."""
    (tmp_path / "run").mkdir()
    lg = Loggers(["wandb"], tmp_path / "run", True)
    lg.log({"loss": 1.0, "pad": 1.0}, 1)
    lg.close()
    recs = wandb_records(tmp_path / "run", until="train/loss")
    whole = next((tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb")).read_bytes()
    cut = tmp_path / "cut" / "wandb" / "offline-run-x" / "run-x.wandb"
    cut.parent.mkdir(parents=True)
    lengths = set()
    for end in range(8, len(whole), max(1, len(whole) // 97)):
        cut.write_bytes(whole[:end])
        part = _read_wandb(tmp_path / "cut")
        assert [r.SerializeToString() for r in part] == [r.SerializeToString() for r in recs[:len(part)]]
        lengths.add(len(part))
    assert len(lengths) > 3 and max(lengths) < len(recs)


def test_wandb_resumed_run_keeps_its_id(tmp_path):
    for step in (1, 2):  # a second process on the same run dir (resume=true) continues the W&B run
        lg = Loggers(["wandb"], tmp_path, True)
        lg.log({"loss": float(step), f"mark{step}": 1.0}, step)
        lg.close()
    recs = wandb_records(tmp_path, until="train/mark2")
    ids = [r.run.run_id for r in recs if r.WhichOneof("record_type") == "run"]
    assert ids == [(tmp_path / "wandb_run_id").read_text().strip()] * 2
    assert {s: row["train/loss"] for s, row in history(recs).items()} == {1: 1.0, 2: 2.0}


def test_wandb_mode_rule(tmp_path, monkeypatch):
    assert wandb_mode() == "offline"  # under pytest
    for var in ("PYTEST_CURRENT_TEST", "CI", "WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login a password b\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_mode() == "offline"  # no key anywhere
    netrc.write_text("machine api.wandb.ai login user password secret\n")
    assert wandb_mode() == "online"  # `wandb login` writes this entry
    netrc.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"  # the environment beats the key
    monkeypatch.setenv("CI", "true")
    assert wandb_mode() == "offline"  # CI beats both
    assert wandb_mode("online") == "online"  # an explicit config beats everything
    with pytest.raises(ValueError, match="wandb_mode"):
        wandb_mode("sometimes")


def test_tensorboard_and_jsonl_read_back(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lg = Loggers(LoggerConfig(kinds=["console", "jsonl", "tensorboard"]), tmp_path, True, config=CONFIG)
    lg.log({"loss": 2.5, "grad_norm": 0.5}, 1)
    lg.log({"loss": 1.5, "grad_norm": 0.25}, 2)
    lg.log_decoder_eval(SUMMARY, 2)
    lg.close()
    ea = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in ea.Scalars("train/loss")] == [(1, 2.5), (2, 1.5)]
    assert [e.value for e in ea.Scalars("final/tau")] == pytest.approx([2.1])
    h = ea.Histograms("final/accepted_length_hist")[0].histogram_value
    assert list(h.bucket) == [3, 5, 2] and h.num == 10 and h.sum == 9 and h.max == 2
    assert "config/text_summary" in ea.Tags()["tensors"]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["loss"] for r in rows[:2]] == [2.5, 1.5]
    assert rows[2]["final/spec_accept_hist"] == [3, 5, 2] and rows[2]["final/eval"] == "mtbench"
    out = capsys.readouterr().out
    assert "[step 2] loss=1.5 grad_norm=0.25" in out and "final/tau=2.1" in out


def test_other_ranks_write_nothing(tmp_path):
    lg = Loggers(LoggerConfig(kinds=["jsonl", "wandb", "tensorboard"]), tmp_path, False, config=CONFIG)
    lg.log({"loss": 1.0}, 1)
    lg.log_decoder_eval(SUMMARY, 1)
    lg.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unknown logger kind"):
        Loggers(["console", "mlflow"], tmp_path, True)


def test_training_run_logs_every_metric_to_every_backend(tiny_run):
    """The recipe's own calls: what a dashboard should show is really there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = history(wandb_records(tiny_run, until="final/accepted_length_hist"))
    train_keys = {"train/loss", "train/lr", "train/grad_norm", "train/target_tokens_per_s", "div/s1"}
    assert train_keys <= set(rows[1])
    # every measured position reaches W&B; one no round reached is not measured (null in jsonl)
    evals = [json.loads(x) for x in open(tiny_run / "metrics.jsonl") if '"eval/sim_tau"' in x]
    measured = {k for k, v in evals[0].items() if k.startswith("eval/acc_") and v is not None}
    assert {"eval/sim_tau", "eval/acc_1"} | measured <= set(rows[2])
    assert {"eval/acc_1", "eval/acc_2", "eval/acc_3"} <= set(evals[0])
    last = rows[max(rows)]
    assert {"final/tau", "final/tau_draft", "final/tokens_per_s", "final/speedup",
            "final/accepted_length_hist"} <= set(last)
    final = json.loads((tiny_run / "final_eval" / "result.json").read_text())["summary"]
    assert last["final/tau"] == pytest.approx(final["tau"])
    assert last["final/accepted_length_hist"]["values"] == final["spec_accept_hist"]
    ea = EventAccumulator(str(tiny_run / "tensorboard")).Reload()
    assert len(ea.Scalars("train/loss")) == 4
    assert ea.Scalars("final/tau")[0].value == pytest.approx(final["tau"])
    jsonl = [json.loads(line) for line in open(tiny_run / "metrics.jsonl")]
    assert [r["step"] for r in jsonl if "loss" in r] == [1, 2, 3, 4]
