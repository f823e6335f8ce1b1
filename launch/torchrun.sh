#!/usr/bin/env bash
# One node, N GPUs (or N CPU processes): the training job (`python -m specdistill.train`, any
# folder) on every local device under torchrun.
#   bash launch/torchrun.sh drafter=eagle target=llama trainer=full                  # all GPUs, DDP
#   bash launch/torchrun.sh target=llama trainer=full trainer.backend=deepspeed deepspeed=zero3
#   NPROC=2 bash launch/torchrun.sh target=tiny trainer=smoke trainer.backend=deepspeed  # 2 CPU ranks
#   RUN_ID=<id> bash launch/torchrun.sh <same overrides> resume=true   # continue a stopped job
# Every rank composes the same Hydra config; RUN_ID (default: the start time) names the one run dir
# they share, runs/train/$RUN_ID (unless run_dir= is given). NPROC defaults to the GPU count (1
# without GPUs). DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
if [ -z "${NPROC:-}" ]; then
    NPROC=1
    if command -v nvidia-smi >/dev/null 2>&1; then NPROC="$(nvidia-smi -L | wc -l)"; fi
fi
export RUN_ID="${RUN_ID:-$(date +%Y-%m-%d_%H-%M-%S)}"
cmd=(torchrun --standalone --nnodes=1 --nproc-per-node="$NPROC" -m specdistill.train "$@")
if [ -n "${DRY_RUN:-}" ]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
