"""Exports on a tiny target: every (drafter, layout) pair the registry holds (each drafter's own
layouts plus `hf`; full and pruned vocabularies where the layout takes them) reloads with the same
weights, logits and greedy decoding; the engine layouts compute what the engines' own forward passes
(re-implemented here from their sources, reading only the exported files) compute; unsupported
pairs and corrupted exports are refused with a clear error; writes are atomic; a push while offline
fails clearly and keeps the export; the export job (train/export.py) and train/serve parity work on
a real tiny training run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from eagle3_engines import dflash_logits, dspark_logits, first_step_logits
from omegaconf import OmegaConf
from procs import pythonpath
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import specdistill.drafters  # noqa: F401  (registers every drafter)
from specdistill.decode.spec import generate
from specdistill.drafters.base import DRAFTERS, DecodeState, TrainBatch, build_drafter
from specdistill.drafters.parts.anchors import dense_logits
from specdistill.drafters.parts.head import fit_draft_vocab
from specdistill.drafters.parts.layouts import ExportError
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.export.folder import export_drafter, full_config, load_export, validate_export
from specdistill.target.model import Target
from specdistill.train.export import ExportConfig, run_export
from specdistill.train.hub import PushError, push_to_hub

V, H = 128, 32
GREEDY = SamplingParams()


def example_configs() -> list:
    """(format, drafter config) for every registered (drafter, layout) pair: the layout's
    `requires` on the full vocabulary, and on a pruned one when the layout accepts it."""
    out = []
    for name, cls in sorted(DRAFTERS.items()):
        fields = cls.config_class.__dataclass_fields__
        for fmt, layout in sorted(cls.layouts.items()):
            for vd in [None, 48] if "draft_vocab_size" in fields else ["n/a"]:
                cfg = {"name": name, **layout.requires}
                if vd != "n/a":
                    cfg["draft_vocab_size"] = vd
                if layout.refusal(full_config(cfg)) is None:
                    out.append(pytest.param(fmt, cfg, id=f"{name}-{fmt}" + ("-pruned" if vd == 48 else "")))
    return out


PAIRS = example_configs()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: on a shared 2-core machine a second OpenMP thread makes each one ~100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A real (saveable) word-level tokenizer over the V ids t0..t{V-1}; EOS = id 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t1", eos_token="t2")


@pytest.fixture(scope="module")
def target() -> Target:
    torch.manual_seed(0)
    # 4 layers: eagle3's default aux layers (1, 2, 3) are ones every engine can name
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    model = LlamaForCausalLM(cfg)  # a non-default rope theta: a wrong one in an export shows up
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions, so drafts get accepted
    return Target(model, tiny_tokenizer(), "tiny")


def trained(target, cfg: dict):
    """The drafter with every weight moved off its init and a real (non-arange) vocab map."""
    d = build_drafter(cfg, target)
    g = torch.Generator().manual_seed(1)
    if cfg.get("draft_vocab_size"):
        fit_draft_vocab(d, torch.rand(V, generator=g), always_include=[2])
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return d.eval(), cfg


EAGLE_ENGINE = {"name": "eagle", "input_norm": False, "draft_vocab_size": None}
EAGLE_PRUNED = {"name": "eagle", "draft_vocab_size": 48}
MEDUSA = {"name": "medusa"}


def batch(target, drafter, T=20) -> TrainBatch:
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(5))
    out = target.forward(ids, layers=drafter.feature_layers)
    ones = torch.ones(1, T, dtype=torch.long)
    return TrainBatch(ids, ones, ones, out.logits, None if out.features is None else out.features.clone())


# -- the engines' forward passes, rebuilt from the exported files only -----------------------
def eagle1_engine_logits(folder: Path, target, b: TrainBatch) -> torch.Tensor:
    """vLLM llama_eagle.py / SGLang llama_eagle.py / speculators EagleSpeculator: fc over
    [embed(token t+1), hidden t] -> decoder layers (layer 0 without input_layernorm) -> the
    target's LM head. (B, T-1, V)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    if "speculators_config" in cfg:  # EagleSpeculator's module names
        cfg = cfg["transformer_layer_config"]
        w = {k.replace("fusion_fc.", "fc.").replace("transformer.", "layers.0."): v for k, v in w.items()}
    llama = LlamaConfig(**{k: cfg[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings")},
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]})
    llama._attn_implementation = "sdpa"
    layers = [LlamaDecoderLayer(llama, i) for i in range(llama.num_hidden_layers)]
    layers[0].input_layernorm = nn.Identity()
    for i, layer in enumerate(layers):
        p = f"layers.{i}."
        layer.load_state_dict({k[len(p):]: v for k, v in w.items() if k.startswith(p)}, strict=True)
    fc = nn.Linear(2 * H, H, bias="fc.bias" in w)
    fc.load_state_dict({k[3:]: v for k, v in w.items() if k.startswith("fc.")}, strict=True)
    with torch.no_grad():
        x = fc(torch.cat([target.embed_tokens()(b.input_ids[:, 1:]), b.features[:, :-1]], -1))
        T = x.shape[1]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), torch.finfo(x.dtype).min).triu(1)[None, None]
        rope = LlamaRotaryEmbedding(llama)(x, pos)
        for layer in layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return target.lm_head()(x)


def medusa_vllm_logits(folder: Path, feats: torch.Tensor) -> list[torch.Tensor]:
    """vLLM medusa.py: ResidualBlock per head, shared lm_head (original_lm_head), token_map
    scattering a truncated vocab into the full one (-inf elsewhere)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    assert cfg["original_lm_head"] and cfg["model_type"] == "medusa"
    out = []
    for i in range(cfg["num_heads"]):
        x = feats
        for j in range(cfg["num_hidden_layers"]):
            bias = w[f"blocks.{i}.layers.{j}.bias"] if cfg["medusa_fc_bias"] else None
            x = x + F.silu(F.linear(x, w[f"blocks.{i}.layers.{j}.weight"], bias))
        logits = F.linear(x, w["lm_heads.0.weight"])
        if "token_map" in w:
            assert cfg["truncated_vocab_size"] == len(w["token_map"]) < cfg["vocab_size"]
            full = logits.new_full((*logits.shape[:-1], cfg["vocab_size"]), float("-inf"))
            full[..., w["token_map"]] = logits
            logits = full
        out.append(logits)
    return out


class ResBlock(nn.Module):  # FasterDecoding/Medusa medusa_model.py
    def __init__(self, hidden):
        super().__init__()
        self.linear, self.act = nn.Linear(hidden, hidden), nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_original_logits(folder: Path, feats: torch.Tensor) -> list[torch.Tensor]:
    """The Medusa repo's MedusaModel heads, loaded from medusa_lm_head.pt as its from_pretrained does."""
    cfg = json.loads((folder / "config.json").read_text())
    K, L = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
    heads = nn.ModuleList(nn.Sequential(*([ResBlock(H)] * L), nn.Linear(H, V, bias=False)) for _ in range(K))
    heads.load_state_dict(torch.load(folder / "medusa_lm_head.pt", weights_only=True), strict=True)
    with torch.no_grad():
        return [h(feats) for h in heads]


def engine_logits(folder: Path, target, b: TrainBatch) -> list[torch.Tensor] | None:
    """What the engine that reads this folder computes (picked by its config's architecture, as
    the engines do): EAGLE-1 heads -> [(1, T-1, V)], Medusa heads -> one (1, T, V) per head (and
    the original repo's heads when medusa_lm_head.pt is there), EAGLE-3 heads -> [(1, T-1, V)]
    (tests/eagle3_engines.py). None: no engine re-implemented."""
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    with torch.no_grad():
        if arch in ("LlamaForCausalLM", "LlamaForCausalLMEagle", "EagleSpeculator"):
            return [eagle1_engine_logits(folder, target, b)]
        if arch in ("LlamaForCausalLMEagle3", "Eagle3Speculator", "PEagleSpeculator"):  # step 1
            return [first_step_logits(folder, target, b.input_ids[0])]
        if arch in ("DFlashSpeculator", "DFlashDraftModel"):  # (1, T, V) per draft slot, every anchor
            return dflash_logits(folder, target, b.input_ids[0])
        if arch in ("DSparkSpeculator", "Qwen3DSparkModel"):  # the same, with the Markov bias
            return dspark_logits(folder, target, b.input_ids[0])
        if arch == "MedusaModel":
            out = medusa_vllm_logits(folder, b.features)
            if (folder / "medusa_lm_head.pt").is_file():
                assert all(torch.allclose(x, y, atol=1e-5) for x, y in
                           zip(out, medusa_original_logits(folder, b.features)))
            return out
    return None


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,cfg", PAIRS)
def test_round_trip_logits_decoding_and_engine_forward(tmp_path, target, fmt, cfg):
    src, cfg = trained(target, cfg)
    out = export_drafter(src, cfg, target, fmt, tmp_path / "x", base_model="org/tiny",
                         k=4)["path"]
    back = load_export(out, target).eval()
    b = batch(target, src)
    with torch.no_grad():
        want, got = src.forward_train(b), back.forward_train(b)
    assert all(torch.allclose(p.logits, q.logits, atol=1e-5) for p, q in zip(want, got))
    prompt = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(7))
    r1 = generate(target, src, prompt, max_new_tokens=24, k=4)
    r2 = generate(target, back, prompt, max_new_tokens=24, k=4)
    assert torch.equal(r1.tokens, r2.tokens) and r1.accepted == r2.accepted
    tokens = torch.cat([prompt, r1.tokens])  # the same drafts, chain and tree, mid-generation
    feats = target.forward(tokens[None, :-1], layers=src.feature_layers, logits=False).features
    for d in (src, back):
        d.reset()
    state = DecodeState(tokens=tokens, features=None if feats is None else feats[0])
    assert torch.equal(src.propose(state, 4, GREEDY).tokens, back.propose(state, 4, GREEDY).tokens)
    if src.supports_tree:
        t1, t2 = src.propose_tree(state, GREEDY), back.propose_tree(state, GREEDY)
        assert torch.equal(t1.tokens, t2.tokens) and torch.equal(t1.parents, t2.parents)
    card = (out / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "org/tiny" and cfg["name"] in meta["tags"] and meta["license"]
    assert f"exported as `{fmt}`" in card and len(meta["tags"]) == len(set(meta["tags"]))
    standalone = DRAFTERS[cfg["name"]].layouts[fmt].save is not None  # loaded by transformers above
    theirs = None if fmt == "hf" or standalone else engine_logits(out, target, b)
    if theirs is not None:  # the engine's forward = ours, on the draft vocab
        cols = src.d2t if src.d2t is not None else torch.arange(V)  # (Vd,) target ids
        for pred, logits in zip(want, theirs):  # logits (1, n, V) over positions 0..n-1
            n = logits.shape[1]
            ours = dense_logits(pred)[:, :n]  # NaN where our head never ran (nothing trained there)
            ran = ~ours[..., 0].isnan()  # (1, n)
            assert ran.sum() >= n // 2 and torch.allclose(logits[..., cols][ran], ours[ran], atol=1e-5)
            assert int(torch.isinf(logits).sum()) == logits[..., 0].numel() * (V - len(cols))


def test_every_non_hf_tensor_layout_has_an_engine_check(tmp_path, target):
    """The engine layouts registered today are all re-implemented above (a new one is flagged)."""
    seen = set()
    for param in PAIRS:
        fmt, cfg = param.values
        if fmt == "hf" or cfg.get("draft_vocab_size"):
            continue
        src, cfg = trained(target, cfg)
        layout = DRAFTERS[cfg["name"]].layouts[fmt]
        if layout.save is not None:  # a standalone model, checked by transformers itself
            continue
        out = export_drafter(src, cfg, target, fmt, tmp_path / f"{cfg['name']}-{fmt}")["path"]
        assert engine_logits(out, target, batch(target, src)) is not None, (cfg["name"], fmt)
        seen.add(fmt)
    assert seen


def test_config_values_engines_read(tmp_path, target):
    src, cfg = trained(target, EAGLE_ENGINE)
    vllm_dir = export_drafter(src, cfg, target, "vllm", tmp_path / "v")["path"]
    vllm = json.loads((vllm_dir / "config.json").read_text())
    assert vllm["architectures"] == ["LlamaForCausalLM"]  # vLLM's EAGLEConfig adds the Eagle prefix
    assert vllm["rope_theta"] == 50000.0 and vllm["num_hidden_layers"] == 1 and vllm["vocab_size"] == V
    sgl = export_drafter(src, cfg, target, "sglang", tmp_path / "s")["path"]
    assert json.loads((sgl / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert not load_file(str(sgl / "model.safetensors"))["fc.bias"].any()
    spec = json.loads((export_drafter(src, cfg, target, "speculators", tmp_path / "p",
                                      base_model="org/tiny", k=3)["path"]
                       / "config.json").read_text())
    sc = spec["speculators_config"]  # the fields vLLM's SpeculatorsConfig validation reads
    assert spec["speculators_model_type"] == "eagle" and sc["algorithm"] == "eagle"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"]["name_or_path"] == "org/tiny"
    assert isinstance(spec["transformer_layer_config"], dict) and spec["layernorms"] is False


@pytest.mark.parametrize("cfg,fmt,says", [
    (EAGLE_PRUNED, "vllm", "draft_vocab_size=null"),
    ({"name": "eagle", "draft_vocab_size": None}, "sglang", "input_norm=false"),
    ({**EAGLE_ENGINE, "feature_layer": 1}, "vllm", "feature_layer=-1"),
    ({**EAGLE_ENGINE, "num_layers": 2}, "speculators", "num_layers=1"),
    (EAGLE_ENGINE, "eagle3", "unknown format 'eagle3' for drafter 'eagle'; its formats: hf, "
                             "sglang, speculators, vllm"),
    (EAGLE_ENGINE, "medusa", "unknown format 'medusa' for drafter 'eagle'"),
    (MEDUSA, "sglang", "unknown format 'sglang' for drafter 'medusa'; its formats: hf, medusa, vllm"),
    (MEDUSA, "onnx", "unknown format"),
    ({"name": "ngram"}, "hf", "registers no export layouts"),
    ({"name": "eagle", "draft_vocab_size": 4096}, "hf", r"draft_vocab_size=4096 must be in \[1, 128\]"),
])
def test_unsupported_combinations_are_refused(tmp_path, target, cfg, fmt, says):
    with pytest.raises((ExportError, ValueError), match=says):
        export_drafter(build_drafter(cfg, target), cfg, target, fmt, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp folder left


# -- validation of corrupted exports ----------------------------------------------------------
def _edit_tensors(folder, fn, name="model.safetensors"):
    t = load_file(str(folder / name))
    fn(t)
    save_file(t, str(folder / name))


def _edit_config(folder, fn):
    c = json.loads((folder / "config.json").read_text())
    fn(c)
    (folder / "config.json").write_text(json.dumps(c))


CORRUPTIONS = {  # exports of one configuration per layout validator, corrupted
    "missing key": (EAGLE_PRUNED, "hf", lambda f: _edit_tensors(f, lambda t: t.pop("fc.weight")),
                    "required tensor 'fc.weight' is missing"),
    "extra key": (EAGLE_ENGINE, "vllm", lambda f: _edit_tensors(
        f, lambda t: t.update({"layers.0.input_layernorm.weight": torch.ones(H)})),
        "unexpected tensor 'layers.0.input_layernorm.weight'"),
    "wrong shape": (EAGLE_PRUNED, "hf", lambda f: _edit_tensors(
        f, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:40].clone()})),
        r"lm_head.weight has shape \(40, 32\), expected \(48, 32\)"),
    "wrong dtype": (MEDUSA, "medusa", lambda f: _edit_tensors(
        f, lambda t: t.update({"blocks.0.layers.0.weight": t["blocks.0.layers.0.weight"].half()})),
        "has dtype torch.float16, expected torch.float32"),
    "d2t not increasing": (EAGLE_PRUNED, "hf", lambda f: _edit_tensors(
        f, lambda t: t["d2t"].__setitem__(slice(0, 2), torch.tensor([5, -1]))), "strictly increasing"),
    "d2t out of range": (EAGLE_PRUNED, "hf", lambda f: _edit_tensors(
        f, lambda t: t["d2t"].__setitem__(-1, 500)), r"outside \[0, 128\)"),
    "t2d disagrees": (EAGLE_PRUNED, "hf", lambda f: _edit_tensors(
        f, lambda t: t["t2d"].__setitem__(int((~t["t2d"]).nonzero()[0]), True)), "t2d disagrees with d2t"),
    "token_map repeats": ({"name": "medusa", "draft_vocab_size": 48, "num_layers": 2}, "medusa",
                          lambda f: _edit_tensors(
        f, lambda t: t["token_map"].__setitem__(1, t["token_map"][0])), "strictly increasing"),
    "config value": (MEDUSA, "medusa", lambda f: _edit_config(f, lambda c: c.update(num_heads=3)),
                     "num_heads = 3, expected 4"),
    "config key": (EAGLE_ENGINE, "vllm", lambda f: _edit_config(f, lambda c: c.pop("rope_theta")),
                   "required key 'rope_theta' is missing"),
    "not ours": ({"name": "eagle", "draft_vocab_size": None}, "hf",
                 lambda f: _edit_config(f, lambda c: c.pop("specdistill")),
                 "not an export written by export.folder"),
    "weights file": (MEDUSA, "medusa", lambda f: (f / "medusa_lm_head.pt").unlink() or
                     (f / "model.safetensors").unlink(), "weights file model.safetensors is missing"),
    "sglang bias": (EAGLE_ENGINE, "sglang", lambda f: _edit_tensors(
        f, lambda t: t["fc.bias"].fill_(0.5)), "fc.bias must be zero"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_validation_rejects_a_corrupted_export(tmp_path, target, name):
    case, fmt, corrupt, says = CORRUPTIONS[name]
    src, cfg = trained(target, case)
    out = export_drafter(src, cfg, target, fmt, tmp_path / "x")["path"]
    assert validate_export(out, target) == []
    corrupt(out)
    with pytest.raises(ExportError, match=r"is damaged: .*(missing|bytes|sha256)"):
        validate_export(out, target)  # its MANIFEST.json names the changed file first
    (out / "MANIFEST.json").unlink()  # an export without one (older, or by another tool):
    with pytest.raises(ExportError, match=says):  # the layout's own checks find the problem
        validate_export(out, target)
    with pytest.raises(ExportError):
        load_export(out, target)


def test_export_for_another_target_and_vocab_warnings(tmp_path, target):
    src, cfg = trained(target, EAGLE_PRUNED)
    out = export_drafter(src, cfg, target, "hf", tmp_path / "x")["path"]
    other = Target(LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=4)),
                   target.tokenizer, "other")
    with pytest.raises(ExportError, match="was exported for target tiny"):
        load_export(out, other)
    short = Target(target.model, type("Tok", (), {"eos_token_id": 2, "__len__": lambda s: 64})(), "t")
    no_eos = trained(target, EAGLE_PRUNED)[0]
    no_eos.set_draft_vocab(torch.arange(80, 128))  # excludes EOS 2; ids >= 64 are not tokens
    warnings = export_drafter(no_eos, cfg, short, "hf", tmp_path / "y")["warnings"]
    assert any("EOS ids [2]" in w for w in warnings) and any("padding rows" in w for w in warnings)


# -- atomic writes, Hub push -------------------------------------------------------------------
def test_export_is_atomic(tmp_path, target):
    src, cfg = trained(target, {"name": "eagle", "draft_vocab_size": None})

    def crash(folder):
        assert (folder / "model.safetensors").is_file()  # called on the complete temp folder
        raise RuntimeError("killed mid-export")

    with pytest.raises(RuntimeError, match="killed"):
        export_drafter(src, cfg, target, "hf", tmp_path / "x", check=crash)
    assert list(tmp_path.iterdir()) == []
    first = export_drafter(src, cfg, target, "hf", tmp_path / "x")["path"]
    with pytest.raises(ExportError, match="exists; pass overwrite=true"):
        export_drafter(src, cfg, target, "hf", tmp_path / "x")
    with pytest.raises(RuntimeError):
        export_drafter(src, cfg, target, "hf", tmp_path / "x", overwrite=True, check=crash)
    assert validate_export(first, target) == []  # a failed overwrite keeps the old export
    export_drafter(src, cfg, target, "hf", tmp_path / "x", overwrite=True, dtype="bfloat16")
    assert json.loads((first / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_push_to_hub_offline_fails_clearly_and_keeps_the_export(tmp_path, target, monkeypatch):
    src, cfg = trained(target, MEDUSA)
    out = export_drafter(src, cfg, target, "medusa", tmp_path / "x")["path"]
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(PushError, match=f"HF_HUB_OFFLINE is set.*complete at {out}"):
        push_to_hub(out, "org/tiny-medusa")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # "online" but the network is unreachable
    with pytest.raises(PushError, match="could not push to org/tiny-medusa.*hf upload"):
        push_to_hub(out, "org/tiny-medusa", token="hf_x", endpoint="http://127.0.0.1:9")
    assert validate_export(out, target) == []


# -- the CLI on a real (tiny) training run -----------------------------------------------------
def test_cli_exports_a_run_with_parity_and_a_card(tmp_path, tiny_run):
    from specdistill.decode.evaluate import load_decode_drafter
    from specdistill.train.export import measure_parity

    cfg = OmegaConf.merge(OmegaConf.structured(ExportConfig), {
        "run": str(tiny_run), "format": "vllm", "out": str(tmp_path / "vllm"),
        "push_to_hub": "org/tiny-eagle"})
    with pytest.raises(PushError, match="offline"):  # exported first, then the push fails
        run_export(cfg)
    card = (tmp_path / "vllm" / "README.md").read_text()
    final = (tiny_run / "final_eval" / "result.md").read_text().strip()
    assert final in card and "## Training configuration" in card and "input_norm: false" in card
    cfg.update({"format": "hf", "out": str(tmp_path / "hf"), "push_to_hub": None})

    def check(folder, target, info):  # runs on the complete temp folder, before the rename
        decoded = load_decode_drafter(OmegaConf.create({"ckpt": str(folder)}), target)
        assert decoded.name == "eagle" and not decoded.cfg.input_norm  # `python -m decode ckpt=`
        return measure_parity(folder, target, info, limit=1)

    result = run_export(cfg, check=check)
    parity = result["parity"]
    assert parity["identical"] and parity["prompts"] == 1
    assert parity["tau_export"] == pytest.approx(parity["tau_training_end"])
    assert "## Train/serve parity" in (tmp_path / "hf" / "README.md").read_text()
    cfg.update({"run": str(tiny_run / "checkpoints" / "step-0000002"), "out": str(tmp_path / "c")})
    with pytest.raises(ExportError, match="the drafter the final eval measured"):
        run_export(cfg, check=lambda f, t, info: measure_parity(f, t, info))
    assert not (tmp_path / "c").exists()


def test_module_cli_runs(tmp_path, tiny_run):
    """`python -m train.export` through Hydra; nothing lands in the working directory."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "train.export", f"run={tiny_run}", "format=speculators",
           f"out={tmp_path / 'spec'}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exported" in done.stdout and sorted(p.name for p in tmp_path.iterdir()) == ["spec"]
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "Traceback" not in again.stderr  # one clear line, exit 2
    assert f"python -m train.export: error: {tmp_path / 'spec'} exists; pass overwrite=true" in again.stderr
    cfg = OmegaConf.merge(OmegaConf.structured(ExportConfig),
                          {"run": str(tiny_run), "format": "eagle3", "out": str(tmp_path / "e3")})
    with pytest.raises(ExportError, match="unknown format 'eagle3'"):  # refused before any loading
        run_export(cfg)


def test_drafters_never_import_train_or_decode():
    """The arrows point one way: export (and every drafter module) stays free of train/ and decode/,
    which is why parity lives in train/export.py."""
    import ast

    root = Path(__file__).resolve().parents[1] / "drafters"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.split(".")[0] in ("train", "decode")]
            assert not bad, f"{path.name} imports {bad}"


def test_overwrite_replaces_only_an_earlier_export(tmp_path, target):
    """Fault report cases 13-14: overwrite=true never deletes unrelated files, and an unwritable
    out= is named as out=, not as a temporary folder."""
    src, cfg = trained(target, {"name": "eagle", "draft_vocab_size": None, "input_norm": False})
    out = export_drafter(src, cfg, target, "vllm", tmp_path / "e")["path"]
    export_drafter(src, cfg, target, "vllm", out, overwrite=True)  # an earlier export: replaced
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # readable by a serving account
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match=r"not a specdistill export \(notes.txt\)"):
        export_drafter(src, cfg, target, "vllm", mine, overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep me"
    with pytest.raises(ExportError, match=r"cannot write the export to out=/proc/specdistill-x"):
        export_drafter(src, cfg, target, "vllm", "/proc/specdistill-x/e")


def test_export_states_the_length_it_was_trained_on(tmp_path, tiny_run, target, caplog):
    """A run trained on rows shorter than its target serves (data.max_length=96, tiny context 4096)
    is exported with that length in config.json and the card, and one warning line; an export
    trained to the target's whole context has the field and no warning."""
    import logging

    from specdistill.export.card import CardFacts

    cfg = OmegaConf.merge(OmegaConf.structured(ExportConfig), {
        "run": str(tiny_run), "format": "hf", "out": str(tmp_path / "short")})
    with caplog.at_level(logging.WARNING, logger="specdistill.export.folder"):
        result = run_export(cfg)
    line = ("trained on <= 96 tokens; the target serves up to 4096; acceptance past 96 is "
            "unmeasured")
    assert [r.getMessage() for r in caplog.records] == [f"export {tmp_path / 'short'}: {line}"]
    meta = json.loads((tmp_path / "short" / "config.json").read_text())["specdistill"]
    assert meta["context"] == result["context"] == {"trained_max_length": 96,
                                                    "target_max_length": 4096}
    card = (tmp_path / "short" / "README.md").read_text()
    assert "## Context length" in card and f"**Warning: {line}.**" in card
    caplog.clear()
    src, dcfg = trained(target, EAGLE_ENGINE)  # this module's target: context 256
    with caplog.at_level(logging.WARNING, logger="specdistill.export.folder"):
        export_drafter(src, dcfg, target, "hf", tmp_path / "full",
                       facts=CardFacts(trained_length=256))
    assert caplog.records == []
    meta = json.loads((tmp_path / "full" / "config.json").read_text())["specdistill"]
    assert meta["context"] == {"trained_max_length": 256, "target_max_length": 256}
    card = (tmp_path / "full" / "README.md").read_text()
    assert "at most 256 tokens" in card and "Warning" not in card

