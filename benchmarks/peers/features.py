"""The SAME tokenised conversations and captured target features, written in each peer's format.

Our trainer reads a capture (data/capture.py): per conversation the ids, the loss mask, the
concatenated aux-layer features (T, 3H) and the POST-norm final hidden state (T, H) the LM head
reads. The peers want the same numbers arranged their way:

- speculators 0.9.0 reads `hs_{i}.safetensors` with `token_ids` (T,) and `hidden_states`
  (T, 3 aux + 1, H) whose last entry is the PRE-norm output of the last decoder layer (its model
  applies the verifier's norm itself: speculators/models/eagle3/core.py). transformers'
  `hidden_states[L]` is already normed, so the pre-norm state is taken with a forward pre-hook on
  the final norm (`prenorm_last`): one extra target forward per conversation, under the capture's
  own autocast, checked against the capture (norm(pre) == the captured post-norm state).
- SpecForge 0.2.0 reads `.ckpt` files (torch.save) with `input_ids`, `loss_mask`,
  `aux_hidden_state` (T, 3H) and the POST-norm `hidden_state` (T, H)
  (specforge/algorithms/eagle3/data.py): the capture as is, with a batch axis.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from specdistill.data.capture import autocast


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


def conversations(target, rows, offline, autocast_dtype: str | None,
                  check_tol: float = 0.05) -> Iterator[dict]:
    """Per conversation of `rows` (the train split our trainer reads, captured in `offline`):
    ids, loss mask, aux features (T, 3H), post-norm (T, H) from the capture and pre-norm (T, H).
    Refuses a pre-norm state whose norm is not the capture's post-norm state (another target,
    setting or position): relative error above `check_tol` (the capture stores bf16 features)."""
    norm = final_norm(target)
    for i in range(len(rows)):
        ids = torch.as_tensor(rows[i]["input_ids"])
        aux, post = offline.get(i, ids.tolist())
        pre = prenorm_last(target, ids, autocast_dtype)
        with torch.inference_mode():
            again = norm(pre.to(target.dtype)).float()
        err = float((again - post).norm() / post.norm().clamp_min(1e-12))
        if err > check_tol:
            raise ValueError(f"conversation {i}: norm(pre-norm state) differs from the captured "
                             f"post-norm state by {err:.3f} (relative): the capture is of another "
                             f"target or setting; capture again")
        yield {"input_ids": ids, "loss_mask": torch.as_tensor(rows[i]["loss_mask"]),
               "aux": aux.float(), "post": post.float(), "pre": pre}


def write_speculators(convs, out: Path) -> int:
    """speculators' offline data: `data.jsonl` rows (input_ids, loss_mask: they pass its
    prepare-data step through) and `hidden_states/hs_{i}.safetensors` (token_ids, hidden_states
    (T, 3 aux + PRE-norm last, H))."""
    hs = out / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out / "data.jsonl", "w") as fh:
        for i, c in enumerate(convs):
            T, H = c["pre"].shape
            stack = torch.cat([c["aux"].view(T, -1, H), c["pre"][:, None]], dim=1)  # (T, 4, H)
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
