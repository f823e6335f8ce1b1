"""target/attention.py: the few-query attention equals SDPA's (every mask kind, GQA, causal
blocks, fully masked padding rows finite), runs exactly where it is the faster kernel (16-bit CPU
forwards of <= FEW_Q_MAX queries, masked fp32 ones of 2..FEW_Q_MAX) and leaves everything else to
SDPA; targets and EAGLE drafters use it."""
import pytest
import torch
import torch.nn.functional as F

import specdistill.target.attention as attn
from specdistill.target.attention import (
    FEW_Q,
    FEW_Q_MAX,
    FP32_MIN_KEYS,
    KEYS_PER_QUERY,
    few_query,
    grouped_attention,
    masked_few_query,
)


def qkv(q, L, dtype=torch.float64, B=2, H=6, Hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, d, generator=g, dtype=dtype)
                 for h, n in ((H, q), (Hkv, L), (Hkv, L)))


def sdpa(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=True)


@pytest.mark.parametrize("q", [1, 3, 16])
def test_grouped_attention_equals_sdpa(q):
    L = 20
    Q, K, V = qkv(q, L)
    # no mask: the block is the last q positions, causal (a decode step or a verify block)
    causal = torch.arange(L)[None, :] <= (L - q + torch.arange(q))[:, None]  # (q, L)
    torch.testing.assert_close(grouped_attention(Q, K, V, None), sdpa(Q, K, V, causal))
    torch.testing.assert_close(grouped_attention(Q, K, V, None, causal=False), sdpa(Q, K, V))
    # a per-row bool mask (B, 1, q, L) and the same as an additive one; a wider mask is cut to L
    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(2, 1, q, L, generator=g) < 0.6
    allowed[..., 0] = True
    ref = sdpa(Q, K, V, allowed)
    torch.testing.assert_close(grouped_attention(Q, K, V, allowed), ref)
    add = torch.zeros(allowed.shape, dtype=Q.dtype).masked_fill(~allowed, -1e9)
    torch.testing.assert_close(grouped_attention(Q, K, V, add), ref)
    wide = torch.cat([allowed, torch.ones(2, 1, q, 5, dtype=torch.bool)], dim=-1)
    torch.testing.assert_close(grouped_attention(Q, K, V, wide), ref)
    torch.testing.assert_close(grouped_attention(Q, K, V, None, scaling=0.3),
                               F.scaled_dot_product_attention(Q, K, V, attn_mask=causal,
                                                              scale=0.3, enable_gqa=True))


def test_a_fully_masked_row_stays_finite():
    Q, K, V = qkv(2, 6)
    none = torch.zeros(2, 1, 2, 6, dtype=torch.bool)
    out = grouped_attention(Q, K, V, none)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, V.mean(2, keepdim=True).repeat_interleave(3, 1).expand_as(out))


def test_dispatch_is_16_bit_cpu_few_queries_over_many_keys_only(monkeypatch):
    n = KEYS_PER_QUERY
    assert few_query(torch.zeros(1, 2, FEW_Q_MAX, 4, dtype=torch.bfloat16), n * FEW_Q_MAX)
    assert few_query(torch.zeros(1, 2, 1, 4, dtype=torch.float16), n)
    assert not few_query(torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16), n - 1)
    assert not few_query(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16), 3 * n - 1)
    assert not few_query(torch.zeros(1, 2, FEW_Q_MAX + 1, 4, dtype=torch.bfloat16), 10**6)
    assert not few_query(torch.zeros(1, 2, 1, 4, dtype=torch.float32), 10**6)
    m = torch.ones(1, 1, 3, FP32_MIN_KEYS, dtype=torch.bool)
    assert masked_few_query(torch.zeros(1, 2, 3, 4), FP32_MIN_KEYS, m)
    assert not masked_few_query(torch.zeros(1, 2, 3, 4), FP32_MIN_KEYS, None)  # SDPA's own GQA
    assert not masked_few_query(torch.zeros(1, 2, 1, 4), 10**6, m)  # one query: SDPA is faster
    assert not masked_few_query(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16), 10**6, m)
    calls = []
    real = attn.grouped_attention
    monkeypatch.setattr(attn, "grouped_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 3
    for q, L, dtype, ours in ((1, n, torch.bfloat16, True), (4, 4 * n, torch.bfloat16, True),
                              (4, 4 * n - 1, torch.bfloat16, False),
                              (FEW_Q_MAX + 1, 4000, torch.bfloat16, False),
                              (1, n, torch.float32, False),
                              # fp32: masked verify blocks of 2..FEW_Q_MAX queries (no K/V repeat)
                              (3, FP32_MIN_KEYS, torch.float32, True),
                              (3, FP32_MIN_KEYS - 1, torch.float32, False),
                              (FEW_Q_MAX + 1, 4000, torch.float32, False)):
        calls.clear()
        Q, K, V = qkv(q, L, dtype)
        causal = torch.arange(L)[None, :] <= (L - q + torch.arange(q))[:, None]  # (q, L)
        out, _ = attn.few_query_attention(module, Q, K, V, causal[None, None])
        assert bool(calls) == ours, (q, dtype)
        ref = sdpa(Q.double(), K.double(), V.double(), causal)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.transpose(1, 2).double(), ref, rtol=tol, atol=tol)


def test_targets_and_eagle_drafters_use_it(tiny_target_cfg, monkeypatch):
    from specdistill.drafters.base import build_drafter
    from specdistill.target.model import load_target

    target = load_target(tiny_target_cfg)
    assert target.model.config._attn_implementation == FEW_Q
    d = build_drafter({"name": "eagle", "draft_vocab_size": None}, target)
    assert d.layers[0].self_attn.config._attn_implementation == FEW_Q
    # a bf16 target: a decode step and a verify block give SDPA's logits within bf16 rounding
    model = target.model.to(torch.bfloat16)
    ids = torch.randint(0, target.vocab_size, (2, 12))  # prefill: SDPA; the steps after: ours
    monkeypatch.setattr(attn, "KEYS_PER_QUERY", 1)  # the tiny target's short caches count as long
    with torch.no_grad():
        ours = model(ids).logits.float()
        model.set_attn_implementation("sdpa")
        ref = model(ids).logits.float()
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= 0.02 * scale
