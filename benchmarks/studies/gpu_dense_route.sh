#!/usr/bin/env bash
# One GPU call (at most ~10 min on one H100) for the three prepared patches (benchmarks/studies/README.md):
#   0. SMOKE=1: the GPU smoke first (OUT/gpu_smoke_h200.json), for a call that must stand alone;
#   1. the gate of the patched tree against BASE_DIR on the rows the first two patches can move: GLM-4.5-Air's lin4
#      (the Gluon 4-bit GEMV's warps per shape) and gpt-oss-120b's first 12 layers with experts-mxfp4 (the fp4 word
#      GEMV), via gpu_session_gate.sh with its other steps off (SKIP_GATE=1 leaves it out);
#   2. the bf16 projections route's A/B, the step with the fused decode's plain projections through qlinear's GEMV
#      and without (MOEC_DENSE_GEMV=1 / 0, runtime/decode.py _DenseGEMV): DeepSeek-V2-Lite experts-hls2 with its bf16
#      peer, then gpt-oss-120b experts-hls2 (SKIP_GPTOSS=1 leaves it out), 4k/32k batch 1, each pair only where both
#      runs fit; then bench_dense_gemv (cuBLAS against qlinear's GEMV per shape) where it fits;
#   3. FLIP_SMOKE=1: when dense_gemv_flip.py finds no row slower than x1.01 and one x0.97 or faster, the launch
#      config's qlinear.dense_gemv.on turns true and the smoke reruns on that tree (`dense_gemv_flip --apply` makes
#      the same edit here, so both have one source_tree).
# END=S (default 575) is when the archives must start; no step starts that would not end before it. OUT ends with
# records.tgz (every other JSON), logs.tgz and, with a smoke, gpu_smoke_h200.json.
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
left() { echo $(( ${END:-575} - (SECONDS - T0) )); }  # seconds before the archives must start
if [ -z "${SKIP_GATE:-}" ] && [ "$(left)" -ge 60 ]; then  # (timeout 0 would mean no limit at all)
  SKIP_SMOKE=1 SKIP_MLA=1 SKIP_HLS2=1 SKIP_LAYERS=1 SKIP_V2LITE=1 EXTRA="gpt-oss-120b@12:experts-mxfp4" \
    timeout $(( $(left) - 10 < 280 ? $(left) - 10 : 280 )) bash benchmarks/studies/gpu_session_gate.sh "$BASE" "$OUT/gate"
  echo "gate done at $((SECONDS - T0)) s"
fi
ARGS=(--contexts 4096,32768 --batches 1 --prefill none --steps 30 --no-breakdown --recipes moec/recipes/experts-hls2.yaml)
ab() {  # ab NAME LIMIT BUDGET BENCH_ARGS...: the pair MOEC_DENSE_GEMV=0 then 1, only where both fit
  local name=$1 limit=$2 budget=$3; shift 3
  [ "$(left)" -lt $((2 * limit)) ] && { echo "$name: no time left for its pair (the archives come first)"; return; }
  for v in 0 1; do
    MOEC_DENSE_GEMV=$v timeout "$limit" python3 -m benchmarks.bench_latency --out "$OUT/latency_${name}_dense$v.json" \
      --budget "$budget" "$@" "${ARGS[@]}" > "$OUT/logs/${name}_dense$v.log" 2>&1
    echo "$name dense=$v rc=$? at $((SECONDS - T0)) s"
  done
}
ab v2lite 105 85 --shapes deepseek-v2-lite
[ -z "${SKIP_GPTOSS:-}" ] && ab gptoss 80 60 --shapes gpt-oss-120b --no-peer
if [ "$(left)" -gt 100 ]; then
  timeout $(( $(left) - 10 < 110 ? $(left) - 10 : 110 )) python3 -m benchmarks.bench_dense_gemv --budget 80 \
    --shapes gpt-oss-qkv,gpt-oss-o,v2lite-q,v2lite-o,v2lite-shared-gu,v2lite-shared-down,v2lite-kv-a,glm-qkv,glm-o \
    --out "$OUT/dense_gemv.json" > "$OUT/logs/dense_gemv.log" 2>&1
  echo "dense_gemv rc=$? at $((SECONDS - T0)) s"; tail -9 "$OUT/logs/dense_gemv.log"
fi
for m in v2lite gptoss; do  # the route's A/B: cuBLAS (dense0) -> qlinear's GEMV (dense1), per row
  [ -f "$OUT/latency_${m}_dense1.json" ] && python3 -m benchmarks.compare_latency "$OUT/latency_${m}_dense0.json" \
    "$OUT/latency_${m}_dense1.json" --tol 0.03
done
if [ -n "${FLIP_SMOKE:-}" ] && [ "$(left)" -gt 200 ] && python3 -m benchmarks.studies.dense_gemv_flip --decide "$OUT"/latency_*_dense[01].json; then
  timeout $(( $(left) - 5 )) bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 > "$OUT/logs/smoke_on.log" 2>&1
  echo "smoke (route on) rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke_on.log"
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs
 recs=$(ls *.json 2>/dev/null | grep -v '^gpu_smoke_h200.json$')
 tar czf records.tgz $recs gate && rm -rf $recs gate)
