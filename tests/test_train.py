"""The distillation recipe on a tiny target: loss goes down, resume is exact, crashes are safe,
online and offline capture give the same batches, greedy decoding with the trained drafter stays
the target's."""
import json
from pathlib import Path

import pytest
import torch
from conftest import write_chats
from hydra import compose, initialize_config_dir

import specdistill.train.__main__  # noqa: F401  (stores the schemas)
from specdistill.data.capture import CaptureConfig, OfflineFeatures, capture, capture_split
from specdistill.decode.spec import generate
from specdistill.drafters.parts.vocab import select_draft_vocab
from specdistill.store import rundir as runs
from specdistill.store.drafter import load_drafter
from specdistill.train import checkpoint as ckpt
from specdistill.train import recipe as recipe_mod
from specdistill.train.recipe import DistillRecipe, NonFiniteLoss

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """48 small conversations with learnable structure."""
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl", 48, 12)


def make_cfg(tmp_path, chat_file, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=[
            "target=tiny", "data=jsonl", f"data.path={chat_file}", "data.max_length=128",
            "data.eval_fraction=0.1", f"data.cache_dir={tmp_path / 'cache'}", "trainer=smoke",
            "trainer.final_eval=null", f"run_dir={tmp_path / 'run'}", "logger=jsonl",
            "drafter=eagle", "drafter.draft_vocab_size=512", *overrides])


def run(cfg) -> DistillRecipe:
    r = DistillRecipe(cfg)
    r.setup()
    r.train()
    r.cleanup()
    return r


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_training_lowers_the_loss(tmp_path, chat_file):
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=40", "trainer.lr=3e-3",
                   "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1")
    r = run(cfg)
    got = losses(Path(cfg.run_dir))
    first = sum(got[s] for s in range(1, 6)) / 5
    last = sum(got[s] for s in range(36, 41)) / 5
    assert last < 0.7 * first, (first, last)
    assert (Path(cfg.run_dir) / "config.yaml").is_file()
    assert r.last_eval["positions"] > 0 and 1.0 <= r.last_eval["sim_tau"] <= 1 + cfg.trainer.eval_k
    # the target is never saved with the drafter
    saved = runs.latest_checkpoint(Path(cfg.run_dir))
    from safetensors.torch import load_file
    names = load_file(str(saved / "drafter.safetensors")).keys()
    assert not any("embed_tokens" in n or n.startswith("model.") for n in names)


def test_resume_gives_the_uninterrupted_losses(tmp_path, chat_file):
    full = make_cfg(tmp_path / "a", chat_file, "trainer.max_steps=6", "trainer.save_every=3",
                    "trainer.log_every=1", "trainer.eval_every=0")
    run(full)
    # the same job, stopped after its step-3 checkpoint (as a crash would stop it)
    part = make_cfg(tmp_path / "b", chat_file, "trainer.max_steps=6", "trainer.save_every=3",
                    "trainer.log_every=1", "trainer.eval_every=0")
    stopped = DistillRecipe(part)
    stopped.setup()
    for _ in range(3):
        stopped.train_step()
    stopped.save_checkpoint()
    stopped.train_step()  # lost work: after the checkpoint
    stopped.cleanup()
    resumed = make_cfg(tmp_path / "b", chat_file, "trainer.max_steps=6", "trainer.save_every=3",
                       "trainer.log_every=1", "trainer.eval_every=0", "resume=true")
    r = run(resumed)
    assert r.step == 6
    a, b = losses(Path(full.run_dir)), losses(Path(resumed.run_dir))
    for s in (4, 5, 6):
        assert b[s] == pytest.approx(a[s], rel=1e-5, abs=1e-6), (s, a, b)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, chat_file, monkeypatch):
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=6", "trainer.save_every=2",
                   "trainer.eval_every=0")
    real = recipe_mod.drafter_loss
    calls = {"n": 0}

    def poisoned(*a, **k):
        loss, parts = real(*a, **k)
        calls["n"] += 1
        return (loss * float("nan"), parts) if calls["n"] == 3 else (loss, parts)

    monkeypatch.setattr(recipe_mod, "drafter_loss", poisoned)
    r = DistillRecipe(cfg)
    r.setup()
    with pytest.raises(NonFiniteLoss, match="loss is nan at step 2"):
        r.train()
    last = runs.latest_checkpoint(Path(cfg.run_dir))
    assert last is not None and last.name == "step-0000002"
    assert load_drafter(last, r.target) is not None


def test_crash_mid_checkpoint_leaves_previous_intact(tmp_path, chat_file, monkeypatch):
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=4", "trainer.save_every=2",
                   "trainer.eval_every=0")
    r = DistillRecipe(cfg)
    r.setup()
    r.train_step(), r.train_step()
    r.save_checkpoint()

    def crash(*a, **k):
        raise OSError("disk died mid-write")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    r.train_step(), r.train_step()
    with pytest.raises(OSError, match="disk died"):
        r.save_checkpoint()
    assert [p.name for p in runs.complete_checkpoints(Path(cfg.run_dir))] == ["step-0000002"]


def test_online_and_offline_capture_give_the_same_batches(tmp_path, chat_file):
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=1")
    r = DistillRecipe(cfg)
    r.setup()
    rows = r.train_ds
    out = capture_split(r.target, rows, CaptureConfig(layers=list(r.drafter.feature_layers),
                                                      shard_size=8, batch_size=3),
                        tmp_path / "feats", progress=False)
    assert len(list(out.glob("shard-*.safetensors"))) == (len(rows) + 7) // 8
    raw = next(r.batches)
    online = r.make_batch(raw)
    r.offline = OfflineFeatures(out, r.drafter.feature_layers, r.target)
    offline = r.make_batch(raw)
    assert r.offline._open == {}  # the shards it read are unmapped again: not the job's memory
    real = raw["attention_mask"].bool()
    torch.testing.assert_close(offline.features[real], online.features[real], rtol=1e-4, atol=1e-5)
    read = online.target_logits.known  # the teacher where a loss reads it (train/teacher.py)
    assert read.any() and torch.equal(read, offline.target_logits.known)
    torch.testing.assert_close(offline.target_logits[read], online.target_logits[read],
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(offline.loss_mask, online.loss_mask)
    # the capture batches rows of similar lengths together: every row is still stored as its own
    lengths = [len(x) for x in rows["input_ids"]]
    assert sorted(range(8), key=lambda j: -lengths[j]) != list(range(8))  # batched out of order
    for i in range(len(rows)):
        ids = rows[i]["input_ids"]
        f, h = capture(r.target, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                       r.drafter.feature_layers)
        got_f, got_h = r.offline.get(i, ids)
        torch.testing.assert_close(got_f, f[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_h, h[0], rtol=1e-4, atol=1e-5)
    # a resumed capture skips finished shards and a mismatched one is refused
    capture_split(r.target, rows, CaptureConfig(layers=list(r.drafter.feature_layers),
                                                shard_size=8), out, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        capture_split(r.target, rows, CaptureConfig(layers=[0], shard_size=8), out, progress=False)
    with pytest.raises(ValueError, match="other settings"):  # autocast is part of the settings
        capture_split(r.target, rows, CaptureConfig(layers=list(r.drafter.feature_layers),
                                                    shard_size=8, autocast="bfloat16"), out,
                      progress=False)
    # bf16 autocast: the same features within bf16 precision, stored in fp32
    bf = capture_split(r.target, rows, CaptureConfig(layers=list(r.drafter.feature_layers),
                                                     shard_size=8, autocast="bfloat16"),
                       tmp_path / "feats-bf16", progress=False)
    assert json.loads((bf / "manifest.json").read_text())["autocast"] == "bfloat16"
    r.offline = OfflineFeatures(bf, r.drafter.feature_layers, r.target)
    low = r.make_batch(raw)
    assert low.features.dtype == torch.float32
    err = (low.features[real] - online.features[real]).norm() / online.features[real].norm()
    assert 0 < err < 0.03, err  # really computed in bf16, and close
    # online (and on-policy) batches run the target under the same autocast: the same numbers
    r.offline, r.tcfg.capture_autocast = None, "bfloat16"
    online_bf = r.make_batch(raw)
    assert online_bf.features.dtype == torch.float32
    torch.testing.assert_close(online_bf.features[real], low.features[real], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(online_bf.target_logits[read], low.target_logits[read], rtol=1e-3,
                               atol=1e-3)


def test_greedy_decoding_with_the_trained_drafter_is_the_targets(tmp_path, chat_file):
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=10", "trainer.lr=3e-3")
    r = run(cfg)
    drafter = load_drafter(Path(cfg.run_dir) / "best", r.target).eval()
    for row in r.eval_ds.select(range(min(3, len(r.eval_ds)))):
        prompt = row["input_ids"][:20]
        plain = generate(r.target, None, prompt, max_new_tokens=24)
        for tree in (False, True):
            spec = generate(r.target, drafter, prompt, max_new_tokens=24, k=4, tree=tree)
            assert torch.equal(spec.tokens, plain.tokens)


def test_unwritable_run_dir_is_refused_before_training(tmp_path, chat_file):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = make_cfg(tmp_path, chat_file, f"run_dir={blocker / 'run'}")
    with pytest.raises((PermissionError, OSError, FileExistsError, NotADirectoryError)):
        DistillRecipe(cfg).setup()


def test_train_conversations_trains_on_a_prefix_of_one_capture(tmp_path, chat_file):
    """trainer.train_conversations=N: the whole split is captured once (reused by every N), batches
    and the draft vocabulary come from its first N conversations only; too many is refused."""
    feats = tmp_path / "feats"
    cfg = make_cfg(tmp_path / "a", chat_file, "trainer.max_steps=1", "trainer.features=offline",
                   f"trainer.features_dir={feats}", "trainer.train_conversations=6",
                   "trainer.batch_size=4", "drafter.draft_vocab_size=64")
    r = DistillRecipe(cfg)
    r.setup()
    assert len(r.train_ds) == 6 and len(r.split_ds) > 6
    assert len(r.offline) == len(r.split_ds)  # the capture holds the whole split
    seen = set()
    for _ in range(12):  # 8 epochs of the 6 conversations
        seen |= set(next(r.batches)["index"].tolist())
    assert seen == set(range(6))
    def vocab(ds):
        return select_draft_vocab(recipe_mod.token_counts(ds, r.target.vocab_size),
                                  len(r.drafter.d2t), r.target.eos_token_ids)
    assert torch.equal(r.drafter.d2t, vocab(r.train_ds))  # fitted to the six alone
    assert not torch.equal(r.drafter.d2t, vocab(r.split_ds))
    r.train_step()  # a batch of the prefix reads its features from the whole split's capture
    r.cleanup()
    too_many = make_cfg(tmp_path / "b", chat_file, "trainer.max_steps=1",
                        "trainer.train_conversations=999")
    with pytest.raises(ValueError, match="train_conversations=999"):
        DistillRecipe(too_many).setup()


def test_final_eval_target_keeps_training_threads_under_its_own_load(tiny_target_cfg, monkeypatch):
    """The final eval reloads the target at decode's dtype; with target.threads=0 that would lower
    torch's threads to the cores the 1-minute load average leaves idle, a load that is the job's
    own training (the fresh-clone main job evaluated on 1 of 2 cores): it keeps training's."""
    import dataclasses
    import os
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from specdistill.target.model import load_target
    from specdistill.train.final_eval import decode_target

    trained = load_target(tiny_target_cfg)  # float32, as training loads it
    cfg = OmegaConf.structured(dataclasses.replace(tiny_target_cfg, dtype="bfloat16", threads=0))
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0, 2.0, 2.0))  # training kept 2 cores busy
    monkeypatch.setattr("specdistill.target.precision.available_cores", lambda: 2)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        again = decode_target(SimpleNamespace(target=cfg), trained)
        assert again is not trained and again.dtype == torch.bfloat16
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_max_minutes_stops_cleanly_with_a_checkpoint(tmp_path, chat_file, caplog):
    """A wall-clock budget ends the loop after the step that crosses it: an eval, a checkpoint at
    that step (best/ too), a logged stop; the schedule's max_steps is not reached."""
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=40", "trainer.max_minutes=0.00001",
                   "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=20")
    with caplog.at_level("INFO", logger=recipe_mod.__name__):
        r = run(cfg)
    assert r.step == 1 and r.stopped_early
    assert runs.latest_checkpoint(Path(cfg.run_dir)).name == "step-0000001"
    assert (Path(cfg.run_dir) / "best").exists()
    rows = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
    assert any(row.get("step") == 1 and row.get("train_minutes", 0) > 0 for row in rows)
    assert "trainer.max_minutes=1e-05 reached" in caplog.text
    said = [r.getMessage() for r in caplog.records if "cut the recipe short" in r.getMessage()]
    assert len(said) == 1 and "learning rate stood at" in said[0]
    assert "on-policy heads phase" not in said[0]  # this recipe has none
    assert "trainer.max_steps to the steps that fit (about 1" in said[0]


def test_a_budget_that_stops_before_the_on_policy_phase_says_so(tmp_path, chat_file, caplog):
    """trainer.max_minutes stops a run whose on-policy heads phase starts at 90% of max_steps:
    the stop names the phase that never ran and the max_steps that would fit it."""
    cfg = make_cfg(tmp_path, chat_file, "drafter=eagle3", "drafter.draft_vocab_size=256",
                   "drafter.ttt_length=1", "trainer.max_steps=40", "trainer.max_minutes=0.00001",
                   "trainer.on_policy_heads_start=0.9", "trainer.eval_every=0",
                   "trainer.save_every=0", "trainer.log_every=20")
    with caplog.at_level("INFO", logger=recipe_mod.__name__):
        run(cfg)
    said = [r.getMessage() for r in caplog.records if "cut the recipe short" in r.getMessage()]
    assert len(said) == 1 and "on-policy heads phase" in said[0] and "from step 36" in said[0]


class StepClock:
    """The schedule's clock: `seconds` more at every reading (one reading a step)."""

    def __init__(self, seconds: float):
        self.now, self.seconds = 0.0, seconds

    def __call__(self) -> float:
        self.now += self.seconds
        return self.now


def test_schedule_minutes_fits_the_whole_recipe_into_the_minutes(tmp_path, chat_file, caplog,
                                                                 monkeypatch):
    """trainer.schedule=minutes: one minute at ~6 s a step ends after ~10 of max_steps=40, with
    the learning rate at its floor and the on-policy heads phase run in the last 20% of the
    minutes (a step-based schedule cut there says it cut both); the checkpoint carries the
    minutes and the phase, and a resume given a longer budget goes on with both."""
    from specdistill.train import schedule as S

    monkeypatch.setattr(S, "_now", StepClock(6.0))
    args = ["drafter=eagle3", "drafter.draft_vocab_size=256", "drafter.ttt_length=1",
            "trainer.max_steps=40", "trainer.schedule=minutes", "trainer.on_policy_heads_start=0.8",
            "trainer.on_policy_heads_anchors=0.5", "trainer.eval_every=0", "trainer.save_every=0",
            "trainer.log_every=1"]
    cfg = make_cfg(tmp_path, chat_file, *args, "trainer.max_minutes=1")
    with caplog.at_level("INFO", logger=recipe_mod.__name__):
        r = run(cfg)
    assert 8 <= r.step <= 11 and r.stopped_early
    lr = cfg.trainer.lr * cfg.trainer.min_lr_ratio
    assert r.optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    first = r.schedule.on_policy_from
    assert first is not None and 0.7 * r.step <= first < r.step
    rows = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
    scored = [row["step"] for row in rows if "scored" in row]  # the steps the target scored
    assert scored == list(range(first + 1, r.step + 1))
    assert "the whole schedule in the minutes" in caplog.text
    assert "cut the recipe short" not in caplog.text
    state = ckpt.load_trainer_state(runs.latest_checkpoint(Path(cfg.run_dir)))["schedule"]
    assert state["on_policy_from"] == first and state["seconds"] >= 60

    again = run(make_cfg(tmp_path, chat_file, *args, "trainer.max_minutes=2", "resume=true"))
    assert again.schedule.earlier_s == pytest.approx(state["seconds"])
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(lr)  # the longer budget's end
    assert again.step > r.step and again.schedule.on_policy_from == first  # the phase goes on
    rows = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
    assert all("scored" in row for row in rows if row.get("step", 0) > r.step and "loss" in row)


def test_schedule_minutes_needs_its_minutes(tmp_path, chat_file):
    with pytest.raises(ValueError, match="trainer.schedule=minutes spans trainer.max_minutes"):
        run(make_cfg(tmp_path, chat_file, "trainer.schedule=minutes"))
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before any work


def test_max_minutes_out_of_range_is_refused(tmp_path, chat_file):
    from specdistill.cli.errors import UserError
    from specdistill.cli.ranges import check_ranges
    from specdistill.train.config import TrainConfig

    with pytest.raises(UserError, match="trainer.max_minutes"):
        check_ranges(make_cfg(tmp_path, chat_file, "trainer.max_minutes=0"), TrainConfig)
    r = run(make_cfg(tmp_path, chat_file, "trainer.max_steps=2", "trainer.max_minutes=60"))
    assert r.step == 2 and not r.stopped_early  # a budget not reached changes nothing


def test_window_trains_long_rows_in_windows_of_the_whole_rows_features(tmp_path, chat_file):
    """trainer.window: a micro-batch longer than the window is trained window by window, each with
    the target's features and teacher of the WHOLE rows sliced (not a forward over the window
    alone), its loss weighted by its share of the trained tokens; a step runs and spans with
    nothing trained are skipped."""
    from specdistill.train.batches import row_windows

    trained = torch.tensor([[0] * 40 + [1] * 60, [0] * 70 + [1] * 10 + [0] * 20])
    spans = row_windows(trained, 32)  # 0-31: nothing trained, skipped
    assert [(c.start, c.stop) for c, _ in spans] == [(32, 64), (64, 96), (96, 100)]
    assert [n for _, n in spans] == pytest.approx([24 / 70, 42 / 70, 4 / 70])
    assert row_windows(trained, 100) == [(slice(0, 100), 1.0)] == row_windows(trained, None)
    cfg = make_cfg(tmp_path, chat_file, "trainer.max_steps=2", "trainer.window=64",
                   "trainer.eval_every=0", "trainer.save_every=0", "drafter=eagle3",
                   "drafter.draft_vocab_size=512")
    r = DistillRecipe(cfg)
    r.setup()
    raw = next(r.batches)
    raw = {**raw, **{k: torch.cat([raw[k]] * 3, dim=1) for k in  # rows of 3 x T tokens
                     ("input_ids", "attention_mask", "loss_mask")}}
    T = raw["input_ids"].shape[1]
    assert T > 128
    r.offline = None  # the longer rows were never captured: online features of the whole rows
    whole = r.make_batch(raw)
    got = list(r.make_batches(raw))
    want = row_windows(raw["loss_mask"] * raw["attention_mask"], 64)
    assert len(got) == len(want) >= 3 and [last for _, _, last in got] == [False] * (len(got) - 1) + [True]
    for (batch, share, _), (cut, n) in zip(got, want):
        assert batch.input_ids.shape[1] <= 64 and share == n
        assert torch.equal(batch.input_ids, raw["input_ids"][:, cut])
        torch.testing.assert_close(batch.features, whole.features[:, cut])
        read = batch.target_logits.known
        torch.testing.assert_close(batch.target_logits[read], whole.target_logits.dense()[:, cut][read])
    if cut.start >= 64:  # a later window alone would give other features (the row before it)
        alone = r.make_batch({k: raw[k][:, cut] for k in ("input_ids", "attention_mask", "loss_mask")})
        assert not torch.allclose(alone.features, whole.features[:, cut], atol=1e-3)
    r.train()
    assert r.step == 2 and all(torch.isfinite(p).all() for p in r.params)
    r.cleanup()


def test_a_chunked_capture_gives_the_whole_rows_features(tiny_target_cfg):
    """capture(chunk=): right-padded rows through the target a chunk at a time over a KV cache
    give the features and final states of one whole-row forward (within float rounding), with a
    chunk that does not divide the length; without a cache the later chunks would differ."""
    from specdistill.target.model import load_target

    target = load_target(tiny_target_cfg, training=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (2, 150), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 97:] = 0  # the second row is padded after 97 tokens
    whole_f, whole_h = capture(target, ids, mask, [1, 2])
    for chunk in (16, 64, 149):
        f, h = capture(target, ids, mask, [1, 2], chunk=chunk)
        real = mask.bool()
        torch.testing.assert_close(f[real], whole_f[real], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(h[real], whole_h[real], rtol=1e-4, atol=1e-5)
    alone_f, _ = capture(target, ids[:, 64:], mask[:, 64:], [1, 2])  # a chunk without the cache
    assert not torch.allclose(alone_f[0], whole_f[0, 64:], atol=1e-3)
