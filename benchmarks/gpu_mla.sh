#!/usr/bin/env bash
# Issue 35 on the GPU machine in one call: the MLA smoke shape (benchmarks/gpu_smoke.py --shapes smoke-mla), then
# decode latency of deepseek-v2-lite (random weights at its real shape: bf16 with the fp16 latent cache, and
# experts-hls2) at 4k/32k, batch 1 and 16, with the per-kernel breakdown at 32k batch 1, then Mixtral's
# latency-hls2-nuq2 in the same call (the "% of floor Mixtral reaches in the same run" the issue compares with).
# Usage, from the repo root:  bash benchmarks/gpu_mla.sh OUT_DIR        (~7 min on one H100/H200)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_mla.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
timeout 200 python3 -m benchmarks.gpu_smoke --shapes smoke-mla --jobs 4 --out "$OUT/gpu_smoke_mla.json" \
  > "$OUT/smoke_mla.log" 2>&1
echo "smoke-mla rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/smoke_mla.log"
timeout 240 python3 -m benchmarks.bench_latency --out "$OUT/latency_deepseek_v2_lite.json" \
  --shapes deepseek-v2-lite --recipes moec/recipes/experts-hls2.yaml --contexts 4096,32768 --prefill 4096 \
  --steps 30 --budget 150 > "$OUT/latency_ds.log" 2>&1
echo "deepseek-v2-lite rc=$? at $((SECONDS - T0)) s"; tail -4 "$OUT/latency_ds.log"
LEFT=$((560 - SECONDS + T0))
[ $LEFT -gt 90 ] && timeout $LEFT python3 -m benchmarks.bench_latency --out "$OUT/latency_mixtral_samecall.json" \
  --shapes mixtral-8x7b --recipes moec/recipes/latency-hls2-nuq2.yaml --contexts 32768 --prefill none --steps 30 \
  --budget 10 > "$OUT/latency_mx.log" 2>&1
echo "mixtral rc=$? at $((SECONDS - T0)) s"
