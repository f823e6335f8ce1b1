"""One vLLM engine in its own process, driven over JSON lines (run by decode/engine/vllm.py).

This file runs inside the vLLM virtualenv (decode/engine/envs.py), which has its own torch and
transformers, so it imports nothing of specdistill: only vLLM and the standard library.

    <venv>/bin/python vllm_worker.py <settings.json>

settings.json: {"model": <target folder>, "dtype": "float32", "max_model_len": 2048, "seed": 0,
                "speculative_config": {...} or null}
stdin, one JSON object per line:   {"op": "generate", "prompt_ids": [...], "max_tokens": 128,
                                    "stop_token_ids": [...]}  |  {"op": "quit"}
replies, one JSON object per line on the file descriptor given as --reply-fd (stdout and stderr
carry vLLM's own logs): first {"ready": true, "vllm": <version>, "load_s": ...} or {"error": ...},
then per request {"ids": [...], "seconds": ..., "spec": {"drafts", "draft_tokens", "accepted",
"accepted_per_pos"}} (the request's own counts: the counters' differences around it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counts(llm) -> dict:
    """The speculative-decoding counters now, summed over their label sets."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            pos = out["accepted_per_pos"]
            pos.extend([0] * (len(m.values) - len(pos)))
            for i, v in enumerate(m.values):
                pos[i] += int(v)
    return out


def difference(after: dict, before: dict) -> dict:
    pos_a, pos_b = after["accepted_per_pos"], before["accepted_per_pos"]
    pos_b = pos_b + [0] * (len(pos_a) - len(pos_b))
    return {**{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")},
            "accepted_per_pos": [a - b for a, b in zip(pos_a, pos_b)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("settings")
    ap.add_argument("--reply-fd", type=int, required=True)
    args = ap.parse_args()
    reply_stream = os.fdopen(args.reply_fd, "w", buffering=1)

    def reply(obj: dict) -> None:
        reply_stream.write(json.dumps(obj) + "\n")
        reply_stream.flush()

    settings = json.loads(open(args.settings).read())
    t0 = time.perf_counter()
    try:  # vLLM's own modules not importable: its install is damaged (not the export's fault)
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        reply({"error": f"{type(e).__name__}: {e}", "damaged": True,
               "traceback": traceback.format_exc()[-4000:]})
        return
    try:
        llm = LLM(model=settings["model"], tokenizer=settings["model"], dtype=settings["dtype"],
                  max_model_len=settings["max_model_len"], max_num_seqs=1, enforce_eager=True,
                  seed=settings.get("seed", 0), disable_log_stats=False,
                  enable_prefix_caching=False,
                  kv_cache_memory_bytes=settings.get("kv_cache_memory_bytes"),
                  speculative_config=settings.get("speculative_config"))
    except BaseException as e:  # the engine's own words, verbatim, for the report
        reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})
        return
    reply({"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - t0})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                                    stop_token_ids=req.get("stop_token_ids") or None,
                                    detokenize=False)
            before = spec_counts(llm)
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_ids"])], params,
                               use_tqdm=False)
            seconds = time.perf_counter() - t
            reply({"ids": list(out[0].outputs[0].token_ids), "seconds": seconds,
                   "finish_reason": out[0].outputs[0].finish_reason,
                   "spec": difference(spec_counts(llm), before)})
        except BaseException as e:
            reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})


if __name__ == "__main__":
    main()
