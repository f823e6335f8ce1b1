"""P-EAGLE (drafters/peagle.py) on tiny random targets: shapes and options, training logits equal
the decode-time single forward's (mask positions included, padded row and a cache carried over
rounds), adaptive length, the tree from per-position top-k, greedy losslessness with a briefly
trained drafter, sampling losslessness (chi-square with a wrong-rule control), a short run of the
real recipe, and the vLLM parallel-drafting export against the engine's forward rebuilt from the
files."""
from __future__ import annotations

import json

import pytest
import torch
from decode_toys import check_sampling_lossless, greedy_lossless_accepted, make_target, teach
from eagle3_engines import (
    TOY_H,
    TOY_L,
    TOY_V,
    feature_batch,
    parallel_draft,
    perturbed_drafter,
    recipe_cfg,
    tiny8_target,
    train_rows,
    twin,
)
from safetensors.torch import load_file

from specdistill.drafters.base import DecodeState, build_drafter
from specdistill.drafters.parts.anchors import dense_logits
from specdistill.drafters.parts.sampling import SamplingParams, warp
from specdistill.drafters.peagle import Peagle
from specdistill.export.folder import export_drafter, load_export
from specdistill.target.model import Target
from specdistill.train.losses import distill_loss

V, H, L = TOY_V, TOY_H, TOY_L
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny8_target()


def make(target, seed=1, **cfg) -> Peagle:
    return perturbed_drafter(target, "peagle", seed, **cfg)


make_batch = feature_batch


# -- the network ----------------------------------------------------------------------------------
def test_shapes_weights_and_bad_settings(target):
    d = make(target, ttt_length=4, draft_vocab_size=48, loss_weights=[1.0, 0.5, 0.5, 0.25])
    assert d.feature_layers == (2, 4, 5) and d.mask_token_id == V - 1 and d.supports_tree
    preds = d.forward_train(make_batch(target, d))
    assert [p.shift for p in preds] == [1, 2, 3, 4]
    assert [p.weight for p in preds] == [1.0, 0.5, 0.5, 0.25]
    assert all(dense_logits(p).shape == (2, 14, 48) for p in preds)
    s = d.state_dict()
    assert s["mask_hidden"].shape == (3 * H,) and s["fc.weight"].shape == (H, 3 * H)
    assert s["layers.0.self_attn.q_proj.weight"].shape == (H, 2 * H)  # EAGLE-3's midlayer
    decay = build_drafter({"name": "peagle", "ttt_length": 3, "mask_token_id": 5}, target)
    assert decay.mask_token_id == 5
    assert [p.weight for p in decay.forward_train(make_batch(target, decay))] == \
        pytest.approx([1, 0.8, 0.64])
    with pytest.raises(ValueError, match="mask_token_id"):
        build_drafter({"name": "peagle", "mask_token_id": V}, target)
    with pytest.raises(ValueError, match="one weight per draft position"):
        build_drafter({"name": "peagle", "ttt_length": 3, "loss_weights": [1.0]}, target)


@pytest.mark.parametrize("cfg", [{}, {"num_layers": 2, "draft_vocab_size": 48, "fc_norm": True,
                                      "norm_before_residual": True}], ids=["default", "options"])
def test_training_logits_equal_the_decode_forward(target, cfg):
    """Position j at anchor t in training == draft j of ONE decode-time forward after tokens[:t+2]
    (the masks see what they see in training), fresh and through a cache kept from a shorter
    prefix (an earlier round); the padded row included."""
    d = make(target, ttt_length=5, **cfg)
    batch = make_batch(target, d)
    with torch.no_grad():
        preds = d.forward_train(batch)
    for row, t in ((0, 2), (0, 7), (1, 3)):  # trained anchors of every j (row 1: padding from 10)
        ids, feats = batch.input_ids[row], batch.features[row]
        for earlier in (None, t - 2):
            d.reset()
            if earlier is not None:  # a round at a shorter prefix leaves its cache behind
                d.draft_logits(DecodeState(ids[:earlier + 2], feats[:earlier + 1]), 3)
            logits = d.draft_logits(DecodeState(ids[:t + 2], feats[:t + 1]), 5)  # (5, Vd)
            assert len(d.cache) == t + 1  # only the real positions stay cached
            for j in range(5):
                torch.testing.assert_close(logits[j], dense_logits(preds[j])[row, t].float(),
                                           atol=1e-4, rtol=1e-4)


def test_mask_anchors_match_the_all_anchor_logits(target):
    """mask_anchors=0.5: each row draws ceil(half its candidates) distinct anchors, each with a
    counted mask token (t+3 .. t+5), spare slots at T-1; the masks computed there alone ((A x T)
    attention) give the all-anchor logits at those anchors, hence the decode-time forward's;
    draft position 1 stays at every anchor, unchanged."""
    full = make(target, ttt_length=4)
    sub = twin(full, mask_anchors=0.5)
    batch = make_batch(target, full)
    batch.loss_mask[0, :7] = 0  # a prompt: its tokens are not scored
    with torch.no_grad():
        ref = full.forward_train(batch)
        torch.manual_seed(0)
        got = sub.forward_train(batch)
    B, T = batch.input_ids.shape
    anchors = got[1].anchors  # (B, A)
    assert got[0].anchors is None and torch.equal(got[0].logits, ref[0].logits)
    assert all(p.anchors is anchors for p in got[1:]) and got[1].logits.shape[:2] == anchors.shape
    counted = batch.loss_mask.bool() & batch.attention_mask.bool()
    for b in range(B):
        cand = {t for t in range(T) if any(counted[b, t + 1 + j] for j in (2, 3, 4) if t + 1 + j < T)}
        drawn = [t for t in anchors[b].tolist() if t != T - 1]
        assert len(drawn) == len(set(drawn)) == -(-len(cand) // 2) and set(drawn) <= cand
        assert anchors.shape[1] - len(drawn) == anchors[b].tolist().count(T - 1)
    for j in range(1, 4):  # every slot the loss reads is its anchor's all-anchor logits
        at = dense_logits(ref[j])[torch.arange(B)[:, None], anchors]  # (B, A, Vd); NaN: not trained
        ran = ~at[..., 0].isnan()  # (B, A)
        assert ran.sum() >= ran.shape[1]
        torch.testing.assert_close(got[j].logits[ran], at[ran], atol=1e-5, rtol=1e-5)
    ids, feats = batch.input_ids[0], batch.features[0]
    for t in anchors[0, :2].tolist():  # the training-time unroll == decode-time drafting
        sub.reset()
        logits = sub.draft_logits(DecodeState(ids[:t + 2], feats[:t + 1]), 4)  # (4, Vd)
        a = anchors[0].tolist().index(t)
        for j in range(1, 4):
            torch.testing.assert_close(logits[j], got[j].logits[0, a].float(), atol=1e-4, rtol=1e-4)


def test_mask_anchors_loss(target):
    """At more anchors than any row has, the sampled loss is the all-anchor loss (the loss reads
    DraftPrediction.anchors right); at a share it scores fewer mask positions and still trains."""
    full = make(target, ttt_length=4)
    every = twin(full, mask_anchors=100)
    batch = make_batch(target, full)
    batch.loss_mask[1, :5] = 0
    ref_loss, ref = distill_loss(full.forward_train(batch), batch)
    loss, parts = distill_loss(every.forward_train(batch), batch)
    torch.testing.assert_close(loss, ref_loss)
    for key in ref:
        torch.testing.assert_close(parts[key], ref[key])
    half = twin(full, mask_anchors=0.5)
    loss, parts = distill_loss(half.forward_train(batch), batch)
    loss.backward()
    assert parts["positions/s1"] == ref["positions/s1"]
    assert 0 < parts["positions/s2"] < ref["positions/s2"]
    assert half.mask_hidden.grad is not None and bool(half.mask_hidden.grad.abs().sum() > 0)
    for bad in (0, 2.5, -1):
        with pytest.raises(ValueError, match="mask_anchors"):
            build_drafter({"name": "peagle", "mask_anchors": bad}, target)


def test_propose_caps_k_and_cuts_on_confidence(target):
    d = make(target, ttt_length=4)
    batch = make_batch(target, d)
    state = DecodeState(batch.input_ids[0, :8], batch.features[0, :7])
    d.reset()
    probs = d.draft_logits(state, 4).softmax(-1)  # (4, V)
    greedy = SamplingParams()
    chain = d.propose(state, 9, greedy)  # k capped at the 4 positions trained
    assert chain.tokens.tolist() == probs.argmax(-1).tolist() and chain.probs is None
    conf = probs.max(-1).values  # (4,)
    cut = float(conf[1:].min()) + 1e-6  # the least confident later draft stops the chain there
    n = 1 + int(conf[1:].argmin())
    assert d.propose(state, 4, greedy, min_confidence=cut).tokens.tolist() == \
        probs.argmax(-1)[:n].tolist()
    sp = SamplingParams(temperature=1.0)
    sampled = d.propose(state, 4, sp, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sampled.probs, warp(probs.log(), sp))  # q per position, (4, V)


def test_tree_comes_from_the_per_position_distributions(target):
    """Every node at depth d holds one of position d's top-k tokens; the argmax chain is a path;
    the size is tree_total_tokens; a sampled tree carries the q each node was drawn from."""
    d = make(target, ttt_length=4, tree_top_k=3, tree_depth=6, tree_total_tokens=10)
    batch = make_batch(target, d)
    state = DecodeState(batch.input_ids[0, :8], batch.features[0, :7])
    d.reset()
    top = d.draft_logits(state, 4).topk(3, dim=-1).indices  # (4, 3)
    tree = d.propose_tree(state, SamplingParams())
    depth = tree.depths()
    assert len(tree.tokens) == 10 and int(depth.max()) <= 4  # depth capped at ttt_length
    for tok, dep in zip(tree.tokens.tolist(), depth.tolist()):
        assert tok in top[dep - 1].tolist()
    node = -1
    for dep in range(int(depth.max())):  # the chain of argmaxes is a path from the root
        kids = [i for i in range(len(tree.tokens)) if int(tree.parents[i]) == node
                and int(tree.tokens[i]) == int(top[dep, 0])]
        assert len(kids) == 1
        node = kids[0]
    sampled = d.propose_tree(state, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    q_tok = sampled.probs.gather(1, sampled.tokens[:, None])  # (N, 1): q of each node's own token
    assert len(sampled.tokens) == 10 and bool((q_tok > 0).all())


# -- losslessness -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def taught():
    tgt = make_target(vocab=64, seed=3, init=0.2)
    return tgt, teach(tgt, {"name": "peagle", "ttt_length": 4}, steps=100)


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_decoding_is_lossless(taught, tree):
    tgt, d = taught
    accepted = greedy_lossless_accepted(tgt, d, tree)
    assert accepted > 10  # the drafter was right often enough for acceptance to be exercised


def test_sampled_generation_has_the_target_distribution(monkeypatch):
    """One round of 2 parallel drafts at T=1: the target's joint of tokens 2 and 3 (chi-square),
    and the same test catches a wrong acceptance rule."""
    tgt = make_target(vocab=8, seed=3, init=0.2)
    torch.manual_seed(0)  # untrained: q far from p, so a wrong rule shows plainly
    check_sampling_lossless(tgt, build_drafter({"name": "peagle", "ttt_length": 2}, tgt), monkeypatch)


# -- the real recipe --------------------------------------------------------------------------------
@pytest.mark.parametrize("anchors", [None, 0.5], ids=["every_anchor", "half_the_anchors"])
def test_recipe_trains_peagle_and_loss_goes_down(tmp_path, anchors):
    from conftest import write_chats

    chats = write_chats(tmp_path / "chats.jsonl", 32, 12)
    extra = [] if anchors is None else [f"drafter.mask_anchors={anchors}"]
    rows = train_rows(recipe_cfg(tmp_path, chats, "peagle", "trainer.max_steps=30", "trainer.lr=3e-3",
                                 "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1",
                                 *extra))
    loss = {x["step"]: x["loss"] for x in rows if "loss" in x}
    first, last = sum(loss[s] for s in range(1, 5)) / 4, sum(loss[s] for s in range(27, 31)) / 4
    assert last < 0.7 * first, (first, last)
    step = [x for x in rows if "loss" in x][-1]  # all 3 draft positions scored
    assert {"div/s1", "div/s3"} <= set(step)
    if anchors is not None:  # the masks at about half the anchors the real position is scored at
        assert 0 < step["positions/s2"] < 0.75 * step["positions/s1"]


# -- export -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,cfg", [
    ("vllm", {}), ("vllm", {"draft_vocab_size": 48, "num_layers": 2}),
    ("speculators", {"draft_vocab_size": 48, "num_layers": 2, "norm_before_fc": True,
                     "norm_before_residual": True}),
    ("speculators", {"fc_norm": True, "norm_output": True})],
    ids=["vllm_full", "vllm_pruned", "speculators_pruned", "speculators_eagle31"])
def test_export_matches_the_engine_parallel_forward(target, fmt, cfg, tmp_path):
    """format=vllm / speculators, then the engine's parallel-drafting forward rebuilt from the
    files alone (eagle3_engines.parallel_draft: [real positions; k-1 masks of config
    mask_token_id and the file's mask_hidden, fused by the file's norms and fc] in ONE pass); its
    k logits == our training logits; our decoder reads the folder back to the same drafts."""
    d = make(target, ttt_length=4, mask_token_id=7, **cfg)
    folder = export_drafter(d, {"name": "peagle", "ttt_length": 4, "mask_token_id": 7, **cfg},
                            target, fmt, tmp_path / fmt, base_model="org/tiny8")["path"]
    config = json.loads((folder / "config.json").read_text())
    W = load_file(str(folder / "model.safetensors"))
    assert config["mask_token_id"] == 7 and W["mask_hidden"].numel() == 3 * H
    assert config["eagle_aux_hidden_state_layer_ids"] == list(d.feature_layers)
    if fmt == "vllm":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["parallel_drafting"]
    else:  # speculators 0.9.0: PEagleSpeculatorConfig, mask_hidden as its (1, 1, 3H) parameter
        assert config["speculators_model_type"] == "peagle" and W["mask_hidden"].shape == (1, 1, 3 * H)
        assert config["architectures"] == ["PEagleSpeculator"]
        assert config["speculators_config"]["algorithm"] == "peagle"
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    b = make_batch(target, d, B=1)
    ids = b.input_ids[0]
    with torch.no_grad():
        preds = d.forward_train(b)
        for t in (2, 4):  # anchors every draft position trains at (tokens t+2 .. t+5 real: padding from 10)
            logits = parallel_draft(fmt, config, W, target, ids, t, 4)  # (4, Vd)
            for j in range(4):
                torch.testing.assert_close(logits[j], dense_logits(preds[j])[0, t].float(),
                                           atol=2e-4, rtol=1e-4)
    back = load_export(folder, target)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    state = DecodeState(ids[:10], b.features[0, :9])
    for x in (d, back):
        x.reset()
    assert torch.equal(d.propose(state, 4, SamplingParams()).tokens,
                       back.propose(state, 4, SamplingParams()).tokens)
