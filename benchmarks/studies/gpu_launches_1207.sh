#!/usr/bin/env bash
# The twelfth session's second GPU call (~9 min): three launch-count switches decided, the smoke on the resulting
# tree, then the rows of issues 35 and 36 on that tree, GLM-4.5-Air against llama.cpp in the same call.
#   0. in the background: llama-bench built (carry gpu/lcpp) and the random GLM-4.5-Air Q2_K GGUF written;
#   1. (none: the first call's bench_mla_attention is not repeated)
#   2. the step as shipped, then with each switch's variable: MOEC_GEMV_EARLY=1 (the dense GEMV's weights loaded
#      ahead of the PDL wait: DeepSeek-V2-Lite experts-hls2 with its bf16 peer, GLM-4.5-Air latency-hls2-nuq2-lin4,
#      gpt-oss-120b experts-hls2), MOEC_ROUTE_IN_GEMV=1 (the router's GEMV routes in its epilogue:
#      V2-Lite, GLM, gpt-oss), MOEC_ROUTER_IN_SHARED=1 (V2-Lite), and all three together (V2-Lite) ->
#      `fp4h_flip --decide-switches` turns on, in this copy, each switch that wins;
#   3. the GPU smoke on this tree (OUT/gpu_smoke_h200.json);
#   4. llama-bench on the GLM GGUF (depths 4096, 32768);
#   5. the rows on the smoked tree: GLM-4.5-Air latency-hls2-nuq2-lin4 and latency-hls2-lin4 (llama.cpp attached),
#      Mixtral-8x7B, gpt-oss-120b and DeepSeek-V2-Lite experts-hls2 (V2-Lite with its bf16 peer and breakdowns);
#   6. pack_out.sh: the smoke, the flips and the final rows kept, the rest in rest.tgz.
# Usage, from the repo root on the GPU machine: bash benchmarks/studies/gpu_launches_1207.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: gpu_launches_1207.sh OUT_DIR}
END=${END:-550}
source benchmarks/studies/call_lib.sh
source benchmarks/peers/peer_bg.sh glm-4.5-air  # sets BUILD and GGUF
ab base MOEC_AB=base v2lite glm gptoss
ab early MOEC_GEMV_EARLY=1 v2lite glm gptoss
ab route_in_gemv MOEC_ROUTE_IN_GEMV=1 v2lite glm gptoss
ab router_in_shared MOEC_ROUTER_IN_SHARED=1 v2lite
(export MOEC_GEMV_EARLY=1 MOEC_ROUTE_IN_GEMV=1 MOEC_ROUTER_IN_SHARED=1
 lat v2lite_all3 deepseek-v2-lite experts-hls2 --no-breakdown)
decide_smoke_rows 130
bash benchmarks/pack_out.sh "$OUT" gpu_smoke_h200.json flip_switches.json latency_glm.json latency_mixtral.json \
  latency_gptoss.json latency_v2lite.json
