"""small_lm on a tiny random Llama target (4 layers, tied embeddings like SmolLM2, the SmolLM2
tokenizer): layers copied from the target, shared embeddings, tokenizer refusal, LoRA, on-policy
batches, the HF export (reload, assisted generation) and lossless decoding.

The generic drafter contract (shapes, cache under accept/reject, save/load, pruned vocab, training
lowers the loss) is tested for small_lm by tests/test_drafters.py, parametrised over the registry."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_MODEL
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdistill.data.dataset import pad_batch
from specdistill.decode.spec import generate
from specdistill.drafters.base import DecodeState, TrainBatch, build_drafter
from specdistill.drafters.parts.anchors import dense_logits
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.export.card import CardFacts
from specdistill.export.folder import ExportError, export_drafter, load_export
from specdistill.store.drafter import load_drafter, save_drafter
from specdistill.target.model import TargetConfig, load_target
from specdistill.train.losses import distill_loss
from specdistill.train.on_policy import OnPolicyMixer, assistant_starts


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                                    model_config={**TINY_MODEL, "num_hidden_layers": 4,
                                                  "tie_word_embeddings": True}, seed=0,
                                    dtype="float32"))  # pinned: auto is bf16 on some CPUs


def small(target, **cfg):
    return build_drafter({"name": "small_lm", **cfg}, target)


def prompt_ids(target, text="Count from one to ten.") -> torch.Tensor:
    return target.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True,
                                                return_tensors="pt")["input_ids"][0]  # (P,)


def train_batch(target, T=20) -> TrainBatch:
    ids = torch.randint(0, target.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(2, T, dtype=torch.long)
    attn[1, -5:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0
    return TrainBatch(ids, attn, loss_mask, target.forward(ids, attention_mask=attn).logits)


def test_built_from_target_copies_layers_and_shares_embeddings(target):
    src = target.model.model
    for cfg, picked in (({"num_layers": 2}, [0, 1]), ({"num_layers": 2, "layer_stride": 2}, [0, 2]),
                        ({"layers": [3, 0]}, [3, 0])):  # explicit layers set num_layers
        d = small(target, **cfg)
        layers = d.hf_model.model.layers
        assert len(layers) == 2 and d.feature_layers == ()
        for j, i in enumerate(picked):
            ref = src.layers[i].state_dict()
            assert all(torch.equal(v, ref[k]) for k, v in layers[j].state_dict().items())
        assert torch.equal(d.hf_model.model.norm.weight, src.norm.weight)
        # embeddings and LM head: the target's own tensors, called, neither trained nor saved
        assert d.hf_model.get_input_embeddings().weight is target.embed_tokens().weight
        assert d.hf_model.get_output_embeddings().weight is target.lm_head().weight
        assert not any(v.shape[0] == target.vocab_size for v in d.state_dict().values())
        trainable = {n for n, p in d.named_parameters() if p.requires_grad}
        assert trainable == {n for n, _ in d.named_parameters()} and trainable
    batch = train_batch(target)
    (pred,) = d.forward_train(batch)
    assert pred.shift == 0 and dense_logits(pred).shape == (2, 20, target.vocab_size)
    # every layer of the target: the drafter's forward IS the target's
    full = small(target, num_layers=4)
    (pred,) = full.forward_train(batch)
    torch.testing.assert_close(pred.logits, batch.target_logits[pred.at], atol=1e-5, rtol=0)
    own = small(target, num_layers=1, freeze_embeddings=False)  # own, untied, trainable copies
    emb, head = own.hf_model.get_input_embeddings().weight, own.hf_model.get_output_embeddings().weight
    assert emb.requires_grad and head.requires_grad and emb.data_ptr() != head.data_ptr()
    assert torch.equal(emb, target.embed_tokens().weight) and emb is not target.embed_tokens().weight
    with pytest.raises(ValueError, match="target layers \\[0, 2, 4\\]"):
        small(target, num_layers=3, layer_stride=2)
    for bad in ([0, 0], [4], []):
        with pytest.raises(ValueError, match="must be distinct target layers in 0..3"):
            small(target, layers=bad)
    with pytest.raises(ValueError, match="without layer_stride"):
        small(target, layers=[0, 2], layer_stride=2)
    with pytest.raises(ValueError, match="fresh_config.hiden_size"):
        small(target, source="fresh", fresh_config={"hiden_size": 32})
    fresh = small(target, source="fresh", num_layers=1, freeze_embeddings=False,
                  fresh_config={"hidden_size": 32, "intermediate_size": 64, "head_dim": 8})
    assert dense_logits(fresh.forward_train(batch)[0]).shape == (2, 20, target.vocab_size)


def _pretrained_folder(path, tokenizer, vocab: int):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_pretrained_source_and_tokenizer_refusal(target, tmp_path):
    ok = _pretrained_folder(tmp_path / "ok", target.tokenizer, target.vocab_size)
    d = small(target, source="pretrained", pretrained=ok)
    emb, head = d.hf_model.get_input_embeddings().weight, d.hf_model.get_output_embeddings().weight
    assert not emb.requires_grad and torch.equal(emb, head) and emb.data_ptr() != head.data_ptr()
    save_drafter(d, {"name": "small_lm", "source": "pretrained", "pretrained": ok}, tmp_path / "saved")
    back = load_drafter(tmp_path / "saved", target)
    batch = train_batch(target)
    assert torch.equal(back.forward_train(batch)[0].logits, d.forward_train(batch)[0].logits)
    other = AutoTokenizer.from_pretrained(ok)
    other.add_tokens(["<extra_tok>"])
    bad = _pretrained_folder(tmp_path / "bad", other, target.vocab_size + 1)
    with pytest.raises(ValueError) as err:
        small(target, source="pretrained", pretrained=bad)
    msg = str(err.value)
    assert "does not share the target's tokenizer" in msg
    assert f"target {len(target.tokenizer)} tokens, drafter {len(target.tokenizer) + 1}" in msg
    assert "'<extra_tok>': absent / 49152" in msg and "LM head rows differ" in msg


def test_lora_trains_adapters_only_and_merges(target, tmp_path):
    d = small(target, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    names = [n for n, p in d.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    frozen = {n: p.detach().clone() for n, p in d.named_parameters() if not p.requires_grad}
    batch = train_batch(target)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss, _ = distill_loss(d.forward_train(batch), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in d.named_parameters() if n in frozen)
    assert any(float(p.detach().abs().sum()) > 0 for n, p in d.named_parameters() if "lora_B" in n)
    cfg = {"name": "small_lm", "lora": {"r": 4, "alpha": 8,
                                        "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    save_drafter(d, cfg, tmp_path)
    d.eval()
    assert torch.equal(load_drafter(tmp_path, target).eval().forward_train(batch)[0].logits,
                       d.forward_train(batch)[0].logits)
    merged = d.to_hf_model()  # W + (alpha / r) B A: no adapters left, the same function
    assert not any("lora" in k for k in merged.state_dict())
    q0 = merged.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q0, target.model.model.layers[0].self_attn.q_proj.weight)
    with torch.no_grad():
        torch.testing.assert_close(merged(batch.input_ids).logits, d.logits(batch.input_ids),
                                   atol=1e-5, rtol=0)


def _raw_batch(target):
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    from specdistill.data.chat import encode_chat

    rows = [encode_chat(target.tokenizer, chat, 256), encode_chat(target.tokenizer, chat[:2], 256)]
    return pad_batch([{"input_ids": r.input_ids, "loss_mask": r.loss_mask} for r in rows], 0)


def test_on_policy_batches_come_from_the_drafter(target):
    d = small(target, num_layers=1)
    raw = _raw_batch(target)
    eos = target.eos_token_ids

    def mixer(fraction=1.0, temperature=0.0):
        return OnPolicyMixer(d, fraction=fraction, max_new_tokens=12, temperature=temperature, seed=3,
                             rank=0, pad_id=0, eos_ids=eos, max_length=256, progress=False)

    out = mixer()(raw, step=5, micro=0)
    hf = d.to_hf_model()
    for b in range(2):
        n, mask = int(out["attention_mask"][b].sum()), out["loss_mask"][b]
        P = int((mask[:n] == 0).sum())
        assert mask[P:n].all() and not mask[:P].any() and not mask[n:].any() and n > P
        real = int(raw["attention_mask"][b].sum())
        assert P in assistant_starts(raw["loss_mask"][b, :real])  # a prompt ends where a turn starts
        assert torch.equal(out["input_ids"][b, :P], raw["input_ids"][b, :P])
        want = hf.generate(out["input_ids"][b:b + 1, :P], do_sample=False, max_new_tokens=12,
                           eos_token_id=sorted(eos), pad_token_id=0)[0, P:]  # HF greedy on the drafter
        assert out["input_ids"][b, P:n].tolist() == want.tolist()
    sampled = mixer(temperature=1.0)
    got = sampled(raw, step=7, micro=1)
    choice, gen = sampled.generators(7, 1)
    torch.rand((), generator=choice)  # the coin
    starts = assistant_starts(raw["loss_mask"][0, :int(raw["attention_mask"][0].sum())])
    P = starts[int(torch.randint(len(starts), (), generator=choice))]
    d.reset()
    cont = d.propose(DecodeState(raw["input_ids"][0, :P]), 12, SamplingParams(temperature=1.0), gen).tokens
    hit = torch.isin(cont, torch.tensor(sorted(eos)))  # the mixer cuts after the first EOS
    cont = cont[:int(hit.long().argmax()) + 1] if bool(hit.any()) else cont
    assert got["input_ids"][0, P:int(got["attention_mask"][0].sum())].tolist() == cont.tolist()
    assert torch.equal(sampled(raw, 7, 1)["input_ids"], got["input_ids"])  # seeded by (step, micro)
    coins = [mixer(fraction=0.3)(raw, s, 0) is raw for s in range(30)]
    assert 12 < sum(coins) < 30  # about 70% kept
    late = OnPolicyMixer(d, fraction=1.0, max_new_tokens=12, temperature=0.0, seed=3, rank=0,
                         pad_id=0, eos_ids=eos, max_length=256, start_step=6, progress=False)
    assert late(raw, 5, 0) is raw and not late.last  # warm-up: fixed data before step 6
    assert torch.equal(late(raw, 6, 0)["input_ids"], mixer()(raw, 6, 0)["input_ids"]) and late.last
    with pytest.raises(ValueError, match="reads target features"):
        OnPolicyMixer(build_drafter({"name": "eagle"}, target), fraction=0.5, max_new_tokens=8,
                      temperature=1.0, seed=0, rank=0, pad_id=0, eos_ids=eos, max_length=64)


def test_hf_export_reloads_and_assists_target_generate(target, tmp_path):
    d = small(target, num_layers=2, lora={"r": 2})
    with torch.no_grad():  # move the adapters off zero so the merge matters
        for n, p in d.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    facts = CardFacts(final={"eval": "mtbench", "generations": 2, "k": 4, "max_new_tokens": 16},
                      final_table="| tau | speedup |\n|---:|---:|\n| 2.345 | 1.21x |",
                      simulated={"step": 8, "tau": 1.5, "acceptance": [0.8, 0.6]})
    cfg = {"name": "small_lm", "num_layers": 2, "lora": {"r": 2}}
    out = export_drafter(d, cfg, target, "causal_lm", tmp_path / "export", facts=facts,
                         k=4)["path"]
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= files
    card = (out / "README.md").read_text()  # the measurements the caller handed over
    assert "| 2.345 | 1.21x |" in card and "0.800, 0.600" in card and "step 8" in card
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.tie_word_embeddings and exported.config.num_hidden_layers == 2
    ids = prompt_ids(target)[None]
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, d.eval().logits(ids), atol=1e-5, rtol=0)
    assert exported.config.specdistill["drafter"]["name"] == "small_lm"
    with torch.no_grad():  # our decoder can load the folder back as a drafter
        torch.testing.assert_close(load_export(out, target).logits(ids), d.logits(ids),
                                   atol=1e-5, rtol=0)
    calls = []
    exported.register_forward_hook(lambda *a: calls.append(1))
    kw = dict(do_sample=False, max_new_tokens=20, pad_token_id=0)
    plain = target.model.generate(ids, **kw)
    assisted = target.model.generate(ids, assistant_model=exported, **kw)
    assert calls and torch.equal(plain, assisted)
    with pytest.raises(ValueError, match="full vocabulary"):
        small(target, draft_vocab_size=64).to_hf_model()
    with pytest.raises(ExportError, match="format causal_lm needs .*draft_vocab_size=null"):
        export_drafter(small(target, draft_vocab_size=64), {"name": "small_lm", "draft_vocab_size": 64},
                       target, "causal_lm", tmp_path / "pruned")


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_decoding_equals_plain(target, tree):
    ids = prompt_ids(target, "Write a haiku.")
    shape = {"tree_top_k": 3, "tree_depth": 4, "tree_total_tokens": 12}
    plain = generate(target, None, ids, max_new_tokens=16)
    spec = generate(target, small(target, num_layers=2, **shape), ids, max_new_tokens=16, k=4,
                    tree=tree)
    assert torch.equal(spec.tokens, plain.tokens)
    same = generate(target, small(target, num_layers=4, **shape), ids, max_new_tokens=16, k=4,
                    tree=tree)
    assert torch.equal(same.tokens, plain.tokens)
    # a drafter with all the target's layers is the target: (nearly) every draft is accepted
    assert sum(same.accepted) >= 0.8 * sum(min(4, d) for d in same.drafted)


def test_tree_expansions_match_full_forward(target, monkeypatch):
    """Every tree expansion (cached, batched, tree-masked) equals the drafter's plain forward over
    the committed tokens + the node's path; one child per node gives the greedy chain."""
    import specdistill.drafters.small_lm as module

    calls, real_tree = [], module.dynamic_tree

    def recording_tree(expand_fn, *args):
        def expand(tokens, parents, frontier):
            logp = expand_fn(tokens, parents, frontier)  # (F, V)
            calls.append((tokens.clone(), parents.clone(), frontier.clone(), logp))
            return logp
        return real_tree(expand, *args)

    monkeypatch.setattr(module, "dynamic_tree", recording_tree)
    d = small(target, num_layers=2, tree_top_k=2, tree_depth=3, tree_total_tokens=100)
    ids = prompt_ids(target, "Write a haiku.")
    d.propose_tree(DecodeState(ids), SamplingParams())
    assert len(calls) == 2
    for tokens, parents, frontier, logp in calls:
        for i, node in enumerate(frontier.tolist()):
            path = []
            while node >= 0:
                path.insert(0, int(tokens[node]))
                node = int(parents[node])
            with torch.no_grad():
                ref = d.logits(torch.cat([ids, torch.tensor(path)])[None])[0, -1].log_softmax(-1)
            torch.testing.assert_close(logp[i], ref, atol=1e-4, rtol=0)
    d.cfg.tree_top_k, d.cfg.tree_depth = 1, 5
    assert torch.equal(d.propose_tree(DecodeState(ids), SamplingParams()).tokens,
                       d.propose(DecodeState(ids), 5, SamplingParams()).tokens)


def test_recipe_mixes_on_policy_batches(tmp_path):
    """`python -m train drafter=small_lm trainer.on_policy_fraction=1`: every step trains on the
    drafter's own continuations (logged as on_policy = 1) and the loss is finite."""
    from hydra import compose, initialize_config_dir

    import specdistill.train.__main__  # noqa: F401  (stores the train schemas)
    from specdistill.train.recipe import DistillRecipe

    chats = tmp_path / "chats.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Continue from {words[i % 8]}."},
        {"from": "gpt", "value": " ".join(words[(i + j) % 8] for j in range(8))}]}) + "\n"
        for i in range(12)))
    conf = __import__("pathlib").Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "target=tiny", "data=jsonl", f"data.path={chats}", "data.max_length=64",
            "data.eval_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}", "trainer=smoke",
            "trainer.max_steps=2", "trainer.eval_conversations=1", "trainer.final_eval=null",
            "trainer.on_policy_fraction=1.0", "trainer.on_policy_max_new_tokens=6",
            f"run_dir={tmp_path / 'run'}", "logger.kinds=[jsonl]", "drafter=small_lm",
            "drafter.num_layers=1"])
    recipe = DistillRecipe(cfg)
    recipe.setup()
    recipe.train()
    recipe.cleanup()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(r["on_policy"] == 1.0 and r["loss"] >= 0 for r in steps)
    assert all(0 < r["positions/s0"] <= 2 * 6 for r in steps)  # only the continuations count


def test_small_lm_exports_in_the_layouts_it_registered(target, tmp_path):
    cfg = {"name": "small_lm", "num_layers": 1}
    d = small(target, num_layers=1)
    with pytest.raises(ExportError, match="unknown format 'vllm'.*its formats: causal_lm, hf"):
        export_drafter(d, cfg, target, "vllm", tmp_path / "v")
    ids = prompt_ids(target)[None]
    for fmt in ("hf", "causal_lm"):
        out = export_drafter(d, cfg, target, fmt, tmp_path / fmt)["path"]
        back = load_export(out, target)  # what `python -m decode ckpt=<export>` calls
        with torch.no_grad():
            torch.testing.assert_close(back.logits(ids), d.logits(ids))


def test_offline_capture_for_a_drafter_without_features(tmp_path):
    """small_lm reads no target features: the offline capture stores only what the loss needs, and
    its batches equal online ones (a featureless capture used to fail reading `features`)."""
    from hydra import compose, initialize_config_dir

    import specdistill.train.__main__  # noqa: F401  (stores the train schemas)
    from specdistill.train.recipe import DistillRecipe

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Say {i}."}, {"from": "gpt", "value": f"{i} " * (3 + i % 5)}]})
        + "\n" for i in range(10)))
    conf = __import__("pathlib").Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "target=tiny", "data=jsonl", f"data.path={chats}", "data.max_length=64",
            "data.eval_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}", "trainer=smoke",
            "trainer.features=offline", f"trainer.features_dir={tmp_path / 'feats'}",
            "trainer.final_eval=null", f"run_dir={tmp_path / 'run'}", "logger.kinds=[jsonl]",
            "drafter=small_lm", "drafter.num_layers=1", "drafter.draft_vocab_size=256"])
    recipe = DistillRecipe(cfg)
    recipe.setup()
    assert json.loads((tmp_path / "feats" / "manifest.json").read_text())["layers"] == []
    raw = next(recipe.batches)
    offline = recipe.make_batch(raw)
    recipe.offline = None
    online = recipe.make_batch(raw)
    assert offline.features is None and online.features is None
    read = online.target_logits.known  # where a loss reads the teacher: both have it there
    assert read.any() and torch.equal(read, offline.target_logits.known)
    torch.testing.assert_close(offline.target_logits[read], online.target_logits[read],
                               rtol=1e-4, atol=1e-4)
    recipe.cleanup()


def test_bench_grid_replay_equals_the_real_decoder(tmp_path):
    """`python -m benchmarks.small_lm_study --tiny`: one trained run, its real-decoder eval and its greedy
    replay on the same prompts and answer length, which must give the decoder's tau exactly."""
    from benchmarks.small_lm_study import main

    out = tmp_path / "bench"
    rows = main(["--tiny", "--out", str(out), "--steps", "2", "--layers", "1", "--losses",
                 "forward_kl", "--on-policy-fraction", "0", "--limit", "2", "--max-new-tokens",
                 "8", "--replay-prompts", "2", "--replay-tokens", "8", "--alpha-prompts", "1"])
    assert [r["run"] for r in rows] == ["L1-forward_kl-fixed"]
    rep = [json.loads(line) for line in (out / "replay.jsonl").read_text().splitlines()]
    assert len(rep) == 1 and rep[0]["rounds"] > 0 and rep[0]["alpha_positions"] == 7
    assert rows[0]["tau"] > 1.0  # drafts were accepted: the equality below has something to match
    assert rep[0]["replay_tau"] == pytest.approx(rows[0]["tau"], abs=1e-12)
    assert 0.0 <= rep[0]["alpha_t1"] <= 1.0
    table = (out / "table.md").read_text()
    assert "replay tau k=4" in table and "Best greedy replay (2 prompts x 8 tokens," in table
    # a rerun trains and replays nothing again
    assert main(["--tiny", "--out", str(out), "--only-replay", "--replay-prompts", "2",
                 "--replay-tokens", "8"]) == rows
    assert len((out / "replay.jsonl").read_text().splitlines()) == 1
    # every checkpoint of a run, replayed: the last one is the final drafter
    main(["--tiny", "--out", str(out), "--replay-checkpoints", rows[0]["run_dir"],
          "--replay-prompts", "2", "--replay-tokens", "8", "--alpha-prompts", "0"])
    ck = [json.loads(line) for line in (out / "replay_checkpoints.jsonl").read_text().splitlines()]
    assert [r["run"] for r in ck] == ["L1-forward_kl-fixed@step-0000002"]
    assert ck[0]["replay_tau"] == pytest.approx(rows[0]["tau"], abs=1e-12)


def test_bench_standard_errors_count_prompts_not_rounds():
    from benchmarks.replaying import paired_gap, ratio_se

    assert ratio_se([3, 1], [1, 1]) == pytest.approx((2.0, 1.0))  # residuals +1, -1 over 2 prompts
    assert ratio_se([2, 4], [1, 2]) == pytest.approx((2.0, 0.0))  # every prompt at the ratio
    a = {"per_prompt": [[1, 3, 0.5, 1], [1, 1, 0.5, 1]]}  # rounds, tokens, alpha sum, positions
    b = {"per_prompt": [[1, 2, 0.25, 1], [1, 0, 0.25, 1]]}
    assert paired_gap(a, b, "tau") == pytest.approx((1.0, 0.0))  # a beats b by 1 on both prompts
    assert paired_gap(a, b, "alpha") == pytest.approx((0.25, 0.0))
    assert paired_gap(a, a, "tau") == pytest.approx((0.0, 0.0))


def test_bench_init_divergence_is_zero_for_the_whole_target(tiny_target_cfg):
    """A drafter built from every target layer IS the target: KL 0 and full agreement; fewer
    layers start away from it."""
    from benchmarks.small_lm_study import init_divergence
    from specdistill.target.model import load_target

    target = load_target(tiny_target_cfg)
    answers = [{"prompt": [5, 6, 7, 8], "answer": [9, 10, 11, 12, 13]},
               {"prompt": [40, 41], "answer": [42, 43, 44]}]
    md = init_divergence(target, [[0, 1], [1]], answers).splitlines()
    assert md[2].startswith("| [0, 1] | 0.00 | 1.000 |")
    kl, agree = (float(x) for x in md[3].strip("|").split("|")[1:])
    assert kl > 0.0 and agree < 1.0
