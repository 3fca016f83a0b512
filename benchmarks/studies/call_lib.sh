# Sourced by the GPU call scripts (bash, from the repo root, OUT set): the helpers they share.
#   left                         seconds left before END (default 560) since the script's start (T0)
#   lat NAME SHAPE RECIPES [ARGS]  bench_latency at 4k and 32k, batch 1, 30 steps -> OUT/latency_NAME.json
#   ab SWITCH VAR=VALUE SHAPES...  lat with one switch's variable set, per shape: glm (GLM-4.5-Air
#                                latency-hls2-nuq2-lin4), v2lite (DeepSeek-V2-Lite experts-hls2 with its bf16 peer),
#                                gptoss, mixtral (experts-hls2) -> OUT/latency_<shape>_SWITCH.json
#   llama_glm MIN_LEFT           wait (while more than MIN_LEFT s are left) for peer_bg.sh's build and GGUF, then
#                                llama-bench on the GLM-4.5-Air GGUF at depths 4096 and 32768 -> OUT/llama_bench_*.json
#   decide_smoke_rows MIN_LEFT   after the A/B: `fp4h_flip --decide-switches` flips this copy, the GPU smoke on it
#                                (OUT/gpu_smoke_h200.json), llama_glm MIN_LEFT, then the rows of issues 35 and 36 on
#                                the smoked tree: GLM-4.5-Air nuq2-lin4 and lin4 (llama.cpp attached), Mixtral,
#                                gpt-oss and DeepSeek-V2-Lite experts-hls2 (the last two with breakdowns)
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
END=${END:-560}
left() { echo $(( END - (SECONDS - T0) )); }
lat() {
  local name=$1 shape=$2 recipes=$3; shift 3
  [ "$(left)" -lt 40 ] && { echo "$name: no time left"; return; }
  timeout 120 python3 -m benchmarks.bench_latency --out "$OUT/latency_$name.json" --shapes "$shape" \
    --recipes $(for r in $recipes; do echo "moec/recipes/$r.yaml"; done) --contexts 4096,32768 --batches 1 \
    --prefill none --steps 30 --budget 100 "$@" > "$OUT/logs/lat_$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - T0)) s"; grep -E "│ .* │" "$OUT/logs/lat_$name.log" | cut -c1-150
}
ab() {
  local sw=$1 var=$2 S; shift 2
  for S in "$@"; do
    (export "${var?}"
     case $S in
       glm) lat "glm_$sw" glm-4.5-air latency-hls2-nuq2-lin4 --no-peer --no-breakdown ;;
       v2lite) lat "v2lite_$sw" deepseek-v2-lite experts-hls2 --no-breakdown ;;
       gptoss) lat "gptoss_$sw" gpt-oss-120b experts-hls2 --no-peer --no-breakdown ;;
       mixtral) lat "mixtral_$sw" mixtral-8x7b experts-hls2 --no-peer --no-breakdown ;;
     esac)
  done
}
llama_glm() {
  while { kill -0 "$BUILD" || kill -0 "$GGUF"; } 2> /dev/null && [ "$(left)" -gt "$1" ]; do sleep 5; done
  tail -1 "$OUT/logs/gguf.log"
  if ! kill -0 "$GGUF" 2> /dev/null && [ -x /tmp/lc/build/bin/llama-bench ] && [ -f /tmp/glm-4.5-air.gguf ]; then
    timeout 80 /tmp/lc/build/bin/llama-bench -m /tmp/glm-4.5-air.gguf -ngl 99 -fa 1 -p 0 -n 64 \
      -d 4096,32768 -ctk f16 -ctv f16 -r 2 -o json > "$OUT/llama_bench_glm-4.5-air.json" 2> "$OUT/logs/bench_glm.err"
    echo "llama-bench glm rc=$? at $((SECONDS - T0)) s"
  else
    echo "no llama.cpp row: the build or the GGUF not done at $((SECONDS - T0)) s"; kill "$BUILD" "$GGUF" 2> /dev/null
  fi
  rm -f /tmp/glm-4.5-air.gguf
}
decide_smoke_rows() {
  python3 -m benchmarks.studies.fp4h_flip --decide-switches "$OUT" 2>&1 | grep -E "on$|off$"
  timeout 300 bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 > "$OUT/logs/smoke.log" 2>&1
  echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke.log"
  llama_glm "$1"
  lat glm glm-4.5-air "latency-hls2-nuq2-lin4 latency-hls2-lin4" --no-peer --no-breakdown
  [ -s "$OUT/llama_bench_glm-4.5-air.json" ] && python3 -m benchmarks.peers.speedup_vs_llamacpp \
    "$OUT/latency_glm.json" "$OUT" "$OUT/latency_glm.json" 2>&1 | tail -4
  lat mixtral mixtral-8x7b experts-hls2 --no-peer --no-breakdown
  lat gptoss gpt-oss-120b experts-hls2 --no-peer
  lat v2lite deepseek-v2-lite experts-hls2
}
