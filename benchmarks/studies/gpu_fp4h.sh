#!/usr/bin/env bash
# One GPU call (~8 min on one H100 or H200) for the fp4 experts' fp16x2 MoE decode kernels (moec/kernels/fp4_h2.py)
# and the router on the dense route, ending with a smoke on the tree their evidence chose:
#   1. the kernels against moe_decode_ref and the fp32 word path (gpu_smoke.check_fp4h_moe alone) -> fp4h_check.json;
#   2. the step's A/B: gpt-oss-120b's first 12 layers, experts-mxfp4, 4k/32k batch 1: MOEC_FP4H=0 (the fp32 word
#      GEMV), 1 (with the breakdown), then 1 with MOEC_DENSE_GEMV_ROUTER=1 -> latency_fp4h0/fp4h1/fp4h1_router.json;
#   3. bench_dense_gemv on the router shapes (cuBLAS against the tl GEMV of the dense route) -> dense_gemv_routers.json;
#   V2LITE=1: DeepSeek-V2-Lite experts-hls2 (and its bf16 peer) with MOEC_MLA_UV=0 (cuBLAS's bmm) then 1 (mla_uv)
#      -> latency_v2lite_uv0/uv1.json;
#   4. fp4h_flip.py --decide: each switch (fp4_h2.ON_BY_DEFAULT, qlinear.dense_gemv.router, model.MLA_UV_DEFAULT)
#      turned on in this copy where its evidence holds -> flip.json (`fp4h_flip --apply ...` makes the same edits in
#      the checkout);
#   5. SMOKE=1: the GPU smoke on that tree (OUT/gpu_smoke_h200.json, kept out of the archive); the llama.cpp peer
#      is gpu_moe_sweeps.sh PEER=1's;
#   6. SWEEP=1: the fp4 launch slot's sweep (sweep_moe_decode --kind mxfp4 --write-config OUT/cfg) and the step with
#      its winner (latency_fp4h1_swept.json).
# END=S (default 575): no step starts that would not end before it. OUT ends with records.tgz, logs.tgz and the smoke.
# Usage, from the repo root on the GPU machine:  [SMOKE=1] [V2LITE=1] [SWEEP=1] bash benchmarks/studies/gpu_fp4h.sh OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: gpu_fp4h.sh OUT_DIR}
mkdir -p "$OUT/logs" "$OUT/cfg"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
left() { echo $(( ${END:-575} - (SECONDS - T0) )); }
timeout 150 python3 -c "
import json, sys
from benchmarks.gpu_smoke import check_fp4h_moe
r = check_fp4h_moe('cuda')
json.dump(r, open(sys.argv[1], 'w'), indent=1)
for x in r: print(x['check'], x['ok'], x.get('max_rel_err'), x.get('error'))
sys.exit(0 if all(x['ok'] for x in r) else 1)" "$OUT/fp4h_check.json" > "$OUT/logs/check.log" 2>&1
echo "check rc=$? at $((SECONDS - T0)) s"; tail -6 "$OUT/logs/check.log"
ARGS=(--shapes gpt-oss-120b@12 --no-peer --recipes moec/recipes/experts-mxfp4.yaml --contexts 4096,32768 --batches 1
      --prefill none --steps 30 --budget 100)
lat() {  # lat NAME LIMIT FP4H ROUTER CONFIG_DIR [BENCH_ARGS...]: one bench_latency run with those switches
  local name=$1 limit=$2 fp4h=$3 router=$4 cfg=$5; shift 5
  [ "$(left)" -lt "$limit" ] && { echo "$name: no time left"; return; }
  MOEC_FP4H=$fp4h MOEC_DENSE_GEMV_ROUTER=$router MOEC_KERNEL_CONFIG_DIR=$cfg timeout "$limit" \
    python3 -m benchmarks.bench_latency --out "$OUT/latency_$name.json" "${ARGS[@]}" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "$name rc=$? at $((SECONDS - T0)) s"; grep -E "ms|Error" "$OUT/logs/$name.log" | tail -3
}
NOCFG=$OUT/nocfg  # an empty config dir: the shipped configs
mkdir -p "$NOCFG"
lat fp4h0 ${LIM0:-100} 0 0 "$NOCFG" --no-breakdown
lat fp4h1 ${LIM1:-120} 1 0 "$NOCFG"
lat fp4h1_router ${LIM0:-100} 1 1 "$NOCFG" --no-breakdown
if [ -n "${V2LITE:-}" ] && [ "$(left)" -gt 420 ]; then  # MLA's absorbed output product: cuBLAS's bmm, then mla_uv
  for v in 0 1; do
    MOEC_MLA_UV=$v timeout 100 python3 -m benchmarks.bench_latency --out "$OUT/latency_v2lite_uv$v.json" \
      --shapes deepseek-v2-lite --recipes moec/recipes/experts-hls2.yaml --contexts 4096,32768 --batches 1 \
      --prefill none --steps 30 --budget 80 $([ $v = 0 ] && echo --no-breakdown) > "$OUT/logs/v2lite_uv$v.log" 2>&1
    echo "v2lite uv=$v rc=$? at $((SECONDS - T0)) s"; grep -E "ms|Error" "$OUT/logs/v2lite_uv$v.log" | tail -4
  done
fi
if [ "$(left)" -gt 300 ]; then  # the router shapes: cuBLAS against the tl GEMV
  timeout 45 python3 -m benchmarks.bench_dense_gemv --budget 30 --shapes gpt-oss-router,glm-router,v3-router,v2lite-router \
    --out "$OUT/dense_gemv_routers.json" > "$OUT/logs/dense_gemv.log" 2>&1
  echo "dense_gemv routers rc=$? at $((SECONDS - T0)) s"; tail -5 "$OUT/logs/dense_gemv.log"
fi
python3 -m benchmarks.studies.fp4h_flip --decide "$OUT" 2>&1 | tee "$OUT/logs/flip.log"
if [ -n "${SMOKE:-}" ]; then  # the smoke on the tree the flips left
  timeout $(( $(left) - 5 < 330 ? $(left) - 5 : 330 )) bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 \
    > "$OUT/logs/smoke.log" 2>&1
  echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke.log"; bash scripts/source_tree.sh
fi
if [ -n "${SWEEP:-}" ] && [ "$(left)" -gt 200 ]; then
  timeout $(( $(left) - 120 < 200 ? $(left) - 120 : 200 )) python3 -m benchmarks.sweep_moe_decode --kind mxfp4 \
    --shapes gpt-oss-120b --batches 1 --budget 150 --out "$OUT/moe_decode_sweep_mxfp4.json" \
    --write-config "$OUT/cfg" > "$OUT/logs/sweep.log" 2>&1
  echo "sweep rc=$? at $((SECONDS - T0)) s"; grep -E "^best|wrote" "$OUT/logs/sweep.log"
  ls "$OUT"/cfg/*.json > /dev/null 2>&1 && lat fp4h1_swept 100 1 0 "$OUT/cfg" --no-breakdown
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs nocfg
 recs=$(ls *.json 2>/dev/null | grep -v '^gpu_smoke_h200.json$')
 tar czf records.tgz $recs cfg && rm -rf $recs cfg)
