#!/usr/bin/env bash
# One GPU call (~9.5 min) of MoE decode launch sweeps on the shapes the shipped configs were never swept on, data only
# (no config written), and with PEER=1 the llama.cpp peer of gpt-oss-120b in the same call:
#   0. PEER=1: llama-bench built in the background from the start (peers/llamacpp_peer.sh build; carry gpu/lcpp);
#   1. the 2-bit prmt path (experts-hls2) on gpt-oss-120b's, GLM-4.5-Air's and DeepSeek-V2-Lite's routed experts at
#      batch 1 (the prmt slot was swept on Mixtral and Qwen3: moe_decode_sweep_h200.json) -> moe_decode_sweep_hls2_moe3.json;
#   2. the fp4 slot on gpt-oss-120b's mxfp4 experts on the fp16x2 kernels (MOEC_FP4H=1) -> moe_decode_sweep_mxfp4_fp4h.json;
#   3. PEER=1: gpt-oss-120b's first 12 layers, experts-mxfp4 and experts-hls2 at 4k/32k on the shipped defaults, then
#      llama.cpp MXFP4 and Q2_K on the same layers, attached (speedup_vs_llamacpp -> latency_gpt_oss_120b_peer.json).
# The sweeps write their JSON as they go, so a cut call keeps its rows; the peer's time is kept aside from the start.
# Usage, from the repo root on the GPU machine:  [PEER=1] bash benchmarks/studies/gpu_moe_sweeps.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: gpu_moe_sweeps.sh OUT_DIR}
mkdir -p "$OUT/logs" /tmp/peer
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
KEEP=$([ -n "${PEER:-}" ] && echo 230 || echo 0)  # seconds kept for the peer's steps
left() { echo $(( ${END:-575} - KEEP - (SECONDS - T0) )); }
if [ -n "${PEER:-}" ]; then
  nice -n 10 bash benchmarks/peers/llamacpp_peer.sh /tmp/peer build > "$OUT/logs/build.log" 2>&1 &
  BUILD=$!
fi
B1=$(( $(left) * 3 / 5 ))
timeout $(( B1 + 30 )) python3 -m benchmarks.sweep_moe_decode --kind hls2 --batches 1 \
  --shapes gpt-oss-120b,glm-4.5-air,deepseek-v2-lite --budget "$B1" --out "$OUT/moe_decode_sweep_hls2_moe3.json" > "$OUT/logs/sweep_hls2.log" 2>&1
echo "hls2 sweep rc=$? at $((SECONDS - T0)) s"; grep -E "^best" "$OUT/logs/sweep_hls2.log"
if [ "$(left)" -gt 60 ]; then
  MOEC_FP4H=1 timeout $(( $(left) )) python3 -m benchmarks.sweep_moe_decode --kind mxfp4 --shapes gpt-oss-120b \
    --batches 1 --budget $(( $(left) - 30 )) --out "$OUT/moe_decode_sweep_mxfp4_fp4h.json" > "$OUT/logs/sweep_mxfp4.log" 2>&1
  echo "mxfp4 sweep rc=$? at $((SECONDS - T0)) s"; grep -E "^best" "$OUT/logs/sweep_mxfp4.log"
fi
if [ -n "${PEER:-}" ]; then
  KEEP=0
  timeout 100 python3 -m benchmarks.bench_latency --out "$OUT/latency_gpt_oss_120b_peer.json" --shapes gpt-oss-120b@12 \
    --contexts 4096,32768 --recipes moec/recipes/experts-mxfp4.yaml moec/recipes/experts-hls2.yaml --batches 1 \
    --prefill none --steps 30 --no-peer --no-breakdown --budget 80 > "$OUT/logs/lat.log" 2>&1
  echo "moec rows rc=$? at $((SECONDS - T0)) s"; grep -E "ms" "$OUT/logs/lat.log" | tail -4
  while kill -0 "$BUILD" 2> /dev/null && [ "$(left)" -gt 80 ]; do sleep 5; done
  kill -0 "$BUILD" 2> /dev/null && { echo "llama-bench build not done at $((SECONDS - T0)) s"; kill "$BUILD"; }
  wait "$BUILD"; echo "llama-bench build rc=$? at $((SECONDS - T0)) s"
  for T in MXFP4 Q2_K; do
    [ "$(left)" -lt 70 ] && { echo "$T: no time left"; continue; }
    QTYPE=$T LAYERS=12 timeout $(( $(left) - 5 )) bash benchmarks/peers/llamacpp_peer.sh /tmp/peer gpt-oss-120b \
      >> "$OUT/logs/peer.log" 2>&1
    echo "llama.cpp $T rc=$? at $((SECONDS - T0)) s"; tail -2 "$OUT/logs/peer.log"
  done
  cp /tmp/peer/llama_bench_gpt-oss-120b*.json "$OUT/" 2>/dev/null
  python3 -m benchmarks.peers.speedup_vs_llamacpp "$OUT/latency_gpt_oss_120b_peer.json" "$OUT" \
    "$OUT/latency_gpt_oss_120b_peer.json" 2>&1 | tail -6
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
