#!/usr/bin/env bash
# Issue 36 on the GPU machine, GLM-4.5-Air, everything one call (same-run ratios):
#  1. llama-bench built in the background (peers/llamacpp_peer.sh build; carry gpu/lcpp/src.tgz) while the GPU works;
#  2. moec's decode latency of the whole model (random weights at its real shape) with experts-hls2 (fp16 KV) and
#     latency-hls2-nuq2 (2-bit KV) at 4k/32k, batch 1, with the per-kernel breakdown at 32k;
#  3. the Mixtral shape with latency-hls2-nuq2 at the same points (the "% of floor Mixtral's reaches" reference);
#  4. the bf16 model per layer (212 GB does not fit one GPU: bench_layers at 4 and 12 layers, the difference);
#  5. llama.cpp's glm4moe at Q2_K on the same depths, then speedup_vs_llamacpp attached to the batch-1 rows.
# Outputs land in OUT_DIR as they are made, so a call cut by its limit keeps what ran (6 files).
# Usage, from the repo root:  [PEER=0] bash benchmarks/gpu_glm.sh OUT_DIR        (~8 min on one H100/H200)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_glm.sh OUT_DIR}
mkdir -p "$OUT" /tmp/peer
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
LOG="$OUT/run.log"
T0=$SECONDS
if [ "${PEER:-1}" = 1 ]; then
  nice -n 10 bash benchmarks/peers/llamacpp_peer.sh /tmp/peer build > /tmp/peer/build.out 2>&1 &
  BUILD=$!
fi
LAT=(--contexts 4096,32768 --batches 1 --prefill none --steps 30 --no-peer)
timeout 300 python3 -m benchmarks.bench_latency --out "$OUT/latency_glm_4_5_air.json" --shapes glm-4.5-air \
  --recipes moec/recipes/experts-hls2.yaml moec/recipes/latency-hls2-nuq2.yaml "${LAT[@]}" --budget 240 \
  > /tmp/peer/glm.log 2>&1
echo "glm-4.5-air rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; tail -12 /tmp/peer/glm.log >> "$LOG"
timeout 120 python3 -m benchmarks.bench_latency --out "$OUT/latency_mixtral_ref.json" --shapes mixtral-8x7b \
  --recipes moec/recipes/latency-hls2-nuq2.yaml "${LAT[@]}" --no-breakdown --budget 60 > /tmp/peer/mix.log 2>&1
echo "mixtral reference rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; tail -5 /tmp/peer/mix.log >> "$LOG"
timeout 150 python3 -m benchmarks.bench_layers --out "$OUT/layers_glm_4_5_air_bf16.json" --shape glm-4.5-air \
  --bf16 --layers 4,12 --steps 30 > /tmp/peer/layers.log 2>&1
echo "bf16 per layer rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; grep -E "per layer|Error" /tmp/peer/layers.log >> "$LOG"
if [ "${PEER:-1}" = 1 ]; then
  wait $BUILD; echo "llama-bench build rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; tail -3 /tmp/peer/build.out >> "$LOG"
  timeout $((570 - SECONDS + T0)) bash benchmarks/peers/llamacpp_peer.sh /tmp/peer glm-4.5-air 2>&1 | tee -a "$LOG"
  cp /tmp/peer/llama_bench_glm-4.5-air.json "$OUT/" 2>/dev/null
  [ -f "$OUT/llama_bench_glm-4.5-air.json" ] && python3 -m benchmarks.peers.speedup_vs_llamacpp \
    "$OUT/latency_glm_4_5_air.json" "$OUT" "$OUT/latency_glm_4_5_air.json" 2>&1 | tee -a "$LOG"
fi
echo "done at $((SECONDS - T0)) s" | tee -a "$LOG"
