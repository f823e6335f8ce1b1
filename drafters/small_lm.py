"""Small-LM drafter: a small causal LM over the target's tokenizer, distilled from the target
(DistillSpec). It reads no target features, so it drafts on its own and also serves as a plain
Hugging Face draft model (`generate(assistant_model=...)`, vLLM/SGLang draft models) once exported
(layout `causal_lm` below).

Sources (`source`):
  target_layers  the target's own architecture with n decoder layers copied from the target (the
                 first n, layers 0, m, 2m, ... with layer_stride=m, or an explicit list `layers`)
                 and its final norm;
  pretrained     any HF model id / local folder whose tokenizer is the target's (e.g. a 135M model
                 for a 1.7B one of the same family); a different vocabulary is refused, naming it;
  fresh          the target's architecture and widths with `fresh_config` overrides, random init.

Design decision (embeddings and LM head): with freeze_embeddings=true (the default) and the target's
hidden size, the drafter does NOT copy the target's embedding and LM head: it calls the target's
frozen modules (drafters.parts.head.Shared, outside the module tree). A V x H matrix is the biggest weight
a small LM has (SmolLM2: 28 M of a 2-layer drafter's 35 M; Llama-3: 0.5 B), so this saves that
memory twice, keeps it out of the optimizer and out of every checkpoint, and keeps the interface's
rule that saved drafters never hold the target's weights. The export copies them in, so the exported folder
is a standalone model. With freeze_embeddings=false (or a pretrained source) the drafter owns
untied copies: separate matrices train freely and safetensors can save them.

Training: teacher-forced next-token logits at every position, DraftPrediction(shift=0), compared
with the target's logits at the same position. Decoding: the drafter's own KV cache
(drafters/parts/cache.py), cropped to the longest prefix it shares with the committed tokens (accepted
drafts stay cached).
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from specdistill.cli.ranges import MAX_DRAFT, MAX_LAYERS, MAX_TREE, MAX_VOCAB, rng
from specdistill.drafters.base import (
    ChainProposal,
    DecodeState,
    Drafter,
    DrafterConfig,
    DraftPrediction,
    TrainBatch,
    TreeProposal,
    register,
)
from specdistill.drafters.parts.anchors import counted
from specdistill.drafters.parts.cache import DraftCache
from specdistill.drafters.parts.head import Shared, init_draft_head
from specdistill.drafters.parts.layouts import ExportError, ExportLayout, torch_dtype
from specdistill.drafters.parts.sampling import SamplingParams
from specdistill.drafters.parts.tree import dynamic_tree, in_target_vocab
from specdistill.target.attention import use_few_query_attention

SOURCES = ("target_layers", "pretrained", "fresh")


@dataclass
class LoraSettings:
    """LoRA through peft on the drafter's decoder layers (r = 0: full fine-tuning)."""

    # adapter rank; 0 = no LoRA, every drafter weight except frozen embeddings trains
    r: int = rng(0, 0, 4096)
    alpha: int = rng(16, 1, 65536)  # scale of the adapter output is alpha / r
    dropout: float = rng(0.0, 0, 1, hi_open=True)  # dropout on the adapter input (training only)
    target_modules: list[str] = field(default_factory=lambda: [  # module names given adapters
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class SmallLmConfig(DrafterConfig):
    """Small-LM drafter settings."""

    name: str = "small_lm"  # registry key
    source: str = "target_layers"  # target_layers | pretrained | fresh (module docstring)
    # target_layers / fresh: decoder layers (pretrained: the model's own)
    num_layers: int = rng(2, 1, MAX_LAYERS)
    # target_layers: copy layers 0, m, 2m, ... (None = first n)
    layer_stride: Optional[int] = rng(None, 1, MAX_LAYERS)
    # target_layers: copy exactly these (sets num_layers)
    layers: Optional[list[int]] = rng(None, 0, MAX_LAYERS)
    pretrained: Optional[str] = None  # pretrained: HF id or local folder with the same tokenizer
    fresh_config: dict[str, Any] = field(default_factory=dict)  # fresh: target-config overrides
    freeze_embeddings: bool = True  # embeddings + LM head frozen (the target's, shared: not saved)
    lora: LoraSettings = field(default_factory=LoraSettings)  # LoRA adapters (lora.r > 0)
    # pruned LM head over the Vd most frequent tokens
    draft_vocab_size: Optional[int] = rng(None, 1, MAX_VOCAB)
    # dynamic tree: children per expanded node and nodes expanded per level
    tree_top_k: int = rng(8, 1, MAX_DRAFT)
    tree_depth: int = rng(6, 1, MAX_DRAFT)  # dynamic tree: levels grown
    tree_total_tokens: int = rng(60, 1, MAX_TREE)  # dynamic tree: nodes kept for verification
    # sampling: draw the tree's children from the warped q (False: EAGLE-2's top-k candidates,
    # verified as deterministic drafts; both lossless)
    tree_sampled: bool = True


def vocab_difference(target_tok, draft_tok, target_rows: int, draft_rows: int) -> Optional[str]:
    """None when drafter and target speak the same token ids, else what differs (sizes, a sample of
    tokens with different ids, special tokens, a probe string's encoding, LM head rows)."""
    out = []
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(tv) != len(dv):
        out.append(f"vocabulary sizes differ: target {len(tv)} tokens, drafter {len(dv)}")
    diff = sorted((t for t in tv.keys() | dv.keys() if tv.get(t) != dv.get(t)),
                  key=lambda t: min(tv.get(t, 1 << 62), dv.get(t, 1 << 62)))
    if diff:
        out.append(f"{len(diff)} tokens have different ids (target id / drafter id), e.g. "
                   + ", ".join(f"{t!r}: {tv.get(t, 'absent')} / {dv.get(t, 'absent')}"
                               for t in diff[:5]))
    for kind in ("bos_token", "eos_token", "pad_token", "unk_token"):
        a, b = getattr(target_tok, kind, None), getattr(draft_tok, kind, None)
        if str(a) != str(b):
            out.append(f"special token {kind}: target {a!r}, drafter {b!r}")
    probe = "Hello, world! 12345 \u00e7a va? \u4f60\u597d <|im_start|>user\n  def f(x):"
    if not diff and target_tok.encode(probe) != draft_tok.encode(probe):
        out.append("the same text tokenises differently (normaliser or pre-tokeniser differ)")
    if target_rows != draft_rows:
        out.append(f"LM head rows differ: target {target_rows}, drafter {draft_rows}")
    return "; ".join(out) or None


# -- the `causal_lm` export: a plain Hugging Face causal-LM folder (config.json, model.safetensors,
# generation_config.json, the target's tokenizer files; the model card is export/folder.py's).
# `AutoModelForCausalLM.from_pretrained(folder)` loads it with no specdistill code, and it drafts
# for the target anywhere a draft model is accepted (HF assisted decoding, vLLM / SGLang draft
# models). LoRA adapters are merged, the target's shared embeddings and LM head copied in
# (`to_hf_model`). `save_causal_lm` writes it and reads it back with transformers alone.
def _check(folder: Path, drafter, dtype: torch.dtype) -> None:
    """Reload the folder with transformers alone; its logits must equal the drafter's."""
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(drafter.target.device).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, drafter.vocab_size, (1, 12), generator=g).to(drafter.target.device)
    was_training = drafter.training
    drafter.eval()
    with torch.no_grad():
        want = drafter.logits(ids).float()  # (1, 12, V)
        got = back(ids).logits.float()  # (1, 12, V)
    drafter.train(was_training)
    tol = 1e-4 if dtype == torch.float32 else 5e-2 * float(want.abs().max())
    if got.shape != want.shape or not torch.allclose(got, want, atol=tol, rtol=0):
        raise ExportError(f"causal_lm export {folder}: the reloaded model's logits differ from the "
                          f"drafter's (max |diff| {float((got - want).abs().max()):.3g})")


def _drop_load_kwargs(path: Path) -> None:
    """transformers records how OUR process loaded the tokenizer (`local_files_only`: whether
    HF_HUB_OFFLINE was set); a served folder must not carry that into the user's process."""
    if path.is_file():
        conf = json.loads(path.read_text())
        if conf.pop("local_files_only", None) is not None:
            path.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")


def save_causal_lm(drafter, folder, ctx) -> None:
    """Write the standalone model and the target's tokenizer into `folder`, then check it."""
    dtype = torch_dtype(ctx.dtype)
    model = drafter.to_hf_model().to(dtype)  # 1. standalone model: LoRA merged
    gen = getattr(ctx.target.model, "generation_config", None)
    if gen is not None:  # the target's EOS / BOS / pad, and our draft length for HF assisted decoding
        model.generation_config = gen.__class__.from_dict(gen.to_dict())
    model.generation_config.num_assistant_tokens = ctx.k
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.config.specdistill = ctx.meta  # what load_export needs to know it again
    for key in [k for k in vars(model.config) if k.startswith("_specdistill")]:
        delattr(model.config, key)  # our decoders' private marks (decode/exact.py), not the model's
    model.save_pretrained(folder)  # 2. config.json, model.safetensors, generation_config.json
    ctx.target.tokenizer.save_pretrained(folder)
    _drop_load_kwargs(Path(folder) / "tokenizer_config.json")
    _check(Path(folder), drafter, dtype)  # 3. read back with transformers alone


def load_causal_lm(folder, target) -> "SmallLm":
    """An exported `causal_lm` folder as a drafter for our decoder: small_lm with
    source=pretrained (which refuses a folder whose tokenizer is not the target's)."""
    return SmallLm.build({"name": "small_lm", "source": "pretrained", "pretrained": str(folder)},
                         target)


CAUSAL_LM = ExportLayout(
    format="causal_lm", tags=("transformers",), save=save_causal_lm, load=load_causal_lm,
    serving={"vllm": {"method": "draft_model"},
             "llamacpp": {"spec_type": "draft-simple", "needs_target": False}},
    requires={"draft_vocab_size": None},  # an HF causal LM scores the full vocabulary
    summary="a standalone Hugging Face causal LM (LoRA merged, the target's embeddings and LM head "
            "copied in) that transformers, vLLM and SGLang load as a draft model.",
    usage="from transformers import AutoModelForCausalLM\n"
          "target = AutoModelForCausalLM.from_pretrained('{base}')\n"
          "draft = AutoModelForCausalLM.from_pretrained('{path}')\n"
          "out = target.generate(**inputs, assistant_model=draft, do_sample=False)  # k={k}")


@register("small_lm", config=SmallLmConfig, layouts=(CAUSAL_LM,))
class SmallLm(Drafter):
    """A small HF causal LM (held as `self.lm`, peft-wrapped with LoRA) drafting on its own."""

    def __init__(self, cfg: SmallLmConfig, target) -> None:
        super().__init__(target.vocab_size, cfg, target)
        if cfg.source not in SOURCES:
            raise ValueError(f"small_lm: source must be one of {SOURCES}, not {cfg.source!r}")
        if cfg.fresh_config and cfg.source != "fresh":
            raise ValueError("small_lm: fresh_config is read only with source=fresh")
        if cfg.layer_stride is not None and cfg.source != "target_layers":
            raise ValueError("small_lm: layer_stride is read only with source=target_layers")
        if cfg.layers is not None:
            if cfg.source != "target_layers" or cfg.layer_stride is not None:
                raise ValueError("small_lm: layers (explicit target layers) is read only with "
                                 "source=target_layers and without layer_stride")
            cfg = dataclasses.replace(cfg, layers=[int(i) for i in cfg.layers],
                                      num_layers=len(cfg.layers))
        if cfg.lora.r > 0 and not cfg.freeze_embeddings:
            raise ValueError("small_lm: with LoRA (lora.r > 0) only adapters train; set "
                             "freeze_embeddings=true or lora.r=0 for a full fine-tune")
        self.cfg = cfg  # with `layers` resolved
        lm = (self._pretrained(cfg, target) if cfg.source == "pretrained"
              else self._from_target(cfg, target))
        use_few_query_attention(lm)  # its draft steps are one-token forwards (target/attention.py)
        if cfg.freeze_embeddings:
            lm.get_input_embeddings().requires_grad_(False)
            lm.get_output_embeddings().requires_grad_(False)
        full = lm.get_output_embeddings()
        init_draft_head(self, full, cfg.draft_vocab_size, target.vocab_size)
        if self.lm_head is not None:
            self.lm_head.requires_grad_(not cfg.freeze_embeddings)
            full.requires_grad_(False)  # unused in training: the pruned head replaces it
        if cfg.lora.r > 0:
            from peft import LoraConfig, get_peft_model

            lm = get_peft_model(lm, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                               lora_dropout=cfg.lora.dropout,
                                               target_modules=list(cfg.lora.target_modules)))
        self.lm = lm
        self.to(target.device)
        self.reset()

    # -- construction -----------------------------------------------------------------------------
    @staticmethod
    def _layer_indices(cfg: SmallLmConfig, n_target: int) -> list[int]:
        if cfg.layers is not None:
            idx = list(cfg.layers)
            if not idx or len(set(idx)) != len(idx) or min(idx) < 0 or max(idx) >= n_target:
                raise ValueError(f"small_lm: layers={idx} must be distinct target layers in "
                                 f"0..{n_target - 1} (at least one)")
            return idx
        stride = cfg.layer_stride or 1
        idx = [i * stride for i in range(cfg.num_layers)]
        if cfg.num_layers < 1 or stride < 1 or idx[-1] >= n_target:
            raise ValueError(f"small_lm: num_layers={cfg.num_layers}, layer_stride="
                             f"{cfg.layer_stride} pick target layers {idx}; the target has "
                             f"{n_target} (0..{n_target - 1}) and both must be >= 1")
        return idx

    def _from_target(self, cfg: SmallLmConfig, target) -> nn.Module:
        """The target's architecture with fewer layers: copied (target_layers) or random (fresh)."""
        conf = copy.deepcopy(target.config)
        n_target = conf.num_hidden_layers
        conf.num_hidden_layers, conf.tie_word_embeddings = cfg.num_layers, False
        idx = list(range(cfg.num_layers))
        if cfg.source == "target_layers":
            idx = self._layer_indices(cfg, n_target)
        elif cfg.num_layers < 1:
            raise ValueError(f"small_lm: num_layers must be >= 1, got {cfg.num_layers}")
        for key, value in cfg.fresh_config.items():
            if not hasattr(conf, key):
                raise ValueError(f"small_lm: fresh_config.{key} is not a field of "
                                 f"{type(conf).__name__}")
            setattr(conf, key, value)
        if isinstance(getattr(conf, "layer_types", None), list):  # per-layer attention kinds
            types = target.config.layer_types
            conf.layer_types = [types[i % len(types)] for i in idx]
        lm = type(target.model)(conf).float()  # e.g. LlamaForCausalLM; fresh: random init
        src = target.model.base_model
        if cfg.source == "target_layers":
            with torch.no_grad():
                for j, i in enumerate(idx):
                    lm.base_model.layers[j].load_state_dict(
                        {k: v.float() for k, v in src.layers[i].state_dict().items()})
                lm.base_model.norm.load_state_dict(
                    {k: v.float() for k, v in src.norm.state_dict().items()})
        same_width = conf.hidden_size == target.hidden_size
        if cfg.freeze_embeddings and not same_width:
            raise ValueError(f"small_lm: hidden_size {conf.hidden_size} != the target's "
                             f"{target.hidden_size}, so the target's embeddings cannot be shared; "
                             f"set freeze_embeddings=false to train the drafter's own")
        if cfg.freeze_embeddings:  # the target's frozen matrices, called, not copied
            lm.base_model.embed_tokens = Shared(target.embed_tokens(), torch.float32)
            lm.lm_head = Shared(target.lm_head(), torch.float32)
        elif same_width:  # own, untied copies that train
            with torch.no_grad():
                lm.get_input_embeddings().weight.copy_(target.embed_tokens().weight.float())
                lm.get_output_embeddings().weight.copy_(target.lm_head().weight.float())
        return lm

    @staticmethod
    def _pretrained(cfg: SmallLmConfig, target) -> nn.Module:
        """An HF causal LM with the target's tokenizer; its embeddings and LM head untied."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not cfg.pretrained:
            raise ValueError("small_lm: source=pretrained needs `pretrained` (an HF id or folder)")
        tok = AutoTokenizer.from_pretrained(cfg.pretrained)
        lm = AutoModelForCausalLM.from_pretrained(cfg.pretrained, dtype=torch.float32)
        problem = vocab_difference(target.tokenizer, tok, target.vocab_size,
                                   lm.get_output_embeddings().weight.shape[0])
        if problem:
            raise ValueError(f"small_lm: {cfg.pretrained} does not share the target's tokenizer "
                             f"({target.source}): {problem}. A drafter must propose the target's "
                             f"token ids; pick a model of the same family")
        head = lm.get_output_embeddings()
        if head.weight is lm.get_input_embeddings().weight:  # tied: separate tensors to save
            head.weight = nn.Parameter(head.weight.detach().clone())
        lm.config.tie_word_embeddings = False
        return lm

    # -- the network ------------------------------------------------------------------------------
    @property
    def hf_model(self) -> nn.Module:
        """The HF causal LM (under the peft wrapper when LoRA is on; adapters injected in place)."""
        return self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm

    def full_head(self) -> nn.Module:
        """A pruned head starts from this model's own full head."""
        return self.hf_model.get_output_embeddings()

    def logits(self, ids: torch.Tensor, attention_mask=None, position_ids=None,
               cache=None, at: torch.Tensor | None = None) -> torch.Tensor:
        """ids (B, Q) -> next-token logits (B, Q, Vd), or (M, Vd) at the (B, Q) bool `at` only;
        masks and positions as HF takes them."""
        h = self.hf_model.base_model(input_ids=ids, attention_mask=attention_mask,
                                     position_ids=position_ids, cache=cache,
                                     use_cache=cache is not None).last_hidden_state  # (B, Q, H)
        head = self.lm_head if self.lm_head is not None else self.hf_model.get_output_embeddings()
        return head(h if at is None else h[at])  # (B, Q | M, Vd)

    def forward_train(self, batch: TrainBatch) -> list[DraftPrediction]:
        """logits[:, t] = the drafter's distribution of token t+1: shift 0 (target_logits[:, t]),
        computed only where the loss reads them."""
        at = counted(batch, 0)  # (B, T)
        return [DraftPrediction(logits=self.logits(batch.input_ids, batch.attention_mask, at=at), at=at)]

    # -- decoding ---------------------------------------------------------------------------------
    def reset(self) -> None:
        self._cache = DraftCache(config=self.hf_model.config)

    def _step(self, ids: torch.Tensor, start: int, mask=None) -> torch.Tensor:
        """ids (Q,) at positions start.. through the cache -> logits (Q, Vd)."""
        pos = torch.arange(start, start + ids.shape[0], device=ids.device)[None]  # (1, Q)
        return self.logits(ids[None], mask, pos, self._cache.kv)[0].float()

    @torch.no_grad()
    def _sync(self, state: DecodeState) -> torch.Tensor:
        """Crop the cache to the longest prefix shared with state.tokens (at least the last token
        is recomputed), run the rest -> the next token's logits (Vd,)."""
        tokens = state.tokens  # (T,)
        T = tokens.shape[0]
        if T < 1:
            raise ValueError("small_lm: propose needs at least one committed token")
        keep = min(self._cache.shared_prefix(tokens), T - 1)
        self._cache.sync_to(tokens, keep, committed=T)
        return self._step(tokens[keep:], keep)[-1]  # (Vd,)

    @torch.no_grad()
    def propose(self, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None,
                min_confidence: float = 0.0) -> ChainProposal:
        """Draft up to k tokens autoregressively; drafted tokens stay in the cache (a later round
        that accepted them reuses them)."""
        if k < 1:
            return ChainProposal(tokens=state.tokens.new_empty(0))
        logits = self._sync(state)  # (Vd,)
        T = state.tokens.shape[0]

        def step(i: int, token: torch.Tensor) -> torch.Tensor:
            cache = self._cache
            cache.tokens = torch.cat([cache.tokens, token.view(1).to(cache.tokens.device)])
            return self._step(token.view(1), T + i)[0]  # (Vd,)

        return self.draft_chain(logits, step, k, sampling, generator, min_confidence)

    @torch.no_grad()
    def propose_tree(self, state: DecodeState, sampling: SamplingParams,
                     generator: torch.Generator | None = None) -> TreeProposal:
        """Dynamic (EAGLE-2 style) tree, sampled children when sampling. A level's frontier runs
        as one batch through the cache; each node sees the committed tokens, its ancestors and
        itself."""
        root = self._sync(state).log_softmax(-1)  # (Vd,)

        def expand(tokens: torch.Tensor, parents: torch.Tensor, frontier: torch.Tensor):
            allowed, pos, base = self._cache.tree_level(frontier, parents)  # (F, K), (1, F)
            ids = self.target_ids(tokens[frontier])[None]  # (1, F)
            out = self.logits(ids, allowed[None, None], pos, self._cache.kv)[0].float()  # (F, Vd)
            self._cache.add_level(frontier, base)
            return out.log_softmax(-1)

        sampled = sampling if self.cfg.tree_sampled else None  # None: the top-k tree
        try:
            tree = dynamic_tree(expand, root, self.cfg.tree_top_k, self.cfg.tree_depth,
                                self.cfg.tree_total_tokens, sampled, generator)
        finally:  # forget the tree's entries: the cache holds the committed tokens only
            self._cache.forget_drafts()
        return in_target_vocab(tree, self.d2t, self.vocab_size)

    # -- export -----------------------------------------------------------------------------------
    def to_hf_model(self) -> nn.Module:
        """A standalone copy of the drafter as an HF causal LM (LoRA merged, the target's frozen
        embeddings and LM head copied in, tied again when the target ties them)."""
        if self.draft_vocab is not None:
            raise ValueError("small_lm: an HF model needs the full vocabulary; a drafter with "
                             "draft_vocab_size cannot be exported as one (train with "
                             "draft_vocab_size=null)")
        lm = copy.deepcopy(self.lm)
        if hasattr(lm, "merge_and_unload"):  # peft: W += (alpha / r) B A, adapters removed
            lm = lm.merge_and_unload()
        emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
        if isinstance(emb, Shared):
            w = emb.weight.detach().float()  # (V, H)
            lm.base_model.embed_tokens = nn.Embedding.from_pretrained(
                w.clone(), freeze=False, padding_idx=getattr(emb.module, "padding_idx", None))
            new_head = nn.Linear(w.shape[1], head.weight.shape[0], bias=head.bias is not None)
            new_head.load_state_dict({k: v.detach().float() for k, v in head.module.state_dict().items()})
            lm.lm_head = new_head.to(w.device)
            if head.weight is emb.weight:  # the target ties them: so does the export
                lm.lm_head.weight = lm.base_model.embed_tokens.weight
                lm.config.tie_word_embeddings = True
        lm.config.architectures = [type(lm).__name__]
        return lm.eval()
