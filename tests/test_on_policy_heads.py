"""On-policy distillation of draft heads (train/on_policy_heads.py, Eagle3.forward_own) on a tiny
8-layer target: the unroll drafts what the chain drafts at decode time, the target scores exactly
those drafts (not the real tokens), the loss trains towards that score, and a job runs its
on-policy phase."""
from __future__ import annotations

import pytest
import torch
from eagle3_engines import feature_batch, perturbed_drafter, tiny8_target

from specdistill.data.capture import target_logits
from specdistill.drafters.base import DecodeState, TrainBatch, build_drafter
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.train.losses import aligned, distill_loss
from specdistill.train.on_policy_heads import (
    check_on_policy_heads,
    replayed,
    score_own_drafts,
    scored_anchors,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny8_target()


@pytest.mark.parametrize("vocab", [None, 48])
def test_the_own_unroll_drafts_what_the_chain_drafts(target, vocab):
    d = perturbed_drafter(target, "eagle3", draft_vocab_size=vocab).eval()
    batch = feature_batch(target, d)
    with torch.no_grad():
        preds = d.forward_own(batch, steps=3)
    for row, t in ((0, 2), (0, 6), (1, 3)):
        ids = batch.input_ids[row]
        d.reset()
        chain = d.propose(DecodeState(ids[:t + 2], batch.features[row, :t + 1]), 3,
                          SamplingParams()).tokens  # greedy: d_1, d_2, d_3 after token t+1
        drafts = [p.logits[row, t].argmax() for p in preds]
        as_ids = [x if d.d2t is None else d.d2t[x] for x in drafts]
        assert chain.tolist() == [int(x) for x in as_ids]
        assert [int(p.inputs[row, t]) for p in preds[1:]] == chain[:2].tolist()  # fed its own


def test_the_own_steps_at_the_scored_anchors_are_the_dense_unroll_there(target):
    d = perturbed_drafter(target, "eagle3", draft_vocab_size=48).eval()
    batch = feature_batch(target, d)
    at = scored_anchors(batch, 0.5, torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = d.forward_own(batch, steps=3)
        sparse = d.forward_own(batch, steps=3, at=at)
    # step 1: its head only where its loss counts and at the scored anchors (dense: everywhere)
    assert sparse[0].scored is None and bool((sparse[0].at & at).eq(at).all())
    assert torch.equal(sparse[0].logits, dense[0].logits[sparse[0].at])
    for j in (1, 2):  # steps 2, 3 only at the anchors (layer + head), fed the same own drafts
        assert torch.equal(sparse[j].scored, at)
        torch.testing.assert_close(sparse[j].logits, dense[j].logits[at])
        assert torch.equal(sparse[j].inputs[at], dense[j].inputs[at])


@pytest.mark.parametrize("share,rows", [(1.0, None), (0.5, 1)])
def test_the_target_scores_the_drafts_not_the_real_tokens(target, share, rows):
    d = perturbed_drafter(target, "eagle3", draft_vocab_size=48).eval()
    batch = feature_batch(target, d)
    at = scored_anchors(batch, share, torch.Generator().manual_seed(3), rows)
    with torch.no_grad():
        preds = d.forward_own(batch, steps=3, at=at)
    scored = score_own_drafts(target, batch, preds, d2t=d.d2t, autocast_dtype=None)
    anchors = at.nonzero().tolist()  # row-major: the order of the logits and teachers
    assert scored == 2 * (len(anchors) - len(replays(batch, preds, anchors)))
    if rows is None:
        assert len(anchors) == 12 + 8  # every anchor with t + 2 real: rows of 14 / 10
    else:  # one row, half of its anchors: the prefix it scores ends at its last anchor
        assert len({r for r, _ in anchors}) == 1 and 0 < len(anchors) < 12
    differs = 0
    for i, (row, t) in enumerate(anchors):
        d1, d2 = (int(preds[j].inputs[row, t]) for j in (1, 2))
        ids = torch.cat([batch.input_ids[row, :t + 2], torch.tensor([d1, d2])])[None]
        fresh = target_logits(target, target.forward(ids, layers=(-1,), logits=False).features,
                              d.d2t)[0]  # the target after the real text up to t+1, then d1, d2
        torch.testing.assert_close(preds[1].teacher[i], fresh[-2], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(preds[2].teacher[i], fresh[-1], atol=1e-4, rtol=1e-4)
        real = batch.input_ids[row, t + 2]  # teacher forcing would score after the real token
        differs += int(d1 != real)
        if d1 != real:
            forced = target_logits(target, target.forward(batch.input_ids[row:row + 1, :t + 3],
                                                          layers=(-1,), logits=False).features,
                                   d.d2t)[0, -1]
            assert not torch.allclose(preds[1].teacher[i], forced, atol=1e-3)
    assert differs > 0  # the check above ran


def replays(batch, preds, anchors) -> list[tuple[int, int]]:
    """The anchors whose drafts d_1, d_2 are the real tokens t+2, t+3, with token t+4 real too."""
    n = batch.attention_mask.sum(-1)
    return [(r, t) for r, t in anchors if t + 4 < n[r] and all(
        int(preds[j].inputs[r, t]) == int(batch.input_ids[r, t + 1 + j]) for j in (1, 2))]


def with_ids(target, d, ids, attn):
    out = target.forward(ids, layers=d.feature_layers, attention_mask=attn)
    return TrainBatch(ids, attn, attn.clone(), out.logits, out.features)


@pytest.mark.parametrize("vocab", [None, 48])
def test_drafts_that_are_the_real_tokens_take_the_batch_teacher_without_a_forward(target, vocab):
    """Where an anchor's drafts all equal the real tokens after it, the target's verdict on them is
    the batch's teacher there: it is reused (no forward over those drafts), and every teacher
    still equals the target's fresh forward over the real text + the drafts."""
    d = perturbed_drafter(target, "eagle3", draft_vocab_size=vocab).eval()
    batch = feature_batch(target, d)
    ids, attn = batch.input_ids.clone(), batch.attention_mask
    forced = [(0, 1), (0, 5), (1, 2)]  # rewrite tokens t+2, t+3 to the drafts at t (ascending t)
    for r, t in forced:
        with torch.no_grad():
            own = d.forward_own(with_ids(target, d, ids, attn), steps=3)
        ids[r, t + 2], ids[r, t + 3] = own[1].inputs[r, t], own[2].inputs[r, t]
    batch = with_ids(target, d, ids, attn)
    at = scored_anchors(batch, 1.0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        preds = d.forward_own(batch, steps=3, at=at)
    anchors = at.nonzero().tolist()
    again = replays(batch, preds, anchors)
    assert set(forced) <= set(again) and len(again) < len(anchors)
    scored = score_own_drafts(target, batch, preds, d2t=d.d2t, autocast_dtype=None)
    assert scored == 2 * (len(anchors) - len(again))  # the replayed anchors cost no forward
    for i, (r, t) in enumerate(anchors):
        d1, d2 = (int(preds[j].inputs[r, t]) for j in (1, 2))
        row = torch.cat([batch.input_ids[r, :t + 2], torch.tensor([d1, d2])])[None]
        fresh = target.forward(row, layers=(-1,), logits=False).features
        fresh = target_logits(target, fresh, d.d2t)[0]
        torch.testing.assert_close(preds[1].teacher[i], fresh[-2], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(preds[2].teacher[i], fresh[-1], atol=1e-4, rtol=1e-4)


def test_an_anchor_replays_only_where_every_draft_is_real_and_the_batch_has_its_teacher():
    T = 8
    ids = torch.arange(T)[None]
    ones = torch.ones(1, T, dtype=torch.long)
    drafted = torch.stack([ids + 2, ids + 3], -1)  # d_1, d_2 at t: the real tokens t+2, t+3
    drafted[0, 1, 1] = 99  # anchor 1: d_2 is wrong
    loss = ones.clone()
    loss[0, 6] = 0  # token 6 is not trained: no teacher at position 5
    batch = TrainBatch(ids, ones, loss, torch.empty(0))
    at = torch.ones(1, T, dtype=torch.bool)
    at[0, 3] = False  # not a scored anchor
    # t needs teachers at t+2 and t+3 (tokens t+3, t+4 trained and inside the row): t <= 3, and
    # not t = 2, 3 (position 5); so 0 alone (1: a wrong draft, 3: not scored)
    assert replayed(batch, drafted, at)[0].tolist() == [True] + [False] * 7
    for short in (1, 2, 3):  # rows too short for any replay, and no error
        assert not replayed(TrainBatch(ids[:, :short], ones[:, :short], ones[:, :short],
                                       torch.empty(0)), drafted[:, :short], at[:, :short]).any()


def test_the_loss_trains_the_own_steps_towards_the_score(target):
    d = perturbed_drafter(target, "eagle3", draft_vocab_size=48)
    batch = feature_batch(target, d)
    batch.target_logits = target_logits(target, target.forward(
        batch.input_ids, layers=(-1,), logits=False).features, d.d2t)
    at = scored_anchors(batch, 0.5, torch.Generator().manual_seed(0))
    preds = d.forward_own(batch, steps=2, at=at)
    with pytest.raises(ValueError, match="not scored"):  # the loss never guesses a teacher
        distill_loss(preds, batch)
    score_own_drafts(target, batch, preds, d2t=d.d2t, autocast_dtype=None)
    draft, teacher, _, _ = aligned(preds[1], batch)
    assert 0 < len(draft) <= at.sum()  # the scored anchors (loss mask permitting)
    b, t = at.nonzero(as_tuple=True)
    last = (t + 3 >= batch.attention_mask.sum(-1)[b])  # token t+3 past the row: not counted
    assert len(draft) == int((~last).sum())
    torch.testing.assert_close(teacher, preds[1].teacher[~last])
    torch.testing.assert_close(draft, preds[1].logits[~last])
    loss, parts = distill_loss(preds, batch)
    loss.backward()
    assert "div/s2" in parts and d.fc.weight.grad is not None


def test_a_batch_without_scored_anchors_trains_step_one_only(target):
    d = perturbed_drafter(target, "eagle3", draft_vocab_size=48)
    batch = feature_batch(target, d)
    batch.target_logits = target_logits(target, target.forward(
        batch.input_ids, layers=(-1,), logits=False).features, d.d2t)
    none = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    preds = d.forward_own(batch, steps=2, at=none)
    assert score_own_drafts(target, batch, preds, d2t=d.d2t, autocast_dtype=None) == 0
    loss, parts = distill_loss(preds, batch)
    loss.backward()
    assert torch.isfinite(loss) and parts["positions/s2"] == 0 and parts["positions/s1"] > 0


def test_drafters_without_own_steps_are_refused(target):
    from types import SimpleNamespace

    cfg = SimpleNamespace(on_policy_heads_start=0.5)
    for name in ("peagle", "medusa"):
        with pytest.raises(ValueError, match="on_policy_heads_start"):
            check_on_policy_heads(cfg, build_drafter({"name": name}, target))
    check_on_policy_heads(cfg, build_drafter({"name": "eagle3"}, target))


def test_a_job_runs_its_on_policy_phase(tmp_path):
    import json

    from conftest import write_chats
    from test_train import make_cfg, run

    chats = write_chats(tmp_path / "chats.jsonl", 24, 10)
    cfg = make_cfg(tmp_path, chats, "drafter=eagle3", "drafter.draft_vocab_size=256",
                   "drafter.ttt_length=1", "trainer.max_steps=4", "trainer.log_every=1",
                   "trainer.on_policy_heads_start=0.5", "trainer.eval_every=0",
                   "trainer.save_every=0")
    run(cfg)
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in x]
    assert [r.get("scored", 0) > 0 for r in rows] == [False, False, True, True]
    assert all("div/s2" in r for r in rows[2:]) and "div/s2" not in rows[0]


def test_a_run_branches_into_a_later_phase_before_its_phase_began(tmp_path):
    """resume=true may move trainer.on_policy_heads_start while every step so far was teacher-forced
    under both settings (a phase-length study branches one run there); once the phase has run it
    is refused, naming the key."""
    import json
    import shutil

    from conftest import write_chats
    from test_train import make_cfg, run

    from specdistill.cli.errors import UserError

    chats = write_chats(tmp_path / "chats.jsonl", 24, 10)
    common = ["drafter=eagle3", "drafter.draft_vocab_size=256", "drafter.ttt_length=1",
              "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=0",
              "trainer.save_every=2", "trainer.keep_last=3"]
    run(make_cfg(tmp_path, chats, *common, "trainer.on_policy_heads_start=0.5"))  # on-policy: steps 3, 4
    branch = tmp_path / "branch"
    shutil.copytree(tmp_path / "run", branch)
    shutil.rmtree(branch / "checkpoints" / "step-0000004")  # step 2: steps 1-2 teacher-forced
    later = [*common, f"run_dir={branch}", "resume=true", "trainer.on_policy_heads_start=0.75"]
    run(make_cfg(tmp_path, chats, *later))
    rows = [json.loads(x) for x in open(branch / "metrics.jsonl") if '"loss"' in x]
    assert [(r["step"], r.get("scored", 0) > 0) for r in rows[-2:]] == [(3, False), (4, True)]
    with pytest.raises(UserError, match=r"trainer.on_policy_heads_start: 0.5 -> 0.75"):
        run(make_cfg(tmp_path, chats, *common, "resume=true", "trainer.on_policy_heads_start=0.75"))


def test_windows_are_refused_with_on_policy_heads(target):
    """trainer.window with the on-policy heads: the target would score a window's drafts without
    the row before it, so the pair is refused naming both settings."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(on_policy_heads_start=0.5, window=1024)
    with pytest.raises(ValueError, match=r"trainer.window=1024 with trainer.on_policy_heads_start"):
        check_on_policy_heads(cfg, build_drafter({"name": "eagle3"}, target))
    check_on_policy_heads(SimpleNamespace(on_policy_heads_start=None, window=1024),
                          build_drafter({"name": "eagle3"}, target))
