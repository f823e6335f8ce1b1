"""target/prepack.py: a decoding fp32 CPU target runs its linear layers through oneDNN with
packed weights, the same numbers as F.linear within fp32 rounding; autograd, exact verification,
copies, training targets, `prepack=false` and a machine short of memory keep torch's F.linear;
speculative decoding with a packed target stays lossless."""
import pytest
import torch
import torch.nn.functional as F

import specdistill.target.prepack as prepack
from specdistill.target.model import load_target

pytestmark = pytest.mark.skipif(not prepack.supported(), reason="this torch has no oneDNN linear ops")


def packed_linear(out=96, inp=64, bias=True, seed=0) -> torch.nn.Linear:
    with torch.random.fork_rng():  # seeded here; the other tests' random draws stay as they were
        torch.manual_seed(seed)
        lin = torch.nn.Linear(inp, out, bias=bias).requires_grad_(False)
    assert prepack.use_prepacked_linear(torch.nn.Sequential(lin)) == 1
    return lin


@pytest.mark.parametrize("bias", [True, False])
def test_packed_rows_equal_f_linear(bias):
    lin = packed_linear(bias=bias)
    for shape in ((1, 64), (1, 1, 64), (2, 64), (1, 3, 64), (2, 5, 64), (300, 64)):
        x = torch.randn(*shape)
        ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
        with torch.no_grad():
            got = lin(x)
        assert got.shape == ref.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # the packed kernel really ran: the packed copy keeps the weight it was packed from
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = lin(x)
        lin.weight.zero_()
        torch.testing.assert_close(lin(x), before)


def zeroed_after_packing() -> torch.nn.Linear:
    """A packed layer whose own weight is zeroed afterwards: F.linear gives the bias only, the
    packed kernel the packed weight's product, so every output tells which path ran."""
    lin = packed_linear()
    with torch.no_grad():
        lin.weight.zero_()
    return lin


def test_autograd_and_disabled_keep_f_linear():
    lin = zeroed_after_packing()
    with torch.no_grad():
        x3 = torch.randn(3, 64)
        with prepack.disabled():  # exact verification's switch
            assert torch.equal(lin(x3), F.linear(x3, lin.weight, lin.bias))
        assert not torch.equal(lin(x3), F.linear(x3, lin.weight, lin.bias))  # outside: packed
    xg = torch.randn(3, 64, requires_grad=True)  # autograd through a frozen layer (the loss side)
    lin.weight.requires_grad_(False)
    y = lin(xg)
    assert torch.equal(y, lin.bias.expand(3, -1))  # F.linear (the zeroed weight)
    y.sum().backward()
    assert xg.grad is not None


def test_exact_verification_disables_it():
    from specdistill.decode import exact

    lin = zeroed_after_packing()
    x = torch.randn(3, 64)
    with torch.no_grad(), exact.active():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_copies_are_not_packed():
    """deepcopy (e.g. a bf16 copy for generation) works and the copy runs F.linear."""
    import copy

    model = torch.nn.Sequential(zeroed_after_packing())
    twin = copy.deepcopy(model)
    assert prepack.is_prepacked(model) and not prepack.is_prepacked(twin)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(twin(x), F.linear(x, twin[0].weight, twin[0].bias))
        assert not torch.equal(model(x), F.linear(x, model[0].weight, model[0].bias))


def test_only_decoding_fp32_targets_are_packed(tiny_target_cfg, monkeypatch):
    assert prepack.is_prepacked(load_target(tiny_target_cfg).model)
    assert not prepack.is_prepacked(load_target(tiny_target_cfg, training=True).model)
    tiny_target_cfg.prepack = False
    assert not prepack.is_prepacked(load_target(tiny_target_cfg).model)
    tiny_target_cfg.prepack = True
    tiny_target_cfg.dtype = "bfloat16"
    assert not prepack.is_prepacked(load_target(tiny_target_cfg).model)
    tiny_target_cfg.dtype = "float32"
    monkeypatch.setattr(prepack, "_available_bytes", lambda: 1000)  # a machine short of memory
    assert not prepack.is_prepacked(load_target(tiny_target_cfg).model)


def test_packed_target_logits_and_lossless_decoding(tiny_target_cfg):
    from specdistill.decode.spec import generate
    from specdistill.drafters.base import build_drafter
    from specdistill.drafters.parts.head import cast_drafter

    packed = load_target(tiny_target_cfg)
    tiny_target_cfg.prepack = False
    plain = load_target(tiny_target_cfg)
    ids = torch.randint(0, packed.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = packed.model(ids).logits, plain.model(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    drafter = build_drafter({"name": "eagle", "draft_vocab_size": None}, packed)  # always proposes
    assert not prepack.is_prepacked(drafter)
    cast_drafter(drafter.eval(), packed, torch.float32)  # decode time: packed like its target
    own = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
    assert own and prepack.is_prepacked(torch.nn.ModuleList(own))
    assert not prepack.is_prepacked(cast_drafter(build_drafter(
        {"name": "eagle", "draft_vocab_size": None}, plain).eval(), plain, torch.float32))
    ref = generate(packed, None, ids[0], max_new_tokens=24).tokens
    spec = generate(packed, drafter, ids[0], max_new_tokens=24, k=3)
    assert sum(spec.drafted) > 0  # verify forwards of >= 2 rows ran
    assert torch.equal(spec.tokens, ref)


def test_cost_curves_are_keyed_by_it(tiny_target_cfg):
    """The batched planner's cached verify-cost curve (decode/batched/cost.py) is per target
    AND per kernel choice: a packed target's costs are not an unpacked one's."""
    from specdistill.decode.batched.cost import target_hash

    packed = load_target(tiny_target_cfg)
    tiny_target_cfg.prepack = False
    plain = load_target(tiny_target_cfg)
    assert target_hash(packed) != target_hash(plain)
    assert target_hash(plain) == target_hash(load_target(tiny_target_cfg))


def test_prepacked_block_unpacks_at_exit():
    """`prepacked(model)` (the self-generation phase of a training target): packed inside the
    block, torch's F.linear again after it; layers packed before the block stay packed."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32)).requires_grad_(False)
    before = packed_linear()  # packed before: not unpacked by the block
    x = torch.randn(3, 64)
    with prepack.prepacked(torch.nn.ModuleList([model, before])) as n:
        assert n == 2 and prepack.is_prepacked(model)
        with torch.no_grad():
            model[0].weight.zero_()  # the packed copy still holds the weight it was packed from
            assert not torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))
    assert not prepack.is_prepacked(model) and prepack.is_prepacked(torch.nn.Sequential(before))
    assert "forward" not in model[0].__dict__
    with torch.no_grad():
        assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))


def test_the_jobs_final_eval_decodes_with_packed_layers(tiny_target_cfg):
    """The main job's final eval keeps its fp32 training target where decoding would load the
    same dtype (train/final_eval.py decode_target): packed then, as `python -m decode` loads it."""
    from omegaconf import OmegaConf

    from specdistill.train.final_eval import decode_target

    trained = load_target(tiny_target_cfg, training=True)
    assert not prepack.is_prepacked(trained.model)
    off = OmegaConf.create({"target": {"dtype": "float32", "device": "cpu", "prepack": False}})
    assert decode_target(off, trained) is trained and not prepack.is_prepacked(trained.model)
    on = OmegaConf.create({"target": {"dtype": "float32", "device": "cpu", "prepack": True}})
    assert decode_target(on, trained) is trained and prepack.is_prepacked(trained.model)
