"""Target loading: hidden states of chosen layers and the same logits as a plain transformers forward."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdistill.target.model import TargetConfig, TargetLoadError, load_target


def _check_against_plain_forward(target, plain_model):
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                               add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = target.forward(ids, layers=(0, 1, -1))
    H = target.hidden_size
    assert out.features.shape == (1, ids.shape[1], 3 * H)
    assert out.logits.shape == (1, ids.shape[1], target.vocab_size)
    with torch.no_grad():
        ref = plain_model(ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.features[..., :H], ref.hidden_states[0])
    torch.testing.assert_close(out.features[..., H:2 * H], ref.hidden_states[1])
    torch.testing.assert_close(out.features[..., 2 * H:], ref.hidden_states[-1])
    # the final-normed state is what the LM head reads
    torch.testing.assert_close(target.lm_head()(out.features[..., 2 * H:]), ref.logits)
    assert all(not p.requires_grad for p in target.model.parameters())


def test_tiny_target(tiny_target_cfg):
    target = load_target(tiny_target_cfg)
    assert target.num_layers == 2 and target.hidden_size == 64
    _check_against_plain_forward(target, target.model)
    again = load_target(tiny_target_cfg)  # seeded: the same random weights
    torch.testing.assert_close(again.model.lm_head.weight, target.model.lm_head.weight)


def test_a_cast_model_is_the_model_a_load_at_that_dtype_gives(tiny_target_cfg, tmp_path):
    """A target cast to bf16 (the first load of a GGUF, a random-init target, the bf16 copy that
    self-generation and regeneration run) computes what `from_pretrained(dtype=bf16)` of the same
    weights computes: RoPE's frequencies stay fp32. `.to(bf16)` rounds them, which moves the
    attention of late positions (this test fails with it)."""
    from dataclasses import replace

    from specdistill.target.precision import model_at

    fp32 = load_target(tiny_target_cfg).model
    fp32.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = torch.arange(5, 405)[None]  # late positions: the frequencies' rounding grows with them
    with torch.no_grad():
        ref = loaded(ids).logits
        for model in (model_at(fp32, torch.bfloat16),
                      load_target(replace(tiny_target_cfg, dtype="bfloat16")).model):
            assert model.model.rotary_emb.inv_freq.dtype == torch.float32
            assert torch.equal(model(ids).logits, ref)
        assert model_at(fp32, torch.float32) is fp32
        assert not torch.equal(fp32.to(torch.bfloat16)(ids).logits, ref)  # what the cast avoids


@pytest.mark.slow
def test_smollm2_target_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path))
    cfg = TargetConfig(path="packaged:smollm2")
    first = load_target(cfg)  # de-quantises the GGUF and writes the cache
    cached = list((tmp_path / "targets").iterdir())
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()
    # from the safetensors cache; torch's own linear kernels, to compare with HF's forward exactly
    second = load_target(TargetConfig(path="packaged:smollm2", prepack=False))
    assert "from cache" in second.source
    assert second.num_layers == 30 and second.hidden_size == 576 and second.vocab_size == 49152
    plain = AutoModelForCausalLM.from_pretrained(cached[0], dtype=second.dtype)  # auto: bf16 or fp32
    _check_against_plain_forward(second, plain)
    torch.testing.assert_close(first.model.lm_head.weight, second.model.lm_head.weight)
    ids = torch.arange(100, 164)[None]  # prepacked (fp32 CPUs: target/prepack.py): fp32 rounding
    with torch.no_grad():
        torch.testing.assert_close(first.model(ids).logits, plain(ids).logits, rtol=1e-4, atol=2e-3)
    assert 2 in second.eos_token_ids  # <|im_end|>


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(TargetLoadError, match="could not load target .* local folder"):
        load_target(TargetConfig(path=str(tmp_path)))
    with pytest.raises(TargetLoadError, match="GGUF file .* not found"):
        load_target(TargetConfig(path=str(tmp_path), gguf_file="nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(TargetLoadError, match="could not read GGUF"):
        load_target(TargetConfig(path=str(bad), cache_dir=str(tmp_path / "c")))
    with pytest.raises(TargetLoadError, match="unknown packaged target"):
        load_target(TargetConfig(path="packaged:gpt5"))


def test_model_without_chat_template_is_refused(tiny_target_cfg, tmp_path):
    target = load_target(tiny_target_cfg)
    target.tokenizer.chat_template = None
    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(TargetLoadError, match="no chat template"):
        load_target(TargetConfig(path=str(tmp_path)))
