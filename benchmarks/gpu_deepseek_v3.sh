#!/usr/bin/env bash
# Issue 35's deepseek-v3 rows in one GPU call (real layer dimensions, random weights in GPU memory; one H100/H200
# holds neither the compressed model, 182 GiB, nor more than 5 of its layers in bf16): bench_layers at two layer
# counts for latency-hls2-mla2 (2-bit experts, 2-bit latent cache) and experts-hls2 (2-bit experts, fp16 latent),
# 8 and 20 layers (the first 3 dense), and the bf16 peer at 4 and 5 layers: per-layer time, its % of the per-layer
# floor, the projection to 61 layers; then Mixtral's latency-hls2-nuq2 at 4k/32k in the same call (the "% of
# floor Mixtral's reaches" reference). Outputs land in OUT_DIR as they are made (4 JSON files + run.log).
# Usage, from the repo root:  bash benchmarks/gpu_deepseek_v3.sh OUT_DIR        (~1.5 min on one H100)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_deepseek_v3.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
LOG="$OUT/run.log"; T0=$SECONDS
layers() {  # NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m benchmarks.bench_layers --out "$OUT/layers_deepseek_v3_$name.json" --shape deepseek-v3 \
    --steps 30 "$@" > "/tmp/layers_$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"
  grep -E "per layer|Error|error" "/tmp/layers_$name.log" | tail -4 | tee -a "$LOG"
}
layers mla2 200 --recipe moec/recipes/latency-hls2-mla2.yaml --layers 8,20
layers hls2 160 --recipe moec/recipes/experts-hls2.yaml --layers 8,20
layers bf16 150 --bf16 --layers 4,5
LEFT=$((570 - SECONDS + T0))
[ $LEFT -gt 60 ] && timeout $LEFT python3 -m benchmarks.bench_latency --out "$OUT/latency_mixtral_ref_deepseek_v3.json" \
  --shapes mixtral-8x7b --recipes moec/recipes/latency-hls2-nuq2.yaml --contexts 4096,32768 --batches 1 \
  --prefill none --steps 30 --no-breakdown --no-peer --budget 60 > /tmp/mix.log 2>&1
echo "mixtral reference rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; tail -4 /tmp/mix.log >> "$LOG"
