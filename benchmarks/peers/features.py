"""The SAME tokenised conversations and captured target features, written in each peer's format.

Our trainer reads a capture (data/capture.py): per conversation the ids, the loss mask, the
concatenated aux-layer features (T, 3H) and the POST-norm final hidden state (T, H) the LM head
reads. The peers want the same numbers arranged their way:

- speculators 0.9.0 reads `hs_{i}.safetensors` with `token_ids` (T,) and `hidden_states`
  (T, 3 aux + 1, H) whose last entry is the PRE-norm output of the last decoder layer: its models
  apply the verifier's norm to it and read it nowhere else (eagle3/core.py, dflash/core.py,
  dspark/core.py, peagle/core.py: `self.verifier_norm(verifier_last_hidden_states)`, the only use).
  So what it needs is a state whose norm is the captured post-norm state, not the layer's own
  output: `prenorm_preimage` gives post / w (w the norm's weight), whose RMS is 1 up to the norm's
  eps, so that norm(post / w) = post up to eps / (2 mean(x^2)) relative (x the layer's output),
  checked for every conversation (a target forward for one that is off by more than 1e-3). One
  true pre-norm forward (`prenorm_last`, a forward pre-hook on the final norm) checks that the
  capture is of this target.
- SpecForge 0.2.0 reads `.ckpt` files (torch.save) with `input_ids`, `loss_mask`,
  `aux_hidden_state` (T, 3H) and the POST-norm `hidden_state` (T, H)
  (specforge/algorithms/eagle3/data.py): the capture as is, with a batch axis.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from specdistill.data.capture import autocast

log = logging.getLogger(__name__)


def final_norm(target) -> torch.nn.Module:
    """The target's final norm (the module between the last decoder layer and the LM head)."""
    return target.model.model.norm


@torch.inference_mode()
def prenorm_last(target, input_ids: torch.Tensor, autocast_dtype: str | None) -> torch.Tensor:
    """(T, H) the last decoder layer's output BEFORE the final norm, for one conversation."""
    got = []
    hook = final_norm(target).register_forward_pre_hook(lambda _m, args: got.append(args[0]))
    try:
        with autocast(target, autocast_dtype):
            target.forward(input_ids[None].to(target.device), logits=False)
    finally:
        hook.remove()
    return got[0][0].float().cpu()  # (T, H)


def prenorm_preimage(post: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """(T, H) a state whose image through the RMS norm `norm` is `post`: post / w. Its mean
    square is mean(x^2) / (mean(x^2) + eps) ~ 1, so norm(post / w) = post * (1 + eps / (2 mean(x^2)))
    to first order, x the state before the norm."""
    return post.float() / norm.weight.detach().float()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def conversations(target, rows, offline, autocast_dtype: str | None,
                  check_tol: float = 0.05, preimage_tol: float = 1e-3) -> Iterator[dict]:
    """Per conversation of `rows` (the train split our trainer reads, captured in `offline`):
    ids, loss mask, aux features (T, 3H), post-norm (T, H) from the capture and `pre` (T, H), a
    state whose final norm is the post-norm state (what speculators reads: the module doc).
    The first conversation's true pre-norm state (one target forward) must norm to the capture's
    post-norm state within `check_tol` (relative; the capture stores bf16 features), or the
    capture is refused as another target's or setting's. Every conversation's preimage must norm
    back within `preimage_tol`; one that does not takes the target forward instead."""
    norm = final_norm(target)
    worst, forwards = 0.0, 0
    for i in range(len(rows)):
        ids = torch.as_tensor(rows[i]["input_ids"])
        aux, post = offline.get(i, ids.tolist())
        post = post.float()
        if i == 0:
            with torch.inference_mode():
                again = norm(prenorm_last(target, ids, autocast_dtype).to(target.dtype)).float()
            err = _rel_err(again, post)
            if err > check_tol:
                raise ValueError(f"conversation {i}: norm(pre-norm state) differs from the captured "
                                 f"post-norm state by {err:.3f} (relative): the capture is of another "
                                 f"target or setting; capture again")
        pre = prenorm_preimage(post, norm)
        with torch.inference_mode():
            err = _rel_err(norm(pre.to(target.dtype)).float(), post)
        if not err <= preimage_tol:  # NaN included: a norm that is not an RMS norm with a usable weight
            log.warning("conversation %d: norm(post / w) is %.2g from the post-norm state "
                        "(relative): its pre-norm state comes from a target forward", i, err)
            pre, forwards = prenorm_last(target, ids, autocast_dtype), forwards + 1
        else:
            worst = max(worst, err)
        yield {"input_ids": ids, "loss_mask": torch.as_tensor(rows[i]["loss_mask"]),
               "aux": aux.float(), "post": post, "pre": pre}
    log.info("speculators' last entry: norm(post / w) = the post-norm state to %.1e relative at "
             "worst over %d conversations; %d took a target forward", worst, len(rows), forwards)


def write_speculators(convs, out: Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """speculators' offline data: `data.jsonl` rows (input_ids, loss_mask: they pass its
    prepare-data step through) and `hidden_states/hs_{i}.safetensors` (token_ids, hidden_states
    (T, 3 aux + PRE-norm last, H)) in bf16, the dtype its collate casts every batch to
    (speculators/train/data.py `hidden_states_dtype`): the same numbers, half the disk."""
    hs = out / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out / "data.jsonl", "w") as fh:
        for i, c in enumerate(convs):
            T, H = c["pre"].shape
            stack = torch.cat([c["aux"].view(T, -1, H), c["pre"][:, None]], dim=1).to(dtype)
            save_file({"token_ids": c["input_ids"].long().contiguous(),
                       "hidden_states": stack.contiguous()}, str(hs / f"hs_{i}.safetensors"))
            fh.write(json.dumps({"id": i, "input_ids": c["input_ids"].tolist(),
                                 "loss_mask": c["loss_mask"].tolist()}) + "\n")
            n += 1
    return n


def write_specforge(convs, out: Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """SpecForge's offline data: `data_{i:05d}.ckpt` (it lists them sorted) with input_ids (T,),
    loss_mask (T,), aux_hidden_state (1, T, 3H) and the POST-norm hidden_state (1, T, H), the
    shapes its reader takes (specforge/algorithms/eagle3/data.py normalize_offline_sample), in
    bf16 as its own captures store them (its target head runs at model.torch_dtype, bf16 by
    default, and refuses fp32 states; our capture's aux features are bf16 already)."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for i, c in enumerate(convs):
        torch.save({"input_ids": c["input_ids"].long(), "loss_mask": c["loss_mask"].long(),
                    "aux_hidden_state": c["aux"][None].to(dtype).contiguous(),
                    "hidden_state": c["post"][None].to(dtype).contiguous()}, out / f"data_{i:05d}.ckpt")
        n += 1
    return n
