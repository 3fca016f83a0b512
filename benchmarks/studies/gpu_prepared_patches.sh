#!/usr/bin/env bash
# The GPU call that times 2026-12-06's CPU-prepared step changes (MLA's prologue kernel, the experts' biases as
# stored, the shared expert's fused gate/up; in moec/ since that day's second session) on this tree against BASE_DIR
# (the tree before them), with the lin4 recipe (moec/recipes/, in GLM_RECIPES of benchmarks/gpu_smoke.py), in one
# call (~8 min on one H100):
#   1. the GPU smoke on this tree (the record a moec/ change must carry);
#   2. decode latency, batch 1, 4k/32k, on BASE_DIR (scripts/base_tree.sh REV: the tree before the patches) and
#      this tree, compared by compare_latency: DeepSeek-V2-Lite and DeepSeek-V3 (8 layers) with experts-hls2 and
#      latency-hls2-mla2 (what the fused MLA prologue saves), gpt-oss-120b with experts-hls2 and experts-mxfp4
#      (what passing the experts' biases as stored saves: three fp32 copies a layer);
#   3. GLM-4.5-Air with latency-hls2-nuq2-lin4 beside attn4 (4k/32k, batch 1, with the breakdown), and attn4 on
#      BASE_DIR (what the fused shared expert saves);
#   4. benchmarks/studies/pdl_chain.py (programmatic dependent launch on a GEMV chain).
# Outputs in OUT_DIR: the smoke record, six latency files, logs and the PDL record in one archive (8-file limit).
# Usage, from the repo root on the GPU machine:  bash benchmarks/studies/gpu_prepared_patches.sh BASE_DIR OUT_DIR
# (carry BASE_DIR: bash scripts/base_tree.sh REV && rm -rf base_tree/benchmarks/results
#  base_tree/moec/builtin/demo-mla/model.safetensors, to stay under the 64 MiB a call carries)
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:?usage: gpu_prepared_patches.sh BASE_DIR OUT_DIR}; OUT=${2:?usage: gpu_prepared_patches.sh BASE_DIR OUT_DIR}
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || {
  echo "gpu_prepared_patches.sh: needs a CUDA GPU" >&2; exit 2; }
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
PYTHONPATH=$PWD bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 14 > "$OUT/logs/smoke.log" 2>&1
echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke.log"
COMMON=(--contexts 4096,32768 --batches 1 --prefill none --steps 30 --no-peer --no-breakdown --budget 100)
MLA=(--shapes deepseek-v2-lite,deepseek-v3@8 --recipes moec/recipes/experts-hls2.yaml moec/recipes/latency-hls2-mla2.yaml)
OSS=(--shapes gpt-oss-120b --recipes moec/recipes/experts-hls2.yaml moec/recipes/experts-mxfp4.yaml)
lat() {  # lat DIR NAME ARGS...: bench_latency from DIR's tree into OUT/NAME
  local dir=$1 name=$2; shift 2
  (cd "$dir" && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.bench_latency --out "$OUT/$name" "${COMMON[@]}" "$@" \
    > "$OUT/logs/$name.log" 2>&1); echo "$name rc=$? at $((SECONDS - T0)) s"
}
lat "$BASE" latency_mla_base.json "${MLA[@]}"
lat . latency_mla_new.json "${MLA[@]}"
lat "$BASE" latency_oss_base.json "${OSS[@]}"
lat . latency_oss_new.json "${OSS[@]}"
for f in mla oss; do
  echo "$f: base vs this tree"
  PYTHONPATH=$PWD python3 -m benchmarks.compare_latency "$OUT/latency_${f}_base.json" "$OUT/latency_${f}_new.json" \
    --tol 0.03
done
PYTHONPATH=$PWD timeout 120 python3 -m benchmarks.bench_latency --out "$OUT/latency_glm_lin4.json" --shapes glm-4.5-air \
  --contexts 4096,32768 --batches 1 --prefill none --steps 30 --no-peer --budget 100 \
  --recipes moec/recipes/latency-hls2-nuq2-lin4.yaml moec/recipes/latency-hls2-nuq2-attn4.yaml \
  > "$OUT/logs/glm.log" 2>&1; echo "glm rc=$? at $((SECONDS - T0)) s"; tail -9 "$OUT/logs/glm.log"
# the base tree's attn4 (the shared expert's fused gate/up is what GLM's attn4 rows gain): breakdown off
lat "$BASE" latency_glm_base.json --shapes glm-4.5-air --recipes moec/recipes/latency-hls2-nuq2-attn4.yaml
echo "glm attn4: base vs this tree"
PYTHONPATH=$PWD python3 -m benchmarks.compare_latency "$OUT/latency_glm_base.json" "$OUT/latency_glm_lin4.json" --tol 0.03
PYTHONPATH=$PWD timeout 90 python3 -m benchmarks.studies.pdl_chain --out "$OUT/logs/pdl_chain.json" > "$OUT/logs/pdl.log" 2>&1
echo "pdl rc=$? at $((SECONDS - T0)) s"; cat "$OUT/logs/pdl.log"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
