#!/usr/bin/env bash
# One GPU call (~9 min on one H100) for two changes at once, no smoke (the smoke comes in the next call, on the tree
# that keeps what this one measures):
#   1. the gate of the patched tree against BASE_DIR on the rows the patches can move: GLM-4.5-Air's lin4 (the Gluon
#      4-bit GEMV's warps per shape) and gpt-oss-120b's first 12 layers with experts-mxfp4 (the fp4 word GEMV), via
#      gpu_session_gate.sh with its other steps off;
#   2. the bf16 projections: bench_dense_gemv (cuBLAS against qlinear's GEMV per shape), then the step with the fused
#      decode's plain projections through qlinear's GEMV and without (MOEC_DENSE_GEMV=1 / 0, runtime/decode.py
#      _DenseGEMV): DeepSeek-V2-Lite experts-hls2 with its bf16 peer, gpt-oss-120b experts-hls2, 4k/32k batch 1.
# OUT ends with records.tgz (every JSON) and logs.tgz (and gpu_smoke_h200.json with SMOKE=1: the smoke first, for a call
# that must stand alone; SKIP_GPTOSS=1 leaves gpt-oss out of step 2's A/B, AB_DEADLINE=S starts no A/B pass after S s;
# SKIP_GATE=1 leaves out step 1 and bench_dense_gemv (a second call: the A/B alone); FLIP_SMOKE=1 after the A/B turns
# the launch config's qlinear.dense_gemv.on to true when no row got slower than x1.01 and one got x0.97 or faster,
# then runs the GPU smoke on that tree (OUT/gpu_smoke_h200.json; the same edit here, benchmarks/studies/
# dense_gemv_flip.py, gives the same source_tree)).
# Usage, from the repo root on the GPU machine:  bash benchmarks/studies/gpu_dense_route.sh BASE_DIR OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:?usage: gpu_dense_route.sh BASE_DIR OUT_DIR}; OUT=${2:?usage: gpu_dense_route.sh BASE_DIR OUT_DIR}
mkdir -p "$OUT/gate"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
if [ -n "${SMOKE:-}" ]; then  # SMOKE=1: the GPU smoke first (OUT/gpu_smoke_h200.json), for a call that must stand alone
  timeout 300 bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 > "$OUT/smoke.log" 2>&1
  echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/smoke.log"
fi
mkdir -p "$OUT/logs"; [ -f "$OUT/smoke.log" ] && mv "$OUT/smoke.log" "$OUT/logs/"
if [ -z "${SKIP_GATE:-}" ]; then
  SKIP_SMOKE=1 SKIP_MLA=1 SKIP_HLS2=1 SKIP_LAYERS=1 SKIP_V2LITE=1 EXTRA="gpt-oss-120b@12:experts-mxfp4" \
    timeout 280 bash benchmarks/studies/gpu_session_gate.sh "$BASE" "$OUT/gate"
  echo "gate done at $((SECONDS - T0)) s"
  timeout 110 python3 -m benchmarks.bench_dense_gemv --budget 85 --out "$OUT/dense_gemv.json" \
    --shapes gpt-oss-qkv,gpt-oss-o,v2lite-q,v2lite-o,v2lite-shared-gu,v2lite-shared-down,v2lite-kv-a,glm-qkv,glm-o \
    > "$OUT/logs/dense_gemv.log" 2>&1
  echo "dense_gemv rc=$? at $((SECONDS - T0)) s"; tail -9 "$OUT/logs/dense_gemv.log"
fi
ARGS=(--contexts 4096,32768 --batches 1 --prefill none --steps 30 --no-breakdown --recipes moec/recipes/experts-hls2.yaml)
for v in 0 1; do
  [ $((SECONDS - T0)) -gt "${AB_DEADLINE:-420}" ] && { echo "dense=$v: no time left (the archives come first)"; break; }
  MOEC_DENSE_GEMV=$v timeout 110 python3 -m benchmarks.bench_latency --out "$OUT/latency_v2lite_dense$v.json" \
    --shapes deepseek-v2-lite --budget 90 "${ARGS[@]}" > "$OUT/logs/v2lite_dense$v.log" 2>&1
  echo "v2lite dense=$v rc=$? at $((SECONDS - T0)) s"
  [ -n "${SKIP_GPTOSS:-}" ] && continue
  MOEC_DENSE_GEMV=$v timeout 80 python3 -m benchmarks.bench_latency --out "$OUT/latency_gptoss_dense$v.json" \
    --shapes gpt-oss-120b --budget 60 --no-peer "${ARGS[@]}" > "$OUT/logs/gptoss_dense$v.log" 2>&1
  echo "gpt-oss dense=$v rc=$? at $((SECONDS - T0)) s"
done
for m in v2lite gptoss; do  # the route's A/B: cuBLAS (dense0) -> qlinear's GEMV (dense1), per row
  [ -f "$OUT/latency_${m}_dense1.json" ] && python3 -m benchmarks.compare_latency "$OUT/latency_${m}_dense0.json" \
    "$OUT/latency_${m}_dense1.json" --tol 0.03
done
if [ -n "${FLIP_SMOKE:-}" ] && python3 -m benchmarks.studies.dense_gemv_flip --decide "$OUT"/latency_*_dense[01].json; then
  timeout 300 bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 > "$OUT/logs/smoke_on.log" 2>&1
  echo "smoke (route on) rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke_on.log"
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs
 recs=$(ls *.json 2>/dev/null | grep -v '^gpu_smoke_h200.json$')
 tar czf records.tgz $recs gate && rm -rf $recs gate)
