#!/usr/bin/env bash
# The eleventh session's last GPU call (~9 min): three switches decided, the smoke on the resulting tree,
# then every %-of-floor and peer row of issues 35 and 36 on that tree, GLM-4.5-Air against llama.cpp in the same call.
#   0. in the background: llama-bench built (carry gpu/lcpp) and the random GLM-4.5-Air Q2_K GGUF written;
#   1. the step as shipped, then with each switch's variable (MOEC_ROUTER_BLOCK_O=1, MOEC_DENSE_LEAST_PADDING=1,
#      MOEC_NORM_PAIRS=1 after norm_pairs_check.py) on the rows it can move (GLM-4.5-Air latency-hls2-nuq2-lin4,
#      DeepSeek-V2-Lite experts-hls2 with its bf16 peer, gpt-oss-120b experts-hls2) -> `fp4h_flip --decide-switches`
#      turns on, in this copy, each switch that wins;
#   2. the GPU smoke on this tree (OUT/gpu_smoke_h200.json);
#   3. llama-bench on the GLM GGUF (depths 4096, 32768);
#   4. the rows on the smoked tree: GLM-4.5-Air latency-hls2-nuq2-lin4 and latency-hls2-lin4 (llama.cpp attached),
#      Mixtral-8x7B, gpt-oss-120b and DeepSeek-V2-Lite experts-hls2 (V2-Lite with its bf16 peer), with breakdowns.
# Usage, from the repo root on the GPU machine: bash benchmarks/studies/gpu_final_1207.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: gpu_final_1207.sh OUT_DIR}
END=${END:-560}
source benchmarks/studies/call_lib.sh
source benchmarks/peers/peer_bg.sh glm-4.5-air  # sets BUILD and GGUF
ab base MOEC_AB=base glm v2lite gptoss
ab router_rows MOEC_ROUTER_BLOCK_O=1 glm v2lite gptoss
ab dense_pad MOEC_DENSE_LEAST_PADDING=1 v2lite
timeout 60 python3 -m benchmarks.studies.norm_pairs_check --out "$OUT/norm_pairs_check.json" > "$OUT/logs/pairs.log" 2>&1
echo "norm_pairs_check rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/pairs.log" | cut -c1-300
ab norm_pairs MOEC_NORM_PAIRS=1 glm v2lite gptoss
decide_smoke_rows 150
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
