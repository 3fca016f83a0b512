#!/usr/bin/env bash
# Issue 36 on the GPU machine, GLM-4.5-Air: decode latency of the whole model (random weights at its real shape)
# with experts-hls2 (fp16 KV) and latency-hls2-nuq2 (2-bit KV) at 4k/32k, batch 1 and 16, with the per-kernel
# breakdown at 32k batch 1; the bf16 model (212 GB) does not fit one GPU, so no bf16 peer here (--no-peer).
# The llama.cpp peer is a second call: bash benchmarks/peers/llamacpp_peer.sh OUT_DIR glm-4.5-air (carry gpu/lcpp).
# Usage, from the repo root:  bash benchmarks/gpu_glm.sh OUT_DIR        (~5 min on one H100/H200; not yet run)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_glm.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
timeout 540 python3 -m benchmarks.bench_latency --out "$OUT/latency_glm_4_5_air.json" --shapes glm-4.5-air \
  --recipes moec/recipes/experts-hls2.yaml moec/recipes/latency-hls2-nuq2.yaml --no-peer --contexts 4096,32768 \
  --prefill none --steps 30 --budget 420 > "$OUT/latency_glm.log" 2>&1
echo "glm-4.5-air rc=$? at $((SECONDS - T0)) s"; tail -8 "$OUT/latency_glm.log"
