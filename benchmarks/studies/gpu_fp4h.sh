#!/usr/bin/env bash
# One GPU call (~8 min on one H100 or H200) for the fp4 experts' fp16x2 MoE decode kernels (moec/kernels/fp4_h2.py):
#   1. the kernels against moe_decode_ref and the fp32 word path (gpu_smoke.check_fp4h_moe alone) -> fp4h_check.json;
#   2. the step's A/B: gpt-oss-120b's first 12 layers, experts-mxfp4, MOEC_FP4H=0 (the fp32 word GEMV) then 1,
#      4k/32k batch 1 -> latency_fp4h{0,1}.json (1 with the breakdown), compared by compare_latency;
#   3. SWEEP=1: the fp4 launch slot's sweep on the fp16x2 kernels (sweep_moe_decode --kind mxfp4, gpt-oss-120b, batch 1),
#      its winner written to OUT/cfg/<device>.json -> moe_decode_sweep_mxfp4.json;
#   4. SWEEP=1: the step again with that config (MOEC_KERNEL_CONFIG_DIR=OUT/cfg) -> latency_fp4h1_swept.json;
#   5. bench_dense_gemv on the router shapes (cuBLAS against the tl GEMV of the dense route) -> dense_gemv_routers.json.
# Order: 1, the MOEC_FP4H=1 row, SMOKE=1: the GPU smoke (OUT/gpu_smoke_h200.json), the MOEC_FP4H=0 row, 3-5 (each only
# where it ends before END); SWEEP=1 runs steps 3-4 (left out by default); SMOKE_SUBSET=1 after the baseline row: the
# smoke's kernel checks and experts-hls2 / experts-mxfp4 on smoke-mla, smoke-glm and smoke-oss (gpu_smoke_subset.json),
# with both new paths on (MOEC_FP4H=1, MOEC_DENSE_GEMV_ROUTER=1; the shipped defaults keep them off until measured). END=S (default 570): no step starts that would not end before it. OUT ends with records.tgz and
# logs.tgz (and the smoke record).
# Usage, from the repo root on the GPU machine:  bash benchmarks/studies/gpu_fp4h.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: gpu_fp4h.sh OUT_DIR}
mkdir -p "$OUT/logs" "$OUT/cfg"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
left() { echo $(( ${END:-570} - (SECONDS - T0) )); }
timeout 150 python3 -c "
import json, sys
from benchmarks.gpu_smoke import check_fp4h_moe
r = check_fp4h_moe('cuda')
json.dump(r, open(sys.argv[1], 'w'), indent=1)
for x in r: print(x['check'], x['ok'], x.get('max_rel_err'), x.get('error'))
sys.exit(0 if all(x['ok'] for x in r) else 1)" "$OUT/fp4h_check.json" > "$OUT/logs/check.log" 2>&1
echo "check rc=$? at $((SECONDS - T0)) s"; cat "$OUT/logs/check.log" | tail -6
ARGS=(--shapes gpt-oss-120b@12 --no-peer --recipes moec/recipes/experts-mxfp4.yaml --contexts 4096,32768 --batches 1
      --prefill none --steps 30 --budget 100)
lat() {  # lat NAME LIMIT FP4H CONFIG_DIR [BENCH_ARGS...]: one bench_latency run, MOEC_FP4H and the config dir set
  local name=$1 limit=$2 fp4h=$3 cfg=$4; shift 4
  [ "$(left)" -lt "$limit" ] && { echo "$name: no time left"; return; }
  MOEC_FP4H=$fp4h MOEC_KERNEL_CONFIG_DIR=$cfg timeout "$limit" python3 -m benchmarks.bench_latency \
    --out "$OUT/latency_$name.json" "${ARGS[@]}" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - T0)) s"
}
NOCFG=$OUT/nocfg  # an empty config dir: the shipped configs
mkdir -p "$NOCFG"
lat fp4h1 ${LIM1:-140} 1 "$NOCFG"
if [ -n "${SMOKE:-}" ]; then  # SMOKE=1: the GPU smoke next (OUT/gpu_smoke_h200.json, kept out of the archive)
  timeout 330 bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 > "$OUT/logs/smoke.log" 2>&1
  echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke.log"
fi
lat fp4h0 ${LIM0:-110} 0 "$NOCFG" --no-breakdown
if [ -n "${SMOKE_SUBSET:-}" ] && [ "$(left)" -gt 60 ]; then  # the routes this change moves: MoE routing, fp4 experts
  MOEC_FP4H=1 MOEC_DENSE_GEMV_ROUTER=1 timeout $(( $(left) - 5 )) python3 -m benchmarks.gpu_smoke --out "$OUT/gpu_smoke_subset.json" --jobs 14 \
    --shapes smoke-mla smoke-glm smoke-oss --recipes experts-hls2 experts-mxfp4 > "$OUT/logs/smoke_subset.log" 2>&1
  echo "smoke subset rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke_subset.log"
fi
[ -f "$OUT/latency_fp4h0.json" ] && python3 -m benchmarks.compare_latency "$OUT/latency_fp4h0.json" \
  "$OUT/latency_fp4h1.json" --tol 0.03
if [ -n "${SWEEP:-}" ] && [ "$(left)" -gt 200 ]; then
  timeout $(( $(left) - 120 < 200 ? $(left) - 120 : 200 )) python3 -m benchmarks.sweep_moe_decode --kind mxfp4 \
    --shapes gpt-oss-120b --batches 1 --budget 150 --out "$OUT/moe_decode_sweep_mxfp4.json" \
    --write-config "$OUT/cfg" > "$OUT/logs/sweep.log" 2>&1
  echo "sweep rc=$? at $((SECONDS - T0)) s"; grep -E "^best|wrote" "$OUT/logs/sweep.log"
fi
[ -n "${SWEEP:-}" ] && ls "$OUT"/cfg/*.json > /dev/null 2>&1 && lat fp4h1_swept 110 1 "$OUT/cfg" --no-breakdown
if [ "$(left)" -gt 45 ]; then  # the routers now on the dense route (decode._route): cuBLAS against the tl GEMV
  timeout 40 python3 -m benchmarks.bench_dense_gemv --budget 30 --shapes gpt-oss-router,glm-router,v3-router,v2lite-router \
    --out "$OUT/dense_gemv_routers.json" > "$OUT/logs/dense_gemv.log" 2>&1
  echo "dense_gemv routers rc=$? at $((SECONDS - T0)) s"; tail -5 "$OUT/logs/dense_gemv.log"
fi
[ -f "$OUT/latency_fp4h1_swept.json" ] && python3 -m benchmarks.compare_latency "$OUT/latency_fp4h1.json" \
  "$OUT/latency_fp4h1_swept.json" --tol 0.03
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs nocfg
 recs=$(ls *.json 2>/dev/null | grep -v '^gpu_smoke_h200.json$')
 tar czf records.tgz $recs cfg && rm -rf $recs cfg)
