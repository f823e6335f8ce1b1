"""Self-distillation data: regenerate the assistant answers of a chat dataset with the target.

    python -m data.regenerate out=runs/regen/sharegpt-smollm2.jsonl limit=2000
    python -m train data=jsonl data.path=runs/regen/sharegpt-smollm2.jsonl

A drafter learns the target's own distribution best from text the target itself would write, so the
user turns are kept and each of the first `max_turns` assistant answers is replaced by the target's
answer to the conversation so far (its own earlier answers included). The output is ShareGPT JSONL
(`{"id", "conversations": [{"from", "value"}]}`) that `data=jsonl` reads.

Batched (HF `generate` with left padding), resumable (one line per finished conversation, flushed;
a restart skips ids already written and repairs a line cut by a crash), limited by `limit`.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING

from data import quiet
from data.assets import asset_path
from data.sharegpt import Conversation, iter_conversations

log = logging.getLogger(__name__)
FROM = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclass
class RegenerateConfig:
    """`python -m data.regenerate`: answers of the target for the conversations of `data`."""

    target: Any = MISSING  # the target (conf/target/*.yaml)
    data: Any = MISSING  # the source chat data (conf/data/*.yaml)
    out: str = MISSING  # the ShareGPT JSONL file written (appended to on resume)
    limit: Optional[int] = 1000  # conversations to regenerate (None = all)
    max_turns: int = 1  # assistant answers regenerated per conversation (later turns are cut)
    batch_size: int = 8  # conversations per generate call
    max_new_tokens: int = 512  # budget per answer
    max_prompt_tokens: int = 1536  # conversations whose context is longer are skipped (counted)
    temperature: float = 0.0  # 0 = greedy answers; > 0 samples (diversity)
    seed: int = 0  # sampling seed


def source_path(data_cfg) -> Path:
    return asset_path("sharegpt") if data_cfg.kind == "sharegpt" else Path(data_cfg.path)


def done_ids(out: Path) -> set[str]:
    """Ids already written; a last line cut by a crash is removed so the file stays valid JSONL."""
    if not out.is_file():
        return set()
    raw = out.read_bytes()
    keep = raw[: raw.rfind(b"\n") + 1]  # everything up to the last complete line
    if len(keep) != len(raw):
        log.warning("%s ends with a partial line (interrupted run): removing it", out)
        out.write_bytes(keep)
    return {json.loads(line)["id"] for line in keep.decode("utf-8").splitlines() if line.strip()}


@torch.inference_mode()
def answer_batch(target, contexts: list[list[dict]], cfg) -> list[str]:
    """The target's answers to a batch of conversation prefixes (left-padded, one generate call)."""
    tok = target.tokenizer
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in contexts]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    kwargs = dict(do_sample=cfg.temperature > 0, max_new_tokens=cfg.max_new_tokens,
                  pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    if cfg.temperature > 0:
        kwargs["temperature"] = cfg.temperature
    out = target.model.generate(**enc, **kwargs)
    return [tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            for row in out]


def regenerate(target, convs: list[Conversation], cfg, out: Path, progress: bool = True) -> dict:
    """Regenerate `convs` into `out`; return counts {written, skipped_done, skipped_too_long}."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    seen = done_ids(out)
    todo = [c for c in convs if c.id not in seen]
    counts = {"written": 0, "skipped_done": len(convs) - len(todo), "skipped_too_long": 0}
    # state per conversation: the prefix rebuilt so far and where we are in the original
    states = [{"conv": c, "new": [], "pos": 0, "answers": 0} for c in todo]
    bar = tqdm(total=len(states), desc="regenerate", disable=not progress)
    with open(out, "a", encoding="utf-8") as f:
        for b in range(0, len(states), cfg.batch_size):
            active = states[b:b + cfg.batch_size]
            while active:
                contexts = []
                for s in active:  # copy turns up to the next assistant turn to answer
                    msgs = s["conv"].messages
                    while s["pos"] < len(msgs) and msgs[s["pos"]]["role"] != "assistant":
                        s["new"].append(msgs[s["pos"]])
                        s["pos"] += 1
                    contexts.append(list(s["new"]))
                n_tok = [len(target.tokenizer.apply_chat_template(
                    c, add_generation_prompt=True)["input_ids"]) for c in contexts]
                ok = [s for s, c, n in zip(active, contexts, n_tok)
                      if any(m["role"] == "user" for m in c) and n <= cfg.max_prompt_tokens]
                for s, c, n in zip(active, contexts, n_tok):
                    if s not in ok:  # nothing to answer (no user turn) or too long: finish it here
                        s["pos"] = len(s["conv"].messages)
                        if n > cfg.max_prompt_tokens and not s["answers"]:
                            counts["skipped_too_long"] += 1
                if ok:
                    answers = answer_batch(target, [list(s["new"]) for s in ok], cfg)
                    for s, a in zip(ok, answers):
                        s["new"].append({"role": "assistant", "content": a})
                        s["answers"] += 1
                        s["pos"] += 1
                still = []
                for s in active:
                    finished = s["answers"] >= cfg.max_turns or s["pos"] >= len(s["conv"].messages)
                    if not finished:
                        still.append(s)
                    elif s["answers"]:
                        rec = {"id": s["conv"].id, "conversations": [
                            {"from": FROM[m["role"]], "value": m["content"]} for m in s["new"]]}
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                        f.flush()
                        counts["written"] += 1
                        bar.update(1)
                    else:
                        bar.update(1)
                active = still
    bar.close()
    return counts


def main() -> None:
    import hydra
    from hydra.core.config_store import ConfigStore

    from data.dataset import DataConfig
    from drafters.target import TargetConfig, load_target

    @dataclass
    class _Schema(RegenerateConfig):
        target: TargetConfig = MISSING
        data: DataConfig = MISSING

    ConfigStore.instance().store(name="regenerate_schema", node=_Schema)

    @hydra.main(config_path="../conf", config_name="regenerate", version_base="1.3")
    def _run(cfg) -> None:
        target = load_target(cfg.target)
        convs = list(iter_conversations(source_path(cfg.data), limit=cfg.limit))
        counts = regenerate(target, convs, cfg, Path(cfg.out),
                            progress=not quiet())
        print(f"regenerated into {cfg.out}: {counts}")

    _run()


if __name__ == "__main__":
    main()
