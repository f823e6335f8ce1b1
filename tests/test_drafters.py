"""Trainable drafters on a tiny random Llama target: training shapes, decode-time proposals, the
drafter's KV cache under accept/reject, pruned vocabularies, save/load, and that training learns.

Tests over "every trainable drafter" are parametrised over the registry, so a new drafter is
picked up with no edit here."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specdistill.drafters  # noqa: F401  (registers every drafter)
from specdistill.drafters.base import (
    CONFIGS,
    DRAFTERS,
    DecodeState,
    TrainBatch,
    build_drafter,
    trainable_drafters,
)
from specdistill.drafters.parts.anchors import counted, dense_logits
from specdistill.drafters.parts.head import fit_draft_vocab
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.drafters.parts.vocab import (
    d2t_to_offsets,
    expand_probs,
    offsets_to_d2t,
    select_draft_vocab,
    t2d_mask,
)
from specdistill.store.drafter import load_drafter, save_drafter
from specdistill.target.model import Target
from specdistill.train.losses import distill_loss, drafter_loss

V, H = 128, 32
TRAINABLE = trainable_drafters()
GREEDY, SAMPLE = SamplingParams(), SamplingParams(temperature=0.8, top_k=20)


@pytest.fixture(scope="module")
def target() -> Target:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
    with torch.no_grad():  # peaked next-token distributions, like a trained LM (random init is ~uniform)
        model.lm_head.weight.mul_(20.0)
    return Target(model, SimpleNamespace(eos_token_id=2), "tiny")


def make_batch(target, drafter, B=2, T=16, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)  # (B, T)
    attn = torch.ones(B, T, dtype=torch.long)
    if B > 1:
        attn[-1, T - 4:] = 0  # right padding on the last row
    out = target.forward(ids, layers=drafter.feature_layers, attention_mask=attn)
    loss_mask = attn.clone()
    loss_mask[:, :3] = 0  # a "prompt" that is not trained on
    return TrainBatch(ids, attn, loss_mask, out.logits, out.features)


def decode_state(target, drafter, tokens: torch.Tensor) -> DecodeState:
    """What the decoder shows: committed tokens and target features of tokens[:-1]."""
    feats = target.forward(tokens[None, :-1], layers=drafter.feature_layers, logits=False).features
    return DecodeState(tokens=tokens, features=None if feats is None else feats[0])  # (T,), (T-1, F)


def pruned(name: str) -> dict:
    return {"name": name, "draft_vocab_size": 48}


def full(name: str, **settings) -> dict:
    """The drafter with the full target vocabulary (EAGLE's schema default prunes to 8192 ids,
    more than this tiny target has)."""
    fields = CONFIGS[name].__dataclass_fields__
    return {"name": name, **({"draft_vocab_size": None} if "draft_vocab_size" in fields else {}),
            **settings}


def randomise(drafter, seed=1) -> None:
    """Move every parameter off its init (zero-init Medusa heads would hide alignment bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name", TRAINABLE)
@pytest.mark.parametrize("prune", [False, True])
def test_forward_backward_shapes(target, name, prune):
    d = build_drafter(pruned(name) if prune else full(name), target)
    batch = make_batch(target, d)
    preds = d.forward_train(batch)
    Vd = 48 if prune else V
    # shift 0 = next token (a small LM); EAGLE / Medusa predict from shift 1 on
    # the head runs only where the loss counts (p.at), or at sampled anchors, or everywhere
    lead = [(int(p.at.sum()),) if p.at is not None else tuple(p.anchors.shape)
            if p.anchors is not None else (2, 16) for p in preds]
    assert preds and all(p.logits.shape == (*r, Vd) and p.shift >= 0 for p, r in zip(preds, lead))
    assert all(p.at is None or int(p.at.sum()) < 2 * 16 for p in preds)  # padding, prompts skipped
    loss, parts = drafter_loss(d, preds, batch, "forward_kl", 1.0, 0.1, d2t=d.d2t)  # the recipe's
    loss.backward()
    grads = [p.grad for p in d.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert not any(p.requires_grad for p in target.model.parameters())
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in parts.values())


@pytest.fixture
def own_rng():
    """Seed freely inside the test: the other tests' random draws stay as they were."""
    with torch.random.fork_rng():
        yield


@pytest.mark.parametrize("name", TRAINABLE)
def test_head_only_where_the_loss_counts_changes_nothing(target, name, monkeypatch, own_rng):
    """The head runs only at the anchors the loss counts (drafters/parts/anchors.py counted): the loss
    and every gradient equal those of the head run at every position, the loss picking its rows."""
    import importlib

    def run(everywhere: bool):
        torch.manual_seed(0)  # the same init and sampled anchors (P-EAGLE, DFlash) in both runs
        d = build_drafter(pruned(name), target)
        randomise(d)
        module = importlib.import_module(type(d).__module__)
        if everywhere and hasattr(module, "counted"):
            monkeypatch.setattr(module, "counted",
                                lambda b, s: torch.ones(b.input_ids.shape, dtype=torch.bool))
        batch = make_batch(target, d)
        preds = d.forward_train(batch)
        monkeypatch.undo()
        loss, _ = distill_loss(preds, batch, "forward_kl", 1.0, 0.1, d2t=d.d2t)
        loss.backward()
        rows = sum(p.logits[..., 0].numel() for p in preds)
        return loss.detach(), {n: p.grad for n, p in d.named_parameters() if p.grad is not None}, rows

    lazy, dense = run(False), run(True)
    assert torch.allclose(lazy[0], dense[0], rtol=1e-5, atol=1e-6)
    assert lazy[1].keys() == dense[1].keys() and lazy[1]
    for n in lazy[1]:
        assert torch.allclose(lazy[1][n], dense[1][n], rtol=1e-4, atol=1e-6), n
    if "block-drafting" not in DRAFTERS[name].tags:  # dflash / dspark: sampled anchors already
        assert lazy[2] < dense[2]  # and the head really ran at fewer rows


@pytest.mark.parametrize("name", TRAINABLE)
def test_teacher_only_where_the_loss_reads_it(target, name, own_rng):
    """The trainer's batch (train/teacher.py train_batch) holds the target's logits only where a
    loss reads them, NaN elsewhere: the loss equals the one against the teacher at every position
    (so no NaN is ever read), and prompts and padding cost no LM-head rows."""
    from specdistill.data.capture import capture
    from specdistill.train.teacher import train_batch

    torch.manual_seed(0)
    d = build_drafter(pruned(name), target)
    randomise(d)
    dense = make_batch(target, d)  # the target's full logits at every position
    feats, final = capture(target, dense.input_ids, dense.attention_mask, d.feature_layers)
    raw = {"input_ids": dense.input_ids, "attention_mask": dense.attention_mask,
           "loss_mask": dense.loss_mask}
    lazy = train_batch(raw, feats, target, final, d.d2t, "cpu")
    at = counted(lazy, 0)
    assert 0 < int(at.sum()) < at.numel() and bool(lazy.target_logits[~at].isnan().all())
    assert lazy.target_logits.rows.shape[0] == int(at.sum()) + 1  # those rows only, and the NaN one
    torch.testing.assert_close(lazy.target_logits[at], dense.target_logits[at][:, d.d2t])
    torch.manual_seed(1)
    want = distill_loss(d.forward_train(dense), dense, "forward_kl", 1.0, 0.1, d2t=d.d2t)[0]
    torch.manual_seed(1)
    got = distill_loss(d.forward_train(lazy), lazy, "forward_kl", 1.0, 0.1)[0]
    assert torch.isfinite(got) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_a_block_drafter_gets_its_teacher_only_at_its_drawn_blocks(target, name):
    """With a drawn share of anchors, the teacher is built only at the drawn anchors' blocks
    (Drafter.teacher_rows, drawn before the teacher into batch.anchors): fewer LM-head rows than
    every scored position, and the same anchors, loss and gradients as a teacher at every one."""
    from specdistill.data.capture import capture
    from specdistill.train.teacher import train_batch

    torch.manual_seed(0)
    d = build_drafter({**pruned(name), "anchors": 0.3}, target)
    randomise(d)
    dense = make_batch(target, d)
    feats, final = capture(target, dense.input_ids, dense.attention_mask, d.feature_layers)
    raw = {"input_ids": dense.input_ids, "attention_mask": dense.attention_mask,
           "loss_mask": dense.loss_mask}

    def run(drafter):
        torch.manual_seed(1)
        batch = train_batch(raw, feats, target, final, d.d2t, "cpu", drafter)
        d.zero_grad()
        preds = d.forward_train(batch)
        loss = drafter_loss(d, preds, batch, "forward_kl")[0]
        loss.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        return batch, preds[0].anchors, loss.detach(), grads

    lazy, anchors, loss, grads = run(d)
    every, anchors_every, loss_every, grads_every = run(None)
    built = lazy.target_logits.known
    assert lazy.anchors is not None and every.anchors is None
    assert 0 < int(built.sum()) < int(counted(every, 0).sum())  # fewer LM-head rows
    assert torch.equal(anchors, anchors_every) and torch.isfinite(loss) and torch.equal(loss, loss_every)
    assert grads.keys() == grads_every.keys() and grads
    for n in grads:
        assert torch.equal(grads[n], grads_every[n]), n
    assert d.teacher_rows(every) is not None
    assert build_drafter(pruned(name), target).teacher_rows(every) is None


@pytest.mark.parametrize("name", TRAINABLE)
@pytest.mark.parametrize("prune", [False, True])
def test_proposals_are_target_ids(target, name, prune):
    d = build_drafter(pruned(name) if prune else full(name), target)
    randomise(d)
    if prune:  # a real map, not the placeholder 0..Vd-1
        fit_draft_vocab(d, torch.arange(V).flip(0).float(), always_include=[2])
    st = decode_state(target, d, torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(3)))
    g = torch.Generator().manual_seed(0)
    chain = d.propose(st, 3, SAMPLE, g)
    n = chain.tokens.shape[0]
    assert 1 <= n <= 3 and chain.tokens.dtype == torch.long and chain.probs.shape == (n, V)
    assert torch.allclose(chain.probs.sum(-1), torch.ones(n), atol=1e-5)
    assert bool((chain.probs[torch.arange(n), chain.tokens] > 0).all())
    greedy = d.propose(st, 3, GREEDY)
    assert greedy.probs is None and 1 <= greedy.tokens.shape[0] <= 3
    assert d.propose(st, 3, GREEDY, min_confidence=1.01).tokens.shape == (1,)  # at least one token
    assert d.propose(st, 0, GREEDY).tokens.shape == (0,)
    trees = [d.propose_tree(st, GREEDY)] if d.supports_tree else []  # dspark: chains only
    for tree in trees:
        assert tree.tokens.shape == tree.parents.shape
        assert bool((tree.parents < torch.arange(len(tree.parents))).all())
    for ids in (chain.tokens, greedy.tokens, *[t.tokens for t in trees]):
        assert bool(((ids >= 0) & (ids < V)).all())
        if prune:
            assert bool(d.draft_vocab.t2d[ids].all())  # only draft-vocab tokens are ever proposed
            assert float(chain.probs[:, ~d.draft_vocab.t2d].abs().sum()) == 0.0


@pytest.mark.parametrize("name", TRAINABLE)
def test_cache_handles_accept_and_reject(target, name):
    """Proposing after a partial accept (or a full reject) equals proposing from a fresh reset."""
    cached, fresh = build_drafter(full(name), target), build_drafter(full(name), target)
    randomise(cached)
    fresh.load_state_dict(cached.state_dict())
    tokens = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(4))
    first = cached.propose(decode_state(target, cached, tokens), 4, GREEDY)
    rounds = [torch.cat([tokens, first.tokens[:2], torch.tensor([7])]),  # 2 accepted + bonus
              None]  # then: everything rejected, only a bonus token
    for new in rounds:
        new = torch.cat([tokens, torch.tensor([5])]) if new is None else new
        st = decode_state(target, cached, new)
        fresh.reset()
        a, b = cached.propose(st, 4, GREEDY), fresh.propose(st, 4, GREEDY)
        assert torch.equal(a.tokens, b.tokens)
        ga, gb = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        sa, sb = cached.propose(st, 4, SAMPLE, ga), fresh.propose(st, 4, SAMPLE, gb)
        assert torch.equal(sa.tokens, sb.tokens) and torch.allclose(sa.probs, sb.probs, atol=1e-5)
        tokens = new
    # a different prompt without reset() (sharing 5 tokens) must not reuse the stale positions
    other = torch.cat([tokens[:5], torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(5))])
    st = decode_state(target, cached, other)
    fresh.reset()
    ga, gb = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.allclose(cached.propose(st, 4, SAMPLE, ga).probs, fresh.propose(st, 4, SAMPLE, gb).probs,
                          atol=1e-5)


def test_eagle_training_matches_decoding(target):
    """Teacher-forced logits at t == the decode-time logits of the first draft after t; the
    unrolled step 2 at t == the decode-time second step fed the true token (the TTT mask)."""
    d = build_drafter(full("eagle", train_unroll=3), target)
    randomise(d)
    batch = make_batch(target, d, B=1, T=12)
    preds = d.forward_train(batch)
    assert [p.shift for p in preds] == [1, 2, 3]
    ids = batch.input_ids[0]
    for t in (3, 7):  # anchors every step is trained at (token t+4 < T)
        d.reset()
        h = d.drafting.sync(DecodeState(ids[:t + 2], batch.features[0, :t + 1]))  # (1, 1, H)
        assert torch.allclose(d.head(h)[0, 0], dense_logits(preds[0])[0, t], atol=1e-4)
        for j in (2, 3):  # feed the true next token and the drafter's own feature
            h = d.backbone(d.inputs(ids[t + j].view(1, 1), h), torch.tensor([[t + j - 1]]), None, d.cache.kv)
            assert torch.allclose(d.head(h)[0, 0], dense_logits(preds[j - 1])[0, t], atol=1e-4)


def test_eagle_tree_expands_each_node_correctly(target, monkeypatch):
    """Every expansion's log-probs equal the node's draft distribution recomputed from scratch
    along its path (checks the tree mask and positions); top_k=1 gives the greedy chain."""
    import specdistill.drafters.parts.drafting as eagle_module

    calls = []

    def recording_tree(expand_fn, *args):
        def expand(tokens, parents, frontier):
            logp = expand_fn(tokens, parents, frontier)  # (F, Vd)
            calls.append((tokens.clone(), parents.clone(), frontier.clone(), logp))
            return logp
        return eagle_module.dynamic_tree.__wrapped_tree__(expand, *args)

    recording_tree.__wrapped_tree__ = eagle_module.dynamic_tree
    monkeypatch.setattr(eagle_module, "dynamic_tree", recording_tree)
    d = build_drafter(full("eagle", tree_top_k=3, tree_depth=4, tree_total_tokens=100),
                      target)
    randomise(d)
    tokens = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(6))
    st = decode_state(target, d, tokens)
    tree = d.propose_tree(st, GREEDY)
    assert len(tree.tokens) == 3 + 9 + 9 + 9  # 3 children of each of the 3 best nodes per level
    assert len(calls) == 3

    def path_logp(tokens_, parents_, node: int) -> torch.Tensor:
        path = []
        while node >= 0:
            path.append(int(tokens_[node]))
            node = int(parents_[node])
        d.reset()
        h = d.drafting.sync(st)
        for i, tok in enumerate(reversed(path)):
            h = d.backbone(d.inputs(torch.tensor([[tok]]), h), torch.tensor([[len(tokens) - 1 + i]]),
                          None, d.cache.kv)
        return d.head(h)[0, 0].log_softmax(-1)

    for toks, pars, frontier, logp in calls:
        for i, node in enumerate(frontier.tolist()):
            assert torch.allclose(logp[i], path_logp(toks, pars, node), atol=1e-4)
    chain = d.propose(st, 4, GREEDY)
    d.cfg.tree_top_k = 1
    assert torch.equal(d.propose_tree(st, GREEDY).tokens, chain.tokens)


def test_medusa_alignment_and_fresh_heads(target):
    d = build_drafter(full("medusa"), target)
    batch = make_batch(target, d)
    for p in d.forward_train(batch):  # zero-init blocks: every head is the target's LM head
        assert torch.allclose(p.logits, batch.target_logits[p.at], atol=1e-5)  # at its anchors
    assert [(p.shift, p.weight) for p in d.forward_train(batch)] == [(1, 1.0), (2, 0.8),
                                                                     (3, 0.8 ** 2), (4, 0.8 ** 3)]
    randomise(d)
    st = decode_state(target, d, torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(7)))
    chain = d.propose(st, 10, GREEDY)
    assert len(chain.tokens) == 4  # capped at num_heads
    expect = [int(d.head_logits(st.features[-1], k).argmax()) for k in range(4)]
    assert chain.tokens.tolist() == expect  # head k reads the feature that produced the bonus token
    feats = st.features.clone()
    feats[:-1] = 0.0  # only the last feature matters
    assert torch.equal(d.propose(DecodeState(st.tokens, feats), 4, GREEDY).tokens, chain.tokens)
    feats[-1] = st.features[-2]
    assert not torch.equal(d.propose(DecodeState(st.tokens, feats), 4, GREEDY).tokens, chain.tokens)
    tree = d.propose_tree(st, GREEDY)
    assert len(tree.tokens) == 26 and int(tree.tokens[0]) == expect[0]
    small = build_drafter(full("medusa", tree_top_k=2, num_heads=3), target)
    assert len(small.tree.parents) == 2 + 4 + 5  # hand-counted default paths with ranks < 2, depth <= 3


def test_draft_vocab_maps():
    counts = torch.tensor([5.0, 1, 5, 0, 3, 3])
    assert select_draft_vocab(counts, 3).tolist() == [0, 2, 4]  # 4 beats 5 on the 3-3 tie (lower id)
    assert select_draft_vocab(counts, 3, always_include=[3]).tolist() == [0, 2, 3]
    d2t = torch.tensor([1, 4, 5])
    assert t2d_mask(d2t, 6).tolist() == [False, True, False, False, True, True]
    assert d2t_to_offsets(d2t).tolist() == [1, 3, 3]  # target_id = i + offset[i]
    assert torch.equal(offsets_to_d2t(d2t_to_offsets(d2t)), d2t)
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    assert torch.equal(expand_probs(probs, d2t, 6), torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.3, 0.2]]))
    with pytest.raises(ValueError):
        select_draft_vocab(counts, 1, always_include=[0, 1])


@pytest.mark.parametrize("name", TRAINABLE)
def test_pruned_head_starts_from_target_rows(target, name):
    d = build_drafter(pruned(name), target)
    counts = torch.zeros(V).index_fill_(0, torch.arange(60, 108), 10.0)
    assert fit_draft_vocab(d, counts, always_include=[2])
    assert d.d2t[0] == 2 and d.d2t.shape == (48,) and int(d.draft_vocab.t2d.sum()) == 48
    assert torch.equal(d.lm_head.weight, target.lm_head().weight[d.d2t])
    assert not fit_draft_vocab(build_drafter(full(name), target), counts)


@pytest.mark.parametrize("name", TRAINABLE)
@pytest.mark.parametrize("prune", [False, True])
def test_save_load_round_trip(target, name, prune, tmp_path):
    cfg = pruned(name) if prune else full(name)
    d = build_drafter(cfg, target)
    randomise(d)
    if prune:
        fit_draft_vocab(d, torch.arange(V).float())
    save_drafter(d, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter.json", "drafter.safetensors"]
    loaded = load_drafter(tmp_path, target)
    batch = make_batch(target, d)
    for a, b in zip(d.forward_train(batch), loaded.forward_train(batch)):
        assert torch.equal(a.logits, b.logits)
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "drafter.safetensors"))
    assert set(saved) == set(d.state_dict())
    target_shapes = {tuple(p.shape) for p in target.model.parameters() if p.dim() == 2 and p.shape[0] == V}
    assert not any(tuple(v.shape) in target_shapes for v in saved.values())  # no embedding / LM head
    if prune:
        assert torch.equal(loaded.d2t, d.d2t)


def test_init_from_target_layer(target):
    d = build_drafter(full("eagle", init_from_target_layer=-1), target)
    src = target.model.model.layers[-1].state_dict()
    assert all(torch.equal(v, src[k]) for k, v in d.layers[0].state_dict().items())


SHIPPED = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "drafter").glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_yaml_composes_builds_and_holds_only_differences(tiny_target_cfg, name):
    """Every conf/drafter/*.yaml is a registered drafter, composes, builds on the tiny target (the
    SmolLM2 vocabulary) as it is, and sets only keys whose value differs from its schema."""
    import yaml
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specdistill.decode.config import store_schemas
    from specdistill.drafters.base import config_dict
    from specdistill.target.model import load_target

    store_schemas()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(overrides=[f"+drafter={name}"]).drafter
    assert cfg.name == name and name in CONFIGS
    shipped = yaml.safe_load((conf / "drafter" / f"{name}.yaml").read_text())
    schema = config_dict(CONFIGS[name]())
    same = {k: v for k, v in shipped.items() if k != "defaults" and schema.get(k) == v}
    assert not same, f"conf/drafter/{name}.yaml repeats schema defaults {same}"
    assert build_drafter(OmegaConf.to_container(cfg), load_target(tiny_target_cfg)).name == name


@pytest.mark.parametrize("name", TRAINABLE)
def test_training_lowers_loss(target, name):
    torch.manual_seed(0)
    cfg = full(name)
    if "train_unroll" in CONFIGS[name].__dataclass_fields__:
        cfg["train_unroll"] = 2
    if "source" in CONFIGS[name].__dataclass_fields__:  # small_lm: every layer of the 2-layer
        cfg["num_layers"] = 1  # target would BE the target (zero loss from the start)
    d = build_drafter(cfg, target)
    batch = make_batch(target, d, B=2, T=24)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(25):
        loss, _ = distill_loss(d.forward_train(batch), batch, "forward_kl", 1.0, 0.1, d2t=d.d2t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
