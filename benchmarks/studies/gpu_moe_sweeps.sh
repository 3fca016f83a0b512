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
# SMOKE=1: the GPU smoke first (OUT/gpu_smoke_h200.json; the build runs beside it). SWEEPS=0: no sweeps. ROWS=1: after
# the rest, the rows of the %-of-floor targets on the shipped defaults (DeepSeek-V2-Lite experts-hls2 with its bf16
# peer, Mixtral-8x7B and gpt-oss-120b experts-hls2, GLM-4.5-Air latency-hls2-nuq2-lin4; 4k/32k) -> latency_rows_*.json.
# The next session's first call: SMOKE=1 PEER=1 SWEEPS=0 (~7 min); then ROWS=1 SWEEPS=0, then the sweeps.
# Usage, from the repo root on the GPU machine:
#   [SMOKE=1] [PEER=1] [SWEEPS=0] [ROWS=1] bash benchmarks/studies/gpu_moe_sweeps.sh OUT_DIR
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
if [ -n "${SMOKE:-}" ]; then
  timeout 300 bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 > "$OUT/logs/smoke.log" 2>&1
  echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke.log"
fi
ROWS_KEEP=$([ -n "${ROWS:-}" ] && echo 300 || echo 0)
KEEP=$(( KEEP + ROWS_KEEP ))
B1=$(( $(left) * 3 / 5 ))
if [ "${SWEEPS:-1}" != 0 ] && [ "$B1" -ge 60 ]; then
  timeout $(( B1 + 30 )) python3 -m benchmarks.sweep_moe_decode --kind hls2 --batches 1 \
    --shapes gpt-oss-120b,glm-4.5-air,deepseek-v2-lite --budget "$B1" --out "$OUT/moe_decode_sweep_hls2_moe3.json" \
    > "$OUT/logs/sweep_hls2.log" 2>&1
  echo "hls2 sweep rc=$? at $((SECONDS - T0)) s"; grep -E "^best" "$OUT/logs/sweep_hls2.log"
fi
if [ "${SWEEPS:-1}" != 0 ] && [ "$(left)" -gt 60 ]; then
  MOEC_FP4H=1 timeout $(( $(left) )) python3 -m benchmarks.sweep_moe_decode --kind mxfp4 --shapes gpt-oss-120b \
    --batches 1 --budget $(( $(left) - 30 )) --out "$OUT/moe_decode_sweep_mxfp4_fp4h.json" > "$OUT/logs/sweep_mxfp4.log" 2>&1
  echo "mxfp4 sweep rc=$? at $((SECONDS - T0)) s"; grep -E "^best" "$OUT/logs/sweep_mxfp4.log"
fi
if [ -n "${PEER:-}" ]; then
  KEEP=$ROWS_KEEP
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
if [ -n "${ROWS:-}" ]; then  # each row only where it ends before END
  KEEP=0
  row() {  # row NAME LIMIT SHAPE RECIPE [BENCH_ARGS...]
    local name=$1 limit=$2 shape=$3 recipe=$4; shift 4
    [ "$(left)" -lt "$limit" ] && { echo "$name: no time left"; return; }
    timeout "$limit" python3 -m benchmarks.bench_latency --out "$OUT/latency_rows_$name.json" --shapes "$shape" \
      --recipes "moec/recipes/$recipe.yaml" --contexts 4096,32768 --batches 1 --prefill none --steps 30 \
      --budget $(( limit - 20 )) "$@" > "$OUT/logs/rows_$name.log" 2>&1
    echo "$name rc=$? at $((SECONDS - T0)) s"
  }
  row v2lite 100 deepseek-v2-lite experts-hls2
  row mixtral 70 mixtral-8x7b experts-hls2 --no-peer --no-breakdown
  row gptoss 80 gpt-oss-120b experts-hls2 --no-peer
  row glm 90 glm-4.5-air latency-hls2-nuq2-lin4 --no-peer --no-breakdown
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
