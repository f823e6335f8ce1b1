"""The capture's speed on the real target: milliseconds per token of `capture_split` at several
batch sizes (conversations per target forward), the sizes interleaved round by round.

    python -m benchmarks.capture_speed --features-dir <a capture of the job's data>
    python -m benchmarks.capture_speed --features-dir <dir> --batch-sizes 2 4 8 16 --conversations 64

    python -m benchmarks.capture_speed --features-dir <dir> --batch-sizes 8 --conversations 200 \
        --engine-install /tmp/engine-cache    # + vLLM's install: after the capture, or beside it

The conversations are the first --conversations of an existing capture (its stored token ids), so
the benchmark needs no tokenizer or dataset; the target is the default job's (`conf/train.yaml`,
`--set` overrides it, e.g. --set target=tiny), loaded for training (fp32 weights, the capture under
trainer.capture_autocast, as the job runs it); the layers, autocast and storage are those of
--features-dir. Each round captures the same conversations once per
batch size into an empty folder. Prints a table and writes <out>/capture.json (every round's
seconds, the medians after the first round, tokens, and the forward's padding at each size).

--engine-install CACHE measures what the job's engine check install costs a job that starts it
beside its capture (train/final_eval.py prepare_engine) against one that installs after it: each
round runs, in turn, "after" (the capture, then vLLM installed into CACHE) and "beside" (the
install started in the background, the capture, then a wait for the install), from an empty
CACHE each time (pip's own download cache is kept); the first --batch-sizes entry only.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch


def stored_rows(folder: Path, n: int) -> list[dict]:
    """The first n conversations of a capture as {input_ids, loss_mask} rows."""
    from safetensors import safe_open

    rows: list[dict] = []
    for f in sorted(folder.glob("shard-*.safetensors")):
        with safe_open(str(f), framework="pt") as sh:
            offsets, ids = sh.get_tensor("offsets").tolist(), sh.get_tensor("input_ids")
        rows += [{"input_ids": ids[a:b].tolist(), "loss_mask": [1] * (b - a)}
                 for a, b in zip(offsets, offsets[1:])]
        if len(rows) >= n:
            return rows[:n]
    raise ValueError(f"{folder} holds {len(rows)} conversations; --conversations {n} asks for more")


def padding(rows: list[dict], shard: int, batch: int) -> float:
    """The share of a capture forward's tokens that are padding (capture_split's batching)."""
    from specdistill.data.capture import length_batches

    real = padded = 0
    for s in range(0, len(rows), shard):
        chunk = rows[s:s + shard]
        for part in length_batches(chunk, batch):
            lengths = [len(chunk[j]["input_ids"]) for j in part]
            real, padded = real + sum(lengths), padded + max(lengths) * len(lengths)
    return 1 - real / padded


def install_overlap(target, rows: list[dict], ccfg, cache: Path, out: Path, rounds: int) -> None:
    """Rounds of "after" then "beside" (see the module's doc): seconds of the capture, of the wait
    for the install after it, and both together."""
    from specdistill.data.capture import capture_split
    from specdistill.decode.engine.envs import engines_root, install_in_background, vllm_python

    runs: dict[str, list[dict]] = {"after": [], "beside": []}
    for rnd in range(rounds):
        for arm in runs:
            shutil.rmtree(engines_root(cache), ignore_errors=True)
            shutil.rmtree(out / "scratch", ignore_errors=True)
            t0 = time.perf_counter()
            if arm == "beside":
                install_in_background(cache, out / "install.log")
            capture_split(target, rows, ccfg, out / "scratch", progress=False)
            t1 = time.perf_counter()
            vllm_python(cache)
            t2 = time.perf_counter()
            runs[arm].append({"capture_s": t1 - t0, "install_wait_s": t2 - t1, "total_s": t2 - t0})
            print(f"round {rnd} {arm}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[arm][-1].items()),
                  flush=True)
    print("\n| install | capture s | then waits s | total s |\n|---|---:|---:|---:|")
    for arm, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {arm} the capture | {med['capture_s']:.1f} | {med['install_wait_s']:.1f} | "
              f"{med['total_s']:.1f} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "install_overlap.json").write_text(json.dumps({"conversations": len(rows), "rounds": runs},
                                                         indent=1))


def main(argv=None) -> None:
    from hydra import compose, initialize_config_dir

    import specdistill.train.__main__  # noqa: F401  (stores the schemas)
    from specdistill.cli.paths import CONF_DIR
    from specdistill.data.capture import CaptureConfig, capture_split, read_manifest
    from specdistill.target.model import load_target

    p = argparse.ArgumentParser(prog="python -m benchmarks.capture_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features-dir", required=True, help="a capture whose conversations to use")
    p.add_argument("--conversations", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], help="overrides of the job's config")
    p.add_argument("--out", default="runs/bench/capture")
    p.add_argument("--engine-install", metavar="CACHE", help="time vLLM's install after / beside")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    source = Path(a.features_dir)
    man = read_manifest(source)
    if man is None:
        raise SystemExit(f"--features-dir {source}: no capture there (no manifest.json)")
    rows = stored_rows(source, a.conversations)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=a.set)
    target = load_target(cfg.target, training=True)
    if target.identity != man["target"]:
        raise SystemExit(f"--features-dir {source} was captured from another target than "
                         f"{cfg.target.path!r}: pass that target with --set target=...")
    layers, autocast_dtype = man["layers"], man["autocast"]
    features_dtype = man.get("features_dtype", man["dtype"])
    out = Path(a.out)
    tokens = sum(len(r["input_ids"]) for r in rows)
    if a.engine_install:
        ccfg = CaptureConfig(layers=layers, batch_size=a.batch_sizes[0], autocast=autocast_dtype,
                             dtype=man["dtype"], features_dtype=features_dtype)
        return install_overlap(target, rows, ccfg, Path(a.engine_install), out, a.rounds)
    seconds: dict[int, list[float]] = {b: [] for b in a.batch_sizes}
    for rnd in range(a.rounds):
        for b in a.batch_sizes:
            folder = out / f"scratch-b{b}"
            shutil.rmtree(folder, ignore_errors=True)
            ccfg = CaptureConfig(layers=layers, batch_size=b, autocast=autocast_dtype,
                                 dtype=man["dtype"], features_dtype=features_dtype)
            t0 = time.perf_counter()
            capture_split(target, rows, ccfg, folder, progress=False)
            seconds[b].append(time.perf_counter() - t0)
            shutil.rmtree(folder)
            print(f"round {rnd} batch {b}: {seconds[b][-1]:.1f} s", flush=True)
    result = {"conversations": len(rows), "tokens": tokens, "layers": layers,
              "autocast": autocast_dtype, "features_dtype": features_dtype, "threads": a.threads,
              "rounds": seconds,
              "median_s": {b: statistics.median(s[1:] or s) for b, s in seconds.items()},
              "padding": {b: padding(rows, CaptureConfig().shard_size, b) for b in a.batch_sizes}}
    print(f"\n{len(rows)} conversations, {tokens} tokens; medians after round 0\n")
    print("| batch | padding | s | ms/token | vs first |\n|---:|---:|---:|---:|---:|")
    base = result["median_s"][a.batch_sizes[0]]
    for b in a.batch_sizes:
        m = result["median_s"][b]
        print(f"| {b} | {100 * result['padding'][b]:.1f}% | {m:.1f} | {1000 * m / tokens:.3f} | "
              f"{m / base:.2f}x |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "capture.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
