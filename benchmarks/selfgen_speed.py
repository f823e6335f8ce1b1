"""The target's own answers with their features: one pass (data/generate.py) against two.

    python -m benchmarks.selfgen_speed --batches 2 --batch-sizes 32 128 --max-new-tokens 256 \
        --out runs/bench/selfgen

Two ways to get training rows of the target's own answers with the target's features:
- two_pass: what the job did before: `data.regenerate`'s batched HF `generate` (left padding,
  dynamic cache, the bf16 copy of the target; batches of --two-pass-batch-size, data.regenerate's
  default 8) writes the answers, then the capture forward (data/capture.py: the fp32 target under
  bf16 autocast, as trainer.capture_autocast does) over prompt + answer gives the features;
- one_pass: `generate_with_features` (static cache, finished rows leave the batch, the features
  from the generating forwards), at each of --batch-sizes (data.selfgen.batch_size).

The prompts are drawn as the job draws them (data/selfgen.py build_selfgen): the first --pool
ShareGPT first turns of <= --max-prompt-tokens, sorted by length, cut into consecutive batches. The
bench answers --batches groups of max(--batch-sizes) consecutive prompts, spread evenly over that
order (short and long prompts alike), each group by every mode, the modes alternating group by
group (A B C A B C ...), so load from other processes hits all of them alike. Prints answer tokens/s
and ms per answer token (features included) of each mode and its ratio to two_pass; writes
<out>/selfgen_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def group_starts(n: int, size: int, groups: int) -> list[int]:
    """Starts of `groups` runs of `size` consecutive items among `n`, spread evenly from the first
    to the last possible start (one group: the middle one); distinct and in order."""
    if size > n:
        raise SystemExit(f"a group of {size} prompts needs at least {size} usable prompts; "
                         f"{n} found: raise --pool or lower --batch-sizes")
    if groups == 1:
        return [(n - size) // 2]
    return sorted({round(g * (n - size) / (groups - 1)) for g in range(groups)})


def two_pass(target, model, prompts: list[list[int]], max_new_tokens: int, layers) -> tuple[int, float]:
    """HF generate (left-padded batch) + the capture forward over prompt + answer; returns the
    answer tokens and the seconds of the generate call alone (the answers without features)."""
    from specdistill.data.capture import autocast, capture
    from specdistill.data.dataset import pad_batch

    tok = target.tokenizer
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), tok.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id or 0)
    answers_s = time.perf_counter() - t0
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
    return n, answers_s


def one_pass(target, model, prompts: list[list[int]], max_new_tokens: int, layers) -> tuple[int, float]:
    from specdistill.data.generate import generate_with_features

    out = generate_with_features(model, prompts, max_new_tokens=max_new_tokens,
                                 eos_ids=target.eos_token_ids, layers=layers,
                                 pad_id=target.tokenizer.pad_token_id or 0)
    return sum(len(a.answer) for a in out), None  # the answers and their features: one time


def summarize(runs: dict[str, list[dict]], base: str) -> dict[str, dict]:
    """Per mode: answer tokens, seconds, tokens/s, ms per answer token over all groups (and, where
    the mode times its answers apart from their features, the answers' own tokens/s), and the
    ratio of its tokens/s to `base`'s (overall and per group)."""
    summary = {}
    for name, rs in runs.items():
        tok, sec = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        summary[name] = {"answer_tokens": tok, "seconds": sec, "tokens_per_s": tok / sec,
                         "ms_per_token": 1e3 * sec / tok}
        if all(r.get("answers_seconds") is not None for r in rs):
            summary[name]["answers_only_tokens_per_s"] = tok / sum(r["answers_seconds"] for r in rs)
    for name, s in summary.items():
        s["vs_" + base] = s["tokens_per_s"] / summary[base]["tokens_per_s"]
        per_group = [(r["tokens"] / r["seconds"]) / (b["tokens"] / b["seconds"])
                     for r, b in zip(runs[name], runs[base])]
        s["vs_" + base + "_per_group"] = per_group
        s["vs_" + base + "_median"] = statistics.median(per_group)
        if "answers_only_tokens_per_s" in summary[base]:  # against the base's answers alone
            s["vs_" + base + "_answers_only"] = (s["tokens_per_s"]
                                                 / summary[base]["answers_only_tokens_per_s"])
    return summary


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.selfgen_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=2, help="groups of prompts, each answered by every mode")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32], help="one_pass batch sizes")
    p.add_argument("--two-pass-batch-size", type=int, default=8,
                   help="two_pass batch size (data.regenerate's default: 8)")
    p.add_argument("--pool", type=int, default=1200,
                   help="first turns the groups are drawn from, sorted by length (as the job does)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--layers", type=int, nargs="*", default=[2, 15, 27], help="feature layers")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = the cores)")
    p.add_argument("--tiny", action="store_true", help="random-init tiny target: checks the script")
    p.add_argument("--out", default="runs/bench/selfgen")
    args = p.parse_args(argv)
    from benchmarks.replaying import TINY, compose
    from specdistill.data.assets import asset_path
    from specdistill.data.selfgen import first_turns
    from specdistill.target.model import TargetConfig, load_target
    from specdistill.target.precision import model_at

    if args.tiny:
        target = load_target(compose(TINY).target, training=True)
        layers = [1, 2]
    else:
        target = load_target(TargetConfig(path="packaged:smollm2", dtype="float32",
                                          threads=args.threads), training=True)
        layers = args.layers
    model = model_at(target.model, torch.bfloat16)  # every mode generates at bf16
    found, _ = first_turns(asset_path("sharegpt"), target.tokenizer, args.pool, args.max_prompt_tokens)
    prompts = [q["prompt_ids"] for q in sorted(found, key=lambda q: len(q["prompt_ids"]))]  # stable
    size = max(args.batch_sizes)
    starts = group_starts(len(prompts), size, args.batches)
    modes = [(f"two_pass@{args.two_pass_batch_size}", two_pass, args.two_pass_batch_size)]
    modes += [(f"one_pass@{b}", one_pass, b) for b in args.batch_sizes]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in modes}
    for g, start in enumerate(starts):
        group = prompts[start:start + size]
        for name, fn, bs in modes:  # A B C A B C: the same prompts for every mode
            t0, tokens, answers_s = time.perf_counter(), 0, 0.0
            for b in range(0, len(group), bs):
                n, part_s = fn(target, model, group[b:b + bs], args.max_new_tokens, layers)
                tokens += n
                answers_s = None if part_s is None else answers_s + part_s
            runs[name].append({"group": g, "start": start, "prompts": len(group),
                               "prompt_tokens": [len(group[0]), len(group[-1])], "tokens": tokens,
                               "seconds": time.perf_counter() - t0, "answers_seconds": answers_s})
            print(f"group {g} (prompts {start}..{start + size - 1} of {len(prompts)}, "
                  f"{len(group[0])}-{len(group[-1])} tokens) {name}: {tokens} answer tokens in "
                  f"{runs[name][-1]['seconds']:.1f} s", flush=True)
    base = modes[0][0]
    summary = summarize(runs, base)
    print(f"\n| mode | answer tokens | s | tokens/s | ms / answer token | vs {base} (per group) | "
          f"answers alone: tokens/s |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, s in summary.items():
        groups = ", ".join(f"{x:.2f}" for x in s["vs_" + base + "_per_group"])
        alone = s.get("answers_only_tokens_per_s")
        print(f"| {name} | {s['answer_tokens']} | {s['seconds']:.1f} | {s['tokens_per_s']:.1f} | "
              f"{s['ms_per_token']:.2f} | {s['vs_' + base]:.2f}x ({groups}) | "
              f"{'-' if alone is None else f'{alone:.1f}'} |")
    if "answers_only_tokens_per_s" in summary[base]:
        print(f"\nagainst {base}'s answers alone (its capture left out): " + ", ".join(
            f"{name} {s['vs_' + base + '_answers_only']:.2f}x" for name, s in summary.items()))
    result = {"args": vars(args), "usable_prompts": len(prompts), "summary": summary, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selfgen_bench.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
