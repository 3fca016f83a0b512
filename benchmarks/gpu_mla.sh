#!/usr/bin/env bash
# Issue 35 on the GPU machine in one call: the compressed latent kernel against the fp16 latent kernel
# (benchmarks/bench_mla_nuq_attention.py, with a launch sweep), then decode latency of deepseek-v2-lite (random
# weights at its real shape: bf16 with the fp16 latent cache, experts-hls2 with it, and latency-hls2-mla2 with the
# 2-bit latent cache) at 4k/32k, batch 1 and 16, with the per-kernel breakdown at 32k batch 1, then Mixtral's
# latency-hls2-nuq2 in the same call (the "% of floor Mixtral reaches in the same run" the issue compares with).
# Usage, from the repo root:  bash benchmarks/gpu_mla.sh OUT_DIR        (~9 min on one H100/H200)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_mla.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
timeout 200 python3 -m benchmarks.bench_mla_nuq_attention --sweep --budget 110 \
  --out "$OUT/mla_nuq_attention.json" > "$OUT/attention.log" 2>&1
echo "attention rc=$? at $((SECONDS - T0)) s"; grep -v "^  {" "$OUT/attention.log" | tail -5
timeout 260 python3 -m benchmarks.bench_latency --out "$OUT/latency_deepseek_v2_lite.json" \
  --shapes deepseek-v2-lite --recipes moec/recipes/experts-hls2.yaml moec/recipes/latency-hls2-mla2.yaml \
  --contexts 4096,32768 --prefill none --steps 30 --budget 190 > "$OUT/latency_ds.log" 2>&1
echo "deepseek-v2-lite rc=$? at $((SECONDS - T0)) s"; tail -6 "$OUT/latency_ds.log"
LEFT=$((570 - SECONDS + T0))
[ $LEFT -gt 90 ] && timeout $LEFT python3 -m benchmarks.bench_latency --out "$OUT/latency_mixtral_samecall.json" \
  --shapes mixtral-8x7b --recipes moec/recipes/latency-hls2-nuq2.yaml --contexts 32768 --prefill none --steps 30 \
  --budget 10 > "$OUT/latency_mx.log" 2>&1
echo "mixtral rc=$? at $((SECONDS - T0)) s"
