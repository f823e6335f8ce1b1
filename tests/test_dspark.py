"""DSpark (drafters/dspark.py) on tiny random targets: the heads' shapes and settings, what a block
may see, decoding equals training when the chain is fed back (Markov bias and confidence per
draft, every Markov variant, both anchor layouts), the objective's terms against a hand
computation (dropped slots, both confidence targets), the exports' explicit layout flags, one
mistake per layout trap refused by validation, a short run of the real recipe, and (slow) vLLM
CPU's own verdict on both layouts."""
from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch
from eagle3_engines import TOY_V, feature_batch, perturbed_drafter, recipe_cfg, tiny8_target, train_rows
from procs import installed_vllm_cache
from safetensors.torch import load_file, save_file

from specdistill.drafters.base import DecodeState, DraftPrediction, SlotObjective, TrainBatch, build_drafter
from specdistill.drafters.dspark import DSpark
from specdistill.drafters.parts.anchors import dense_logits
from specdistill.drafters.parts.layouts import ExportError
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.export.folder import export_drafter, load_export, validate_export
from specdistill.target.model import Target
from specdistill.train.losses import slot_loss

V = TOY_V
pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target() -> Target:
    return tiny8_target()


def make(target, seed=1, **cfg) -> DSpark:
    return perturbed_drafter(target, "dspark", seed, markov_rank=8, **cfg)


# -- the network ----------------------------------------------------------------------------------
@pytest.mark.parametrize("anchor", [True, False])
def test_shapes_names_and_bad_settings(target, anchor):
    d = make(target, block_size=5, sample_from_anchor=anchor, draft_vocab_size=48)
    preds = d.forward_train(feature_batch(target, d))
    n = 5 if anchor else 4  # the anchor drafts too, or only holds the last token
    assert d.trained_positions() == n and [p.shift for p in preds] == list(range(n))
    assert all(p.logits.shape == (2, 14, 48) and p.confidence.shape == (2, 14) for p in preds)
    assert [p.weight for p in preds] == pytest.approx([math.exp(-j / 4) for j in range(n)])
    names = set(d.state_dict())  # the engines' names (vLLM qwen3_dspark.py, speculators)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias"} <= names
    assert d.markov_head.markov_w1.weight.shape == (V, 8)  # previous tokens: target ids
    assert d.markov_head.markov_w2.weight.shape == (48, 8)  # the bias: over the draft vocabulary
    assert d.accept_prob_head and not d.supports_tree and d.objective == SlotObjective()
    off = make(target, confidence_head=False)
    assert off.confidence_head is None and off.objective.confidence == 0.0
    assert off.forward_train(feature_batch(target, off))[0].confidence is None
    for bad, says in [({"markov_head_type": "lstm"}, "markov_head_type must be one of"),
                      ({"confidence_target": "kl"}, "confidence_target must be one of"),
                      ({"loss_weights": [1.0, 1.0]}, r"loss_weights needs one weight per draft \(8\)")]:
        with pytest.raises(ValueError, match=says):
            build_drafter({"name": "dspark", **bad}, target)


def test_a_block_sees_only_the_features_before_its_anchor(target):
    d = make(target, block_size=4)
    batch = feature_batch(target, d)
    t = 6
    with torch.no_grad():
        base = d.forward_train(batch)
        late = batch.features.clone()
        late[:, t:] += 1.0  # the anchor's own features and after: invisible to the block at t
        after = d.forward_train(TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                                           batch.target_logits, late))
        early = batch.features.clone()
        early[:, t - 1] += 1.0
        before = d.forward_train(TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                                            batch.target_logits, early))
    for a, b, c in zip(base, after, before):
        torch.testing.assert_close(a.logits[:, t], b.logits[:, t])
        torch.testing.assert_close(a.confidence[:, t], b.confidence[:, t])
        assert not torch.allclose(a.logits[:, t], c.logits[:, t])


@pytest.mark.parametrize("cfg", [{}, {"markov_head_type": "gated", "draft_vocab_size": 48},
                                 {"markov_head_type": "rnn", "sample_from_anchor": False}],
                         ids=["vanilla", "gated_pruned", "rnn_bonus_anchor"])
def test_decoding_equals_training_on_its_own_chain(target, cfg):
    """propose's chain fed back as the text: at the anchor, draft j's training logits pick draft j
    and its confidence is accept_prob[j] (the Markov bias follows the drawn token, the rnn its state)."""
    d = make(target, block_size=4, **cfg)
    batch = feature_batch(target, d, B=1, T=10)
    t, n = 5, d.trained_positions()
    d.reset()
    prop = d.propose(DecodeState(batch.input_ids[0, :t + 1], batch.features[0, :t]), n, GREEDY)
    assert len(prop.tokens) == n and prop.accept_prob.shape == (n,)
    assert bool(((prop.accept_prob > 0) & (prop.accept_prob < 1)).all())
    ids = torch.cat([batch.input_ids[0, :t + 1], prop.tokens])[None]  # the chain as the text
    out = target.forward(ids, layers=d.feature_layers)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        preds = d.forward_train(TrainBatch(ids, ones, ones, out.logits, out.features))
    for j, p in enumerate(preds):
        assert int(d.target_ids(dense_logits(p)[0, t].argmax())) == int(prop.tokens[j])
        torch.testing.assert_close(torch.sigmoid(p.confidence[0, t]), prop.accept_prob[j],
                                   atol=1e-5, rtol=1e-5)
    short = d.propose(DecodeState(batch.input_ids[0, :t + 1], batch.features[0, :t]), 2, GREEDY)
    assert torch.equal(short.tokens, prop.tokens[:2])  # a shorter k: the same first drafts


# -- the objective --------------------------------------------------------------------------------
def _hand_loss(logits, conf, target_logits, mask, weights, objective):
    """The SlotObjective by hand: loop over anchors and slots, drop a block's slots after its first
    unscored token, weighted means of each term."""
    T = mask.shape[0]
    num, den = {"ce": 0.0, "l1": 0.0, "bce": 0.0}, 0.0
    kept = [0] * len(logits)
    for t in range(T):
        for j in range(len(logits)):
            if t + 1 + j >= T or not all(mask[t + 1 + i] for i in range(j + 1)):
                break
            q, p = logits[j][t].softmax(-1), target_logits[t + j].softmax(-1)
            ce = -math.log(q[p.argmax()])
            l1 = float((q - p).abs().sum())
            acc = 1 - l1 / 2 if objective.confidence_target == "tv" else float(q.argmax() == p.argmax())
            c = 1 / (1 + math.exp(-float(conf[j][t])))
            bce = -(acc * math.log(c) + (1 - acc) * math.log(1 - c))
            for name, v in (("ce", ce), ("l1", l1), ("bce", bce)):
                num[name] += weights[j] * v
            den += weights[j]
            kept[j] += 1
    total = sum(getattr(objective, k) * num[n] / den
                for k, n in (("ce", "ce"), ("l1", "l1"), ("confidence", "bce")))
    return total, kept


@pytest.mark.parametrize("conf_target", ["tv", "greedy"])
def test_the_objective_equals_a_hand_computation(conf_target):
    g = torch.Generator().manual_seed(0)
    T, Vs, n = 7, 5, 3
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1])  # token 3 unscored: blocks across it stop there
    batch = TrainBatch(torch.zeros(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.long),
                       mask[None], torch.randn(1, T, Vs, generator=g) * 3)
    logits = [torch.randn(T, Vs, generator=g) * 2 for _ in range(n)]
    conf = [torch.randn(T, generator=g) for _ in range(n)]
    weights = [math.exp(-j / 4) for j in range(n)]
    preds = [DraftPrediction(logits=logits[j][None], shift=j, weight=weights[j],
                             confidence=conf[j][None]) for j in range(n)]
    objective = SlotObjective(confidence_target=conf_target)
    total, parts = slot_loss(preds, batch, objective)
    want, kept = _hand_loss(logits, conf, batch.target_logits[0], mask, weights, objective)
    assert float(total) == pytest.approx(want, rel=1e-5)
    assert [int(parts[f"positions/s{j}"]) for j in range(n)] == kept == [5, 3, 1]
    # anchor 1: slot 0 (token 2) scored, slot 1 (token 3) not: slot 2 (token 4, scored) dropped;
    # slot 2 is kept at anchor 3 only (counted alone, it would be kept at anchors 1, 2 and 3)
    whole = 0.1 * float(parts["ce"]) + 0.9 * float(parts["l1"]) + float(parts["bce"])
    assert whole == pytest.approx(want, rel=1e-5)


def test_the_confidence_learns_the_acceptance(target):
    """A few steps on the objective's BCE alone move the predicted acceptance towards 1 - TV."""
    torch.manual_seed(0)
    d = make(target, block_size=3)
    batch = feature_batch(target, d)
    objective = SlotObjective(ce=0.0, l1=0.0, confidence=1.0)
    opt = torch.optim.Adam(d.confidence_head.parameters(), lr=0.05)
    gaps = []
    for _ in range(40):
        loss, parts = slot_loss(d.forward_train(batch), batch, objective)
        gaps.append(abs(float(parts["conf/s0"]) - float(parts["accept/s0"])))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert gaps[-1] < 0.3 * gaps[0], gaps


# -- exports ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize("anchor", [True, False])
def test_exports_write_every_layout_flag(target, fmt, anchor, tmp_path):
    cfg = {"name": "dspark", "markov_rank": 8, "block_size": 4, "draft_vocab_size": 48,
           "sample_from_anchor": anchor, "mask_token_id": 7}
    d = make(target, **{k: v for k, v in cfg.items() if k not in ("name", "markov_rank")})
    folder = export_drafter(d, cfg, target, fmt, tmp_path / "x", base_model="org/tiny8")["path"]
    c = json.loads((folder / "config.json").read_text())
    W = load_file(str(folder / "model.safetensors"))
    ids, n = list(d.feature_layers), d.trained_positions()
    assert c["sample_from_anchor"] is anchor and c["markov_rank"] == 8 and c["block_size"] == 4
    assert c["markov_head_type"] == "vanilla" and c["enable_confidence_head"] is True
    assert c["confidence_head_with_markov"] is True and c["draft_vocab_size"] == 48
    assert "d2t" in W and W["markov_head.markov_w2.weight"].shape == (48, 8)
    if fmt == "vllm":  # vLLM 0.32.0's Qwen3DSparkModel reads these as they stand
        assert c["architectures"] == ["Qwen3DSparkModel"] and c["model_type"] == "qwen3"
        assert c["dspark_bonus_anchor"] is (not anchor) and c["mask_token_id"] == 7
        assert c["eagle_aux_hidden_state_layer_ids"] == ids  # the engine's capture: layer inputs
        assert c["target_layer_ids"] == [i - 1 for i in ids]  # DSpark's own: layer outputs
    else:  # speculators 0.9.0 DSparkSpeculatorConfig (vLLM's reader defaults sample_from_anchor to false)
        assert c["speculators_model_type"] == "dspark" and c["architectures"] == ["DSparkSpeculator"]
        assert c["aux_hidden_state_layer_ids"] == ids
        assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == n
        assert (c["ce_loss_alpha"], c["l1_loss_alpha"], c["confidence_head_alpha"]) == (0.1, 0.9, 1.0)
    back = load_export(folder, target)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())


def test_vllm_layout_refuses_a_markov_head_vllm_does_not_serve(target, tmp_path):
    d = make(target, markov_head_type="gated")
    with pytest.raises(ExportError, match="vanilla Markov head only"):
        export_drafter(d, {"name": "dspark", "markov_rank": 8, "markov_head_type": "gated"},
                       target, "vllm", tmp_path / "x")


TRAPS = [(fmt, trap.name) for fmt, layout in sorted(DSpark.layouts.items()) if fmt != "hf"
         for trap in layout.traps]


@pytest.mark.parametrize("fmt,name", TRAPS, ids=[f"{f}-{n.replace(' ', '_')}" for f, n in TRAPS])
def test_each_layout_trap_is_refused(target, fmt, name, tmp_path):
    """The mistake each trap names, made in a written folder (whose manifest is then gone, as from
    another tool), is refused by validation with its name; the clean folder validates."""
    cfg = {"name": "dspark", "markov_rank": 8, "draft_vocab_size": 48, "block_size": 4}
    trap = next(x for x in DSpark.layouts[fmt].traps if x.name == name)
    assert trap.applies(cfg)
    d = make(target, draft_vocab_size=48, block_size=4)
    folder = export_drafter(d, cfg, target, fmt, tmp_path / "x")["path"]
    assert validate_export(folder, target) == []
    config = json.loads((folder / "config.json").read_text())
    files = {"model.safetensors": load_file(str(folder / "model.safetensors"))}
    trap.make(config, files)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(files["model.safetensors"], str(folder / "model.safetensors"))
    (folder / "MANIFEST.json").unlink()
    with pytest.raises(ExportError, match=trap.says):
        validate_export(folder, target)


def _ids_as_ours(config, files):  # dflash_config.target_layer_ids written in the input convention
    config["dflash_config"]["target_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]


# each mistake made in a written folder -> what llama.cpp's DSpark reader says or would do
LLAMACPP_MISTAKES = [
    ("vllm", lambda c, f: f["model.safetensors"].pop("d2t"),
     "draft_vocab_size 48 < vocab_size 128 but no d2t table found"),
    ("vllm", _ids_as_ours, r"llama.cpp captures hidden_states \[3, 5, 6\] .*this drafter reads "
                           r"\[2, 4, 5\] \(eagle_aux_hidden_state_layer_ids\)"),
    ("speculators", lambda c, f: c.update(markov_head_type="gated"),
     r"unsupported markov_head_type 'gated' \(only 'vanilla' is supported\)"),
    ("speculators", lambda c, f: c.pop("sample_from_anchor"),
     "sample_from_anchor is not written: llama.cpp takes it as False"),
    ("speculators", lambda c, f: f["model.safetensors"].pop("markov_head.markov_w1.weight"),
     "llama.cpp serves it as DFlash, without the Markov bias"),
    ("vllm", lambda c, f: f["model.safetensors"].update(  # target ids where offsets belong
        d2t=f["model.safetensors"]["d2t"] + torch.arange(48)), "gives target ids that t2d does not mark")]


@pytest.mark.parametrize("fmt,mistake,says", LLAMACPP_MISTAKES,
                         ids=["no_d2t", "aux_ids_as_inputs", "gated", "no_anchor_flag", "no_markov",
                              "d2t_as_ids"])
def test_llamacpp_reads_both_layouts_as_written_and_each_mistake_is_named(target, fmt, mistake,
                                                                          says, tmp_path):
    """What llama.cpp b11434's DSpark converter reads (conversion/qwen.py DSparkModel): both
    layouts as written pass the engine's check; a mistake it refuses is said in its words, one it
    would serve wrong without a word is named, before llama.cpp is built or run."""
    from specdistill.decode.engine import llamacpp_engine as le

    cfg = {"name": "dspark", "markov_rank": 8, "draft_vocab_size": 48, "block_size": 4}
    d = make(target, draft_vocab_size=48, block_size=4)
    assert d.feature_layers == (2, 4, 5)  # the ids the mistakes name
    folder = export_drafter(d, cfg, target, fmt, tmp_path / "x")["path"]
    assert le.spec_type(folder) == ("draft-dspark", True) and le.refusal(folder) is None
    config = json.loads((folder / "config.json").read_text())
    files = {"model.safetensors": load_file(str(folder / "model.safetensors"))}
    mistake(config, files)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(files["model.safetensors"], str(folder / "model.safetensors"))
    (folder / "MANIFEST.json").unlink()
    why = le.refusal(folder)
    assert why is not None and "\n" not in why and why.startswith("llama.cpp b11434's DSpark")
    assert re.search(says, why), why
    run = le.run_export(folder, tmp_path / "t", tmp_path / "cache", 4, [[1, 2]], [4], 64,
                        tmp_path / "out")  # refused before the build: no llama.cpp needed
    assert not run["loaded"] and run["failed_engine"] == "check" and run["error"] == why
    assert not (tmp_path / "cache").exists()


# -- the real recipe --------------------------------------------------------------------------------
def test_recipe_trains_dspark_on_its_own_objective(tmp_path, caplog):
    from conftest import write_chats

    chats = write_chats(tmp_path / "chats.jsonl", 32, 12)
    cfg = recipe_cfg(tmp_path, chats, "dspark", "trainer.max_steps=30", "trainer.lr=3e-3",
                     "trainer.eval_every=0", "trainer.save_every=0", "trainer.log_every=1",
                     "drafter.markov_rank=16", "drafter.anchors=null", "trainer.loss=jsd")
    with caplog.at_level(logging.WARNING):
        rows = train_rows(cfg)
    said = [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]
    assert len(said) == 1 and "trainer.loss=jsd" in said[0] and "dspark" in said[0]
    loss = {x["step"]: x["loss"] for x in rows if "loss" in x}
    first, last = sum(loss[s] for s in range(1, 5)) / 4, sum(loss[s] for s in range(27, 31)) / 4
    assert last < 0.8 * first, (first, last)
    step = [x for x in rows if "loss" in x][-1]
    assert {"ce", "l1", "bce", "accept/s0", "conf/s3", "top1/s3"} <= set(step)  # 4 drafts
    assert not any(k.startswith("div/") for k in step)  # trainer.loss's divergence never ran


# -- the real engine (slow) ---------------------------------------------------------------------------
ENGINE_REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"


@pytest.fixture(scope="module")
def vllm():
    """The specdistill cache with vLLM CPU installed (a missing engine fails, tests/procs.py)."""
    return installed_vllm_cache()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_cpu_serves_dspark_losslessly_or_refuses_it_in_its_own_words(vllm, fmt, tmp_path):
    """vLLM 0.32.0 CPU (2026-12-06) refuses DSpark in both layouts before loading a weight:
    DSpark runs on Model Runner V2 only (v1/worker/gpu/spec_decode/dspark/), and the CPU build
    runs V1. A later build that serves it must do so as our decoder decodes."""
    from specdistill.decode.engine import check as chk
    from specdistill.target.model import TargetConfig, load_target

    smollm2 = load_target(TargetConfig(path="packaged:smollm2", dtype="float32"))
    cfg = {"name": "dspark", "draft_vocab_size": 2048, "block_size": 4, "markov_rank": 32}
    d = build_drafter(cfg, smollm2).eval()
    folder = export_drafter(d, cfg, smollm2, fmt, tmp_path / fmt, k=4)["path"]
    s = chk.engine_check(folder, smollm2, d, limit=1, max_new_tokens=16, k=4, out_dir=tmp_path / "c",
                         cache=vllm, timeout=900)["summary"]
    if s["loaded"]:
        assert s["verdict"] == "pass" and s["spec_equals_plain"] == 1, s
    else:
        assert ENGINE_REFUSAL in s["error"], s["error"]


def test_its_confidence_head_drives_a_lossless_survival_cut(target):
    """The decoder's survival cut (decode/survival.py) reads DSpark's trained confidences: the
    source is the head, the chain is cut where the product of confidences falls below the
    threshold (never below one draft), and greedy output equals plain decoding."""
    from specdistill.decode.spec import generate

    drafter = make(target, seed=3).eval()
    prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(5))
    plain = generate(target, None, prompt, max_new_tokens=24)
    for threshold in (0.0, 0.3, 0.9, 1.0):
        spec = generate(target, drafter, prompt, max_new_tokens=24, k=3, verify_survival=threshold)
        assert spec.tokens.tolist() == plain.tokens.tolist()
        if threshold == 0.0:
            continue
        assert spec.confidence_source == "head" and spec.slot_confidence
        for (conf, n), drafted in zip(spec.slot_confidence, [m for m in spec.drafted if m > 0]):
            survival = torch.tensor(conf).cumprod(0)
            want = max(1, int((survival >= threshold).long().cumprod(0).sum()))
            assert drafted == min(want, 3), (threshold, conf, drafted)
