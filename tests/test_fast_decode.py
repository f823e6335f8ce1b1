"""Fast decoding on CPUs: target.dtype=auto picks bf16 only where the CPU has native
bf16, training keeps float32, decoding at bf16 is still lossless (greedy: the tokens of plain
decoding at bf16; sampling: the bf16 target's distribution), decode records the dtype, and the
benchmark's verify-cost curve and first-difference margins measure what they say."""
import json
import logging

import pytest
import torch
from decode_toys import FixedQ, NoisyOracle, chi2_stat, make_target

import benchmarks.decode_speed as bench
import specdistill.target.precision as precision
from specdistill.decode.evaluate import NEAR_TIE_ULPS, evaluate_drafter, is_near_tie
from specdistill.decode.spec import generate
from specdistill.drafters.ngram import Ngram, NgramConfig
from specdistill.drafters.parts.sampling import SamplingParams, warp
from specdistill.target.model import load_target
from specdistill.target.precision import resolve_dtype, set_threads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _flags(monkeypatch, flags):
    monkeypatch.setattr(precision, "cpu_flags", lambda: set(flags))


# -- the dtype choice ------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, want", [({"avx512f", "avx512_bf16"}, "bfloat16"),
                                         ({"amx_bf16", "amx_tile"}, "bfloat16"),
                                         ({"avx512f", "avx2"}, "float32"), (set(), "float32")])
def test_auto_is_bf16_only_with_native_cpu_bf16(monkeypatch, flags, want):
    _flags(monkeypatch, flags)
    choice = resolve_dtype("auto", "cpu")
    assert choice.dtype == want
    assert choice.cpu_flags == sorted(flags & {"avx512_bf16", "amx_bf16"})
    assert "avx512_bf16" in choice.check  # the log names the check
    # training keeps float32 whatever the CPU: its speed comes from autocast
    assert resolve_dtype("auto", "cpu", training=True).dtype == "float32"


@pytest.mark.parametrize("flags, precision_, capture", [({"amx_bf16"}, "bf16", "bfloat16"),
                                                       ({"avx2"}, "fp32", None)])
def test_training_precision_auto_is_bf16_only_where_native(monkeypatch, flags, precision_, capture):
    from omegaconf import OmegaConf

    from specdistill.train.recipe import DistillRecipe

    _flags(monkeypatch, flags)
    r = DistillRecipe(OmegaConf.create({"run_dir": "unused", "trainer": {
        "precision": "auto", "capture_autocast": "auto", "capture_features_dtype": "auto"}}))
    r._resolve_precision("cpu")  # features stored at bf16 where the drafter trains at bf16
    assert (r.tcfg.precision, r.tcfg.capture_autocast, r.tcfg.capture_features_dtype) == (
        precision_, capture, capture)
    r = DistillRecipe(OmegaConf.create({"run_dir": "unused", "trainer": {
        "precision": "bf16", "capture_autocast": None, "capture_features_dtype": "float32"}}))
    r._resolve_precision("cpu")  # explicit settings stay what they are on any CPU
    assert (r.tcfg.precision, r.tcfg.capture_autocast, r.tcfg.capture_features_dtype) == (
        "bf16", None, None)
    r.tcfg.precision = "bf61"
    with pytest.raises(ValueError, match="trainer.precision='bf61': use fp32, bf16 or auto"):
        r._resolve_precision("cpu")


def test_explicit_and_bad_dtypes(monkeypatch):
    _flags(monkeypatch, {"avx512_bf16"})
    assert resolve_dtype("fp32", "cpu").dtype == "float32"
    assert resolve_dtype("bf16", "cpu", training=True).dtype == "bfloat16"  # explicit wins
    with pytest.raises(ValueError, match="unknown target.dtype 'int8'.*auto"):
        resolve_dtype("int8", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto", "cuda").dtype == "float32"
    assert resolve_dtype("auto", "mps").dtype == "float32"


def test_load_target_runs_at_the_resolved_dtype(tiny_target_cfg, monkeypatch, caplog):
    _flags(monkeypatch, {"avx512_bf16"})
    tiny_target_cfg.dtype = "auto"
    with caplog.at_level(logging.INFO, logger="specdistill.target.model"):
        t = load_target(tiny_target_cfg)
    assert t.dtype == torch.bfloat16 and t.dtype_choice.as_dict()["cpu_bf16_flags"] == ["avx512_bf16"]
    assert "target dtype bfloat16 (target.dtype=auto; /proc/cpuinfo flags" in caplog.text
    assert load_target(tiny_target_cfg, training=True).dtype == torch.float32
    _flags(monkeypatch, {"avx2"})
    assert load_target(tiny_target_cfg).dtype == torch.float32


def test_threads_follow_the_idle_cores_and_are_never_raised_implicitly(monkeypatch):
    monkeypatch.setattr(precision, "available_cores", lambda: 4)
    for load, idle in ((0.2, 4), (1.5, 3), (3.9, 1), (9.0, 1)):
        monkeypatch.setattr(precision.os, "getloadavg", lambda: (load, 0.0, 0.0))
        assert precision.idle_cores() == idle
    before = torch.get_num_threads()  # 1 (fixture)
    monkeypatch.setattr(precision.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert set_threads(0) == 1 and torch.get_num_threads() == 1  # 4 idle cores: not raised
    try:
        assert set_threads(2) == 2 and torch.get_num_threads() == 2  # explicit
        monkeypatch.setattr(precision.os, "getloadavg", lambda: (3.5, 0.0, 0.0))
        assert set_threads(0) == 1 and torch.get_num_threads() == 1  # a busy machine: lowered
    finally:
        torch.set_num_threads(before)


# -- lossless at bf16 ------------------------------------------------------------------------------
BF16_PROMPTS = ([3, 17, 5, 9, 41], list(range(20, 32)))


@pytest.fixture(scope="module")
def bf16_target():
    """A float64 toy cast to bf16 whose greedy path has no near-tie: bf16 keeps 8 significant
    bits, so two logits closer than ~0.8% of their size can round to a tie in one kernel shape
    and not in another (that is a near-tie flip, measured by benchmarks.decode_speed, not a decoder bug)."""
    t = make_target(init=0.2, seed=5)
    t.model.to(torch.bfloat16)
    for prompt in BF16_PROMPTS:  # the precondition: top-2 gaps > 1.4 bf16 spacings everywhere
        ref = generate(t, None, prompt, max_new_tokens=24).tokens
        with torch.no_grad():
            logits = t.model(torch.tensor([prompt + ref.tolist()])).logits[0, len(prompt) - 1:-1]
        top = logits.float().topk(2).values  # (24, 2)
        assert bool(((top[:, 0] - top[:, 1]) / top[:, 0].abs() > 0.011).all())
    return t


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_spec_is_lossless_at_bf16(bf16_target, k, tree):
    for prompt in BF16_PROMPTS:
        ref = generate(bf16_target, None, prompt, max_new_tokens=24).tokens
        ids = torch.tensor([prompt])
        hf = bf16_target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=24)[0, len(prompt):]
        assert ref.tolist() == hf.tolist()
        res = generate(bf16_target, NoisyOracle(bf16_target, noise=0.3, seed=k), prompt,
                       max_new_tokens=24, k=k, tree=tree)
        assert any(n > 0 for n in res.accepted) and any(n < m for n, m in zip(res.accepted, res.drafted))
        if precision.native_bf16("cpu")[0]:  # fp32 accumulation: the toy has no near-tie to flip
            assert res.tokens.tolist() == ref.tolist()
        else:  # emulated bf16 (e.g. an AVX2-only CPU) rounds ~2 spacings apart between a
            # verify forward's and a one-token step's kernels: a flip, if any, is a near-tie
            d = bf16_target.first_difference(torch.tensor(prompt), ref, res.tokens)
            assert d["margin"] is None or is_near_tie(d), d


def test_sampled_generation_has_the_bf16_target_distribution():
    """The chi-square test of tests/test_decode.py with the target at bf16: the joint of two
    tokens from one speculative round matches the one computed from the bf16 target's logits."""
    Vs, prompt = 8, [1, 2, 3, 4]
    tgt = make_target(vocab=Vs, seed=3, init=0.2)
    tgt.model.to(torch.bfloat16)
    sp = SamplingParams(temperature=1.0, top_k=6)
    seqs = torch.tensor([prompt + [a, b] for a in range(Vs) for b in range(Vs)])  # (V*V, 6)
    with torch.no_grad():
        p = warp(tgt.model(seqs).logits.float(), sp)  # (V*V, 6, V)
    joint = torch.einsum("a,ab,abc->bc", p[0, 3], p[::Vs, 4], p[:, 5].reshape(Vs, Vs, Vs))
    gen = torch.Generator().manual_seed(0)
    c = torch.zeros(Vs * Vs)
    for _ in range(2000):
        res = generate(tgt, FixedQ(Vs), prompt, max_new_tokens=4, k=2, sampling=sp, generator=gen)
        c[res.tokens[1] * Vs + res.tokens[2]] += 1
    stat, crit = chi2_stat(c, joint.reshape(-1))
    assert stat < crit, (stat, crit)


def test_decode_result_records_the_dtype(tiny_target_cfg, monkeypatch, tmp_path):
    _flags(monkeypatch, {"avx512_bf16"})
    tiny_target_cfg.dtype = "auto"
    t = load_target(tiny_target_cfg)
    evaluate_drafter(t, Ngram(NgramConfig(), t.vocab_size), limit=1, max_new_tokens=6, out_dir=tmp_path)
    summary = json.loads((tmp_path / "result.json").read_text())["summary"]
    assert summary["target_dtype"] == "bfloat16" and summary["target_dtype_requested"] == "auto"
    assert summary["cpu_bf16_flags"] == ["avx512_bf16"] and "avx512_bf16" in summary["dtype_check"]


# -- the benchmark's measurements ------------------------------------------------------------------
def test_verify_curve_times_every_n_and_leaves_the_cache_as_it_was(tiny_target_cfg):
    t = load_target(tiny_target_cfg)
    ctx = torch.arange(5, 45)
    curve = bench.verify_curve({"float32": t}, ctx, ns=(1, 4, 9), rounds=2)
    assert set(curve["float32"]) == {1, 4, 9} and all(v > 0 for v in curve["float32"].values())
    rows = bench.curve_markdown(curve)
    assert rows[2].startswith("| float32 (steps) | 1.00 |")


def test_first_difference_margin_is_the_targets_logit_gap(bf16_target):
    prompt = torch.tensor([3, 17, 5, 9, 41])
    ref = generate(bf16_target, None, prompt, max_new_tokens=8).tokens
    got = ref.clone()
    got[3] = (ref[3] + 1) % bf16_target.vocab_size
    d = bf16_target.first_difference(prompt, ref, got)
    with torch.no_grad():
        logits = bf16_target.model(torch.cat([prompt, ref[:3]])[None]).logits[0, -1].float()
    assert d["position"] == 3 and d["ref_token"] == int(ref[3]) and d["got_token"] == int(got[3])
    assert d["margin"] == pytest.approx(float(logits[ref[3]] - logits[got[3]])) and d["margin"] >= 0
    assert d["ulp"] == 2.0 ** -7 * 2.0 ** int(torch.tensor(d["top_logit"]).abs().log2().floor())
    assert is_near_tie({**d, "margin": NEAR_TIE_ULPS * d["ulp"]}) and not is_near_tie(
        {**d, "margin": (NEAR_TIE_ULPS + 1) * d["ulp"]})
    assert bf16_target.first_difference(prompt, ref, ref[:5])["margin"] is None


def test_prefill_logits_at_the_last_position_equal_the_full_logits_sliced(tiny_target_cfg):
    """The decoder's prefill asks logits only where it reads them (logits_to_keep=1)."""
    t = load_target(tiny_target_cfg)
    ids = torch.arange(3, 40)[None]  # (1, 37)
    full = t.forward(ids).logits  # (1, 37, V)
    last = t.forward(ids, logits_to_keep=1).logits  # (1, 1, V)
    assert last.shape == (1, 1, t.vocab_size)
    torch.testing.assert_close(last, full[:, -1:])


@pytest.mark.slow
def test_smollm2_bf16_greedy_is_plain_greedy_up_to_near_ties():
    """SmolLM2 at bf16 on MT-bench prompts: plain decoding equals HF greedy generate at bf16
    (the same one-token kernel shapes), and n-gram speculative decoding equals plain decoding,
    except where a bf16 near-tie flips (margin within two bf16 spacings of the top logit)."""
    from specdistill.data.prompts import load_prompts
    from specdistill.decode.evaluate import render
    from specdistill.target.model import TargetConfig

    target = load_target(TargetConfig(path="packaged:smollm2", dtype="bfloat16"))
    ngram = Ngram(NgramConfig(), target.vocab_size)
    for p in load_prompts("mtbench", limit=2):
        ids = render(target, p.turns[:1], [])
        plain = generate(target, None, ids, max_new_tokens=40).tokens
        hf = target.model.generate(ids[None], max_new_tokens=40, do_sample=False)[0, len(ids):]
        assert plain.tolist() == hf.tolist()
        spec = generate(target, ngram, ids, max_new_tokens=40, k=5).tokens
        d = target.first_difference(ids, plain, spec)
        assert d["margin"] is None or is_near_tie(d), (p.id, d)


def test_bench_tables_compare_at_the_same_dtype_and_list_differences():
    from specdistill.decode.metrics import RunMetrics

    m = {("float32", "plain (ours)"): RunMetrics(tokens_per_s=10.0, rounds=5),
         ("float32", "HF greedy"): RunMetrics(tokens_per_s=8.0),
         ("bfloat16", "plain (ours)"): RunMetrics(tokens_per_s=15.0, rounds=5),
         ("bfloat16", "ngram k=5"): RunMetrics(tokens_per_s=12.0, rounds=4, tau=1.25,
                                               time_draft=0.02)}
    mismatch = {key: 0 for key in m} | {("bfloat16", "ngram k=5"): 1}
    rows = bench.modes_markdown(m, mismatch, "float32")
    assert "| float32 | HF greedy | - | 8.0 | 0.80x | 1.00x | 0.80x | - | yes |" in rows
    assert "| bfloat16 | ngram k=5 | 1.25 | 12.0 | 0.80x | - | 1.20x | 5.0 | NO (1) |" in rows
    diffs = {("bfloat16", "ngram k=5"): [{"prompt": 2, "position": 7, "ref_token": 5,
                                          "got_token": 9, "margin": 0.0, "ulp": 0.125}]}
    assert "| bfloat16 | ngram k=5 | 2 | 7 | 5 | 9 | 0.0000 | 0.1250 | yes |" in bench.diffs_markdown(diffs)


def test_bench_runs_a_trained_drafter_at_each_dtype_losslessly(tiny_run, tiny_target_cfg):
    """The trained-drafter rows of benchmarks.decode_speed: one per drafter dtype; a bf16 drafter on an fp32
    target still gives exactly plain decoding's tokens (the decoder verifies every draft)."""
    from argparse import Namespace

    t = load_target(tiny_target_cfg)  # float32
    ds = bench.load_drafters(t, [str(tiny_run / "best")], ["bfloat16", "target"])
    assert [label for label, _ in ds] == ["eagle (drafter bfloat16)", "eagle (drafter float32)"]
    assert [d.fc.weight.dtype for _, d in ds] == [torch.bfloat16, torch.float32]
    # the target's weights the drafter shares (frozen embedding, LM head) stay the target's
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    modes = bench.build_modes(t, ds, Namespace(max_new_tokens=10, k=3, prompt_lookup=3, tree=True,
                                               ks=[2, 3], trees=["6/3/2"], confidences=[0.3]))
    assert {"eagle (drafter bfloat16) k=3", "eagle (drafter bfloat16) k=2",
            "eagle (drafter bfloat16) tree", "eagle (drafter bfloat16) tree 6/3/2",
            "eagle (drafter float32) k=3 conf=0.3"} <= set(modes)
    ids = torch.arange(5, 25)
    ref = modes["plain (ours)"](ids).tokens
    for name in ("eagle (drafter bfloat16) k=3", "eagle (drafter bfloat16) tree",
                 "eagle (drafter float32) k=3", "eagle (drafter float32) k=2",
                 "eagle (drafter float32) tree 6/3/2", "eagle (drafter float32) k=3 conf=0.3"):
        assert torch.equal(modes[name](ids).tokens, ref), name
    # a confidence mode drafts with min_confidence: a threshold of 1 cuts every chain to 1 draft
    strict = bench.build_modes(t, ds[1:], Namespace(max_new_tokens=10, k=3, prompt_lookup=3,
                                                    tree=False, ks=[3], confidences=[1.0]))
    res = strict["eagle (drafter float32) k=3 conf=1"](ids)
    assert torch.equal(res.tokens, ref) and max(res.drafted) <= 1
    # a sized tree: at most 6 nodes verified per round, and the drafter's own size is back after
    d = ds[1][1]
    calls = []
    orig = d.propose_tree
    d.propose_tree = lambda *a, **kw: calls.append(orig(*a, **kw)) or calls[-1]
    modes["eagle (drafter float32) tree 6/3/2"](ids)
    assert calls and all(len(c.tokens) <= 6 for c in calls)
    assert d.cfg.tree_total_tokens != 6
    with pytest.raises(ValueError, match="TOTAL/DEPTH/TOPK"):
        bench.sized_tree(t, d, "6x3", 10)
    with pytest.raises(ValueError, match=r"tree_depth=0 is outside \[1, 64\]"):
        bench.sized_tree(t, d, "6/0/2", 10)


@pytest.mark.parametrize("name", ["eagle", "eagle3", "peagle", "medusa", "small_lm"])
def test_cast_drafter_runs_every_drafter_at_bf16_losslessly(tiny_target_cfg, name):
    """decode's drafter_dtype=target: a drafter cast to bf16 on an fp32 target drafts in bf16 (its
    own weights and the compute dtype of the target modules it calls), leaves the target's weights
    alone, and the output is still plain decoding's."""
    from specdistill.drafters.base import CONFIGS, build_drafter
    from specdistill.drafters.parts.head import Shared, cast_drafter

    t = load_target(tiny_target_cfg)  # float32
    d = build_drafter(CONFIGS[name](), t).eval()
    cast_drafter(d, t, torch.bfloat16)
    own = [p for p in d.parameters() if p.is_floating_point()]
    assert own and all(p.dtype == torch.bfloat16 for p in own)
    assert all(m.dtype == torch.bfloat16 for m in d.modules() if isinstance(m, Shared))
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    rope = [m.inv_freq for m in d.modules() if hasattr(m, "inv_freq")]  # as training computed them
    assert all(f.dtype == torch.float32 for f in rope) and (rope or name in ("medusa", "small_lm"))
    ids = torch.arange(5, 25)
    ref = generate(t, None, ids, max_new_tokens=12).tokens
    out = generate(t, d, ids, max_new_tokens=12, k=3)
    assert torch.equal(out.tokens, ref) and len(out.accepted) > 0


def test_decode_casts_the_drafter_to_the_target_dtype(tiny_run, tmp_path):
    """`python -m decode ckpt=... drafter_dtype=...` records the dtype the drafter ran at."""
    from hydra import compose, initialize_config_dir

    import specdistill.decode.__main__  # noqa: F401  (stores the schemas)
    from specdistill.decode.evaluate import run

    conf = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")
    for setting, want in (("target", "float32"), ("bfloat16", "bfloat16")):
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose(config_name="decode", overrides=[
                "target=tiny", f"ckpt={tiny_run}", "eval.limit=1", "max_new_tokens=8",
                f"drafter_dtype={setting}", f"run_dir={tmp_path / setting}"])
        run(cfg)
        s = json.loads((tmp_path / setting / "result.json").read_text())["summary"]
        assert s["drafter_dtype"] == want and s["target_dtype"] == "float32"
        assert s["outputs_identical_to_plain"] is True


def test_bench_attention_a_b_loads_one_target_per_attention(monkeypatch, tiny_target_cfg):
    """`benchmarks.decode_speed --attn few_q sdpa`: a target per (dtype, attention), named apart; the sdpa
    one runs torch's kernel, the other ours; one attention keeps the plain dtype names."""
    import benchmarks.decode_speed as bench
    from specdistill.target.attention import FEW_Q

    monkeypatch.setattr(bench, "load_target", lambda cfg: load_target(tiny_target_cfg))
    both = bench.load_targets(bench.parse_args(["--dtypes", "float32", "--attn", "few_q", "sdpa"]))
    assert {n: t.model.config._attn_implementation for n, t in both.items()} == {
        "float32 few_q": FEW_Q, "float32 sdpa": "sdpa"}
    one = bench.load_targets(bench.parse_args(["--dtypes", "float32"]))
    assert list(one) == ["float32"] and one["float32"].model.config._attn_implementation == FEW_Q


def test_bench_labels_two_runs_of_one_drafter_apart(monkeypatch):
    """`benchmarks.decode_speed --ckpt A --ckpt B` with two runs of the same drafter kind: each mode's label
    names its run, so neither overwrites the other; one run keeps the short label."""
    from types import SimpleNamespace

    import benchmarks.decode_speed as bench

    monkeypatch.setattr(bench, "resolve_drafter", lambda path, setting: path)
    monkeypatch.setattr(bench, "load_resolved", lambda path, target: _Stub(path))
    monkeypatch.setattr(bench, "cast_drafter", lambda d, target, dtype: None)
    target = SimpleNamespace(dtype=torch.bfloat16)
    two = bench.load_drafters(target, ["runs/a/eagle/best", "runs/a/eagle_v4k/best"], ["target"])
    assert [label for label, _ in two] == ["eagle [eagle] (drafter bfloat16)",
                                           "eagle [eagle_v4k] (drafter bfloat16)"]
    one = bench.load_drafters(target, ["runs/a/eagle/best"], ["target", "float32"])
    assert [label for label, _ in one] == ["eagle (drafter bfloat16)", "eagle (drafter float32)"]


class _Stub:
    name = "eagle"

    def __init__(self, path):
        self.path = path

    def eval(self):
        return self
