"""DFlash (drafters/dflash.py) on tiny random targets: shapes and options, what a block may see
(the features before its anchor, never at or after it), training logits equal the decode-time
single forward's (drawn anchors, a padded row, a cache carried over rounds), adaptive length and
the k cap, the tree from per-position top-k, greedy losslessness with a briefly trained drafter,
sampling losslessness (chi-square with a wrong-rule control), a short run of the real recipe, and
the speculators export against speculators' DFlash forward rebuilt from the files (plus, in
tests/test_eagle3.py, loaded by the speculators release itself)."""
from __future__ import annotations

import itertools
import json
import logging
import math

import pytest
import torch
from decode_toys import check_sampling_lossless, greedy_lossless_accepted, make_target, teach
from eagle3_engines import (
    TOY_H,
    TOY_L,
    TOY_V,
    dflash_block,
    feature_batch,
    perturbed_drafter,
    recipe_cfg,
    tiny8_target,
    train_rows,
    twin,
)
from safetensors.torch import load_file

from specdistill.drafters.base import DecodeState, TrainBatch, build_drafter
from specdistill.drafters.dflash import DFlash
from specdistill.drafters.parts.anchors import dense_logits
from specdistill.drafters.parts.sampling import SamplingParams, warp
from specdistill.export.folder import export_drafter, load_export
from specdistill.target.model import Target
from specdistill.train.losses import distill_loss

V, H, L = TOY_V, TOY_H, TOY_L
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny8_target()


def make(target, seed=1, **cfg) -> DFlash:
    return perturbed_drafter(target, "dflash", seed, **cfg)


def state_at(batch, row: int, t: int) -> DecodeState:
    """What the decoder shows after committing tokens[: t+1] (features of tokens[: t])."""
    return DecodeState(batch.input_ids[row, :t + 1], batch.features[row, :t])


# -- the network ----------------------------------------------------------------------------------
def test_shapes_weights_and_bad_settings(target):
    d = make(target, block_size=5, draft_vocab_size=48)
    assert d.feature_layers == (2, 4, 5) and d.mask_token_id == V - 1 and d.supports_tree
    preds = d.forward_train(feature_batch(target, d))
    assert [p.shift for p in preds] == [0, 1, 2, 3]  # slot i predicts token anchor + i
    assert [p.weight for p in preds] == pytest.approx([math.exp(-i / 4) for i in range(4)])
    assert all(dense_logits(p).shape == (2, 14, 48) and p.anchors is None for p in preds)
    s = d.state_dict()
    assert s["fc.weight"].shape == (H, 3 * H) and s["hidden_norm.weight"].shape == (H,)
    assert s["layers.0.self_attn.q_norm.weight"].shape == (H // 4,)  # per head
    assert not any("embed" in k for k in s)  # the target's embedding, never the drafter's
    w = build_drafter({"name": "dflash", "block_size": 3, "loss_weights": [1.0, 0.25]}, target)
    assert [p.weight for p in w.forward_train(feature_batch(target, w))] == [1.0, 0.25]
    bad = [({"mask_token_id": V}, "mask_token_id"), ({"block_size": 1}, "block_size"),
           ({"block_size": 3, "loss_weights": [1.0]}, "one weight per draft"),
           ({"aux_layers": [2, 99]}, "aux_layers"), ({"anchors": 2.5}, "anchors"),
           ({"anchors": 0}, "anchors")]
    for cfg, says in bad:
        with pytest.raises(ValueError, match=says):
            build_drafter({"name": "dflash", **cfg}, target)


def test_a_block_sees_only_the_features_before_its_anchor(target):
    """Changing the features at or after anchor t leaves its drafts as they are; changing the
    one at t-1 changes them. Padding is never seen either."""
    d = make(target, block_size=4)
    batch = feature_batch(target, d, B=1)
    t = 6
    with torch.no_grad():
        ref = d.forward_train(batch)
        later = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                           batch.target_logits, batch.features.clone())
        later.features[0, t:] += 5.0
        same = d.forward_train(later)
        earlier = TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                             batch.target_logits, batch.features.clone())
        earlier.features[0, t - 1] += 5.0
        moved = d.forward_train(earlier)
    for r, s, m in zip(ref, same, moved):
        torch.testing.assert_close(s.logits[0, t], r.logits[0, t])
        assert not torch.allclose(m.logits[0, t], r.logits[0, t], atol=1e-3)
    padded = feature_batch(target, d)  # row 1: padding from position 10
    padded.features = padded.features.clone()
    with torch.no_grad():
        a = d.forward_train(padded)
        padded.features[1, 10:] += 5.0
        b = d.forward_train(padded)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.logits[1, :10], y.logits[1, :10])


@pytest.mark.parametrize("cfg", [{}, {"num_layers": 2, "draft_vocab_size": 48, "block_size": 6}],
                         ids=["default", "two_layers_pruned"])
def test_training_logits_equal_the_decode_forward(target, cfg):
    """Slot i at anchor t in training == draft i of ONE decode-time forward after tokens[:t+1],
    fresh and through a cache kept from a shorter prefix (an earlier round); the padded row too."""
    d = make(target, **cfg)
    batch = feature_batch(target, d)
    b = d.cfg.block_size
    with torch.no_grad():
        preds = d.forward_train(batch)
    for row, t in ((0, 1), (0, 8), (1, 5)):
        for earlier in (None, t - 1):
            d.reset()
            if earlier:  # a round at a shorter prefix leaves its cache behind
                d.draft_logits(state_at(batch, row, earlier), 2)
            logits = d.draft_logits(state_at(batch, row, t), b - 1)  # (b-1, Vd)
            assert len(d.cache) == t  # only the context stays cached, never the block
            for i in range(b - 1):
                torch.testing.assert_close(logits[i], dense_logits(preds[i])[row, t].float(),
                                           atol=1e-4, rtol=1e-4)


def test_blocks_in_chunks_give_the_same_logits_and_gradients(target, monkeypatch):
    """Attended 3 blocks at a time, the loss and every gradient equal the one-chunk computation's."""
    import specdistill.drafters.parts.attention as attention

    d = make(target, block_size=4, num_layers=2)
    batch = feature_batch(target, d)
    results = []
    for per_chunk in (10 ** 9, 3):
        monkeypatch.setattr(attention, "blocks_per_chunk", lambda T, b, n=per_chunk: n)
        d.zero_grad()
        loss, _ = distill_loss(d.forward_train(batch), batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in d.named_parameters()
                                        if p.grad is not None}))
    (one, g1), (chunked, g2) = results
    torch.testing.assert_close(chunked, one)
    assert g1.keys() == g2.keys() and len(g1) > 10
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], atol=1e-6, rtol=1e-5)


def test_block_attention_is_each_blocks_softmax_over_its_context_and_itself():
    """Against a plain per-block softmax: block a's queries see the context where seen[a] says and
    the b keys of their own block, nothing else (outputs and the gradients of every input)."""
    from specdistill.drafters.parts.attention import block_attention

    B, h, kv, d, A, b, T = 2, 4, 2, 8, 5, 3, 32  # blocks_per_chunk: all 5 blocks in one call
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, A * b, d, generator=g, requires_grad=True) for n in (h, kv, kv))
    ck, cv = (torch.randn(B, kv, T, d, generator=g, requires_grad=True) for _ in range(2))
    seen = torch.rand(B, A, T, generator=g) < 0.6
    seen[0, 0] = False  # a block at anchor 0 sees no context: its own keys only

    def reference():
        out = torch.empty(B, h, A * b, d)
        for r, a, head in itertools.product(range(B), range(A), range(h)):
            rows, j = slice(a * b, (a + 1) * b), head // (h // kv)
            keys = torch.cat([ck[r, j][seen[r, a]], k[r, j, rows]])
            vals = torch.cat([cv[r, j][seen[r, a]], v[r, j, rows]])
            p = (q[r, head, rows] @ keys.T * d ** -0.5).softmax(-1)
            out[r, head, rows] = p @ vals
        return out

    got, want = block_attention(q, k, v, ck, cv, seen, b), reference()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = [torch.autograd.grad(x.pow(2).sum(), (q, k, v, ck, cv)) for x in (got, want)]
    for a_, b_ in zip(*grads):
        torch.testing.assert_close(a_, b_, atol=1e-5, rtol=1e-5)


def test_drawn_anchors_match_the_all_anchor_logits_and_train(target):
    """anchors=0.5: ceil(half of each row's candidates) distinct anchors (a scored token in the
    block), spare slots at T-1; their logits are the all-anchor logits there; the loss at more
    anchors than any row has equals the all-anchor loss; at a share it scores fewer and trains."""
    full = make(target, block_size=4)
    half, every = twin(full, anchors=0.5), twin(full, anchors=100)
    batch = feature_batch(target, full)
    batch.loss_mask[0, :7] = 0  # a prompt: its tokens are not scored
    with torch.no_grad():
        ref = full.forward_train(batch)
        torch.manual_seed(0)
        got = half.forward_train(batch)
    B, T = batch.input_ids.shape
    anchors = got[0].anchors  # (B, A)
    assert all(p.anchors is anchors for p in got)
    counted = batch.loss_mask.bool() & batch.attention_mask.bool()
    for row in range(B):
        cand = {t for t in range(T) if any(counted[row, t + j] for j in (1, 2, 3) if t + j < T)}
        drawn = [t for t in anchors[row].tolist() if t != T - 1]
        assert len(drawn) == len(set(drawn)) == -(-len(cand) // 2) and set(drawn) <= cand
    for i in range(3):
        at = ref[i].logits[torch.arange(B)[:, None], anchors]  # (B, A, Vd)
        torch.testing.assert_close(got[i].logits, at, atol=1e-5, rtol=1e-5)
    ref_loss, ref_parts = distill_loss(ref, batch)
    loss, parts = distill_loss(every.forward_train(batch), batch)
    torch.testing.assert_close(loss, ref_loss)
    loss, parts = distill_loss(half.forward_train(batch), batch)
    loss.backward()
    assert 0 < parts["positions/s0"] < ref_parts["positions/s0"]
    assert half.fc.weight.grad is not None and bool(half.fc.weight.grad.abs().sum() > 0)


def test_propose_caps_k_and_cuts_on_confidence(target, caplog):
    d = make(target, block_size=5)
    batch = feature_batch(target, d)
    state = state_at(batch, 0, 7)
    d.reset()
    probs = d.draft_logits(state, 4).softmax(-1)  # (4, V)
    greedy = SamplingParams()
    with caplog.at_level(logging.WARNING):
        chain = d.propose(state, 9, greedy)  # k capped at block_size - 1 drafts
        d.propose(state, 9, greedy)
    assert chain.tokens.tolist() == probs.argmax(-1).tolist() and chain.probs is None
    assert sum("only 4 draft positions" in r.message for r in caplog.records) == 1  # said once
    conf = probs.max(-1).values  # (4,)
    cut = float(conf[1:].min()) + 1e-6  # the least confident later draft stops the chain there
    n = 1 + int(conf[1:].argmin())
    assert d.propose(state, 4, greedy, min_confidence=cut).tokens.tolist() == \
        probs.argmax(-1)[:n].tolist()
    sp = SamplingParams(temperature=1.0)
    sampled = d.propose(state, 4, sp, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sampled.probs, warp(probs.log(), sp))  # q per position, (4, V)


def test_tree_comes_from_the_per_position_distributions(target):
    d = make(target, block_size=4, tree_top_k=3, tree_depth=6, tree_total_tokens=10)
    state = state_at(feature_batch(target, d), 0, 7)
    d.reset()
    top = d.draft_logits(state, 3).topk(3, dim=-1).indices  # (3, 3)
    tree = d.propose_tree(state, SamplingParams())
    depth = tree.depths()
    assert len(tree.tokens) == 10 and int(depth.max()) == 3  # depth capped at block_size - 1
    for tok, dep in zip(tree.tokens.tolist(), depth.tolist()):
        assert tok in top[dep - 1].tolist()


# -- losslessness -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def taught():
    tgt = make_target(vocab=64, seed=3, init=0.2)
    return tgt, teach(tgt, {"name": "dflash", "block_size": 5})


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_decoding_is_lossless(taught, tree):
    tgt, d = taught
    assert greedy_lossless_accepted(tgt, d, tree) > 10  # acceptance exercised, outputs identical


def test_sampled_generation_has_the_target_distribution(monkeypatch):
    """One round of 2 block drafts at T=1: the target's joint of tokens 2 and 3 (chi-square), and
    the same test catches a wrong acceptance rule."""
    tgt = make_target(vocab=8, seed=3, init=0.2)
    torch.manual_seed(0)  # untrained: q far from p, so a wrong rule shows plainly
    check_sampling_lossless(tgt, build_drafter({"name": "dflash", "block_size": 3}, tgt), monkeypatch)


# -- the real recipe --------------------------------------------------------------------------------
def test_recipe_trains_dflash_and_loss_goes_down(tmp_path):
    from conftest import write_chats

    chats = write_chats(tmp_path / "chats.jsonl", 32, 12)
    cfg = recipe_cfg(tmp_path, chats, "dflash", "trainer.max_steps=30", "trainer.lr=3e-3",
                     "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1")
    rows = train_rows(cfg)
    loss = {x["step"]: x["loss"] for x in rows if "loss" in x}
    first, last = sum(loss[s] for s in range(1, 5)) / 4, sum(loss[s] for s in range(27, 31)) / 4
    assert last < 0.7 * first, (first, last)
    step = [x for x in rows if "loss" in x][-1]
    assert {"div/s0", "div/s2", "top1/s0"} <= set(step)  # all 3 drafts of the block scored


# -- export -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,cfg", [
    ("speculators", {}), ("speculators", {"draft_vocab_size": 48, "num_layers": 2, "block_size": 5}),
    ("vllm", {}), ("vllm", {"draft_vocab_size": 48, "num_layers": 2, "block_size": 5})],
    ids=["speculators_full", "speculators_pruned_2layers", "vllm_full", "vllm_pruned_2layers"])
def test_export_matches_the_engine_block_forward(target, fmt, cfg, tmp_path):
    """format=speculators / vllm: the config fields each engine reads, and its DFlash forward
    rebuilt from the files alone (eagle3_engines.dflash_block) == our drafts at anchors inside and
    at the start of the sequence; our decoder reads the folder back to the same drafts."""
    d = make(target, mask_token_id=7, **cfg)
    full = {"name": "dflash", "mask_token_id": 7, **cfg}
    folder = export_drafter(d, full, target, fmt, tmp_path / "x", base_model="org/tiny8")["path"]
    config = json.loads((folder / "config.json").read_text())
    W = load_file(str(folder / "model.safetensors"))
    b, ids = d.cfg.block_size, list(d.feature_layers)
    vd = cfg.get("draft_vocab_size") or V
    assert config["block_size"] == b and ("d2t" in W) == (vd < V)
    if fmt == "speculators":  # DFlashSpeculatorConfig
        assert config["speculators_model_type"] == "dflash" and config["mask_token_id"] == 7
        assert config["architectures"] == ["DFlashSpeculator"] and config["sample_from_anchor"] is False
        assert config["aux_hidden_state_layer_ids"] == ids
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == b - 1
        assert config["transformer_layer_config"]["model_type"] == "qwen3"
        assert W["embed_tokens.weight"].shape == (V, H) and W["lm_head.weight"].shape[0] == vd
    else:  # vLLM's DFlashDraftModel: eagle ids first, z-lab's target_layer_ids = ours - 1
        assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
        assert config["eagle_aux_hidden_state_layer_ids"] == ids
        assert config["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [i - 1 for i in ids]}
        assert "embed_tokens.weight" not in W and ("lm_head.weight" in W) == (vd < V)
    batch = feature_batch(target, d, B=1)
    with torch.no_grad():
        preds = d.forward_train(batch)
        for t in (0, 4, 9):
            logits = dflash_block(config, W, target, batch.input_ids[0], t)  # (b, Vd)
            for i in range(1, b):
                torch.testing.assert_close(logits[i], dense_logits(preds[i - 1])[0, t].float(),
                                           atol=2e-4, rtol=1e-4)
    back = load_export(folder, target)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    for x in (d, back):
        x.reset()
    state = state_at(batch, 0, 9)
    assert torch.equal(d.propose(state, 4, SamplingParams()).tokens,
                       back.propose(state, 4, SamplingParams()).tokens)
