"""Golden outputs: the decoder's tokens and per-round draft counts (chain, tree, batched, exact)
and the bytes of every export layout, on a tiny target whose logits are far from ties, compared
with digests stored in tests/golden.json. A refactor that moves code must leave them identical;
a change that is meant to alter them regenerates the file on purpose:

    SPECDISTILL_GOLDEN=write python -m pytest tests/test_golden.py -n0

The target's init is wide (initializer_range 0.5), so greedy argmaxes sit far apart and the digests
do not depend on the CPU's kernels; each case also asserts that margin, so a digest that could flip
on another machine fails loudly as a margin, not as a mismatch.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

import specdistill.drafters  # noqa: F401  (registers every drafter)
from specdistill.decode.batched.spec import generate_batch
from specdistill.decode.spec import generate
from specdistill.drafters.base import DRAFTERS, build_drafter
from specdistill.export.folder import export_drafter, full_config
from specdistill.target.model import TargetConfig, load_target

GOLDEN = Path(__file__).with_name("golden.json")
WRITE = os.environ.get("SPECDISTILL_GOLDEN") == "write"
MIN_MARGIN = 1e-3  # the smallest top-1 / top-2 logit gap of the target's greedy tokens we accept
PROMPTS = [[5, 17, 230, 99, 41], list(range(300, 312)), [(7 * i) % 4000 + 10 for i in range(20)]]
N_NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target():
    cfg = TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2", seed=3,
                       dtype="float32", prepack=False,
                       model_config={"hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 4, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "max_position_embeddings": 512,
                                     "initializer_range": 0.5})
    return load_target(cfg)


def drafter(name: str, target, **over):
    torch.manual_seed(11)
    return build_drafter({"name": name, **over}, target).eval()


def recorded(d, log: list):
    """`d` with every proposal's tokens (chains, trees, rows) appended to `log`: the digests then
    see what the drafter proposed, not only what the target kept."""
    for name in ("propose", "propose_tree", "propose_rows"):
        inner = getattr(d, name)

        def wrapper(*a, _inner=inner, _name=name, **kw):
            out = _inner(*a, **kw)
            for p in out if isinstance(out, list) else [out]:
                log.append([_name, p.tokens.tolist()]
                           + ([p.parents.tolist()] if hasattr(p, "parents") else []))
            return out
        setattr(d, name, wrapper)
    return d


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def margin(target, prompt, tokens) -> float:
    """The smallest gap between the target's top two logits over the greedy continuation."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = target.model(ids).logits[0, len(prompt) - 1:-1].float()  # (N, V)
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def check(key: str, value, store: dict) -> None:
    if WRITE:
        store[key] = value
        return
    want = json.loads(GOLDEN.read_text())
    assert key in want, f"no golden for {key}; regenerate (module docstring)"
    assert value == want[key], f"{key} changed: {value} != {want[key]}"


@pytest.fixture(scope="module")
def store():
    out: dict = {}
    yield out
    if WRITE:
        old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**old, **out}, indent=1, sort_keys=True) + "\n")


CASES = [("eagle3", {"k": 3}), ("eagle3", {"tree": True}), ("eagle", {"k": 4}),
         ("eagle", {"tree": True}), ("dflash", {"k": 3}), ("dspark", {"k": 3}), ("peagle", {"k": 3}),
         ("medusa", {"k": 3}), ("medusa", {"tree": True}), ("eagle3", {"k": 2, "exact_verify": True})]


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{'-'.join(map(str, kw.items()))}"
                                                for n, kw in CASES])
def test_single_sequence_decoding(target, store, name, kw):
    proposed: list = []
    d = recorded(drafter(name, target), proposed)
    runs = []
    for p in PROMPTS:
        res = generate(target, d, p, max_new_tokens=N_NEW, **kw)
        assert margin(target, p, res.tokens.tolist()) > MIN_MARGIN
        runs.append([res.tokens.tolist(), list(res.drafted), list(res.accepted)])
    assert proposed, "the drafter proposed nothing"
    runs.append(proposed)
    check(f"generate/{name}/{sorted(kw.items())}", digest(runs), store)


@pytest.mark.parametrize("mode,kw", [("verify_all", {}), ("budgeted", {}), ("verify_all", {"tree": True}),
                                     ("verify_all", {"exact_verify": True})])
def test_batched_decoding(target, store, mode, kw, tmp_path):
    proposed: list = []
    d = recorded(drafter("eagle3", target), proposed)
    res = generate_batch(target, d, PROMPTS, max_new_tokens=N_NEW, batch_size=2, k=3, mode=mode,
                         cache_dir=str(tmp_path), **kw)
    out = [[r.tokens.tolist()] for r in res.results]
    if mode != "budgeted":  # the planner's choices depend on measured times
        out += [[list(r.drafted), list(r.accepted)] for r in res.results] + [proposed]
    check(f"batch/{mode}/{sorted(kw.items())}", digest(out), store)


def layouts():
    for name, cls in sorted(DRAFTERS.items()):
        for fmt, layout in sorted(cls.layouts.items()):
            cfg = {"name": name, **layout.requires}
            if layout.refusal(full_config(cfg)) is None:
                yield pytest.param(fmt, cfg, id=f"{name}-{fmt}")


@pytest.mark.parametrize("fmt,cfg", list(layouts()))
def test_export_bytes(target, store, fmt, cfg, tmp_path):
    d = drafter(cfg["name"], target, **{k: v for k, v in cfg.items() if k != "name"})
    out = tmp_path / "export"
    export_drafter(d, cfg, target, fmt, out)
    files = {}
    for f in sorted(out.rglob("*")):
        if f.is_file() and f.name not in ("README.md", "MANIFEST.json", "COMPLETE"):
            data = f.read_bytes()
            if f.name == "config.json":  # the version stamp and paths are not the layout
                conf = json.loads(data)
                conf.get("specdistill", {}).pop("specdistill_version", None)
                data = json.dumps(conf, sort_keys=True).encode()
            files[str(f.relative_to(out))] = hashlib.sha256(data).hexdigest()[:16]
    check(f"export/{cfg['name']}/{fmt}", digest(files), store)
