"""Self-distillation data: regenerate the assistant answers of a chat dataset with the target.

    python -m specdistill.data.regenerate out=runs/regen/sharegpt-smollm2.jsonl limit=2000
    python -m train data=jsonl data.path=runs/regen/sharegpt-smollm2.jsonl

A drafter learns the target's own distribution best from text the target itself would write, so the
user turns are kept and each of the first `max_turns` assistant answers is replaced by the target's
answer to the conversation so far (its own earlier answers included). The output is ShareGPT JSONL
(`{"id", "conversations": [{"from", "value"}]}`) that `data=jsonl` reads.

Batched (HF `generate` with left padding), resumable (one line per finished conversation, flushed;
a restart skips ids already written and repairs a line cut by a crash), limited by `limit`.
`<out>.regenerate.json` records the target's identity and the generation settings: a resume with
another target or other settings is refused (naming what differs) instead of mixing two kinds of
answers in one file, and a file without it (the user's own) is never appended to or repaired.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING

from specdistill.data import quiet
from specdistill.data.chat import content_text
from specdistill.data.dataset import (DataConfig, RegenerateSettings, cache_root, cached_file_sha256,
                                      data_file, template_kwargs)
from specdistill.data.sharegpt import Conversation, iter_conversations
from specdistill.target.identity import differences
from specdistill.target.model import TargetConfig
from specdistill.target.precision import DTYPES, resolve_dtype
from specdistill.target.precision import model_at

# answers' format: 2 = a generation copy at another dtype keeps fp32 RoPE frequencies
# (drafters/precision.cast_floats; format 1's bf16 copies rounded them, so were not the target)
FORMAT = 2

log = logging.getLogger(__name__)
FROM = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclass
class RegenerateConfig(RegenerateSettings):
    """`python -m specdistill.data.regenerate`: answers of the target for the conversations of `data`."""

    target: Any = MISSING  # the target (conf/target/*.yaml)
    data: Any = MISSING  # the source chat data (conf/data/*.yaml)
    # the ShareGPT JSONL file written (appended to on resume; its target and settings are kept
    # in <out>.regenerate.json, and a file without one is never written to)
    out: str = MISSING


def self_distilled(target, data_cfg, progress: bool = True):
    """`data_cfg` with the target's own answers (data.regenerate set): the first
    `regenerate.limit` conversations are regenerated once into the cache, keyed by target, source
    file and settings (an interrupted run resumes), and the returned config reads that file."""
    from omegaconf import OmegaConf

    settings = data_cfg.regenerate
    src = data_file(data_cfg)
    if not src.is_file():
        raise FileNotFoundError(f"data file {src} does not exist (data.path={data_cfg.path!r}).")
    root = cache_root(data_cfg)
    settings = OmegaConf.to_container(OmegaConf.create(settings))  # a plain dict
    kwargs = template_kwargs(data_cfg)
    parts = [target.identity, cached_file_sha256(src, root), settings, FORMAT]
    if kwargs:  # the template kwargs change the answers (stores made without them keep their keys)
        parts.append(kwargs)
    key = hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    out = root / "regen" / f"{key}.jsonl"
    done = out.with_suffix(".done")
    if done.is_file():
        log.info("self-distillation data from cache %s: %s", out, done.read_text().strip())
    else:
        log.info("self-distillation: the target answers %s conversations of %s into %s "
                 "(first use; resumable)", settings["limit"], src, out)
        cfg = OmegaConf.merge(OmegaConf.structured(RegenerateConfig), settings)
        convs = list(iter_conversations(src, limit=settings["limit"]))
        counts = regenerate(target, convs, cfg, out, progress=progress, template_kwargs=kwargs)
        if counts["written"] == 0:
            raise ValueError(f"self-distillation wrote no conversation from {src}: {counts}; raise "
                             f"data.regenerate.max_prompt_tokens or check the data")
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts))
        os.replace(tmp, done)
        log.info("self-distillation data: %s", counts)
    new = OmegaConf.merge(OmegaConf.structured(DataConfig), data_cfg)
    new.kind, new.path, new.regenerate = "file", str(out), None
    return new


def _record(conv: Conversation, messages: list[dict]) -> dict:
    """A regenerated conversation as a record: ShareGPT form where it is plain chat (the form files
    written before tool and reasoning fields existed have), else OpenAI messages with every field."""
    plain = all(m["role"] in FROM and set(m) == {"role", "content"} and isinstance(m["content"], str)
                for m in messages)
    if plain and not conv.tools:
        return {"id": conv.id, "conversations": [{"from": FROM[m["role"]], "value": m["content"]}
                                                 for m in messages]}
    return {"id": conv.id, "messages": messages, **({"tools": conv.tools} if conv.tools else {})}


# what decides the answers: resuming into one file with other values would mix two kinds
GENERATION_KEYS = ("max_turns", "max_new_tokens", "max_prompt_tokens", "temperature", "seed")


def sidecar(out: Path) -> Path:
    """`<out>.regenerate.json`: the target and settings the answers in `out` were made with.
    Its presence also says that `out` is ours: regenerate never appends to another file."""
    return out.with_name(out.name + ".regenerate.json")


def claim_out(out: Path, target, cfg, dtype: str) -> None:
    """Start `out` (recording who writes it) or resume it: refused when `out` is a file this
    command did not start, or when its answers came from another target or other generation
    settings (every differing key named)."""
    side = sidecar(out)
    record = {"format": FORMAT, "target": target.identity,
              "generation": {**{k: getattr(cfg, k) for k in GENERATION_KEYS}, "dtype": dtype}}
    if side.is_file():
        old = json.loads(side.read_text())
        diffs = differences({k: old.get(k) for k in record}, record)
        if diffs:
            raise ValueError(f"{out} holds answers made with another target or other generation "
                             f"settings ({side.name}): " + "; ".join(diffs) + ". Resuming would "
                             f"mix both in one file: give another out= (or delete {out} and {side})")
        return
    if out.exists() and out.stat().st_size > 0:
        raise FileExistsError(f"{out} exists and was not started by regenerate (no {side.name} "
                              f"next to it): regenerate appends only to its own output and never "
                              f"changes another file; give a new out= file")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, side)


def done_ids(out: Path) -> set[str]:
    """Ids already written into our own `out`. Its last line without a newline is a write cut
    by a crash: removed when it is not a whole record, kept (newline added) when it is."""
    if not out.is_file():
        return set()
    raw = out.read_bytes()
    cut = raw.rfind(b"\n") + 1  # everything up to the last complete line
    tail = raw[cut:]
    if tail.strip():
        try:
            json.loads(tail)["id"]
        except (ValueError, KeyError, TypeError):
            log.warning("%s ends with a partial record (%d bytes; an interrupted run): removing "
                        "it", out, len(tail))
            os.truncate(out, cut)
            raw = raw[:cut]
        else:  # the whole record made it, only its newline did not
            with open(out, "ab") as f:
                f.write(b"\n")
            raw += b"\n"
    return {json.loads(line)["id"] for line in raw.decode("utf-8").splitlines() if line.strip()}


@torch.inference_mode()
def answer_batch(target, model, contexts: list[list[dict]], cfg,
                 template_kwargs: Optional[dict] = None, tools: Optional[list] = None) -> list[str]:
    """The target's answers to a batch of conversation prefixes (left-padded, one generate call),
    prompted as served: the chat template with each conversation's tools (`tools[i]`) and
    data.template_kwargs (e.g. enable_thinking)."""
    tok = target.tokenizer
    tools = tools or [None] * len(contexts)
    texts = [tok.apply_chat_template(c, tools=t or None, add_generation_prompt=True, tokenize=False,
                                     **(template_kwargs or {})) for c, t in zip(contexts, tools)]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    kwargs = dict(do_sample=cfg.temperature > 0, max_new_tokens=cfg.max_new_tokens,
                  pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    if cfg.temperature > 0:
        kwargs["temperature"] = cfg.temperature
    out = model.generate(**enc, **kwargs)
    return [tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            for row in out]


def regenerate(target, convs: list[Conversation], cfg, out: Path, progress: bool = True,
               template_kwargs: Optional[dict] = None) -> dict:
    """Regenerate `convs` into `out`; return counts {written, skipped_done, skipped_too_long,
    skipped_no_user_turn}: every conversation read lands in exactly one of them. The prompts are
    rendered with `template_kwargs` (data.template_kwargs: a thinking mode regenerated on purpose)."""
    kwargs = template_kwargs or {}
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    model = target.model  # or a copy in cfg.dtype (bf16 generates ~2.6x faster on AVX512-BF16 CPUs)
    dtype = str(target.dtype).removeprefix("torch.")
    if cfg.dtype is not None:
        if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
            raise ValueError(f"regenerate dtype {cfg.dtype!r}: use auto, one of {sorted(DTYPES)} "
                             f"or null (the target's own dtype)")
        choice = resolve_dtype(cfg.dtype, target.device.type)  # auto: bf16 where native
        log.info("regenerating at %s (%s)", choice.dtype, choice.check)
        dtype = choice.dtype
        model = model_at(target.model, DTYPES[choice.dtype])
    claim_out(out, target, cfg, dtype)
    seen = done_ids(out)
    # shortest first: a batch pads to its longest prompt, and prefill dominates on CPUs
    todo = sorted((c for c in convs if c.id not in seen),
                  key=lambda c: sum(len(content_text(m)) for m in c.messages[:2]))
    counts = {"written": 0, "skipped_done": len(convs) - len(todo), "skipped_too_long": 0,
              "skipped_no_user_turn": 0}
    # state per conversation: the prefix rebuilt so far and where we are in the original
    states = [{"conv": c, "new": [], "pos": 0, "answers": 0} for c in todo]
    bar = tqdm(total=len(states), desc="regenerate", disable=not progress)
    t0 = time.perf_counter()
    with open(out, "a", encoding="utf-8") as f:
        for b in range(0, len(states), cfg.batch_size):
            active = states[b:b + cfg.batch_size]
            while active:
                contexts = []
                for s in active:  # copy turns up to the next assistant turn that follows a user
                    msgs = s["conv"].messages  # turn (a leading assistant turn stays as context)
                    while s["pos"] < len(msgs) and (msgs[s["pos"]]["role"] != "assistant" or not any(
                            m["role"] == "user" for m in s["new"])):
                        s["new"].append(msgs[s["pos"]])
                        s["pos"] += 1
                    contexts.append(list(s["new"]))
                # a context without a user turn (assistant-first conversation) has nothing to answer
                n_tok = [len(target.tokenizer.apply_chat_template(
                    c, tools=s["conv"].tools, add_generation_prompt=True, **kwargs)["input_ids"])
                    if any(m["role"] == "user" for m in c) else 0 for s, c in zip(active, contexts)]
                ok = [s for s, n in zip(active, n_tok) if 0 < n <= cfg.max_prompt_tokens]
                for s, n in zip(active, n_tok):
                    if s not in ok:  # nothing to answer (no user turn) or too long: finish it here
                        s["pos"] = len(s["conv"].messages)
                        if not s["answers"]:
                            counts["skipped_too_long" if n else "skipped_no_user_turn"] += 1
                if ok:
                    answers = answer_batch(target, model, [list(s["new"]) for s in ok], cfg, kwargs,
                                           [s["conv"].tools for s in ok])
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
                        rec = _record(s["conv"], s["new"])
                        f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                        f.flush()
                        counts["written"] += 1
                        bar.update(1)
                    else:
                        bar.update(1)
                active = still
            if not progress:  # a line per batch where there is no progress bar (logs, CI)
                log.info("regenerated %d/%d conversations (%.0f s)", min(b + cfg.batch_size, len(states)),
                         len(states), time.perf_counter() - t0)
    bar.close()
    return counts


@dataclass
class CLISchema(RegenerateConfig):
    """The command line's schema: the target and data groups typed (at module level, where the
    `from __future__ import annotations` strings resolve)."""

    target: TargetConfig = MISSING
    data: DataConfig = MISSING


def run(cfg) -> dict:
    """`python -m specdistill.data.regenerate` on a composed config: the settings and the data
    file are checked (and its conversations read) before the target loads."""
    from specdistill.cli.ranges import check_ranges
    from specdistill.target.model import load_target

    check_ranges(cfg, CLISchema)
    src = data_file(cfg.data)
    if not src.is_file():
        raise FileNotFoundError(f"data file {src} does not exist (data.path={cfg.data.path!r})")
    convs = list(iter_conversations(src, limit=cfg.limit))
    target = load_target(cfg.target)
    counts = regenerate(target, convs, cfg, Path(cfg.out), progress=not quiet(),
                        template_kwargs=template_kwargs(cfg.data))
    print(f"regenerated into {cfg.out}: {counts}")
    return counts


def store_schema() -> None:
    """Put the command line's schema in Hydra's ConfigStore (conf/regenerate.yaml starts from it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="regenerate_schema", node=CLISchema)


def main() -> None:
    """The command line: the `out=` file's folder checked first, user errors in one line
    (cli/errors.py)."""
    import sys

    import hydra

    from specdistill.cli.errors import user_errors
    from specdistill.cli.paths import CONF_DIR, check_out_dir_arg

    check_out_dir_arg("python -m specdistill.data.regenerate", sys.argv[1:], key="out", file=True)
    store_schema()

    @hydra.main(config_path=CONF_DIR, config_name="regenerate", version_base="1.3")
    def _run(cfg) -> None:
        with user_errors("python -m specdistill.data.regenerate"):
            run(cfg)

    _run()


if __name__ == "__main__":
    main()
