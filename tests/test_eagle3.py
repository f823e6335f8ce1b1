"""EAGLE-3 (drafters/eagle3.py) on tiny random targets: shapes and aux layers, the training-time
test equals decode-time draft steps through the drafter's KV cache, greedy losslessness (chain and
tree), a short run through the real recipe with online and offline capture of three layers, and
the engine exports: each layout is read back by a forward rebuilt from the exported files the way
the engine computes it (its aux-layer ids and capture rule included) and by our own decoder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from decode_toys import greedy_lossless_accepted, make_target
from eagle3_engines import (
    TOY_H,
    TOY_L,
    TOY_V,
    engine_chain,
    engine_name,
    feature_batch,
    perturbed_drafter,
    tiny8_target,
    train_rows,
)
from eagle3_engines import recipe_cfg as eagle3_recipe_cfg
from safetensors.torch import load_file

from specdistill.decode.evaluate import is_near_tie
from specdistill.decode.spec import generate
from specdistill.drafters import eagle3 as e3
from specdistill.drafters.base import DecodeState, TrainBatch, build_drafter, config_dict
from specdistill.drafters.parts.anchors import dense_logits
from specdistill.drafters.parts.head import fit_draft_vocab
from specdistill.drafters.parts.layers import default_aux_layers
from specdistill.drafters.parts.layouts import ExportError
from specdistill.export.folder import export_drafter, load_export
from specdistill.target.model import Target
from specdistill.train.losses import distill_loss

V, H, L = TOY_V, TOY_H, TOY_L  # an 8-layer target: the engines' default aux layers (2, 4, 5) exist


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny8_target()


make_batch = feature_batch


def make(target, seed=1, **cfg) -> e3.Eagle3:
    return perturbed_drafter(target, "eagle3", seed, **cfg)


ALL_OPTIONS = dict(num_layers=2, norm_before_residual=True, norm_before_fc=True, fc_norm=True,
                   norm_output=True, draft_vocab_size=48)


# -- the network ----------------------------------------------------------------------------------
def test_shapes_names_and_aux_layers(target):
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2: inputs of layers 2, 15, 27
    d = make(target, ttt_length=4, draft_vocab_size=48)
    assert d.feature_layers == (2, 4, 5)
    preds = d.forward_train(make_batch(target, d))
    assert [p.shift for p in preds] == [1, 2, 3, 4] and all(p.features is None for p in preds)
    assert [p.weight for p in preds] == pytest.approx([1, 0.8, 0.64, 0.512])
    assert all(dense_logits(p).shape == (2, 14, 48) for p in preds)
    s = d.state_dict()
    assert s["fc.weight"].shape == (H, 3 * H) and s["lm_head.weight"].shape == (48, H)
    assert s["layers.0.self_attn.q_proj.weight"].shape == (H, 2 * H)  # over [embed; feature]
    assert s["layers.0.self_attn.k_proj.weight"].shape == (H // 2, 2 * H)  # 2 KV heads
    assert "layers.0.hidden_norm.weight" in s and "norm.weight" in s
    two = make(target, num_layers=2, aux_layers=[1, 3, 7])
    assert "layers.1.hidden_norm.weight" not in two.state_dict()  # later layers are plain Llama
    assert two.state_dict()["layers.1.self_attn.q_proj.weight"].shape == (H, H)
    for bad in ([1, 2], [1, 2, L + 1], [-1, 2, 3]):
        with pytest.raises(ValueError, match="aux_layers"):
            build_drafter({"name": "eagle3", "aux_layers": bad}, target)


@pytest.mark.parametrize("own", [1, 2], ids=["step2", "step3"])
def test_ttt_attention_is_each_anchors_softmax_over_step_one_and_its_own_keys(own):
    """Against a plain per-anchor softmax: at step own+1 the query of anchor a sees step 1's keys
    where causal[a] says and steps 2..own+1's keys at anchor a only (outputs and the gradient of
    every input), with the anchors in several chunks (blocks_per_chunk: 32 // (2 * own) a chunk)."""
    import itertools

    from specdistill.drafters.parts.attention import blocks_per_chunk, ttt_attention

    B, h, kv, d, Q, T = 2, 4, 2, 8, 21, 32
    assert blocks_per_chunk(T, own) < Q  # chunked
    g = torch.Generator().manual_seed(own)
    k0, v0 = (torch.randn(B, kv, T, d, generator=g, requires_grad=True) for _ in range(2))
    steps_kv = [tuple(torch.randn(B, kv, Q, d, generator=g, requires_grad=True) for _ in range(2))
                for _ in range(own)]
    q = torch.randn(B, h, Q, d, generator=g, requires_grad=True)
    causal = torch.rand(B, 1, Q, T, generator=g) < 0.5
    causal[0, 0, 3] = False  # an anchor that sees none of step 1's keys: its own keys only
    inputs = (q, k0, v0, *itertools.chain(*steps_kv))

    def reference():
        out = torch.empty(B, h, Q, d)
        for r, a, head in itertools.product(range(B), range(Q), range(h)):
            j = head // (h // kv)
            keys = torch.cat([k0[r, j][causal[r, 0, a]], *(kj[r, j, a:a + 1] for kj, _ in steps_kv)])
            vals = torch.cat([v0[r, j][causal[r, 0, a]], *(vj[r, j, a:a + 1] for _, vj in steps_kv)])
            out[r, head, a] = (q[r, head, a] @ keys.T * d ** -0.5).softmax(-1) @ vals
        return out

    store = [(k0, v0), *steps_kv[:-1]]  # what the earlier steps appended
    got, want = ttt_attention(q, *steps_kv[-1], store, causal), reference()
    assert len(store) == own + 1  # this step's keys appended
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = [torch.autograd.grad(x.pow(2).sum(), inputs) for x in (got, want)]
    for a_, b_ in zip(*grads):
        torch.testing.assert_close(a_, b_, atol=1e-5, rtol=1e-5)


def test_init_from_target_layer(target):
    d = build_drafter({"name": "eagle3", "init_from_target_layer": -1, "num_layers": 2}, target)
    src0, src1 = (target.model.model.layers[i].state_dict() for i in (L - 2, L - 1))
    q = d.layers[0].self_attn.q_proj.weight  # (h*d, 2H): the target's q in both halves
    assert torch.equal(q[:, :H], src0["self_attn.q_proj.weight"]) and torch.equal(q[:, H:], q[:, :H])
    assert torch.equal(d.layers[0].hidden_norm.weight, src0["input_layernorm.weight"])
    assert all(torch.equal(v, src1[k]) for k, v in d.layers[1].state_dict().items())
    with pytest.raises(ValueError, match="too few target layers"):
        build_drafter({"name": "eagle3", "init_from_target_layer": 0, "num_layers": 2}, target)


@pytest.mark.parametrize("cfg", [{}, ALL_OPTIONS], ids=["default", "all_options"])
def test_training_unroll_equals_decode_steps(target, cfg):
    """Step j of the training-time test at anchor t == the j-th decode-time draft step after t
    through the drafter's KV cache, fed the true tokens (padded row included)."""
    d = make(target, ttt_length=5, **cfg)
    batch = make_batch(target, d)
    with torch.no_grad():
        preds = d.forward_train(batch)
    for row, t in ((0, 2), (0, 7), (1, 4)):  # row 1 is padded after position 9
        ids = batch.input_ids[row]
        d.reset()
        h = d.drafting.sync(DecodeState(ids[:t + 2], batch.features[row, :t + 1]))  # (1, 1, H)
        torch.testing.assert_close(d.head(h)[0, 0], dense_logits(preds[0])[row, t], atol=1e-4, rtol=1e-4)
        for j in range(2, 6 if row == 0 else 5):
            h = d.backbone(d.inputs(ids[t + j].view(1, 1), h), torch.tensor([[t + j - 1]]), None,
                           d.cache.kv)
            torch.testing.assert_close(d.head(h)[0, 0], dense_logits(preds[j - 1])[row, t], atol=1e-4,
                                       rtol=1e-4)


# -- losslessness -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def taught():
    """A float64 toy target and an eagle3 drafter trained briefly on the target's own greedy text,
    so that decoding accepts some drafts (a random drafter would be trivially lossless)."""
    tgt = make_target(vocab=64, seed=3, init=0.2)
    torch.manual_seed(0)
    d = build_drafter({"name": "eagle3", "ttt_length": 3}, tgt)
    prompts = torch.randint(0, 64, (8, 4), generator=torch.Generator().manual_seed(1))
    ids = torch.stack([generate(tgt, None, p, max_new_tokens=28).tokens for p in prompts])
    ids = torch.cat([prompts, ids], 1)  # (8, 32)
    out = tgt.forward(ids, layers=d.feature_layers)
    ones = torch.ones_like(ids)
    batch = TrainBatch(ids, ones, ones, out.logits.float(), out.features.float())
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(60):
        loss, _ = distill_loss(d.forward_train(batch), batch, "forward_kl")
        opt.zero_grad()
        loss.backward()
        opt.step()
    return tgt, d


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_decoding_is_lossless(taught, tree):
    tgt, d = taught
    accepted = greedy_lossless_accepted(tgt, d, tree)
    assert accepted > 10  # the drafter was right often enough for acceptance to be exercised


@pytest.mark.parametrize("tree", [False, True])
def test_decodes_a_bf16_target_with_float32_weights(taught, tree):
    """target.dtype auto is bf16 on CPUs with native bf16: the drafter keeps float32 weights and
    reads bf16 features, embeddings and LM head (cast as eagle does); greedy output stays the
    bf16 target's own, and drafts are still accepted."""
    import copy

    tgt64, d64 = taught
    tgt = copy.copy(tgt64)
    tgt.model = copy.deepcopy(tgt64.model).to(torch.bfloat16)
    d = build_drafter(config_dict(d64.cfg), tgt)
    d.load_state_dict({k: v.float() if v.is_floating_point() else v
                       for k, v in d64.state_dict().items()})
    assert tgt.dtype == torch.bfloat16 and {p.dtype for p in d.parameters()} == {torch.float32}
    accepted, exact = 0, 0
    for seed in range(4):
        prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(100 + seed))
        plain = generate(tgt, None, prompt, max_new_tokens=30)
        spec = generate(tgt, d, prompt, max_new_tokens=30, k=4, tree=tree)
        diff = tgt.first_difference(prompt, plain.tokens, spec.tokens)
        # bf16 keeps 8 bits: a verify forward and one-token steps may round a near-tie apart
        # (decode.evaluate's rule); anything wider is a decoder or drafter bug
        assert diff["margin"] is None or is_near_tie(diff), diff
        exact += plain.tokens.tolist() == spec.tokens.tolist()
        accepted += sum(spec.accepted)
    assert accepted > 10 and exact >= 3


# -- the real recipe, online and offline capture of three layers -----------------------------------
@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(32):
            seq = " ".join(words[(i + j) % len(words)] for j in range(12))
            f.write(json.dumps({"id": f"c{i}", "conversations": [
                {"from": "human", "value": f"Continue the list from {words[i % len(words)]}."},
                {"from": "gpt", "value": seq}]}) + "\n")
    return path


def recipe_cfg(tmp_path, chats, *overrides):
    return eagle3_recipe_cfg(tmp_path, chats, "eagle3", *overrides)


def test_recipe_trains_eagle3_and_loss_goes_down(tmp_path, chats):
    rows = train_rows(recipe_cfg(tmp_path, chats, "trainer.max_steps=30", "trainer.lr=3e-3",
                                 "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1"))
    loss = {x["step"]: x["loss"] for x in rows if "loss" in x}
    first, last = sum(loss[s] for s in range(1, 5)) / 4, sum(loss[s] for s in range(27, 31)) / 4
    assert last < 0.7 * first, (first, last)
    step = [x for x in rows if "loss" in x][-1]  # all 3 unrolled steps, no feature loss
    assert {"div/s1", "div/s3"} <= set(step) and not any(k.startswith("feat/") for k in step)


def test_online_and_offline_capture_of_three_layers(tmp_path, chats):
    from specdistill.data.capture import CaptureConfig, OfflineFeatures, capture, capture_dir, capture_split
    from specdistill.train.recipe import DistillRecipe

    r = DistillRecipe(recipe_cfg(tmp_path, chats, "trainer.max_steps=1"))
    r.setup()
    assert r.drafter.feature_layers == (0, 1, 2)  # the 2-layer tiny target: embeddings, 1, 2
    out = capture_split(r.target, r.train_ds, CaptureConfig(layers=list(r.drafter.feature_layers),
                                                            shard_size=8), tmp_path / "f", progress=False)
    raw = next(r.batches)
    online = r.make_batch(raw)
    r.offline = OfflineFeatures(out, r.drafter.feature_layers, r.target)
    offline = r.make_batch(raw)
    real = raw["attention_mask"].bool()
    assert online.features.shape[-1] == 3 * r.target.hidden_size  # (B, T, 3H)
    torch.testing.assert_close(offline.features[real], online.features[real], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="layers"):  # another layer set is refused
        OfflineFeatures(out, (0, 1, 1), r.target)
    # every capture holds the final state: an EAGLE-1 drafter ([-1]) and a small LM ([]) train on it
    feats, final = OfflineFeatures(out, (-1,), r.target).get(0, r.train_ds[0]["input_ids"])
    torch.testing.assert_close(feats, final)
    ids = torch.tensor([r.train_ds[0]["input_ids"]])
    _, online_final = capture(r.target, ids, torch.ones_like(ids), ())  # (1, T, H)
    torch.testing.assert_close(final, online_final[0], rtol=1e-4, atol=1e-5)
    assert OfflineFeatures(out, (), r.target).get(0, r.train_ds[0]["input_ids"])[0] is None
    # the default capture folder (train/recipe.py) is keyed by the layer set: eagle's and
    # eagle3's never mix
    folders = {capture_dir(tmp_path, r.target, r.train_ds, "chats", layers, None)
               for layers in (r.drafter.feature_layers, (-1,))}
    assert len(folders) == 2


@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_bf16_stored_features_train_the_same_drafter_under_bf16(tmp_path, chats, name, monkeypatch):
    """trainer.capture_features_dtype=auto with precision=bf16: the layers' features are stored at
    bf16 (half the bytes; the final hidden state, the teacher, stays fp32) in a folder of their own,
    and training is bit-identical to fp32 storage, since the drafter's fuse layer reads them at bf16
    anyway (it would differ if any op read them at fp32 first). An existing capture keeps its
    storage; fp32 training keeps fp32 features."""
    from safetensors import safe_open

    from specdistill.train.precision import features_storage
    from specdistill.train.recipe import DistillRecipe

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))  # the captures' default folders
    runs = {}
    for store in ("float32", "auto", "reuse"):
        over = [f"trainer.features_dir={runs['float32'][2]}"] if store == "reuse" else []
        cfg = eagle3_recipe_cfg(tmp_path / store, chats, name, "trainer.max_steps=3", "trainer.log_every=1",
                                "trainer.features=offline", "trainer.precision=bf16", "trainer.eval_every=0",
                                "trainer.save_every=0", "trainer.capture_features_dtype=auto", *over)
        if store == "float32":
            cfg.trainer.capture_features_dtype = "float32"
        r = DistillRecipe(cfg)
        r.setup()
        r.train()
        rows = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
        runs[store] = ([x["loss"] for x in rows if "loss" in x],
                       {k: v.clone() for k, v in r.drafter.state_dict().items()}, r.offline.folder)
        r.cleanup()
    (l32, w32, f32), (l16, w16, f16), (lre, _, fre) = runs["float32"], runs["auto"], runs["reuse"]
    assert f16 != f32 and fre == f32  # its own folder; a given folder is used as it was made
    for folder, want in ((f32, torch.float32), (f16, torch.bfloat16)):
        with safe_open(str(next(folder.glob("shard-*.safetensors"))), "pt") as sh:
            assert sh.get_tensor("features").dtype == want
            assert sh.get_tensor("final").dtype == torch.float32
    assert len(l32) == 3 and l16 == l32 and lre == l32
    assert all(torch.equal(w16[k], w32[k]) for k in w32)
    assert features_storage("auto", "fp32") is None and features_storage("auto", "bf16") == "bfloat16"
    with pytest.raises(ValueError, match="capture_features_dtype='fp8'"):
        features_storage("fp8", "bf16")


# -- exports ----------------------------------------------------------------------------------------
ENGINE_CFGS = {"sglang": [{}, {"draft_vocab_size": 48}],
               "vllm": [{"draft_vocab_size": 48, "num_layers": 2, "norm_before_residual": True}],
               "speculators": [{"draft_vocab_size": 48, "norm_before_residual": True,
                                "norm_before_fc": True, "num_layers": 2},
                               {"fc_norm": True, "norm_output": True}]}


@pytest.mark.parametrize("engine,cfg", [(e, c) for e, cs in ENGINE_CFGS.items() for c in cs])
def test_export_matches_the_engine_forward_and_reads_back(target, engine, cfg, tmp_path):
    """`format=<engine>` through the export job's writer (validated and read back there), then
    the engine's forward rebuilt from the folder's files alone, and our decoder loading it."""
    d = make(target, ttt_length=3, **cfg)
    folder = export_drafter(d, {"name": "eagle3", "ttt_length": 3, **cfg}, target, engine,
                            tmp_path / engine, base_model="org/tiny8")["path"]
    config = json.loads((folder / "config.json").read_text())
    W = load_file(str(folder / "model.safetensors"))
    assert engine_name(config) == engine
    ids = make_batch(target, d, B=1).input_ids[0]
    # 1. the aux-layer ids: the same layers, one apart between SGLang and vLLM
    key = "eagle_aux_hidden_state_layer_ids"
    got = config["eagle_config"][key] if engine == "sglang" else config[key]
    assert got == [i - (engine == "sglang") for i in d.feature_layers]
    assert config.get("tie_word_embeddings", config.get("transformer_layer_config", {}).get(
        "tie_word_embeddings")) is False
    # 2. the engine's forward from the exported files == ours (training-time test, same tokens)
    with torch.no_grad():
        preds = d.forward_train(make_batch(target, d, B=1))
    for t in (3, 5):  # anchors every step trains at (tokens t+2 .. t+4 real: padding from 10)
        ref = engine_chain(engine, config, W, target, ids, t, 3)
        for j in range(3):
            torch.testing.assert_close(ref[j], dense_logits(preds[j])[0, t].float(), atol=2e-4, rtol=1e-4)
    if engine == "speculators" and d.d2t is None:  # full vocab: speculators has no map buffers
        assert "d2t" not in W and "t2d" not in W and W["lm_head.weight"].shape == (V, H)
    else:
        target_ids = torch.arange(len(W["d2t"])) + W["d2t"]  # the engines' hot_token_id map
        assert torch.equal(target_ids, d.d2t if d.d2t is not None else torch.arange(V))
        assert W["t2d"].dtype == torch.bool and int(W["t2d"].sum()) == len(W["d2t"])
    # 3. our decoder reads the export back exactly
    back = load_export(folder, target)
    assert back.feature_layers == d.feature_layers
    with torch.no_grad():
        again = back.forward_train(make_batch(target, d, B=1))
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(preds, again))


@pytest.mark.parametrize("engine,cfg,match", [
    ("sglang", {"norm_before_residual": True}, "does not implement"),
    ("sglang", {"num_layers": 2}, "num_layers must be 1"),
    ("vllm", {"fc_norm": True}, "does not implement"),
    ("vllm", {"norm_output": True}, "does not implement"),
    ("speculators", {"norm_before_fc": True, "fc_norm": True}, "refuses norm_before_fc"),
    ("sglang", {"aux_layers": [0, 3, 5]}, r"in \[1, 7\]"),  # SGLang cannot name the embeddings
    ("vllm", {"aux_layers": [2, 4, 8]}, r"in \[0, 7\]"),  # nor the final state
    ("tensorrt", {}, "unknown format 'tensorrt' for drafter 'eagle3'; its formats: hf, sglang, "
                     "speculators, vllm")])
def test_export_refuses_what_the_engine_cannot_run(target, engine, cfg, match, tmp_path):
    d = make(target, **cfg)
    with pytest.raises(ExportError, match=match):
        export_drafter(d, {"name": "eagle3", **cfg}, target, engine, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []  # nothing written
    if engine != "tensorrt":  # the engine functions refuse the same
        with pytest.raises(ExportError, match=match):
            e3.engine_state(d, engine)


@pytest.mark.slow
def test_smollm2_eagle3_greedy_is_lossless_on_mtbench():
    """The real target: aux layers (2, 15, 27), and chain / tree output equal to plain greedy after
    a few steps on the target's own continuations of the prompts (so drafts get accepted)."""
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.evaluate import render
    from specdistill.target.model import TargetConfig, load_target

    target = load_target(TargetConfig(path="packaged:smollm2", dtype="float32"))  # no near-ties
    d = build_drafter({"name": "eagle3", "draft_vocab_size": 4096, "ttt_length": 2}, target)
    assert d.feature_layers == (2, 15, 27)
    prompts = [render(target, p.turns[:1], []) for p in load_prompts("mtbench", limit=2)]
    plains = [generate(target, None, ids, max_new_tokens=32) for ids in prompts]
    seqs = [torch.cat([ids, plain.tokens])[None] for ids, plain in zip(prompts, plains)]  # (1, T)
    counts = torch.bincount(torch.cat([s[0] for s in seqs]), minlength=target.vocab_size).float()
    fit_draft_vocab(d, counts, always_include=target.eos_token_ids)
    batches = []
    for s in seqs:
        out = target.forward(s, layers=d.feature_layers)
        ones = torch.ones_like(s)
        batches.append(TrainBatch(s, ones, ones, out.logits.clone(), out.features.clone()))
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=2e-3)
    for step in range(30):
        loss, _ = distill_loss(d.forward_train(batches[step % 2]), batches[step % 2], d2t=d.d2t)
        opt.zero_grad()
        loss.backward()
        opt.step()
    accepted = 0
    for ids, plain in zip(prompts, plains):
        for tree in (False, True):
            spec = generate(target, d, ids, max_new_tokens=32, k=5, tree=tree)
            assert torch.equal(spec.tokens, plain.tokens), tree
            accepted += sum(spec.accepted)
    assert accepted > 0


# -- the real speculators library -------------------------------------------------------------------
SPECULATORS = "speculators==0.9.0"  # the release our format was checked against (2026-11-30)
# run inside the throw-away virtualenv: load an export with the library's own classes and write
# the draft logits of its own training-time-test forward (teacher forced, like ours)
SPECULATORS_LOAD = r"""
import sys, torch
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
folder = sys.argv[1]
x = torch.load(folder + "/inputs.pt")
conf = Eagle3SpeculatorConfig.from_pretrained(folder)
conf.transformer_layer_config._attn_implementation = "eager"
m = Eagle3DraftModel.from_pretrained(folder, config=conf).float().eval()
got = []
m.lm_head.register_forward_hook(lambda mod, i, o: got.append(o[0]))
with torch.no_grad():
    m(hidden_states=x["features"], input_ids=x["input_ids"],
      document_ids=torch.zeros_like(x["input_ids"]), ttt_steps=x["steps"])
torch.save({"logits": torch.stack(got), "state": m.state_dict()}, folder + "/out.pt")
"""


@pytest.fixture(scope="module")
def speculators_python(tmp_path_factory) -> str:
    """A virtualenv over this environment's packages (torch, transformers) with the speculators
    release and the few modules it imports that we lack; no torch/torchvision is reinstalled."""
    import subprocess
    import sys

    venv = tmp_path_factory.mktemp("speculators") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    for args in (["--no-deps", SPECULATORS, "loguru", "hs-connectors==0.9.0"], ["openai", "aiohttp"]):
        if subprocess.run(pip + args, capture_output=True, text=True).returncode != 0:
            pytest.skip(f"cannot install {args} from the package registry")
    return str(venv / "bin" / "python")


# One interpreter in the speculators virtualenv runs every test's script (the release, torch and
# transformers imported once, not once a test: ~10 s each on CI's cores): a line "<script>\t<folder>"
# in, one "@@ ok" or "@@ error <traceback>" line out; its stderr (the library's logs) to a file.
RUNNER = r"""
import sys, traceback
for line in sys.stdin:
    script, folder = line.rstrip("\n").split("\t")
    sys.argv = [script, folder]
    try:
        exec(compile(open(script).read(), script, "exec"), {"__name__": "__main__"})
        print("@@ ok", flush=True)
    except BaseException:
        print("@@ error " + traceback.format_exc().replace("\n", " | "), flush=True)
"""


@pytest.fixture(scope="module")
def speculators_run(speculators_python, tmp_path_factory):
    """run(script, folder): the release's script run on the folder in the module's one speculators
    interpreter; a failure fails the test with the script's traceback."""
    import subprocess

    logs = tmp_path_factory.mktemp("speculators_runner")
    with open(logs / "stderr.log", "w") as err:
        proc = subprocess.Popen([speculators_python, "-u", "-c", RUNNER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)

    def run(script: str, folder: Path) -> None:
        path = folder / "script.py"
        path.write_text(script)
        proc.stdin.write(f"{path}\t{folder}\n")
        proc.stdin.flush()
        for line in proc.stdout:  # the library may print lines of its own first
            if line.startswith("@@ "):
                assert line.startswith("@@ ok"), line[:4000]
                return
        pytest.fail(f"the speculators interpreter exited: {(logs / 'stderr.log').read_text()[-3000:]}")

    yield run
    proc.stdin.close()
    proc.wait(timeout=60)


def _in_speculators(run, script: str, target, d, W: dict, config_of, inputs_of, tmp_path):
    """Our speculators export of d (tensors W, config_of(verifier folder)) written to tmp_path, the
    release's `script` run on it (speculators_run) with inputs_of(ids, batch) in inputs.pt; checks
    that every tensor loaded as written and nothing else. Returns (the script's out.pt, our batch)."""
    from safetensors.torch import save_file

    verifier = tmp_path / "verifier"
    target.model.save_pretrained(verifier)  # the library reads embeddings / head / norm from it
    (tmp_path / "config.json").write_text(json.dumps(config_of(str(verifier))))
    save_file({k: v.contiguous() for k, v in W.items()}, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, V, (1, 14), generator=torch.Generator().manual_seed(0))  # no padding
    out = target.forward(ids, layers=d.feature_layers)
    batch = TrainBatch(ids, torch.ones_like(ids), torch.ones_like(ids), out.logits, out.features)
    torch.save(inputs_of(ids, batch), tmp_path / "inputs.pt")
    run(script, tmp_path)
    out = torch.load(tmp_path / "out.pt")
    state = out["state"]
    assert set(W) <= set(state) and set(state) - set(W) <= {"verifier_lm_head.weight",
                                                            "verifier_norm.weight"}
    assert all(torch.equal(state[k].to(v.dtype), v) for k, v in W.items())
    return out, batch


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [{}, {"draft_vocab_size": 48, "num_layers": 2, "norm_before_fc": True,
                                      "norm_before_residual": True},
                                 {"draft_vocab_size": 48, "fc_norm": True, "norm_output": True}],
                         ids=["full_vocab", "pruned_2layers", "eagle31"])
def test_speculators_release_loads_our_export(target, speculators_run, cfg, tmp_path):
    d = make(target, ttt_length=3, **cfg)
    W = e3.engine_state(d, "speculators")
    # speculators pairs hidden state t with input token t+1 (the caller shifts)
    out, batch = _in_speculators(
        speculators_run, SPECULATORS_LOAD, target, d, W,
        lambda verifier: e3.engine_config(d, "speculators", verifier=verifier),
        lambda ids, batch: {"features": batch.features.float(), "steps": 3,
                            "input_ids": torch.cat([ids[:, 1:], ids[:, -1:]], 1)}, tmp_path)
    with torch.no_grad():
        ours = d.forward_train(batch)
    T = batch.input_ids.shape[1]
    for j in range(3):  # anchors whose true tokens exist at step j
        torch.testing.assert_close(out["logits"][j][:T - 2 - j], dense_logits(ours[j])[0, :T - 2 - j],
                                   atol=1e-4, rtol=1e-4)


# the same for P-EAGLE: PEagleDraftModel.from_pretrained on our `peagle` speculators export, its own
# training forward (COD sampling made exhaustive: ratio 1, the draw it makes recorded) with the
# lm_head's output kept
SPECULATORS_PEAGLE_LOAD = r"""
import sys, torch
import speculators.models.peagle.core as core
from speculators.losses import resolve_loss_config
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
folder, drawn = sys.argv[1], []
x = torch.load(folder + "/inputs.pt")
sample = core.generate_cod_sample_indices
core.generate_cod_sample_indices = lambda *a, **k: drawn.append(sample(*a, **k)) or drawn[-1]
conf = PEagleSpeculatorConfig.from_pretrained(folder)
conf.transformer_layer_config._attn_implementation = "eager"
m = PEagleDraftModel.from_pretrained(folder, config=conf).float().eval()
got = []
m.lm_head.register_forward_hook(lambda mod, i, o: got.append(o[0]))  # (N, Vd): N drawn positions
with torch.no_grad():
    m(hidden_states=x["features"], input_ids=x["input_ids"], document_ids=torch.zeros_like(x["input_ids"]),
      verifier_last_hidden_states=x["last"], num_depths=x["depths"], down_sample_ratio=1.0,
      down_sample_ratio_min=1.0, loss_config=resolve_loss_config("kl_div", "eager"))  # no triton
anchor, depth = drawn[0]
torch.save({"logits": got[0], "anchor": anchor, "depth": depth, "state": m.state_dict()},
           folder + "/out.pt")
"""


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [{"mask_token_id": 7},
                                 {"draft_vocab_size": 48, "num_layers": 2, "norm_before_residual": True},
                                 {"draft_vocab_size": 48, "fc_norm": True, "norm_output": True}],
                         ids=["full_vocab", "pruned_2layers", "eagle31"])
def test_speculators_release_loads_our_peagle_export(target, speculators_run, cfg, tmp_path):
    """Our `peagle` speculators export (drafters/peagle.py) in the release's PEagleDraftModel:
    every tensor loaded as written (mask_hidden included: the library would silently keep a
    random one if it were missing) and nothing else, and its logits at every (anchor, depth) its
    training forward draws == our draft positions (depth 0 = the real position, d = mask d)."""
    from specdistill.drafters.peagle import peagle_speculators_config, peagle_speculators_state

    d = perturbed_drafter(target, "peagle", 1, ttt_length=3, **cfg)
    W = peagle_speculators_state(d)
    # speculators pairs hidden state t with input token t+1 (the caller shifts); the verifier's
    # last state only feeds its loss, never compared
    out, batch = _in_speculators(
        speculators_run, SPECULATORS_PEAGLE_LOAD, target, d, W,
        lambda verifier: peagle_speculators_config(d, verifier=verifier),
        lambda ids, batch: {"features": batch.features.float(), "depths": 3,
                            "last": torch.zeros(1, 14, H),
                            "input_ids": torch.cat([ids[:, 1:], ids[:, -1:]], 1)}, tmp_path)
    with torch.no_grad():
        ours = d.forward_train(batch)
    seen = set()
    for i, (a, dep) in enumerate(zip(out["anchor"].tolist(), out["depth"].tolist())):
        mine = dense_logits(ours[dep])[0, a]  # NaN where no loss reads it: our head never ran
        # its depth-1 draw may start a rollout at anchor -1 (position 0): no such anchor here
        if a >= 0 and not mine.isnan().any():
            torch.testing.assert_close(out["logits"][i], mine, atol=1e-4, rtol=1e-4)
            seen.add(dep)
    assert seen == {0, 1, 2}  # every depth compared


# the same for DFlash: DFlashDraftModel.from_pretrained on our `dflash` speculators export, its own
# anchored-block forward (eager attention over its dense anchor mask; the anchors it draws recorded)
SPECULATORS_DFLASH_LOAD = r"""
import sys, torch
import speculators.models.dflash.core as core
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
folder, drawn = sys.argv[1], []
x = torch.load(folder + "/inputs.pt")
select = core.select_anchors
core.select_anchors = lambda *a, **k: drawn.append(select(*a, **k)) or drawn[-1]
conf = DFlashSpeculatorConfig.from_pretrained(folder)
conf.transformer_layer_config._attn_implementation = "eager"
m = DFlashDraftModel.from_pretrained(folder, config=conf).float().eval()
ids = x["input_ids"]
with torch.no_grad():
    out = m._backbone_forward(x["features"], ids, torch.ones_like(ids), x["last"],
                              torch.zeros_like(ids), max_anchors=x["anchors"])
anchors, valid = drawn[0]
torch.save({"logits": out[1][0], "anchors": anchors, "valid": valid, "state": m.state_dict()},
           folder + "/out.pt")
"""


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [{"mask_token_id": 7}, {"draft_vocab_size": 48, "num_layers": 2}],
                         ids=["full_vocab", "pruned_2layers"])
def test_speculators_release_loads_our_dflash_export(target, speculators_run, cfg, tmp_path):
    """Our `dflash` speculators export (drafters/dflash.py) in the release's DFlashDraftModel:
    every tensor loaded as written and nothing else, and its block logits at every anchor it
    draws (slot i >= 1) == our training logits of draft i there."""
    from specdistill.drafters.dflash import dflash_config, dflash_state

    d = perturbed_drafter(target, "dflash", 1, block_size=4, **cfg)
    W = dflash_state(d, "speculators")
    # speculators reads token t and the aux states before t as we do: no shift; the verifier's
    # last state only feeds its loss, never compared
    out, batch = _in_speculators(
        speculators_run, SPECULATORS_DFLASH_LOAD, target, d, W,
        lambda verifier: dflash_config(d, "speculators", verifier=verifier),
        lambda ids, batch: {"features": batch.features.float(), "input_ids": ids,
                            "last": torch.zeros(1, 14, H), "anchors": 10}, tmp_path)
    with torch.no_grad():
        ours = d.forward_train(batch)
    anchors = out["anchors"][out["valid"]].tolist()
    assert len(anchors) == 10  # 14 tokens, the last block_size never anchors: all 10 drawn
    for n, a in enumerate(out["anchors"].tolist()):
        for i in range(1, 4):
            torch.testing.assert_close(out["logits"][n * 4 + i], dense_logits(ours[i - 1])[0, a],
                                       atol=1e-4, rtol=1e-4)
