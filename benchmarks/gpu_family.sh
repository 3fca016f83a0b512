#!/usr/bin/env bash
# Issue 36 on the GPU machine, one model family per call, SHAPE glm-4.5-air or gpt-oss-120b, in two parts (each
# fits one 10-minute call; ratios are taken within a part):
#   PART=model (default)
#     1. moec's decode latency of the whole model (random weights at its real shape), batch 1, with the per-kernel
#        breakdown at 32k: GLM with experts-hls2 (fp16 KV) and latency-hls2-nuq2 (2-bit KV) at 4k/32k; gpt-oss
#        with experts-mxfp4 (its experts as shipped), experts-hls2 (fp16 KV) and latency-hls2-nuq2 (2-bit KV on the
#        full-attention layers) at 4k/32k/128k (the window layers hold 128 tokens in fp16 rings either way);
#     2. the Mixtral shape with the same first recipe at 4k/32k (the "% of floor Mixtral's reaches" reference);
#     3. the bf16 model per layer (neither fits one GPU in bf16: bench_layers at two layer counts, the difference).
#   PART=peer
#     llama-bench built in the background (peers/llamacpp_peer.sh build; carry gpu/lcpp/src.tgz) while moec times
#     the peer's configuration, then llama.cpp on the same depths and speedup_vs_llamacpp attached: GLM whole, Q2_K
#     against both recipes; gpt-oss at its first 12 layers (the whole model's GGUF would not fit the disk) on both
#     sides, MXFP4 against experts-mxfp4 and Q2_K (Q4_0 on its 2880-input rows) against experts-hls2.
# Outputs land in OUT_DIR as they are made, so a call cut by its limit keeps what ran (at most 6 files).
# Usage, from the repo root:  [PART=model|peer] bash benchmarks/gpu_family.sh SHAPE OUT_DIR    (~8 min a part;
# RECIPES="a b": other recipes of moec/recipes, the peer part times the first two)
set -u
cd "$(dirname "$0")/.."
SHAPE=${1:?usage: gpu_family.sh SHAPE OUT_DIR}; OUT=${2:?usage: gpu_family.sh SHAPE OUT_DIR}
case $SHAPE in
  glm-4.5-air) RECIPES=${RECIPES:-"experts-hls2 latency-hls2-nuq2"}; CTX=4096,32768; LAYERS=4,12; PEER_AT=""; TYPES="Q2_K" ;;
  gpt-oss-120b) RECIPES=${RECIPES:-"experts-mxfp4 experts-hls2 latency-hls2-nuq2"}; CTX=4096,32768,130816; LAYERS=2,8; PEER_AT=12
                TYPES="MXFP4 Q2_K" ;;
  *) echo "gpu_family.sh: SHAPE is glm-4.5-air or gpt-oss-120b, got $SHAPE" >&2; exit 2 ;;
esac
mkdir -p "$OUT" /tmp/peer
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
LOG="$OUT/run.log"; TAG=${SHAPE//[-.]/_}
T0=$SECONDS
LAT=(--batches 1 --prefill none --steps 30 --no-peer)
RFILES=$(for r in $RECIPES; do echo "moec/recipes/$r.yaml"; done)
if [ "${PART:-model}" = model ]; then
  # shellcheck disable=SC2086
  timeout 300 python3 -m benchmarks.bench_latency --out "$OUT/latency_$TAG.json" --shapes "$SHAPE" --contexts "$CTX" \
    --recipes $RFILES "${LAT[@]}" --budget 240 > /tmp/peer/lat.log 2>&1
  echo "$SHAPE rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; tail -14 /tmp/peer/lat.log >> "$LOG"
  timeout 120 python3 -m benchmarks.bench_latency --out "$OUT/latency_mixtral_ref.json" --shapes mixtral-8x7b \
    --contexts 4096,32768 --recipes "moec/recipes/${RECIPES%% *}.yaml" "${LAT[@]}" --no-breakdown --budget 60 \
    > /tmp/peer/mix.log 2>&1
  echo "mixtral reference rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; tail -5 /tmp/peer/mix.log >> "$LOG"
  timeout 150 python3 -m benchmarks.bench_layers --out "$OUT/layers_${TAG}_bf16.json" --shape "$SHAPE" --bf16 \
    --layers "$LAYERS" --steps 30 > /tmp/peer/layers.log 2>&1
  echo "bf16 per layer rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; grep -E "per layer|Error" /tmp/peer/layers.log >> "$LOG"
else
  nice -n 10 bash benchmarks/peers/llamacpp_peer.sh /tmp/peer build > /tmp/peer/build.out 2>&1 &
  BUILD=$!
  AT=${SHAPE}${PEER_AT:+@$PEER_AT}
  # shellcheck disable=SC2086
  timeout 240 python3 -m benchmarks.bench_latency --out "$OUT/latency_${TAG}_peer.json" --shapes "$AT" \
    --contexts 4096,32768 --recipes $(echo "$RFILES" | head -2) "${LAT[@]}" --no-breakdown --budget 180 \
    > /tmp/peer/lat.log 2>&1
  echo "$AT rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; tail -8 /tmp/peer/lat.log >> "$LOG"
  wait $BUILD; echo "llama-bench build rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"; tail -3 /tmp/peer/build.out >> "$LOG"
  for T in $TYPES; do
    QTYPE=$T LAYERS=$PEER_AT timeout $((570 - SECONDS + T0)) bash benchmarks/peers/llamacpp_peer.sh /tmp/peer "$SHAPE" \
      2>&1 | tee -a "$LOG"
    cp /tmp/peer/llama_bench_"$SHAPE"*.json "$OUT/" 2>/dev/null
  done
  python3 -m benchmarks.peers.speedup_vs_llamacpp "$OUT/latency_${TAG}_peer.json" "$OUT" \
    "$OUT/latency_${TAG}_peer.json" 2>&1 | tee -a "$LOG"
fi
echo "done at $((SECONDS - T0)) s" | tee -a "$LOG"
