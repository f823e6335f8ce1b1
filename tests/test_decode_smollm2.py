"""Losslessness on the real SmolLM2 target: speculative greedy output equals plain greedy and HF
`generate` on MT-bench prompts (chain and tree, n-gram drafter). Pinned to float32, where every
token must match exactly; bf16 (the CPU default), where near-ties may break either way, is
tests/test_fast_decode.py's slow test."""
import pytest
import torch

from specdistill.data.prompts import load_prompts
from specdistill.decode.evaluate import render
from specdistill.decode.spec import generate
from specdistill.drafters.base import build_drafter
from specdistill.target.model import TargetConfig, load_target


@pytest.mark.slow
def test_smollm2_speculative_greedy_equals_plain_on_mtbench():
    target = load_target(TargetConfig(path="packaged:smollm2", dtype="float32"))
    ngram = build_drafter({"name": "ngram"}, target)
    for p in load_prompts("mtbench", limit=2):
        ids = render(target, p.turns[:1], [])
        plain = generate(target, None, ids, max_new_tokens=40)
        hf = target.model.generate(ids[None], max_new_tokens=40, do_sample=False)[0, len(ids):]
        assert plain.tokens.tolist() == hf.tolist()
        for tree in (False, True):
            spec = generate(target, ngram, ids, max_new_tokens=40, k=5, tree=tree)
            assert torch.equal(spec.tokens, plain.tokens), (p.id, tree)
            assert spec.target_forwards <= plain.target_forwards
