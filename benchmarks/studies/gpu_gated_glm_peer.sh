#!/usr/bin/env bash
# One GPU call (~8 min): the shared expert's gated down GEMV measured, and GLM-4.5-Air against llama.cpp in the same call.
#   0. in the background from the start: llama-bench built (peers/llamacpp_peer.sh build; carry gpu/lcpp) and, once
#      its sources are unpacked, the random GLM-4.5-Air Q2_K GGUF written (peers/llamacpp_moe.py, ~45 GB on /tmp);
#   1. benchmarks/studies/gated_down_check.py: the gated GEMV against silu_mul + GEMV (equality and µs);
#   2. the step with MOEC_GATED_DOWN=1 then 0: GLM-4.5-Air latency-hls2-nuq2-lin4 (4-bit shared experts, the Gluon
#      GEMV) with its breakdown, DeepSeek-V2-Lite experts-hls2 with its bf16 peer (bf16 shared experts, the tl GEMV;
#      the bf16 routed experts' sum now rounded in add_rms_norm) and both breakdowns; Mixtral-8x7B experts-hls2 once
#      (the %-of-floor reference of the same call);
#   3. llama-bench on the GLM GGUF (depths 4096, 32768), attached to step 2's GLM rows (speedup_vs_llamacpp).
# Usage, from the repo root on the GPU machine: bash benchmarks/studies/gpu_gated_glm_peer.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: gpu_gated_glm_peer.sh OUT_DIR}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
END=${END:-570}
left() { echo $(( END - (SECONDS - T0) )); }
source benchmarks/peers/peer_bg.sh glm-4.5-air  # sets BUILD and GGUF
timeout 90 python3 -m benchmarks.studies.gated_down_check --out "$OUT/gated_down_check.json" > "$OUT/logs/check.log" 2>&1
echo "check rc=$? at $((SECONDS - T0)) s"; grep -o '"shape.*' "$OUT/logs/check.log"
lat() {  # lat NAME SHAPE RECIPE [BENCH_ARGS...]
  local name=$1 shape=$2 recipe=$3; shift 3
  timeout 120 python3 -m benchmarks.bench_latency --out "$OUT/latency_$name.json" --shapes "$shape" \
    --recipes "moec/recipes/$recipe.yaml" --contexts 4096,32768 --batches 1 --prefill none --steps 30 --budget 100 "$@" \
    > "$OUT/logs/lat_$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - T0)) s"; grep -E "│ .* │" "$OUT/logs/lat_$name.log" | cut -c1-150
}
for G in 1 0; do
  MOEC_GATED_DOWN=$G lat "glm_lin4_gated$G" glm-4.5-air latency-hls2-nuq2-lin4 --no-peer $([ $G = 0 ] && echo --no-breakdown)
  MOEC_GATED_DOWN=$G lat "v2lite_gated$G" deepseek-v2-lite experts-hls2 $([ $G = 0 ] && echo --no-breakdown)
done
lat mixtral mixtral-8x7b experts-hls2 --no-peer --no-breakdown
while kill -0 "$BUILD" 2> /dev/null && [ "$(left)" -gt 150 ]; do sleep 5; done
wait "$BUILD"; echo "llama-bench build rc=$? at $((SECONDS - T0)) s"
while kill -0 "$GGUF" 2> /dev/null && [ "$(left)" -gt 110 ]; do sleep 5; done
tail -2 "$OUT/logs/gguf.log"
if ! kill -0 "$GGUF" 2> /dev/null && [ -x /tmp/lc/build/bin/llama-bench ] && [ -f /tmp/glm-4.5-air.gguf ]; then
  timeout $(( $(left) - 10 )) /tmp/lc/build/bin/llama-bench -m /tmp/glm-4.5-air.gguf -ngl 99 -fa 1 -p 0 -n 64 \
    -d 4096,32768 -ctk f16 -ctv f16 -r 2 -o json > "$OUT/llama_bench_glm-4.5-air.json" 2> "$OUT/logs/bench_glm.err"
  echo "llama-bench glm rc=$? at $((SECONDS - T0)) s"
  python3 -m benchmarks.peers.speedup_vs_llamacpp "$OUT/latency_glm_lin4_gated1.json" "$OUT" \
    "$OUT/latency_glm_lin4_gated1.json" 2>&1 | tail -3
else
  echo "no llama.cpp row: the build or the GGUF not done at $((SECONDS - T0)) s"; kill "$GGUF" 2> /dev/null
fi
rm -f /tmp/glm-4.5-air.gguf
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
