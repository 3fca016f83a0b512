#!/usr/bin/env bash
# The shortest GPU call that can carry a moec/ change (~4 min on one H100): the GPU smoke of this tree, then DeepSeek
# decode rows (batch 1, 4k/32k, 30 steps, experts-hls2 and latency-hls2-lin4 from this tree's recipe files) on this
# tree (V2-Lite and V3 at 8 layers) and on BASE_DIR (V2-Lite), and compare_latency between the two.
# Usage, from the repo root on the GPU machine:  bash benchmarks/studies/gpu_smoke_deepseek_rows.sh BASE_DIR OUT_DIR
# (carry BASE_DIR from scripts/base_tree.sh; the rows come after the smoke, so a call cut short keeps the smoke)
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:?usage: gpu_smoke_deepseek_rows.sh BASE_DIR OUT_DIR}; OUT=${2:?usage: gpu_smoke_deepseek_rows.sh BASE_DIR OUT_DIR}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
PYTHONPATH=$PWD bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 > "$OUT/logs/smoke.log" 2>&1
echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke.log"
ARGS=(--contexts 4096,32768 --batches 1 --prefill none --steps 30 --no-peer --no-breakdown
      --recipes "$PWD/moec/recipes/experts-hls2.yaml" "$PWD/moec/recipes/latency-hls2-lin4.yaml")
PYTHONPATH=$PWD timeout 100 python3 -m benchmarks.bench_latency --out "$OUT/latency_new.json" \
  --shapes deepseek-v2-lite,deepseek-v3@8 "${ARGS[@]}" > "$OUT/logs/new.log" 2>&1
echo "this tree rc=$? at $((SECONDS - T0)) s"
(cd "$BASE" && PYTHONPATH=$PWD timeout 70 python3 -m benchmarks.bench_latency --out "$OUT/latency_base.json" \
  --shapes deepseek-v2-lite "${ARGS[@]}" > "$OUT/logs/base.log" 2>&1)
echo "base rc=$? at $((SECONDS - T0)) s"
PYTHONPATH=$PWD python3 -m benchmarks.compare_latency "$OUT/latency_base.json" "$OUT/latency_new.json" --tol 0.03
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
