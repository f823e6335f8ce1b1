"""The peers' side by side (benchmarks/peers): the converters write the SAME conversations and
features in each peer's format (speculators' PRE-norm last layer, SpecForge's POST-norm), a peer's
export is rebuilt exactly as our drafter, and speculators' split keeps our conversations. The
comparison with the installed peer (its own loss on a batch against the shimmed run) needs its
virtualenv and is skipped where there is none (CI)."""
import json
import subprocess

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

    return load_target(TargetConfig(path="tiny", random_init=True, tokenizer="packaged:smollm2",
                                    model_config={**TINY_MODEL, "num_hidden_layers": 4}, seed=0,
                                    dtype="float32"))


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
        assert torch.equal(hs["hidden_states"][:, :3].flatten(1), c["aux"])  # its flatten(1)
        assert torch.equal(hs["hidden_states"][:, 3], c["pre"])  # the LAST entry: pre-norm
        assert not torch.allclose(hs["hidden_states"][:, 3], c["post"], atol=1e-2)


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
    for name, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], v), name
    ids = torch.randint(5, 1000, (12,))
    feats = target.forward(ids[None], layers=tuple(LAYERS), logits=False).features[0, :-1]
    state = DecodeState(tokens=ids, features=feats)
    greedy = SamplingParams(temperature=0.0)
    with torch.inference_mode():
        assert torch.equal(ours.eval().propose(state, 3, greedy).tokens,
                           back.propose(state, 3, greedy).tokens)


def test_an_unknown_export_is_refused():
    with pytest.raises(ValueError, match="not an EAGLE-3 export"):
        peer_format({"architectures": ["LlamaForCausalLM"]})


LOSS_CHECK = r'''
import ast, sys
import torch
import specforge
src = open(specforge.__path__[0] + "/core/loss.py").read()  # imports triton: read, not imported
ref = next(n for n in ast.parse(src).body
           if isinstance(n, ast.FunctionDef) and n.name == "_compute_loss")
ref.decorator_list = []  # its torch.compile needs a compiler toolchain; the math is the function
ns = {"torch": torch, "nn": torch.nn}
exec(compile(ast.Module([ref], []), "specforge/core/loss.py", "exec"), ns)
sys.path.insert(0, sys.argv[1])
import specforge_cpu
specforge_cpu.eager_loss()
from specforge.core.loss import LogSoftmaxLoss
g = torch.Generator().manual_seed(0)
logits = torch.randn(2, 7, 50, generator=g, requires_grad=True)
p = torch.softmax(torch.randn(2, 7, 50, generator=g), -1)
mask = (torch.rand(2, 7, 1, generator=g) > 0.3).float()
ours = LogSoftmaxLoss.apply(logits, p, mask)
(g_ours,) = torch.autograd.grad(ours, logits)
theirs = ns["_compute_loss"](logits, p, mask)
(g_theirs,) = torch.autograd.grad(theirs, logits)
assert torch.allclose(ours, theirs) and torch.allclose(g_ours, g_theirs), (ours, theirs)
print("same", float(ours))
'''


def test_specforge_eager_loss_is_its_own_reference_loss():
    """The one shim that replaces a computation: SpecForge's Triton EAGLE-3 loss, by eager torch.
    On the same batch it equals SpecForge's own reference implementation of that loss (read from
    its installed source), value and gradient. Needs its virtualenv (not in CI)."""
    py = peer_python(PEERS["specforge"])
    if py is None:
        pytest.skip("SpecForge's virtualenv is not installed here (python -m benchmarks.peers installs it)")
    from pathlib import Path

    here = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
    out = subprocess.run([str(py), "-c", LOSS_CHECK, str(here)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "same" in out.stdout, out.stderr[-2000:]
