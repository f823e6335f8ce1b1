"""The target's own answers with their features: one pass (data/selfgen.py) against two.

    python -m train.benchmarks.selfgen --batches 2 --batch-size 32 --max-new-tokens 256 \
        --out runs/bench/selfgen

Two ways to get training rows of the target's own answers with the target's features, on the same
ShareGPT first turns (the first `--batches x --batch-size` with a prompt <= --max-prompt-tokens,
shortest first, as both pipelines order them):
- two_pass: what the job did before: `data.regenerate`'s batched HF `generate` (left padding,
  dynamic cache, the bf16 copy of the target) writes the answers, then the capture forward
  (data/capture.py: the fp32 target under bf16 autocast, as trainer.capture_autocast does) over
  prompt + answer gives the features;
- one_pass: `generate_with_features` (static cache, finished rows leave the batch, the features
  from the generating forwards).
Batches alternate between the two (A B A B ...), so load from other processes hits both alike.
Prints answer tokens/s and ms per answer token (features included) of each, and the ratio;
writes <out>/selfgen_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def two_pass(target, model, prompts: list[list[int]], max_new_tokens: int, layers) -> int:
    """HF generate (left-padded batch) + the capture forward over prompt + answer; answer tokens."""
    from specdistill.data.capture import autocast, capture
    from specdistill.data.dataset import pad_batch

    tok = target.tokenizer
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), tok.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id or 0)
    rows, n = [], 0
    for p, row in zip(prompts, out[:, P:]):
        ans = row.tolist()
        stop = next((i + 1 for i, t in enumerate(ans) if t in target.eos_token_ids), len(ans))
        ans = ans[:stop]
        n += len(ans)
        rows.append({"input_ids": p + ans, "loss_mask": [0] * len(p) + [1] * len(ans)})
    batch = pad_batch(rows, 0)
    with autocast(target, "bfloat16"):
        capture(target, batch["input_ids"], batch["attention_mask"], layers)
    return n


def one_pass(target, model, prompts: list[list[int]], max_new_tokens: int, layers) -> int:
    from specdistill.data.generate import generate_with_features

    out = generate_with_features(model, prompts, max_new_tokens=max_new_tokens,
                                 eos_ids=target.eos_token_ids, layers=layers,
                                 pad_id=target.tokenizer.pad_token_id or 0)
    return sum(len(a.answer) for a in out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m train.benchmarks.selfgen", description=__doc__)
    p.add_argument("--batches", type=int, default=2, help="batches per mode")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--layers", type=int, nargs="*", default=[2, 15, 27], help="feature layers")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = the cores)")
    p.add_argument("--out", default="runs/bench/selfgen")
    args = p.parse_args(argv)
    from specdistill.data.assets import asset_path
    from specdistill.data.selfgen import first_turns
    from specdistill.drafters.precision import model_at
    from specdistill.drafters.target import TargetConfig, load_target

    target = load_target(TargetConfig(path="packaged:smollm2", dtype="float32",
                                      threads=args.threads), training=True)
    model = model_at(target.model, torch.bfloat16)  # both generate at bf16
    n = args.batches * args.batch_size
    prompts, _ = first_turns(asset_path("sharegpt"), target.tokenizer, n, args.max_prompt_tokens)
    prompts = sorted((p["prompt_ids"] for p in prompts), key=len)
    runs = {"two_pass": [], "one_pass": []}
    for b in range(args.batches):  # A B A B: the same prompts for both, one batch at a time
        part = prompts[b * args.batch_size:(b + 1) * args.batch_size]
        for name, fn in (("two_pass", two_pass), ("one_pass", one_pass)):
            t0 = time.perf_counter()
            tokens = fn(target, model, part, args.max_new_tokens, args.layers)
            runs[name].append({"tokens": tokens, "seconds": time.perf_counter() - t0})
            print(f"batch {b} {name}: {tokens} answer tokens in {runs[name][-1]['seconds']:.1f} s",
                  flush=True)
    summary = {}
    for name, rs in runs.items():
        tok, sec = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        summary[name] = {"answer_tokens": tok, "seconds": sec, "tokens_per_s": tok / sec,
                         "ms_per_token": 1e3 * sec / tok,
                         "per_batch_ms_per_token": [1e3 * r["seconds"] / r["tokens"] for r in rs]}
    ratio = summary["one_pass"]["tokens_per_s"] / summary["two_pass"]["tokens_per_s"]
    per_batch = [a["seconds"] / a["tokens"] / (b["seconds"] / b["tokens"])
                 for a, b in zip(runs["two_pass"], runs["one_pass"])]
    print("\n| mode | answer tokens | s | tokens/s | ms / answer token |\n|---|---:|---:|---:|---:|")
    for name, s in summary.items():
        print(f"| {name} | {s['answer_tokens']} | {s['seconds']:.1f} | {s['tokens_per_s']:.1f} | "
              f"{s['ms_per_token']:.2f} |")
    print(f"\none pass / two passes: {ratio:.2f}x tokens/s (per batch pair: "
          f"{', '.join(f'{x:.2f}' for x in per_batch)}; median {statistics.median(per_batch):.2f})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selfgen_bench.json").write_text(json.dumps(
        {"args": vars(args), "summary": summary, "ratio": ratio, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
