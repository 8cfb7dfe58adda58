#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: PyTorch's optimizer and compiled search against eager
# (gpu_torch.py), decoding speed on each backend (decode.py), and the `base` preset's
# training throughput in bf16 (mixed_bfloat16, fused attention through
# keras.ops.dot_product_attention) with the achieved fraction of the measured bf16 matmul
# peak (train_throughput.py). A step that fails is reported and the next one still runs.
# Writes gpu_torch.json, gpu_decode.json and gpu_train.json into $RESULTS (benchmarks/results).
# Without a GPU it says so and exits 0 without running anything.
#
#   bash benchmarks/gpu.sh            (uses .venv/bin/python if present, else python3;
#                                      PYTHON=... and RESULTS=... override)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu.sh: no NVIDIA GPU found (nvidia-smi is missing or lists no device); nothing to run."
    exit 0
fi
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
RESULTS=${RESULTS:-benchmarks/results}
nvidia-smi -L
mkdir -p "$RESULTS"
# The backends installed here (a GPU image often has JAX and PyTorch but not TensorFlow).
backends=()
for b in jax tensorflow torch; do
    if "$PY" -c "import $b" >/dev/null 2>&1; then backends+=("$b"); else echo "gpu.sh: $b is not installed; its rows are left out."; fi
done
failed=()
step() { "$@" || { echo "gpu.sh: failed (status $?): $*"; failed+=("$(basename "$2")"); }; }
if [[ " ${backends[*]} " == *" torch "* ]]; then
    KERAS_BACKEND=torch step "$PY" benchmarks/gpu_torch.py --output "$RESULTS/gpu_torch.json"
fi
step "$PY" benchmarks/decode.py --backends "${backends[@]}" --output "$RESULTS/gpu_decode.json"
only=()
for b in "${backends[@]}"; do only+=("ours-$b"); done
[[ " ${backends[*]} " == *" torch "* ]] && only+=(torch-eager)
step "$PY" benchmarks/train_throughput.py --work base --dtype-policy mixed_bfloat16 --matmul-dtype bfloat16 \
    --only "${only[@]}" --rounds 1 --steps 20 --output "$RESULTS/gpu_train.json"
if ((${#failed[@]})); then echo "gpu.sh: ${#failed[@]} step(s) failed: ${failed[*]}"; exit 1; fi
