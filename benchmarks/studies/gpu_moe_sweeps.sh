#!/usr/bin/env bash
# One GPU call (~7 min) of MoE decode launch sweeps on the shapes the shipped configs were never swept on, data only
# (no config written): the 2-bit prmt path (experts-hls2) on gpt-oss-120b and GLM-4.5-Air's routed experts at batch 1
# (the prmt slot was swept on Mixtral and Qwen3: moe_decode_sweep_h200.json), then the fp4 slot on gpt-oss-120b's
# mxfp4 experts with the fp16x2 kernels (MOEC_FP4H=1). Each writes its JSON as it goes, so a cut call keeps its rows.
# Usage, from the repo root on the GPU machine:  bash benchmarks/studies/gpu_moe_sweeps.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: gpu_moe_sweeps.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
timeout 330 python3 -m benchmarks.sweep_moe_decode --kind hls2 --shapes gpt-oss-120b,glm-4.5-air --batches 1 \
  --budget 300 --out "$OUT/moe_decode_sweep_hls2_oss_glm.json" > "$OUT/sweep_hls2.log" 2>&1
echo "hls2 sweep rc=$? at $((SECONDS - T0)) s"; grep -E "^best" "$OUT/sweep_hls2.log"
MOEC_FP4H=1 timeout $(( 570 - (SECONDS - T0) )) python3 -m benchmarks.sweep_moe_decode --kind mxfp4 \
  --shapes gpt-oss-120b --batches 1 --budget $(( 540 - (SECONDS - T0) )) --out "$OUT/moe_decode_sweep_mxfp4_fp4h.json" \
  > "$OUT/sweep_mxfp4.log" 2>&1
echo "mxfp4 sweep rc=$? at $((SECONDS - T0)) s"; grep -E "^best" "$OUT/sweep_mxfp4.log"
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
