"""Exact verification (decode/exact.py, `exact_verify`): every row of a verify forward rounds
exactly as a one-token step, so greedy speculative chains are bit-identical to plain decoding at
bf16, not only up to near-ties; outside the decoder the target is untouched."""
import json

import pytest
import torch
from decode_toys import NoisyOracle, StubTokenizer
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdistill.decode.evaluate import is_near_tie
from specdistill.decode.exact import VERIFY_ROOM, ExactVerify, active, install
from specdistill.decode.spec import generate
from specdistill.drafters.ngram import Ngram, NgramConfig
from specdistill.target.model import Target, load_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _toy(seed=0, init=0.02, kv_heads=2) -> Target:
    """A bf16 Llama wide enough (hidden 256, 4 heads, GQA 4/2 by default) that bf16 kernels of
    different shapes round differently; small init = flat logits = many near-ties."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      initializer_range=init, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    return Target(model, StubTokenizer(None), "toy-bf16")


@pytest.fixture(scope="module")
def toy():
    return _toy()


@torch.inference_mode()
def _chunked_logits(target, ctx, seq, width, exact):
    """Logits of seq (1, S) run `width` tokens per forward after ctx, exact or not."""
    if exact:
        ev = ExactVerify(target, ctx.shape[1], seq.shape[1])
        cache = ev.cache

        def fwd(ids):
            with active():
                kw = ev.chain(int(cache.get_seq_length()), ids.shape[1], ids.device)
                return target.forward(ids, cache=cache, **kw).logits
    else:
        cache = DynamicCache()

        def fwd(ids):
            return target.forward(ids, cache=cache).logits
    fwd(ctx)
    return torch.cat([fwd(seq[:, j:j + width]) for j in range(0, seq.shape[1], width)], dim=1)


@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA, and plain multi-head attention (one row/head)
def test_exact_verify_rows_equal_one_token_steps_bitwise(toy, kv_heads):
    target = toy if kv_heads == 2 else _toy(kv_heads=kv_heads)
    g = torch.Generator().manual_seed(1)
    ctx, seq = torch.randint(0, 512, (1, 37), generator=g), torch.randint(0, 512, (1, 12), generator=g)
    one = _chunked_logits(target, ctx, seq, 1, exact=True)
    for width in (2, 3, 4, 6, 12):
        assert torch.equal(_chunked_logits(target, ctx, seq, width, exact=True), one), width
    # the exact path computes the same function as the target's own (bf16 rounding apart)
    ref = _chunked_logits(target, ctx, seq, 1, exact=False)
    assert torch.allclose(one.float(), ref.float(), atol=0.05)


def test_hooks_are_inert_outside_the_decoder(toy):
    """After install, a forward outside `active()` (training, capture, HF generate) gives exactly
    what it gave before: same attention implementation, no padding."""
    fresh = _toy()  # same seed, never installed
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    install(toy)
    with torch.inference_mode():
        assert torch.equal(toy.model(ids).logits, fresh.model(ids).logits)
        one = ids[:1, :1]
        assert torch.equal(toy.model(one).logits, fresh.model(one).logits)
        # with a KV cache, as the decoder runs: prefill, a 3-token verify, a one-token step
        caches = DynamicCache(), DynamicCache()
        for chunk in (ids[:1, :5], ids[:1, 5:8], ids[:1, 8:9]):
            got, want = (t.forward(chunk, cache=c).logits for t, c in zip((toy, fresh), caches))
            assert torch.equal(got, want), chunk.shape
    assert toy.model.config._specdistill_attn == fresh.model.config._attn_implementation
    # and plain and speculative decoding without exact_verify are what they were
    prompt = ids[0]
    assert torch.equal(generate(toy, None, prompt, max_new_tokens=12).tokens,
                       generate(fresh, None, prompt, max_new_tokens=12).tokens)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_exact_chain_is_bit_identical_to_plain_exact(toy, k):
    """On a target full of near-ties, speculative chains with exact_verify give plain decoding's
    tokens exactly (no near-tie allowance), whatever the verify width. (Without exact_verify, the
    same runs at k=2, 3 differ from plain decoding in 3 of 6 on the 2-core AVX512-BF16 dev
    machine: near-ties that the verify shapes flip.)"""
    for seed in range(3):
        prompt = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(seed))
        plain = generate(toy, None, prompt, max_new_tokens=60, exact_verify=True)
        spec = generate(toy, NoisyOracle(toy, noise=0.3, seed=seed), prompt, max_new_tokens=60,
                        k=k, exact_verify=True)
        assert spec.tokens.tolist() == plain.tokens.tolist(), (k, seed)
        assert any(n > 0 for n in spec.accepted)  # drafts were accepted, not only bonus tokens
        assert int(spec.cache.get_seq_length()) == len(prompt) + 60 - 1  # cache = tokens[:-1]


def test_exact_tree_decoding_is_lossless_up_to_near_ties(toy):
    """Trees with exact_verify: the accepted branch's keys sit at tree slots, not consecutive ones,
    so a row can still round differently (the docstring of decode/exact.py); every difference
    must be a near-tie."""
    prompt = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(7))
    plain = generate(toy, None, prompt, max_new_tokens=30, exact_verify=True)
    ngram = Ngram(NgramConfig(), toy.vocab_size)
    tree = generate(toy, ngram, prompt, max_new_tokens=30, tree=True, exact_verify=True)
    d = toy.first_difference(prompt, plain.tokens, tree.tokens)
    assert d["margin"] is None or is_near_tie(d), d


def test_static_cache_room_is_checked(toy):
    ev = ExactVerify(toy, 10, 5)
    assert ev.capacity == 10 + 5 + VERIFY_ROOM
    mask = torch.ones(1, 1, 3, ev.capacity + 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="static cache holds .*tree_total_tokens"):
        ev.widen(mask)
    widened = ev.widen(torch.ones(1, 1, 3, 12, dtype=torch.bool))
    assert widened.shape == (1, 1, 3, ev.capacity) and not widened[..., 12:].any()


def test_decode_cli_records_exact_verify_alone_and_batched(tiny_run, tmp_path):
    import subprocess
    import sys
    base = [sys.executable, "-m", "decode", "target=tiny", f"ckpt={tiny_run}", "eval.limit=2",
            "max_new_tokens=12", "k=3", "target.dtype=bfloat16", "exact_verify=true"]
    out = tmp_path / "run"
    subprocess.run(base + [f"run_dir={out}"], check=True, capture_output=True, text=True)
    res = json.loads((out / "result.json").read_text())
    assert res["summary"]["exact_verify"] is True
    assert all(p["identical_to_plain"] for p in res["prompts"])
    for exact, want in (("true", True), ("auto", False)):  # batched: auto = off (its cost)
        run = tmp_path / f"b-{exact}"
        subprocess.run(base[:-1] + [f"exact_verify={exact}", "batch_size=2", f"run_dir={run}"],
                       check=True, capture_output=True, text=True)
        res = json.loads((run / "result.json").read_text())
        assert res["summary"]["exact_verify"] is want and res["summary"]["batch_size"] == 2
        if want:  # exact rows: every output is plain decoding's, no near-tie allowance
            assert all(p["identical_to_plain"] for p in res["prompts"])


@pytest.mark.slow
def test_smollm2_bf16_exact_chain_is_plain_bit_for_bit():
    """The real target at bf16, where plain and speculative decoding differ at near-ties without
    exact_verify (BENCHMARKS.md): with it, n-gram chains give plain decoding's tokens exactly."""
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.evaluate import render
    from specdistill.target.model import TargetConfig

    target = load_target(TargetConfig(path="packaged:smollm2", dtype="bfloat16"))
    ngram = Ngram(NgramConfig(), target.vocab_size)
    for p in load_prompts("mtbench", limit=2):
        ids = render(target, p.turns[:1], [])
        plain = generate(target, None, ids, max_new_tokens=48, exact_verify=True).tokens
        spec = generate(target, ngram, ids, max_new_tokens=48, k=5, exact_verify=True).tokens
        assert spec.tolist() == plain.tolist(), p.id


def test_exact_verify_auto_is_on_for_16_bit_chains_only():
    from specdistill.decode.exact import resolve_exact
    assert resolve_exact("auto", torch.bfloat16, tree=False)
    assert resolve_exact("auto", torch.float16, tree=False)
    assert not resolve_exact("auto", torch.float32, tree=False)  # GEMV -> GEMM costs ~1.6x at fp32
    assert not resolve_exact("auto", torch.bfloat16, tree=True)  # trees keep near-tie flips
    assert resolve_exact(True, torch.float32, tree=True) and resolve_exact("True", torch.float32, True)
    assert not resolve_exact(False, torch.bfloat16, tree=False)
    with pytest.raises(ValueError, match="exact_verify='maybe': use auto, true or false"):
        resolve_exact("maybe", torch.bfloat16, tree=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_exact_chain_on_cuda_is_plain_bit_for_bit():
    """The same static-cache path on a GPU (bf16): chains equal plain decoding exactly."""
    toy = _toy()
    toy.model.to("cuda")  # Target.device follows the model
    prompt = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(3))
    plain = generate(toy, None, prompt, max_new_tokens=40, exact_verify=True)
    ngram = Ngram(NgramConfig(), toy.vocab_size)
    spec = generate(toy, ngram, prompt, max_new_tokens=40, k=4, exact_verify=True)
    assert spec.tokens.tolist() == plain.tokens.tolist()
