#!/usr/bin/env bash
# One GPU call (~7 min on one H100) that records a moec/ change for issues 31/32/35/36 on the final tree:
#   1. the GPU smoke (the record a moec/ change must carry: OUT/gpu_smoke_h200.json);
#   2. the latent kernels alone on DeepSeek-V2-Lite's heads (bench_mla_attention, bench_mla_nuq_attention);
#   3. the speed gate: bench_latency, batch 1 at 4k/32k, experts-hls2 on six shapes and GLM's lin4 recipe, on
#      BASE_DIR's tree and this one (compare_latency, ±3%), this tree's rows with the per-kernel breakdown;
#   4. DeepSeek-V2-Lite with its bf16 peer (issue 35's 70%-of-floor bar) and the latent-cache recipe;
#   5. bf16 per layer (bench_layers, the difference of two layer counts) for GLM-4.5-Air and gpt-oss-120b.
# OUT_DIR ends with three files: gpu_smoke_h200.json, records.tgz (every other JSON), logs.tgz.
# Usage, from the repo root on the GPU machine:  bash benchmarks/studies/gpu_session_gate.sh BASE_DIR OUT_DIR
# (carry BASE_DIR from scripts/base_tree.sh; SKIP_SMOKE=1 leaves step 1 out, SKIP_MLA=1 step 2, SKIP_HLS2=1 step 3's six
#  experts-hls2 rows (GLM's lin4 stays), SKIP_V2LITE=1 step 4, SKIP_LAYERS=1 step 5;
#  EXTRA="SHAPE:RECIPE ...": more gated rows after step 3, e.g. EXTRA="gpt-oss-120b:experts-mxfp4")
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:?usage: gpu_session_gate.sh BASE_DIR OUT_DIR}; OUT=${2:?usage: gpu_session_gate.sh BASE_DIR OUT_DIR}
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || {
  echo "gpu_session_gate.sh: needs a CUDA GPU" >&2; exit 2; }
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
step() {  # step NAME TIMEOUT DIR CMD...: CMD in DIR's tree, its log in OUT/logs/NAME.log
  local name=$1 limit=$2 dir=$3; shift 3
  (cd "$dir" && PYTHONPATH=$PWD timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1)
  echo "$name rc=$? at $((SECONDS - T0)) s"
}
if [ -z "${SKIP_SMOKE:-}" ]; then
  step smoke 300 . bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14; tail -1 "$OUT/logs/smoke.log"
fi
if [ -z "${SKIP_MLA:-}" ]; then
  step mla_attention 90 . python3 -m benchmarks.bench_mla_attention --shapes deepseek-v2-lite --out "$OUT/mla_attention.json"
  step mla_nuq_attention 90 . python3 -m benchmarks.bench_mla_nuq_attention --shapes deepseek-v2-lite --batches 1 \
    --out "$OUT/mla_nuq_attention.json"
  grep -h "b1 32768" "$OUT/logs/mla_attention.log" "$OUT/logs/mla_nuq_attention.log"
fi
ARGS=(--contexts 4096,32768 --batches 1 --prefill none --steps 30 --budget 150)
HLS2=(--shapes deepseek-v2-lite,deepseek-v3@8,glm-4.5-air,gpt-oss-120b,qwen3-30b-a3b,mixtral-8x7b --no-peer
      --recipes moec/recipes/experts-hls2.yaml)
LIN4=(--shapes glm-4.5-air --no-peer --recipes moec/recipes/latency-hls2-nuq2-lin4.yaml)
PAIRS="latency_lin4_base latency_lin4_new"
if [ -z "${SKIP_HLS2:-}" ]; then
  step lat_base 180 "$BASE" python3 -m benchmarks.bench_latency --out "$OUT/latency_base.json" "${ARGS[@]}" "${HLS2[@]}" --no-breakdown
  step lat_new 240 . python3 -m benchmarks.bench_latency --out "$OUT/latency_new.json" "${ARGS[@]}" "${HLS2[@]}"
  PAIRS="latency_base latency_new,$PAIRS"
fi
step lin4_base 90 "$BASE" python3 -m benchmarks.bench_latency --out "$OUT/latency_lin4_base.json" "${ARGS[@]}" "${LIN4[@]}" --no-breakdown
step lin4_new 120 . python3 -m benchmarks.bench_latency --out "$OUT/latency_lin4_new.json" "${ARGS[@]}" "${LIN4[@]}"
for sr in ${EXTRA:-}; do  # EXTRA="SHAPE:RECIPE ...": more gated rows, both trees (e.g. gpt-oss-120b:experts-mxfp4)
  sh=${sr%%:*}; rc=${sr#*:}; tag=${sh//[-.@]/_}_${rc//-/_}
  X=(--shapes "$sh" --no-peer --recipes "moec/recipes/$rc.yaml")
  step "${tag}_base" 120 "$BASE" python3 -m benchmarks.bench_latency --out "$OUT/latency_${tag}_base.json" "${ARGS[@]}" "${X[@]}" --no-breakdown
  step "${tag}_new" 150 . python3 -m benchmarks.bench_latency --out "$OUT/latency_${tag}_new.json" "${ARGS[@]}" "${X[@]}"
  PAIRS="$PAIRS,latency_${tag}_base latency_${tag}_new"
done
IFS=, read -ra PAIRLIST <<< "$PAIRS"
for pair in "${PAIRLIST[@]}"; do
  set -- $pair
  PYTHONPATH=$PWD python3 -m benchmarks.compare_latency "$OUT/$1.json" "$OUT/$2.json" --tol 0.03
done
if [ -z "${SKIP_V2LITE:-}" ]; then
  step lat_v2lite 180 . python3 -m benchmarks.bench_latency --out "$OUT/latency_deepseek_v2_lite.json" "${ARGS[@]}" \
    --shapes deepseek-v2-lite --recipes moec/recipes/experts-hls2.yaml moec/recipes/latency-hls2-mla2.yaml
  PYTHONPATH=$PWD python3 - "$OUT/latency_deepseek_v2_lite.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1])):
    if "ms_median" in r:  # (the breakdown records carry ms_by_group instead)
        print(f"{r['shape']:18} {r['recipe']:22} {r['context']:6} {r['ms_median']:7.3f} ms  {r['pct_of_floor']:5.1f}% of floor")
EOF
fi
if [ -z "${SKIP_LAYERS:-}" ]; then
  for s in glm-4.5-air gpt-oss-120b; do
    step "layers_bf16_$s" 150 . python3 -m benchmarks.bench_layers --shape "$s" --bf16 --out "$OUT/layers_bf16_$s.json"
    tail -3 "$OUT/logs/layers_bf16_$s.log"
  done
fi
# one archive for the records (a device call brings back 8 files; this script writes more): OUT keeps the smoke
# record, records.tgz (every other JSON) and logs.tgz
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs && shopt -s nullglob && set -- *.json && {
  recs=(); for f in "$@"; do [ "$f" != gpu_smoke_h200.json ] && recs+=("$f"); done
  [ ${#recs[@]} -gt 0 ] && tar czf records.tgz "${recs[@]}" && rm -f "${recs[@]}"; })
