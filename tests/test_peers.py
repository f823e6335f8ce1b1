"""The peers' side by side (benchmarks/peers): the converters write the SAME conversations and
features in each peer's format (speculators' PRE-norm last layer, SpecForge's POST-norm), a peer's
export is rebuilt exactly as our drafter, and speculators' split keeps our conversations; our side
of the shims' loss check (its command lines, its report, its line) and of the engine check (each
arm's folder and reader, its columns). The loss check itself needs the peers' virtualenvs: it runs
in the benchmark (benchmarks/peers/losscheck.py), not here."""
import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.peers import features as F
from benchmarks.peers.imports import import_peer, peer_format
from benchmarks.peers.prepare import val_padding
from benchmarks.peers.venvs import PEERS, peer_python
from specdistill.data.capture import CaptureConfig, OfflineFeatures, capture_split
from specdistill.drafters.base import DecodeState, build_drafter
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.drafters.parts.fused_layouts import engine_config, engine_state
from specdistill.drafters.parts.vocab import d2t_to_offsets, offsets_to_d2t
from specdistill.target.model import load_target

LAYERS = [1, 2, 3]  # low / mid / high of a 4-layer tiny target (engines want 3 distinct ids)


@pytest.fixture(scope="module")
def target():
    from conftest import TINY_MODEL
    from specdistill.target.model import TargetConfig

    t = load_target(TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                                 model_config={**TINY_MODEL, "num_hidden_layers": 4}, seed=0,
                                 dtype="float32"))
    with torch.no_grad():  # a trained norm's weight, not init's ones (post / w must differ)
        F.final_norm(t).weight.uniform_(0.5, 3.0, generator=torch.Generator().manual_seed(1))
    return t


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(0)
    out = []
    for T in (9, 14, 6):
        ids = torch.randint(5, 1000, (T,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * (T // 2) + [1] * (T - T // 2)})
    return out


@pytest.fixture(scope="module")
def convs(target, rows, tmp_path_factory):
    folder = tmp_path_factory.mktemp("capture")
    capture_split(target, rows, CaptureConfig(layers=LAYERS), folder, progress=False)
    return list(F.conversations(target, rows, OfflineFeatures(folder, LAYERS, target), None))


def test_prenorm_is_the_last_layer_before_the_final_norm(target, rows):
    ids = torch.tensor(rows[0]["input_ids"])
    pre = F.prenorm_last(target, ids, None)
    with torch.inference_mode():
        out = target.model.model(ids[None], output_hidden_states=True)
        post = out.hidden_states[-1][0]  # transformers' last entry: already normed
        assert torch.allclose(F.final_norm(target)(pre), post, atol=1e-5)
    assert not torch.allclose(pre, post, atol=1e-2)  # the norm changes it: the two are not the same
    assert pre.shape == (len(ids), target.hidden_size)


def test_speculators_files_hold_aux_layers_and_the_prenorm_state(convs, rows, tmp_path):
    assert F.write_speculators(convs, tmp_path) == len(rows)
    lines = [json.loads(l) for l in open(tmp_path / "data.jsonl")]
    for i, (c, row) in enumerate(zip(convs, rows)):
        hs = load_file(str(tmp_path / "hidden_states" / f"hs_{i}.safetensors"))
        T, H = len(row["input_ids"]), c["pre"].shape[-1]
        assert hs["token_ids"].tolist() == row["input_ids"] == lines[i]["input_ids"]
        assert lines[i]["loss_mask"] == row["loss_mask"]
        assert hs["hidden_states"].shape == (T, 4, H)
        assert hs["hidden_states"].dtype == torch.bfloat16  # what its collate casts to
        assert torch.equal(hs["hidden_states"][:, :3].flatten(1), c["aux"].bfloat16())  # flatten(1)
        assert torch.equal(hs["hidden_states"][:, 3], c["pre"].bfloat16())  # the LAST entry
        assert not torch.allclose(hs["hidden_states"][:, 3].float(), c["post"], atol=1e-2)


def test_speculators_norm_of_the_last_entry_is_the_captured_post_norm_state(convs, target):
    """speculators reads the last entry only through the verifier's norm: its image there is the
    very post-norm state our trainer and SpecForge read, up to eps / (2 mean(x^2)) relative
    (~1e-4 at this random target's small states; ~1e-7 at SmolLM2's last layer)."""
    norm = F.final_norm(target)
    for c in convs:
        with torch.inference_mode():
            again = norm(c["pre"])
        assert torch.allclose(again, c["post"], rtol=1e-3, atol=1e-5)
        assert not torch.allclose(c["pre"], c["post"], atol=1e-2)  # not the post-norm state itself


def test_a_norm_that_post_over_w_does_not_invert_takes_the_target_forward(target, rows, tmp_path):
    """A final norm whose weight has a zero (post / w is not finite): the pre-norm state comes from
    a target forward instead, and still norms to the capture."""
    capture_split(target, rows, CaptureConfig(layers=LAYERS), tmp_path, progress=False)
    norm = F.final_norm(target)
    keep = norm.weight.detach().clone()
    try:
        with torch.no_grad():
            norm.weight[0] = 0.0
        capture_split(target, rows, CaptureConfig(layers=LAYERS), tmp_path / "z", progress=False)
        got = list(F.conversations(target, rows, OfflineFeatures(tmp_path / "z", LAYERS, target), None))
        for c, row in zip(got, rows):
            assert torch.isfinite(c["pre"]).all()
            assert torch.equal(c["pre"], F.prenorm_last(target, torch.tensor(row["input_ids"]), None))
    finally:
        with torch.no_grad():
            norm.weight.copy_(keep)


def test_specforge_files_hold_aux_layers_and_the_postnorm_state(convs, rows, target, tmp_path):
    assert F.write_specforge(convs, tmp_path) == len(rows)
    for i, (c, row) in enumerate(zip(convs, rows)):
        d = torch.load(tmp_path / f"data_{i:05d}.ckpt")
        T, H = len(row["input_ids"]), target.hidden_size
        assert d["input_ids"].tolist() == row["input_ids"]  # (T,): its reader adds the batch axis
        assert d["loss_mask"].tolist() == row["loss_mask"]
        assert d["aux_hidden_state"].shape == (1, T, 3 * H)
        assert d["hidden_state"].dtype == d["aux_hidden_state"].dtype == torch.bfloat16  # its own
        assert torch.equal(d["hidden_state"][0], c["post"].bfloat16())  # POST-norm: its head reads it
        assert torch.allclose(F.final_norm(target)(c["pre"]), d["hidden_state"][0].float(), atol=2e-2)
        assert torch.equal(d["aux_hidden_state"][0], c["aux"].bfloat16())


def test_a_capture_of_another_target_is_refused(rows, tmp_path):
    from conftest import TINY_MODEL
    from specdistill.target.model import TargetConfig

    a = load_target(TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                                 model_config={**TINY_MODEL, "num_hidden_layers": 4}, seed=0,
                                 dtype="float32"))
    b = load_target(TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                                 model_config={**TINY_MODEL, "num_hidden_layers": 4}, seed=1,
                                 dtype="float32"))
    capture_split(a, rows, CaptureConfig(layers=LAYERS), tmp_path, progress=False)
    feats = OfflineFeatures(tmp_path, LAYERS, a)
    with pytest.raises(ValueError, match="norm\\(pre-norm state\\) differs"):
        next(F.conversations(b, rows, feats, None))


@pytest.mark.parametrize("n", [1, 7, 40, 48, 815])
def test_speculators_train_split_is_exactly_our_conversations(n):
    v = val_padding(n)
    assert int((n + v) * 0.9) == n and v >= 1  # its split: the first int(len * ratio) rows


@pytest.mark.parametrize("engine", ["speculators", "sglang"])
def test_a_peer_export_is_rebuilt_exactly(target, engine, tmp_path):
    """An export in the peer's layout, its draft vocabulary in the peer's (frequency) order, comes
    back as our drafter with the same weights and the same drafts."""
    torch.manual_seed(0)
    cfg = {"name": "eagle3", "aux_layers": LAYERS, "draft_vocab_size": 64, "ttt_length": 1,
           "norm_before_residual": engine == "speculators"}
    ours = build_drafter(cfg, target)
    ours.draft_vocab.set(torch.randperm(target.vocab_size)[:64].sort().values)
    for p in ours.parameters():
        p.data.normal_(0, 0.05)
    fmt = "vllm" if engine == "sglang" else "speculators"
    tensors = engine_state(ours, fmt)
    d2t = offsets_to_d2t(tensors["d2t"])
    perm = torch.randperm(len(d2t))  # the peer's own order of the same vocabulary
    tensors["d2t"], tensors["lm_head.weight"] = d2t_to_offsets(d2t[perm]), tensors["lm_head.weight"][perm]
    config = engine_config(ours, fmt)
    if engine == "sglang":
        config.pop("norm_before_residual")  # SpecForge writes none: vLLM's default (false)
        config["architectures"] = ["LlamaForCausalLMEagle3"]
    from safetensors.torch import save_file

    folder = tmp_path
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    assert peer_format(config) == engine
    back = import_peer(folder, target, LAYERS)
    a, b = same_weights_and_drafts(ours, back, target, 3)
    assert torch.equal(a.tokens, b.tokens)


def same_weights_and_drafts(ours, back, target, k: int):
    """Asserts `back` holds `ours`' weights exactly; both drafters' greedy k-token drafts on one
    random context of the target's features."""
    for name, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], v), name
    ids = torch.randint(5, 1000, (12,))
    feats = target.forward(ids[None], layers=tuple(LAYERS), logits=False).features[0, :-1]
    state = DecodeState(tokens=ids, features=feats)
    greedy = SamplingParams(temperature=0.0)
    with torch.inference_mode():
        return ours.eval().propose(state, k, greedy), back.propose(state, k, greedy)


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_a_speculators_dspark_export_is_rebuilt_exactly(target, head, tmp_path):
    """speculators' DSpark layout (our export of it, stripped of our block, its draft vocabulary
    in another order: the head's and the Markov W2's rows with it) comes back as our DSpark with
    the same weights, drafts and confidences."""
    from safetensors.torch import save_file

    from benchmarks.peers.imports import import_dspark
    from specdistill.export.folder import export_drafter

    torch.manual_seed(0)
    cfg = {"name": "dspark", "aux_layers": LAYERS, "draft_vocab_size": 64, "block_size": 4,
           "num_layers": 2, "markov_rank": 8, "markov_head_type": head}
    ours = build_drafter(cfg, target)
    ours.draft_vocab.set(torch.randperm(target.vocab_size)[:64].sort().values)
    for p in ours.parameters():
        p.data.normal_(0, 0.05)
    out = Path(export_drafter(ours, cfg, target, "speculators", tmp_path / "ours", k=4)["path"])
    config = json.loads((out / "config.json").read_text())
    config.pop("specdistill")
    tensors = load_file(str(out / "model.safetensors"))
    d2t = offsets_to_d2t(tensors["d2t"])
    perm = torch.randperm(len(d2t))  # the peer's own order of the same vocabulary
    tensors["d2t"] = d2t_to_offsets(d2t[perm])
    for name in ("lm_head.weight", "markov_head.markov_w2.weight"):
        tensors[name] = tensors[name][perm]
    peer = tmp_path / "peer"
    peer.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(peer / "model.safetensors"))
    (peer / "config.json").write_text(json.dumps(config))
    back = import_peer(peer, target, LAYERS)
    assert type(back).__name__ == "DSpark" and back.cfg.markov_head_type == head
    a, b = same_weights_and_drafts(ours, back, target, 4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.accept_prob, b.accept_prob)
    with pytest.raises(ValueError, match="not the layers its features came from"):
        import_dspark(peer, config, target, [0, 1, 2])
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        import_dspark(peer, {**config, "confidence_head_with_markov": False}, target, LAYERS)


def test_an_unknown_export_is_refused():
    with pytest.raises(ValueError, match="not an EAGLE-3 export"):
        peer_format({"architectures": ["LlamaForCausalLM"]})


# -- the shims' loss check: our side ----------------------------------------------------------------
def _target_dir(tmp_path, tied: bool) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / ("tied" if tied else "untied")
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 8, "vocab_size": 32,
                                               "num_attention_heads": 2, "tie_word_embeddings": tied}))
    heads = {} if tied else {"lm_head.weight": torch.zeros(32, 8)}
    save_file({"model.embed_tokens.weight": torch.zeros(32, 8), **heads}, str(d / "model.safetensors"))
    return d


def test_the_speculators_check_runs_its_defaults_on_the_datas_layers(tmp_path):
    from benchmarks.peers import losscheck as LC

    cmd = LC.check_command("speculators", Path("/py"), tmp_path / "data", tmp_path / "t", [1, 2, 3],
                           tmp_path / "run", tmp_path / "r.json")
    assert cmd[:2] == ["/py", str(LC.HERE / "speculators_cpu.py")]
    assert cmd[2:5] == ["--check-loss", "--report", str(tmp_path / "r.json")]
    at = cmd.index("--target-layer-ids")
    assert cmd[at + 1:at + 5] == ["1", "2", "3", "--loss-implementation"]  # the data's, not 2 15 27
    assert cmd[cmd.index("--data-path") + 1] == str(tmp_path / "data" / "speculators")
    assert "--ttt-steps" not in cmd  # its defaults: every TTT step's loss is checked
    assert cmd[-2:] == ["--total-seq-len", str(LC.SPECULATORS_CHECK_TOKENS)]  # the last one wins


@pytest.mark.parametrize("tied", [True, False])
def test_the_specforge_check_reads_the_head_where_the_target_keeps_it(tmp_path, tied):
    import yaml

    from benchmarks.peers import losscheck as LC

    cmd = LC.check_command("specforge", Path("/py"), tmp_path / "data", _target_dir(tmp_path, tied),
                           [1, 2, 3], tmp_path / "run", tmp_path / "r.json")
    assert cmd[2:5] == ["--check-loss", "--report", str(tmp_path / "r.json")]
    run = yaml.safe_load(open(cmd[cmd.index("--config") + 1]))
    # SmolLM2 ties its head (the embedding is the head); an untied target has its own
    assert run["model"]["lm_head_key"] == ("model.embed_tokens.weight" if tied else "lm_head.weight")
    assert run["data"]["hidden_states_path"] == str(tmp_path / "data" / "specforge")
    assert "ttt_length" not in run["training"]  # its defaults (7 TTT steps)
    index = json.loads((Path(run["model"]["target_model_path"]) / "model.safetensors.index.json")
                       .read_text())
    assert set(index["weight_map"]) == {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    with pytest.raises(ValueError, match="no loss check for peer 'eagle'"):
        LC.check_command("eagle", Path("/py"), tmp_path, tmp_path, [1], tmp_path, tmp_path / "r")


def test_a_check_is_ok_only_when_the_shim_says_so_and_exits_zero(tmp_path):
    from benchmarks.peers import losscheck as LC

    rep, log = tmp_path / "r.json", tmp_path / "log"
    same = {"loss_shimmed": 1.5, "loss_reference": 1.5, "loss_diff": 0.0, "grad_diff": 0.0,
            "ok": True, "reference": "specforge.core.loss._compute_loss", "peak_rss_mb": 9}
    rep.write_text(json.dumps(same))
    got = LC.read_check(rep, 0, log)
    assert got["ok"] and got["loss_shimmed"] == got["loss_reference"] == 1.5
    assert "peak_rss_mb" not in got
    assert "same" in LC.check_line("specforge", got) and "1.500000" in LC.check_line("specforge", got)
    rep.write_text(json.dumps({**same, "loss_shimmed": 2.0, "loss_diff": 0.5, "ok": False}))
    got = LC.read_check(rep, 1, log)
    assert not got["ok"] and "DIFFERENT" in LC.check_line("specforge", got)
    rep.write_text(json.dumps(same))
    assert not LC.read_check(rep, 1, log)["ok"]  # a non-zero exit is never ok
    rep.unlink()
    log.write_text("Traceback\nRuntimeError: no batch\n")
    got = LC.read_check(rep, 1, log)
    assert not got["ok"] and got["error"] == "RuntimeError: no batch"
    assert LC.check_line("speculators", got).startswith("- loss check, speculators: did not run")


# -- the replay of every arm ------------------------------------------------------------------------
def test_the_replay_adds_humaneval_to_a_finished_run_and_pairs_the_gap_over_all_prompts(tmp_path,
                                                                                     monkeypatch):
    """A run replayed on MT-bench only, rerun with --humaneval: each arm replays the HumanEval
    answers only (its MT-bench replay is kept), the gap over all prompts pairs prompt by prompt
    (ours gains on HumanEval only, so the all-prompt gap is the MT-bench gap diluted), and the
    table gains the two columns."""
    from benchmarks.peers import replay as R

    answers = {"mtbench": [{"n": 2}, {"n": 4}], "humaneval": [{"n": 8}]}
    monkeypatch.setattr(R, "replay_answers", lambda target, n, tokens, out, kind="mtbench":
                        answers[kind][:n])
    monkeypatch.setattr("specdistill.target.model.load_target", lambda cfg, training: None)
    monkeypatch.setattr(R, "load_arm_drafter", lambda name, res, target, aux: name)
    replayed = []

    def fake_replay(target, drafter, rows, k, tokens):  # ours accepts one more token per answer
        replayed.append((drafter, len(rows)))
        per = [[r["n"], 2 * r["n"] + (drafter == "ours"), 0, 0] for r in rows]
        tau, se = R.ratio_se([p[1] for p in per], [p[0] for p in per])
        return {"tau": tau, "tau_se": se, "rounds": sum(p[0] for p in per), "per_prompt": per}

    monkeypatch.setattr(R, "replay_drafter", fake_replay)
    args = Namespace(out=tmp_path, prompts=2, tokens=16, k=2, set=[], humaneval=0,
                     arms=["ours", "speculators-close"])
    results = {"ours": {"train": {}}, "speculators-close": {"train": {}}}
    R.replay_all(args, results, {"aux_layers": LAYERS})
    assert replayed == [("ours", 2), ("speculators-close", 2)]
    assert "gap_to_ours_all" not in results["speculators-close"]
    args.humaneval = 1
    R.replay_all(args, results, {"aux_layers": LAYERS})
    assert replayed[2:] == [("ours", 1), ("speculators-close", 1)]  # HumanEval only, once each
    peer = results["speculators-close"]
    assert peer["gap_to_ours"][0] == pytest.approx(2.0 - (12 + 2) / 6)
    assert peer["gap_to_ours_all"][0] == pytest.approx(2.0 - (28 + 3) / 14)
    R.replay_all(args, results, {"aux_layers": LAYERS})
    assert len(replayed) == 4  # a rerun replays nothing again
    lines = R.table(results, args).splitlines()
    assert "replay tau (1 HumanEval)" in lines[0] and "all 3 prompts" in lines[0]
    assert lines[0].count("|") == lines[1].count("|") == lines[3].count("|") == 12
    assert lines[2].split("|")[-3].strip() == "2.125 +- nan"  # ours: 17 tokens in 8 rounds


# -- the engine check of every arm: our side ---------------------------------------------------------
def test_the_table_holds_the_engine_columns_and_the_loss_checks_and_no_check_is_an_arm():
    from benchmarks.peers import replay as R

    args = Namespace(k=2, prompts=3, tokens=16, arms=["ours", "speculators-close"])
    results = {"ours": {"train": {"what": "ours"}, "replay": {"tau": 1.5, "tau_se": 0.1},
                        "engine": {"loaded": True, "verdict": "pass", "spec_equals_plain": 3,
                                   "prompts": 3, "tau_engine": 1.61, "tau_replay": 1.6,
                                   "engine_plain_tokens_per_s": 20.0,
                                   "engine_spec_tokens_per_s": 25.5}},
               "speculators-close": {"train": {"what": "close"},
                                     "engine": {"loaded": False, "error": "ValueError: unknown\n"
                                                "weight | midlayer.x", "verdict": "refused"}},
               R.LOSS_CHECK: {"speculators": {"loss_shimmed": 1.0, "loss_reference": 1.0,
                                              "loss_diff": 0.0, "grad_diff": 0.0, "ok": True}}}
    assert list(R.arms(results)) == ["ours", "speculators-close"]
    lines = R.table(results, args).splitlines()
    assert "engine loads" in lines[0] and lines[0].count("|") == lines[1].count("|") == 14
    import re

    def cells(line):  # a cell's escaped \\| is not a column
        return [c.strip() for c in re.split(r"(?<!\\)\|", line)]

    assert len(cells(lines[0])) == len(cells(lines[2])) == len(cells(lines[3])) == 15
    ours = cells(lines[2])
    assert ours[-5:-1] == ["yes", "3/3", "1.610 / 1.600", "20.0 / 25.5"]
    peer = cells(lines[3])
    assert peer[-5].startswith("no: ValueError: unknown weight \\| midlayer.x")  # one cell
    assert peer[-4:-1] == ["—", "—", "—"]
    assert lines[-1].startswith("- loss check, speculators: shimmed trainer 1.000000")
    assert "engine loads" not in R.table({"ours": {"train": {}}}, args)  # no engine run: no columns


@pytest.fixture
def engine_args(tmp_path):
    return Namespace(out=tmp_path, arms=["ours", "speculators-close", "specforge-close"], k=2,
                     prompts=5, engine_prompts=3, tokens=16,
                     set=["target=tiny", "target.model_config.num_hidden_layers=4"])


def test_each_arm_goes_to_the_engine_as_it_ships_and_a_failure_is_its_row(engine_args, tmp_path,
                                                                           monkeypatch):
    """ours: its best checkpoint exported in the layout vLLM serves, read by its own config; a
    peer: its own export folder with vLLM's eagle3 reader and our reading of it as the drafter
    replayed; an arm whose drafter cannot be read records why; the others go on."""
    from benchmarks.peers import engine as E
    from benchmarks.replaying import compose
    from specdistill.decode.engine import check as chk
    from specdistill.store.drafter import save_drafter

    target = load_target(compose(engine_args.set).target, training=True)
    cfg = {"name": "eagle3", "aux_layers": LAYERS, "ttt_length": 1}
    ours = build_drafter(cfg, target)
    save_drafter(ours, cfg, tmp_path / "best")
    peer = tmp_path / "peer"
    peer.mkdir()
    fmt_ours = build_drafter({"name": "eagle3", "aux_layers": LAYERS, "ttt_length": 1,
                              "norm_before_residual": True}, target)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in engine_state(fmt_ours, "speculators").items()},
              str(peer / "model.safetensors"))
    (peer / "config.json").write_text(json.dumps(engine_config(fmt_ours, "speculators")))
    calls = {}

    def fake_check(folder, target, drafter, **kw):
        calls[Path(folder).parent.name if kw["serving"] is None else "peer"] = (Path(folder), drafter, kw)
        return {"summary": {"loaded": True, "verdict": "pass", "spec_equals_plain": 3, "prompts": 3,
                            "tau_engine": 1.5, "tau_replay": 1.5, "engine_spec_tokens_per_s": 9.0,
                            "per_prompt_rows_not_kept": [1]}}

    monkeypatch.setattr(chk, "engine_check", fake_check)
    results = {"ours": {"train": {"drafter": str(tmp_path / "best")}},
               "speculators-close": {"train": {"drafter": str(peer)}},
               "specforge-close": {"train": {"drafter": str(tmp_path / "missing")}},
               "speculators-default": {"train": {"drafter": str(peer)}}}  # not in --arms
    E.engine_all(engine_args, results, {"aux_layers": LAYERS})
    folder, drafter, kw = calls["ours"]
    assert json.loads((folder / "config.json").read_text())["specdistill"]["format"]  # ours: exported
    assert kw["serving"] is None and kw["k"] == 2 and kw["limit"] == 3 and kw["max_new_tokens"] == 16
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in ours.state_dict().items())
    folder, drafter, kw = calls["peer"]
    assert folder == peer and kw["serving"] == {"method": "eagle3"}  # its own folder, as it wrote it
    assert drafter.cfg.norm_before_residual  # our reading of its export: its own config's options
    assert results["ours"]["engine"] == results["speculators-close"]["engine"] == {
        "loaded": True, "verdict": "pass", "spec_equals_plain": 3, "prompts": 3, "tau_engine": 1.5,
        "tau_replay": 1.5, "engine_spec_tokens_per_s": 9.0}
    bad = results["specforge-close"]["engine"]
    assert not bad["loaded"] and bad["verdict"] == "not run" and "missing" in bad["error"]
    assert "engine" not in results["speculators-default"]
    E.engine_all(engine_args, results, {"aux_layers": LAYERS})  # a rerun: each arm checked once
    assert len(calls) == 2


@pytest.mark.parametrize("engine", [False, True])
def test_the_benchmark_checks_each_peers_loss_once_and_runs_the_engine_on_request(tmp_path,
                                                                                  monkeypatch, engine):
    import benchmarks.peers.__main__ as M

    checked, engined = [], []
    monkeypatch.setattr(M, "ensure_peer", lambda peer: Path(f"/venvs/{peer.name}/python"))
    monkeypatch.setattr(M, "write_peer_data", lambda cfg, out, pythons: {"aux_layers": LAYERS})
    monkeypatch.setattr(M.A, "target_folder", lambda cfg: tmp_path / "target")
    monkeypatch.setattr(M.A, "train_arm", lambda name, *a: {"what": name, "drafter": None})
    monkeypatch.setattr(M.R, "replay_all", lambda args, results, data: None)
    monkeypatch.setattr(M.E, "engine_all", lambda args, results, data: engined.append(
        sorted(M.R.arms(results))))

    def check_peer(peer, python, out, aux_layers, target_dir):
        checked.append((peer, str(python), aux_layers, target_dir))
        return {"loss_shimmed": 2.0, "loss_reference": 2.0, "loss_diff": 0.0, "grad_diff": 0.0,
                "ok": True, "rc": 0}

    monkeypatch.setattr(M.LC, "check_peer", check_peer)
    argv = ["--out", str(tmp_path / "b"), "--arms", "ours", "speculators-close", "specforge-default",
            *(["--engine"] if engine else [])]
    M.main(argv)
    assert checked == [(p, f"/venvs/{p}/python", LAYERS, tmp_path / "target")
                       for p in ("specforge", "speculators")]
    results = json.loads((tmp_path / "b" / "peers.json").read_text())
    assert results["loss_check"]["speculators"]["loss_reference"] == 2.0
    md = (tmp_path / "b" / "peers.md").read_text()
    assert "- loss check, specforge: shimmed trainer 2.000000" in md
    assert engined == ([["ours", "specforge-default", "speculators-close"]] if engine else [])
    M.main(argv)  # a rerun continues: each peer is checked once
    assert len(checked) == 2


def test_an_arms_peak_memory_is_its_own_not_the_parents_it_was_forked_from(tmp_path):
    """run_arm samples the child's VmHWM: a parent holding 400 MB that starts a child which
    touches 100 MB reports the child's ~100 MB (plus its interpreter), not the parent's 400 MB
    that getrusage's ru_maxrss carries across fork + exec; its anonymous peak likewise (the
    100 MB buffer, not the interpreter's mapped libraries)."""
    import sys

    from benchmarks.peers.arms import run_arm

    held = bytearray(400 * 2 ** 20)
    held[::4096] = b"x" * len(held[::4096])  # resident
    got = run_arm([sys.executable, "-c", "import time; b = bytearray(100 * 2 ** 20); "
                   "b[::4096] = b'y' * len(b[::4096]); time.sleep(1.5)"], tmp_path / "log",
                  nice=0, every=0.1)
    assert got["rc"] == 0 and 100 <= got["peak_rss_mb"] < 300, got
    assert 100 <= got["peak_anon_mb"] <= got["peak_rss_mb"], got
    del held


def test_schedule_steps_fit_each_arms_schedule_to_its_minutes(tmp_path, monkeypatch):
    """--schedule-steps ours=166 speculators-close=161: our arm runs trainer.max_steps=166 (its
    on-policy phase and LR decay inside the minutes), speculators' scheduler spans 161 steps
    (its warm-up a tenth of them at most); an arm not named keeps our default job's length
    (trainer.max_steps of the composed config: one place says it); bad pairs are refused."""
    from benchmarks.peers import arms as A
    from benchmarks.peers.__main__ import parse_args
    from benchmarks.replaying import compose

    args = parse_args(["--out", str(tmp_path), "--minutes", "1", "--schedule-steps", "ours=166",
                       "speculators-close=161"])
    assert args.schedule_steps == {"ours": 166, "speculators-close": 161}
    cmds = {}
    monkeypatch.setattr(A, "run_arm", lambda cmd, log, env: cmds.setdefault(log.stem, cmd) and {
        "rc": 0, "wall_s": 0.0, "peak_rss_mb": 0.0})
    monkeypatch.setattr(A, "ours_report", lambda run_dir: {})
    monkeypatch.setattr(A, "target_folder", lambda cfg: tmp_path / "target")
    cfg = compose(["trainer.max_steps=321"])  # the default job, at a length only it could give
    for name in ("ours", "speculators-close", "speculators-default"):
        got = A.train_arm(name, args, [], {"aux_layers": LAYERS}, {"speculators": Path("/py")}, cfg)
        assert ("schedule over" in got["what"]) == (name != "speculators-default")
    assert "trainer.max_steps=166" in cmds["ours"]
    sets = parse_args(["--out", str(tmp_path), "--set", "trainer.schedule=minutes"])
    got = A.train_arm("ours", sets, [], {"aux_layers": LAYERS}, {}, cfg)  # --set: said in its row
    assert got["what"].endswith("; trainer.schedule=minutes") and "schedule over" not in got["what"]
    spec = cmds["speculators-close"]
    assert spec[spec.index("--scheduler-total-steps") + 1] == "161"
    assert spec[spec.index("--scheduler-warmup-steps") + 1] == "16"
    dflt = cmds["speculators-default"]
    assert dflt[dflt.index("--scheduler-total-steps") + 1] == "321"
    assert "--scheduler-total-steps" not in A.speculators_args(tmp_path, tmp_path, tmp_path, False)
    with pytest.raises(ValueError, match="total_steps"):  # the close arm's warm-up needs a length
        A.speculators_args(tmp_path, tmp_path, tmp_path, True)
    for bad in (["ours=x"], ["nobody=3"], ["ours=0"]):
        with pytest.raises(SystemExit):
            parse_args(["--schedule-steps", *bad])


def test_arm_names_say_peer_algorithm_and_flavour():
    from benchmarks.peers.__main__ import ARMS, DSPARK_ARMS
    from benchmarks.peers.arms import ArmName

    assert ArmName.parse("ours") == ArmName(None, "eagle3", "ours")
    assert ArmName.parse("ours-dspark") == ArmName(None, "dspark", "ours")
    assert ArmName.parse("speculators-dspark-close") == ArmName("speculators", "dspark", "close")
    assert ArmName.parse("specforge-default") == ArmName("specforge", "eagle3", "default")
    assert {ArmName.parse(a).reference for a in ARMS} == {"ours"}
    assert {ArmName.parse(a).reference for a in DSPARK_ARMS} == {"ours-dspark"}
    for bad in ("ours-close", "speculators", "speculators-dspark", "speculators-fast"):
        with pytest.raises(ValueError, match="not ours"):
            ArmName.parse(bad)


def commands_of_arms(tmp_path, monkeypatch, *arms: str) -> tuple[dict, dict, dict]:
    """Each arm's training command and table line as train_arm makes them (nothing runs), on data
    of 1000 tokens, half of them scored."""
    from benchmarks.peers import arms as A
    from benchmarks.peers.__main__ import parse_args
    from benchmarks.replaying import compose

    args = parse_args(["--out", str(tmp_path), "--minutes", "1", "--arms", *arms])
    cmds = {}
    monkeypatch.setattr(A, "run_arm", lambda cmd, log, env: cmds.setdefault(log.stem, cmd) and {
        "rc": 0, "wall_s": 0.0, "peak_rss_mb": 0.0})
    monkeypatch.setattr(A, "ours_report", lambda run_dir: {})
    monkeypatch.setattr(A, "target_folder", lambda cfg: tmp_path / "target")
    data = {"aux_layers": LAYERS, "tokens": 1000, "answer_tokens": 500}
    whats = {name: A.train_arm(name, args, [], data, {"speculators": Path("/py")}, compose([]))["what"]
             for name in args.arms}
    return cmds, whats, data


def test_the_dspark_arms_train_our_dspark_job_and_speculators_dspark_as_it_ships_or_as_ours(
        tmp_path, monkeypatch):
    """ours-dspark: the default job with drafter=dspark; speculators' DSpark: its defaults (no
    shaping flag), or ours (1 layer, block 4, vocab 8192, CE 0.1 + TV 1.8 = our 0.9 L1, our share of
    anchors); both on the data's layers, scheduled over our DSpark job's length."""
    from benchmarks.peers import arms as A
    from benchmarks.replaying import compose

    cmds, whats, data = commands_of_arms(tmp_path, monkeypatch, "ours-dspark", "speculators-dspark-close",
                                         "speculators-dspark-default")
    assert "drafter=dspark" in cmds["ours-dspark"] and "dspark" in whats["ours-dspark"]
    length = str(compose(A.OURS + ["drafter=dspark"]).trainer.max_steps)
    close, dflt = cmds["speculators-dspark-close"], cmds["speculators-dspark-default"]
    for cmd in (close, dflt):
        assert cmd[cmd.index("--speculator-type") + 1] == "dspark"
        at = cmd.index("--target-layer-ids")
        assert cmd[at + 1:at + 4] == [str(i) for i in LAYERS]
        assert cmd[cmd.index("--scheduler-total-steps") + 1] == length
    assert A.close_anchors(data) == 205  # 0.1 x 4096 packed tokens x half of them scored
    for flag, value in (("--num-layers", "1"), ("--block-size", "4"), ("--draft-vocab-size", "8192"),
                        ("--max-anchors", "205"), ("--optimizer", "adamw")):
        assert close[close.index(flag) + 1] == value, flag
    assert json.loads(close[close.index("--loss-fn") + 1]) == {"ce": 0.1, "tv": 1.8}
    assert "205 anchors" in whats["speculators-dspark-close"]
    assert not {"--num-layers", "--block-size", "--draft-vocab-size", "--loss-fn", "--ttt-steps"} & set(dflt)
    with pytest.raises(ValueError, match="anchors"):
        A.speculators_args(tmp_path, tmp_path, tmp_path, True, 10, "dspark")


@pytest.mark.parametrize("native, dtype", [(True, "bfloat16"), (False, "float32")])
def test_a_close_speculators_arm_trains_in_our_resolved_precision_its_default_in_its_own(
        tmp_path, monkeypatch, native, dtype):
    """trainer.precision=auto is fp32 on a CPU without native bf16 (an AVX2 EPYC, where speculators'
    bf16 autocast made 17 DSpark steps in 10 minutes to our 270): the close arms are given our
    resolved precision as --hidden-states-dtype, the default arms keep speculators' own."""
    from benchmarks.peers import arms as A

    monkeypatch.setattr("specdistill.train.precision.native_bf16", lambda device: (native, "", None))
    cmds, whats, _ = commands_of_arms(tmp_path, monkeypatch, "speculators-close", "speculators-default",
                                      "speculators-dspark-close")
    for name in ("speculators-close", "speculators-dspark-close"):
        cmd = cmds[name]
        assert cmd[cmd.index("--hidden-states-dtype") + 1] == dtype, name
        assert ("bf16" if native else "fp32") + " as ours" in whats[name]
    assert "--hidden-states-dtype" not in cmds["speculators-default"]
    with pytest.raises(ValueError, match="precision"):
        A.speculators_args(tmp_path, tmp_path, tmp_path, True, 10, precision="fp16")


@pytest.mark.parametrize("precision, dtype", [("bf16", "bfloat16"), ("fp32", "float32")])
def test_a_close_specforge_arm_trains_its_draft_in_our_resolved_precision_its_default_in_its_own(
        tmp_path, precision, dtype):
    """SpecForge's close arm gets our resolved trainer.precision as model.torch_dtype (its draft
    model's dtype, bf16 unless told); its default arm keeps SpecForge's own."""
    import yaml

    from benchmarks.peers.specforge_cpu import run_files

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 8, "vocab_size": 32}))
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    for close in (True, False):
        run, _ = run_files(target, tmp_path / "data", tmp_path / f"run-{close}", close, 100, precision)
        model = yaml.safe_load(run.read_text())["model"]
        assert model.get("torch_dtype") == (dtype if close else None), close
    with pytest.raises(ValueError, match="precision"):
        run_files(target, tmp_path / "data", tmp_path / "run", True, 100, "fp16")


def test_the_dspark_arms_go_to_llamacpp_ours_exported_and_the_peers_folder_as_it_wrote_it(
        engine_args, tmp_path, monkeypatch):
    """vLLM's CPU build refuses DSpark: both DSpark arms are checked in llama.cpp, ours exported in
    the layout llama.cpp serves, speculators' folder as written with our DSpark layout's
    llama.cpp entry (its converter's reading checked first) and our reading of it replayed."""
    from safetensors.torch import save_file

    from benchmarks.peers import engine as E
    from benchmarks.replaying import compose
    from specdistill.decode.engine import check as chk
    from specdistill.drafters.dspark import LLAMACPP
    from specdistill.export.folder import export_drafter
    from specdistill.store.drafter import save_drafter

    target = load_target(compose(engine_args.set).target, training=True)
    cfg = {"name": "dspark", "aux_layers": LAYERS, "block_size": 4, "markov_rank": 8}
    ours = build_drafter(cfg, target)
    save_drafter(ours, cfg, tmp_path / "best")
    out = Path(export_drafter(ours, cfg, target, "speculators", tmp_path / "exp", k=4)["path"])
    config = json.loads((out / "config.json").read_text())
    config.pop("specdistill")
    peer = tmp_path / "peer"
    peer.mkdir()
    save_file(load_file(str(out / "model.safetensors")), str(peer / "model.safetensors"))
    (peer / "config.json").write_text(json.dumps(config))
    calls = {}

    def fake_check(folder, target, drafter, **kw):
        calls["peer" if kw["serving"] else "ours"] = (Path(folder), drafter, kw)
        return {"summary": {"engine": kw["engine"], "loaded": True, "verdict": "pass",
                            "spec_equals_plain": 3, "prompts": 3}}

    monkeypatch.setattr(chk, "engine_check", fake_check)
    engine_args.arms = ["ours-dspark", "speculators-dspark-close"]
    results = {"ours-dspark": {"train": {"drafter": str(tmp_path / "best")}},
               "speculators-dspark-close": {"train": {"drafter": str(peer)}}}
    E.engine_all(engine_args, results, {"aux_layers": LAYERS})
    folder, drafter, kw = calls["ours"]
    assert kw["engine"] == "llamacpp" and kw["serving"] is None
    assert json.loads((folder / "config.json").read_text())["specdistill"]["format"] == "vllm"
    folder, drafter, kw = calls["peer"]
    assert folder == peer and kw["engine"] == "llamacpp" and kw["serving"] is LLAMACPP
    assert type(drafter).__name__ == "DSpark"
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in ours.state_dict().items())
    assert E.engine_cells(results["ours-dspark"]["engine"])[:2] == ["yes (llama.cpp)", "3/3"]
