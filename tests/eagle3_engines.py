"""EAGLE-3 draft models as the serving engines compute them, rebuilt from exported files only
(drafters/eagle3.py names the sources and versions read): SGLang / vLLM llama_eagle3.py (midlayer,
fused residual-add norms, the prenorm state fed back) and speculators 0.9.0 Eagle3DraftModel
(layers.0 + HF Llama layers, EAGLE-3.1 norms), and P-EAGLE's single parallel forward (vLLM's
parallel drafting, speculators 0.9.0 PEagleDraftModel), and DFlash's block forward (speculators
0.9.0 DFlashDraftModel, vLLM's DFlash loader). Used by tests/test_eagle3.py (every engine
option, training-time-test steps), tests/test_peagle.py and tests/test_export.py (every registered
eagle3 layout)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(t, pos, c):
    """Neox RoPE of t (T, n, hd) at positions pos (T,) with the config's rope_theta."""
    hd = t.shape[-1]
    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos[:, None].float() * inv[None]  # (T, hd/2)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1)
    return t * cos[:, None] + rot * sin[:, None]


def _attention(x, W, pre, c, pos):
    """Causal GQA attention the engines' way: one stacked qkv projection, neox RoPE."""
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    qkv = x @ torch.cat([W[pre + f"self_attn.{n}_proj.weight"] for n in "qkv"]).T  # stacked
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    T = x.shape[0]
    q, k = _rope(q.view(T, nh, hd), pos, c), _rope(k.view(T, nkv, hd), pos, c)
    k, v = k.repeat_interleave(nh // nkv, 1), v.view(T, nkv, hd).repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, nh * hd)
    return o @ W[pre + "self_attn.o_proj.weight"].T


def _mlp(x, W, pre):
    gate_up = x @ torch.cat([W[pre + "mlp.gate_proj.weight"], W[pre + "mlp.up_proj.weight"]]).T
    g, u = gate_up.chunk(2, -1)
    return (torch.nn.functional.silu(g) * u) @ W[pre + "mlp.down_proj.weight"].T


def engine_forward(engine, config, W, emb, hidden, pos):
    """The draft model of `engine` on one sequence: emb (T, H) target embeddings, hidden (T, H)
    fused or recurrent states -> (logits over the draft vocab (T, Vd), state fed back (T, H)).
    SGLang / vLLM llama_eagle3.py: midlayer with fused residual-add norms, prenorm state fed back;
    speculators Eagle3DraftModel: layers.0 (LlamaDecoderEagle3FirstLayer) + HF Llama layers."""
    c = config.get("transformer_layer_config", config)
    eps = c["rms_norm_eps"]
    nbr = bool(config.get("norm_before_residual", False)) and engine != "sglang"  # SGLang: never
    first = "layers.0." if engine == "speculators" else "midlayer."
    normed = _rms(hidden, W[first + "hidden_norm.weight"], eps)
    residual = normed if nbr else hidden
    x = torch.cat([_rms(emb, W[first + "input_layernorm.weight"], eps), normed], -1)  # (T, 2H)
    h = _attention(x, W, first, c, pos)
    for i in range(c["num_hidden_layers"]):
        pre = first if i == 0 else f"layers.{i}."
        if i > 0:  # vLLM: input_layernorm(h, residual) = add, then norm
            residual = h + residual
            h = _attention(_rms(residual, W[pre + "input_layernorm.weight"], eps), W, pre, c, pos)
        residual = h + residual  # post_attention_layernorm(h, residual)
        h = _mlp(_rms(residual, W[pre + "post_attention_layernorm.weight"], eps), W, pre)
    prenorm = h + residual  # norm(h, residual) -> (normed, prenorm)
    normed = _rms(prenorm, W["norm.weight"], eps)
    back = normed if config.get("norm_output") else prenorm  # speculators 0.9: EAGLE-3.1 option
    return normed @ W["lm_head.weight"].T, back


def engine_capture(engine, config, target, ids):
    """Target features as the engine captures them from ITS ids: vLLM / speculators take the input
    of layer id (hidden_states[id]); SGLang sets layers_to_capture = id + 1 (the output of id)."""
    ids_key = "eagle_aux_hidden_state_layer_ids"
    ids_ = config["eagle_config"][ids_key] if engine == "sglang" else config[ids_key]
    hs = target.model(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1 if engine == "sglang" else i][0] for i in ids_], -1)  # (T, 3H)


def fused_features(engine, config, W, target, ids):
    """fc (after speculators' optional norms) over the 3H-wide states the engine captures (T, H)."""
    return fuse(config, W, engine_capture(engine, config, target, ids))


def fuse(config, W, feats):
    """(T, 3H) aux states (or P-EAGLE's mask_hidden) -> (T, H): speculators' optional norms, fc."""
    eps = config.get("transformer_layer_config", config)["rms_norm_eps"]
    if "input_norm.weight" in W:  # speculators norm_before_fc: one norm over the 3H
        feats = _rms(feats, W["input_norm.weight"], eps)
    if "fc_norm.0.weight" in W:  # speculators fc_norm (EAGLE-3.1): a norm per aux layer
        feats = torch.cat([_rms(f, W[f"fc_norm.{i}.weight"], eps)
                           for i, f in enumerate(feats.chunk(3, -1))], -1)
    return feats @ W["fc.weight"].T  # (T, H)


def engine_chain(engine, config, W, target, ids, t, steps):
    """Draft logits (steps, Vd) after anchor t, each step fed the true token and the state the
    previous step fed back; recomputed over the whole sequence (a KV cache holds the same keys)."""
    hidden = fused_features(engine, config, W, target, ids[:t + 1])  # (t+1, H)
    toks, out = ids[1:t + 2], []
    for j in range(steps):
        emb = target.embed_tokens()(toks)
        logits, back = engine_forward(engine, config, W, emb, hidden, torch.arange(len(toks)))
        out.append(logits[-1])
        toks = torch.cat([toks, ids[t + 2 + j:t + 3 + j]])
        hidden = torch.cat([hidden, back[-1:]])
    return torch.stack(out)


def parallel_draft(engine, config, W, target, ids, t, k):
    """P-EAGLE's k draft logits (k, Vd) after anchor t from ONE engine forward: queries [real
    positions 0..t (embedding of token i+1, fused aux states i); k-1 masks (embedding of config
    mask_token_id, mask_hidden fused like the aux states)] at consecutive positions, causal (vLLM
    parallel drafting; speculators' peagle mask for one anchor: causal over depth 0, then its own
    rollout). Drafts: the outputs at the last real position and at the masks."""
    real = fused_features(engine, config, W, target, ids[:t + 1])  # (t+1, H)
    masks = fuse(config, W, W["mask_hidden"].reshape(1, -1)).expand(k - 1, -1)  # (k-1, H)
    toks = torch.cat([ids[1:t + 2], torch.full((k - 1,), config["mask_token_id"])])  # (t+k,)
    logits, _ = engine_forward(engine, config, W, target.embed_tokens()(toks),
                               torch.cat([real, masks]), torch.arange(t + k))
    return logits[t:]  # (k, Vd)


def engine_name(config: dict) -> str:
    """Which engine reads an EAGLE-3 config.json, told from its keys as each loader expects them."""
    if "speculators_model_type" in config:
        return "speculators"
    return "sglang" if "eagle_config" in config else "vllm"


def first_step_logits(folder: Path, target, ids: torch.Tensor) -> torch.Tensor:
    """The engine's first draft step at every anchor of ids (T,) from the exported files only,
    mapped to the target vocabulary as the engines do (hot-token ids = i + d2t[i], -inf
    elsewhere): (1, T-1, V)."""
    config = json.loads((folder / "config.json").read_text())
    W = load_file(str(folder / "model.safetensors"))
    engine, T = engine_name(config), ids.shape[0]
    hidden = fused_features(engine, config, W, target, ids[:-1])  # (T-1, H)
    emb = target.embed_tokens()(ids[1:])  # (T-1, H)
    logits, _ = engine_forward(engine, config, W, emb, hidden, torch.arange(T - 1))  # (T-1, Vd)
    V = target.vocab_size
    cols = torch.arange(len(W["d2t"])) + W["d2t"] if "d2t" in W else torch.arange(V)
    full = logits.new_full((T - 1, V), float("-inf"))
    full[:, cols] = logits
    return full[None]


def dflash_block(config, W, target, ids, t, states=False):
    """A DFlash engine at ONE anchor t, from the files only (speculators 0.9.0 DFlashDraftModel, or
    vLLM's DFlashQwen3ForCausalLM on the z-lab layout: aux ids eagle_aux_hidden_state_layer_ids,
    else dflash_config.target_layer_ids + 1; embedding and, when absent, head from the target):
    context = hidden_norm(fc(aux states)) at positions < t, projected to keys / values by each
    layer (no query there); block = embeddings of [ids[t], mask x (b-1)] at t .. t+b-1; per layer
    q_norm / k_norm per head, RoPE, attention over [context; block] with no mask (the block is
    bidirectional, the context all before it) -> logits (b, Vd) of the block's slots (states:
    their normed states (b, H), what the head reads)."""
    c = config.get("transformer_layer_config", config)
    eps, nh, nkv, hd = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    zlab = config.get("dflash_config", {})
    aux = config.get("aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids") \
        or [i + 1 for i in zlab["target_layer_ids"]]
    mask_id = config.get("mask_token_id", zlab.get("mask_token_id"))
    head = W["lm_head.weight"] if "lm_head.weight" in W else target.lm_head().weight.float()
    b = config["block_size"]
    if t:
        hs = target.model(ids[None, :t], output_hidden_states=True).hidden_states
        ctx = _rms(torch.cat([hs[i][0] for i in aux], -1) @ W["fc.weight"].T,
                   W["hidden_norm.weight"], eps)  # (t, H)
    else:
        ctx = W["fc.weight"].new_zeros(0, W["fc.weight"].shape[0])
    toks = torch.cat([ids[t:t + 1], torch.full((b - 1,), mask_id)])
    x, pos = target.embed_tokens()(toks).float(), torch.arange(t + b)
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}.self_attn."
        h = _rms(x, W[f"layers.{i}.input_layernorm.weight"], eps)
        q = _rms((h @ W[p + "q_proj.weight"].T).view(b, nh, hd), W[p + "q_norm.weight"], eps)
        kv = torch.cat([ctx, h])  # (t+b, H)
        k = _rms((kv @ W[p + "k_proj.weight"].T).view(t + b, nkv, hd), W[p + "k_norm.weight"], eps)
        v = (kv @ W[p + "v_proj.weight"].T).view(t + b, nkv, hd).repeat_interleave(nh // nkv, 1)
        q, k = _rope(q, pos[t:], c), _rope(k, pos, c).repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(b, nh * hd)
        x = x + o @ W[p + "o_proj.weight"].T
        x = x + _mlp(_rms(x, W[f"layers.{i}.post_attention_layernorm.weight"], eps), W, f"layers.{i}.")
    h = _rms(x, W["norm.weight"], eps)  # (b, H)
    return h if states else h @ head.T  # (b, Vd)


def dflash_logits(folder: Path, target, ids: torch.Tensor) -> list[torch.Tensor]:
    """dflash_block at every anchor of ids (T,): one (1, T, V) per draft slot 1..b-1, mapped to
    the target vocabulary as the engines do (ids i + d2t[i], -inf elsewhere)."""
    config = json.loads((folder / "config.json").read_text())
    W = load_file(str(folder / "model.safetensors"))
    blocks = torch.stack([dflash_block(config, W, target, ids, t) for t in range(len(ids))])
    V = target.vocab_size
    cols = torch.arange(len(W["d2t"])) + W["d2t"] if "d2t" in W else torch.arange(V)
    full = blocks.new_full((*blocks.shape[:2], V), float("-inf"))  # (T, b, V)
    full[..., cols] = blocks
    return [full[None, :, i] for i in range(1, config["block_size"])]


def dspark_logits(folder: Path, target, ids: torch.Tensor) -> list[torch.Tensor]:
    """A DSpark engine (vLLM's Qwen3DSparkForCausalLM, speculators' DSparkDraftModel; vanilla
    Markov head) at every anchor of ids (T,), from the files only: dflash_block's normed slot
    states, the slots that draft (all b under sample_from_anchor, else 1 .. b-1), logits = head(h)
    + markov_w2(markov_w1[the token before the draft]), the token fed as in training (teacher
    forcing). One (1, T, V) per draft, mapped to the target vocabulary as the engines do."""
    config = json.loads((folder / "config.json").read_text())
    W = load_file(str(folder / "model.safetensors"))
    head = W["lm_head.weight"] if "lm_head.weight" in W else target.lm_head().weight.float()
    first, T = 0 if config["sample_from_anchor"] else 1, len(ids)
    w1, w2 = W["markov_head.markov_w1.weight"], W["markov_head.markov_w2.weight"]
    blocks = []
    for t in range(T):
        h = dflash_block(config, W, target, ids, t, states=True)[first:]  # (n, H)
        prev = ids[(t + torch.arange(h.shape[0])).clamp(max=T - 1)]  # (n,)
        blocks.append(h @ head.T + w1[prev] @ w2.T)  # (n, Vd)
    blocks = torch.stack(blocks)  # (T, n, Vd)
    cols = torch.arange(len(W["d2t"])) + W["d2t"] if "d2t" in W else torch.arange(target.vocab_size)
    full = blocks.new_full((*blocks.shape[:2], target.vocab_size), float("-inf"))
    full[..., cols] = blocks
    return [full[None, :, j] for j in range(blocks.shape[1])]


# -- shared toys of the EAGLE-3-family tests (test_eagle3, test_peagle) -------------------------------
TOY_V, TOY_H, TOY_L = 128, 32, 8  # an 8-layer target: the engines' default aux layers (2, 4, 5) exist


def tiny8_target():
    """A random 8-layer Llama target with peaked next-token distributions, like a trained LM."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from specdistill.target.model import Target

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=TOY_V, hidden_size=TOY_H, intermediate_size=64,
                                         num_hidden_layers=TOY_L, num_attention_heads=4,
                                         num_key_value_heads=2, rope_theta=500.0))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return Target(model, SimpleNamespace(eos_token_id=2), "tiny8")


def feature_batch(target, drafter, B=2, T=14, seed=0):
    """A TrainBatch of random ids with the target's features, right padding on the last row."""
    from specdistill.drafters.base import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TOY_V, (B, T), generator=g)  # (B, T)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[-1, T - 4:] = 0
    out = target.forward(ids, layers=drafter.feature_layers, attention_mask=attn)
    return TrainBatch(ids, attn, attn.clone(), out.logits, out.features)


def perturbed_drafter(target, name: str, seed=1, **cfg):
    """A drafter moved off its init (so every weight matters), with a real pruned map if any."""
    from specdistill.drafters.base import build_drafter
    from specdistill.drafters.parts.head import fit_draft_vocab

    d = build_drafter({"name": name, **cfg}, target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    if cfg.get("draft_vocab_size"):
        fit_draft_vocab(d, torch.arange(TOY_V).flip(0).float(), always_include=[2])
    return d


def twin(d, **cfg):
    """A drafter of d's settings plus cfg, with d's weights."""
    from specdistill.drafters.base import build_drafter, config_dict

    other = build_drafter({**config_dict(d.cfg), **cfg}, d.target)
    other.load_state_dict(d.state_dict())
    return other


def recipe_cfg(tmp_path, chats, name: str, *overrides):
    """The train config of a short EAGLE-3-family or DFlash run (drafter `name`, 3 drafts, pruned
    vocab 512) on the tiny target and a chats file."""
    from hydra import compose, initialize_config_dir

    import specdistill.train.__main__  # noqa: F401  (stores the schemas)

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="train", overrides=[
            "target=tiny", "data=jsonl", f"data.path={chats}", "data.max_length=96",
            "data.eval_fraction=0.1", f"data.cache_dir={tmp_path / 'cache'}", "trainer=smoke",
            "trainer.final_eval=null", f"run_dir={tmp_path / 'run'}", "logger=jsonl",
            f"drafter={name}", "drafter.draft_vocab_size=512",
            "drafter.block_size=4" if name in ("dflash", "dspark") else "drafter.ttt_length=3", *overrides])


def train_rows(cfg) -> list[dict]:
    """Run the recipe on cfg; its metrics.jsonl rows."""
    from specdistill.train.recipe import DistillRecipe

    r = DistillRecipe(cfg)
    r.setup()
    r.train()
    r.cleanup()
    return [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
