"""Exact batched decoding (decode/batched/exact.py, `generate_batch(exact_verify=True)`): every row
of a batched forward rounds as its lone exact decode, so each greedy output is bit-identical to
decoding that prompt alone at bf16, whatever the batch size, the other rows and the admission order;
not only up to near-ties."""
import pytest
import torch
from decode_toys import NoisyOracle
from test_exact_verify import _toy

from specdistill.decode.batched.exact import ExactRows
from specdistill.decode.batched.spec import generate_batch
from specdistill.decode.exact import VERIFY_ROOM, ExactVerify
from specdistill.decode.spec import generate
from specdistill.drafters.ngram import Ngram, NgramConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def toy():
    """bf16, small init: flat logits, many near-ties (a batched forward without exact kernels
    changes 2-4 of the 6 outputs below on the 2-core AVX512-BF16 dev machine)."""
    return _toy()


def _work():
    """Ragged prompts and budgets: 6 sequences through batches of up to 4 (admissions mid-run)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (5, 17, 9, 30, 12, 3)]
    return prompts, [40, 25, 60, 33, 50, 45]


@pytest.fixture(scope="module")
def alone(toy):
    """Each prompt decoded alone, plain, with exact kernels: what every exact chain must give."""
    prompts, budgets = _work()
    return [generate(toy, None, p, max_new_tokens=n, exact_verify=True).tokens
            for p, n in zip(prompts, budgets)]


@pytest.mark.parametrize("batch_size", [2, 4])
@pytest.mark.parametrize("mode,k", [("plain", 0), ("verify_all", 1), ("verify_all", 3),
                                    ("budgeted", 3)])
def test_exact_batched_chains_are_unbatched_plain_bit_for_bit(toy, alone, batch_size, mode, k):
    prompts, budgets = _work()
    drafter = (lambda: NoisyOracle(toy, noise=0.3, seed=1)) if mode != "plain" else None
    cost = None
    if mode == "budgeted":  # a flat cost grid: verifying is as cheap as a step, so rows draft
        from specdistill.decode.batched.cost import CostCurve
        cost = CostCurve([1, 2, 4], [1, 2, 3, 4], [[1.0] * 4 for _ in range(3)])
    out = generate_batch(toy, drafter, prompts, max_new_tokens=budgets, batch_size=batch_size,
                         k=max(k, 1), mode=mode, exact_verify=True, cost=cost)
    for i, (ref, res) in enumerate(zip(alone, out.results)):
        assert res.tokens.tolist() == ref.tolist(), (mode, k, batch_size, i)
    assert max(out.batch_sizes) == batch_size  # the rows really shared forwards
    if mode != "plain":
        assert sum(sum(r.accepted) for r in out.results) > 0  # drafts were accepted
        assert max(out.widths) > 1


def test_exact_batched_trees_are_their_lone_exact_trees(toy):
    """Trees: each row's output equals the same tree decode alone with exact kernels (which itself
    matches plain decoding up to near-ties only: decode/exact.py)."""
    prompts, budgets = _work()

    def ngram():
        return Ngram(NgramConfig(), toy.vocab_size)
    lone = [generate(toy, ngram(), p, max_new_tokens=n, tree=True, exact_verify=True).tokens
            for p, n in zip(prompts, budgets)]
    out = generate_batch(toy, ngram, prompts, max_new_tokens=budgets, batch_size=4, tree=True,
                         mode="verify_all", exact_verify=True)
    assert [r.tokens.tolist() for r in out.results] == [t.tolist() for t in lone]
    assert sum(sum(r.accepted) for r in out.results) > 0


def test_exact_rows_mask_positions_and_writes(toy):
    """The layout: row r's block goes to its own columns [L_r, L_r + Q); its mask sees its cached
    columns and its block (chain: causally; tree: ancestors), nothing of the other rows' columns."""
    rows = ExactRows(toy)
    ev = [ExactVerify(toy, 4, 8), ExactVerify(toy, 2, 3)]
    for e, n in zip(ev, (4, 2)):  # a prefill writes each lone cache
        ids = torch.arange(n)[None]
        toy.forward(ids, cache=e.cache, **e.chain(0, n, ids.device))
    rows.add_row(ev[0], 4)
    rows.add_row(ev[1], 2)
    assert rows.caps == [4 + 8 + VERIFY_ROOM, 2 + 3 + VERIFY_ROOM]
    assert rows.cache.layers[0].keys.shape[-2] == rows.caps[0]  # the widest row
    chain = torch.tensor([5, 6, 7])
    anc = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)  # node 1 under node 0
    ids, mask, pos = rows.inputs([chain, torch.tensor([9, 10, 11])], [4, 2], [None, anc])
    assert ids.tolist() == [[5, 6, 7], [9, 10, 11]]
    assert pos.tolist() == [[4, 5, 6], [2, 3, 4]]
    m = mask[:, 0]
    assert m[0, 0, :5].all() and not m[0, 0, 5:].any()  # cache + itself
    assert m[0, 2, :7].all() and not m[0, 2, 7:].any()
    assert m[1, 0, :3].all() and not m[1, 0, 3:].any()  # the root: cache + itself
    assert m[1, 2, :5].all() and not m[1, 2, 5:].any()  # node 1: root, node 0, itself
    rows_idx, cols = rows.write_index(3)
    assert cols.tolist() == [[4, 5, 6], [2, 3, 4]] and rows_idx.tolist() == [[0] * 3, [1] * 3]
    before = rows.cache.layers[0].keys.clone()
    toy.forward(ids, cache=rows.cache, attention_mask=mask, position_ids=pos)
    after = rows.cache.layers[0].keys
    changed = (after != before).any(-1).any(1)  # (B, W) columns written
    assert changed[0].nonzero().flatten().tolist() == [4, 5, 6]
    assert changed[1].nonzero().flatten().tolist() == [2, 3, 4]
    rows.compact([4, 2], [2, torch.tensor([0, 2])])  # row 1 keeps root and node 1 (block pos 2)
    assert torch.equal(rows.cache.layers[0].keys[1, :, 3], after[1, :, 4])
    rows.select_rows([1])
    assert rows.caps == [2 + 3 + VERIFY_ROOM]
    assert rows.cache.layers[0].keys.shape[:3] == (1, 2, rows.caps[0])


def test_exact_rows_room_is_checked(toy):
    rows = ExactRows(toy)
    ev = ExactVerify(toy, 2, 1)
    ids = torch.arange(2)[None]
    toy.forward(ids, cache=ev.cache, **ev.chain(0, 2, ids.device))
    rows.add_row(ev, 2)
    with pytest.raises(ValueError, match="row 0 needs .* static capacity is"):
        rows.inputs([torch.arange(VERIFY_ROOM + 2)], [2])


@pytest.mark.slow
def test_smollm2_bf16_exact_batch_is_unbatched_bit_for_bit():
    """The real target at bf16 with the n-gram drafter, 3 MT-bench prompts through batches of 2."""
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.evaluate import render
    from specdistill.target.model import TargetConfig, load_target

    target = load_target(TargetConfig(path="packaged:smollm2", dtype="bfloat16"))
    ids = [render(target, p.turns[:1], []) for p in load_prompts("mtbench", limit=3)]
    lone = [generate(target, None, x, max_new_tokens=40, exact_verify=True).tokens for x in ids]
    out = generate_batch(target, lambda: Ngram(NgramConfig(), target.vocab_size), ids,
                         max_new_tokens=40, batch_size=2, k=4, exact_verify=True)
    assert [r.tokens.tolist() for r in out.results] == [t.tolist() for t in lone]


def test_exact_attention_reduces_each_row_over_its_own_capacity():
    """Under `active(capacities)` row r's attention is its lone exact decode's: over its own first
    C_r columns, even when another row makes the batch wider. (Over the batch's width instead, a
    reduction of 929 columns padded to 1429 rounds differently on the 2-core AVX512-BF16 dev
    machine at SmolLM2's head shapes: the softmax and p @ v reduce over the length.)"""
    from torch import nn

    from specdistill.decode.exact import active, exact_attention
    from specdistill.target.attention import grouped_attention

    g = torch.Generator().manual_seed(2)  # a draw where the two widths round differently there
    caps, q = [929, 1429], 3
    query = torch.randn(2, 9, q, 64, generator=g).to(torch.bfloat16)
    key = torch.randn(2, 3, 1429, 64, generator=g).to(torch.bfloat16)
    value = torch.randn(2, 3, 1429, 64, generator=g).to(torch.bfloat16)
    cols = torch.arange(1429)
    last = torch.tensor([[c - 128 - q + t for t in range(q)] for c in caps])  # (2, q)
    mask = (cols[None, None, :] <= last[:, :, None])[:, None]  # (2, 1, q, 1429)
    with active(caps):
        out, _ = exact_attention(nn.Module(), query, key, value, mask)  # (2, q, H, d)
    for r, c in enumerate(caps):
        alone = grouped_attention(query[r:r + 1], key[r:r + 1, :, :c], value[r:r + 1, :, :c],
                                  mask[r:r + 1, ..., :c], None, two_rows=True)
        assert torch.equal(out[r:r + 1], alone.transpose(1, 2)), r
    with pytest.raises(ValueError, match="2 row capacities for 1 rows"):
        with active(caps):
            exact_attention(nn.Module(), query[:1], key[:1], value[:1], mask[:1])


def test_batch_bench_exact_cells_match_unbatched(toy):
    """`benchmarks.decode_speed --batch --batch-exact`: every mode again with exact_verify, interleaved; the
    exact cells' outputs equal unbatched (B = 1) exact plain decoding's, and the table says so."""
    from benchmarks.batch_speed import batch_markdown, run_batch_bench

    prompts, _ = _work()
    order = []
    rows = run_batch_bench(toy, NoisyOracle(toy, noise=0.3, seed=1), prompts[:4],
                           batch_sizes=(1, 4), modes=("plain", "verify_all"), k=3,
                           max_new_tokens=30, repeats=1, log=order.append, exact=True)
    assert [o.split(":")[0] for o in order[:4]] == [
        "repeat 1/1 B=1 plain", "repeat 1/1 B=1 verify_all", "repeat 1/1 B=1 plain exact",
        "repeat 1/1 B=1 verify_all exact"]
    exact = [r for r in rows if r["mode"].endswith("exact")]
    assert len(exact) == 4 and all(r["differ_from_unbatched"] == 0 for r in exact)
    assert all(r["differ_from_plain"] == 0 for r in exact)
    assert all(r["differ_from_unbatched"] is not None for r in rows)  # B = 1 ran
    table = "\n".join(batch_markdown(rows))
    assert "| 4 | verify_all exact |" in table and "outputs differ from unbatched" in table


def test_explicit_masks_refuse_contexts_past_a_sliding_window():
    """Decodes that pass their own 4-D attention masks (batched, exact, trees) would attend past a
    sliding-window layer's window: they refuse such a length with the numbers; plain chains alone
    (the model's own masks) and lengths within the window still run."""
    from decode_toys import StubTokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specdistill.target.model import Target

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      use_sliding_window=True, sliding_window=16, max_window_layers=0)
    torch.manual_seed(0)
    target = Target(Qwen2ForCausalLM(cfg).eval(), StubTokenizer(None), "tiny-sliding")
    assert target.sliding_window == 16 and _toy().sliding_window is None
    prompt = torch.arange(1, 9)  # 8 tokens
    ngram = Ngram(NgramConfig(), 64)
    assert len(generate(target, ngram, prompt, max_new_tokens=20, k=3).tokens) == 20  # chains
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 16\) and batched "
                                         r"decoding .* 8 tokens \+ max_new_tokens=20"):
        generate_batch(target, None, [prompt], max_new_tokens=20, mode="plain")
    for kw in ({"exact_verify": True}, {"tree": True}):
        with pytest.raises(ValueError, match="must stay within 16"):
            generate(target, ngram, prompt, max_new_tokens=20, k=3, **kw)
    out = generate_batch(target, None, [prompt, prompt[:5]], max_new_tokens=8, mode="plain")
    assert [len(r.tokens) for r in out.results] == [8, 8]  # within the window: runs


def test_exact_cost_grid_is_measured_through_exact_rows_and_cached_apart(toy, tmp_path,
                                                                          monkeypatch):
    """budgeted + exact plans over the grid of the exact batched forward (its own cache key), and
    measuring that grid runs the exact rows' forward at every size."""
    import specdistill.decode.batched.cost as costs
    from specdistill.decode.batched.planner import batch_planner

    secs = costs.measure_cost(toy, bs=(1, 3), qs=(1, 4), context=8, rounds=1, exact=True)
    assert len(secs) == 2 and all(len(r) == 2 and all(0 < x < 10 for x in r) for r in secs)
    calls = []

    def fake(tgt, bs, qs, *a, exact=False, **kw):
        calls.append(exact)
        return [[0.01 * (1 + b * q / 64) for q in qs] for b in bs]
    monkeypatch.setattr(costs, "measure_cost", fake)
    plain = costs.cost_curve(toy, tmp_path)
    exact = costs.cost_curve(toy, tmp_path, exact=True)
    assert calls == [False, True] and exact.key == plain.key + "-exact"
    planner = batch_planner(toy, None, 3, False, None, None, str(tmp_path), exact=True)
    assert planner.cost.key == exact.key and calls == [False, True]  # read back, not re-measured
    prompts, budgets = _work()
    out = generate_batch(toy, lambda: NoisyOracle(toy, noise=0.3, seed=1), prompts[:3],
                         max_new_tokens=budgets[:3], batch_size=3, k=3, mode="budgeted",
                         exact_verify=True, cache_dir=str(tmp_path / "fresh"))
    assert calls == [False, True, True] and all(len(r.tokens) for r in out.results)  # exact grid


def test_exact_batched_sampling_draws_what_each_prompt_draws_alone(toy):
    """Sampling (T = 0.8) with exact rows: each row's logits are its lone decode's bit for bit, so
    with the same generator and a deterministic drafter every sampled output is the one `generate`
    draws alone with exact_verify (not only the same distribution)."""
    from specdistill.drafters.parts.sampling import SamplingParams

    prompts, budgets = _work()
    sampling = SamplingParams(temperature=0.8)

    def ngram():
        return Ngram(NgramConfig(), toy.vocab_size)
    lone = [generate(toy, ngram(), p, max_new_tokens=n, k=3, sampling=sampling, exact_verify=True,
                     generator=torch.Generator().manual_seed(10 + i)).tokens
            for i, (p, n) in enumerate(zip(prompts, budgets))]
    out = generate_batch(toy, ngram, prompts, max_new_tokens=budgets, batch_size=4, k=3,
                         sampling=sampling, exact_verify=True, seed=10)
    assert [r.tokens.tolist() for r in out.results] == [t.tolist() for t in lone]
