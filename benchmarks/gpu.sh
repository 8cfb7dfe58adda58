#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the `base` preset's training throughput in bf16
# (mixed_bfloat16, fused attention through keras.ops.dot_product_attention) on each
# backend, the achieved fraction of the measured bf16 matmul peak, and decoding speed.
# Writes benchmarks/results/gpu_train.json and benchmarks/results/gpu_decode.json.
# Without a GPU it says so and exits 0 without running anything.
#
#   bash benchmarks/gpu.sh            (uses .venv/bin/python if present, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu.sh: no NVIDIA GPU found (nvidia-smi is missing or lists no device); nothing to run."
    exit 0
fi
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
nvidia-smi -L
mkdir -p benchmarks/results
"$PY" benchmarks/train_throughput.py --work base --dtype-policy mixed_bfloat16 --matmul-dtype bfloat16 \
    --only ours-jax ours-tensorflow ours-torch torch-eager --rounds 1 --steps 20 \
    --output benchmarks/results/gpu_train.json
"$PY" benchmarks/decode.py --output benchmarks/results/gpu_decode.json
KERAS_BACKEND=torch "$PY" benchmarks/gpu_torch.py --output benchmarks/results/gpu_torch.json
