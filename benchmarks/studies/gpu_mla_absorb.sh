#!/usr/bin/env bash
# One GPU call (~8 min on one H100) for the MLA prologue's absorbed query (benchmarks/studies/mla_absorb.patch,
# applied to this tree first: fused_decode.mla_rope_latent with W_UK, the bmm and the cat of DeepSeek's decode step
# inside the prologue kernel) and issue 35's same-call llama.cpp ratio on DeepSeek-V2-Lite:
#   1. llama-bench built in the background (benchmarks/peers/llamacpp_peer.sh build, ~4.5 min on 16 cores) while
#      the GPU smoke runs on this tree (the record a moec/ change must carry);
#   2. decode latency, batch 1, 4k/32k, DeepSeek-V2-Lite and DeepSeek-V3 (8 layers), experts-hls2 and
#      latency-hls2-mla2, on BASE_DIR (the tree before the change) and this tree, compared by compare_latency
#      (after the build: nothing else on the CPU while timing);
#   3. llama.cpp's Q2_K DeepSeek-V2-Lite at 4k/32k (llamacpp_peer.sh deepseek-v2-lite), attached to this tree's
#      rows by peers/speedup_vs_llamacpp.py (`speedup_vs_llamacpp` on each batch-1 row at both depths).
# Usage, from the repo root on the GPU machine:  bash benchmarks/studies/gpu_mla_absorb.sh BASE_DIR OUT_DIR
# (carry BASE_DIR from scripts/base_tree.sh, and gpu/lcpp from benchmarks/peers/lcpp_fetch.sh; SKIP_PEER=1: steps 1-2
# only, ~4 min; SHAPES=a,b: other shapes for step 2, e.g. with moe_split_nocast.patch applied too; RECIPES="a b":
# other recipes of moec/recipes; SKIP_BASE=1: this tree only, no comparison; DOWN_STUDY=1: down_split_experts.py
# after the smoke, DOWN_BASE=1 on BASE_DIR's moec/ too (records labelled base / new; DOWN_TIMEOUT seconds each,
# 200 unless told; DOWN_KINDS=hls2,bf16: the dense path too); SKIP_SMOKE=1: no smoke, e.g. a same-call gate of a
# tree already smoked; LAT_TIMEOUT: seconds a bench_latency run, 170 unless told; LAT_BUDGET: its --budget, 100
# unless told; NO_BREAKDOWN=1: no breakdown of this tree's rows either; MLA_BENCH=1:
# bench_mla_attention and bench_mla_nuq_attention on V2-Lite's heads; NCU_CASES=a,b: ncu_kernels.sh on those cases into OUT/ncu; SKIP_LAT=1: no
# bench_latency rows; PDL_AB=1: this tree's rows again with MOEC_PDL=0, compared)
set -uo pipefail
cd "$(dirname "$0")/../.."
BASE=${1:?usage: gpu_mla_absorb.sh BASE_DIR OUT_DIR}; OUT=${2:?usage: gpu_mla_absorb.sh BASE_DIR OUT_DIR}
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || {
  echo "gpu_mla_absorb.sh: needs a CUDA GPU" >&2; exit 2; }
mkdir -p "$OUT/logs" "$OUT/peer"
export PYTHONUNBUFFERED=1 MOEC_LOG=${MOEC_LOG:-WARNING}
T0=$SECONDS
if [ -z "${SKIP_PEER:-}" ]; then
  nice -n 10 bash benchmarks/peers/llamacpp_peer.sh "$OUT/peer" build > "$OUT/logs/build.log" 2>&1 &
  BUILD=$!
fi
if [ -z "${SKIP_SMOKE:-}" ]; then
  PYTHONPATH=$PWD bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" --jobs 12 > "$OUT/logs/smoke.log" 2>&1
  echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -1 "$OUT/logs/smoke.log"
fi
if [ -n "${DOWN_STUDY:-}" ]; then  # while llama-bench builds: the down GEMV's launches, one layer a shape
  down() {  # down DIR LABEL: this study's script (the newer one) on DIR's moec/
    (PYTHONPATH=$(cd "$1" && pwd) timeout "${DOWN_TIMEOUT:-200}" python3 benchmarks/studies/down_split_experts.py --tree "$2" \
      --kinds "${DOWN_KINDS:-hls2}" --budget $((${DOWN_TIMEOUT:-200} - 40)) --out "$OUT/down_split_experts_$2.json" > "$OUT/logs/down_split_experts_$2.log" 2>&1)
    echo "down_split_experts $2 rc=$? at $((SECONDS - T0)) s"; cat "$OUT/logs/down_split_experts_$2.log"
  }
  [ -n "${DOWN_BASE:-}" ] && down "$BASE" base
  down "$PWD" new
fi
if [ -n "${MLA_BENCH:-}" ]; then  # the fp16 latent kernel alone (issue 35's 70% bar), V2-Lite's heads
  PYTHONPATH=$PWD timeout 240 python3 -m benchmarks.bench_mla_attention --shapes deepseek-v2-lite \
    --out "$OUT/mla_attention.json" > "$OUT/logs/mla_attention.log" 2>&1
  echo "bench_mla_attention rc=$? at $((SECONDS - T0)) s"; cat "$OUT/logs/mla_attention.log"
  PYTHONPATH=$PWD timeout 200 python3 -m benchmarks.bench_mla_nuq_attention --shapes deepseek-v2-lite --batches 1 \
    --out "$OUT/mla_nuq_attention.json" > "$OUT/logs/mla_nuq_attention.log" 2>&1
  echo "bench_mla_nuq_attention rc=$? at $((SECONDS - T0)) s"; cat "$OUT/logs/mla_nuq_attention.log"
fi
if [ -n "${NCU_CASES:-}" ]; then  # Nsight Compute on those cases of benchmarks/studies/ncu_kernels.py
  PYTHONPATH=$PWD timeout 300 bash benchmarks/studies/ncu_kernels.sh "$OUT/ncu" "$NCU_CASES" > "$OUT/logs/ncu.log" 2>&1
  echo "ncu rc=$? at $((SECONDS - T0)) s"; (cd "$OUT/ncu" && gzip -f details.csv 2>/dev/null)
fi
[ -n "${BUILD:-}" ] && { wait "$BUILD"; echo "llama-bench build rc=$? at $((SECONDS - T0)) s"; }
ARGS=(--contexts 4096,32768 --batches 1 --prefill none --steps 30 --no-peer --budget "${LAT_BUDGET:-100}"
      --shapes "${SHAPES:-deepseek-v2-lite,deepseek-v3@8}" --recipes)
for r in ${RECIPES:-experts-hls2 latency-hls2-mla2}; do ARGS+=("moec/recipes/$r.yaml"); done
lat() {  # lat DIR NAME [ARGS...]: bench_latency from DIR's tree into OUT/NAME
  local dir=$1 name=$2; shift 2
  (cd "$dir" && env ${LAT_ENV:-} PYTHONPATH=$PWD timeout "${LAT_TIMEOUT:-170}" python3 -m benchmarks.bench_latency --out "$OUT/$name" "${ARGS[@]}" "$@" \
    > "$OUT/logs/$name.log" 2>&1); echo "$name rc=$? at $((SECONDS - T0)) s"
}
if [ -z "${SKIP_LAT:-}" ]; then
  [ -z "${SKIP_BASE:-}" ] && lat "$BASE" latency_mla_base.json --no-breakdown
  lat . latency_mla_new.json ${NO_BREAKDOWN:+--no-breakdown}  # with the per-kernel-group breakdown
  grep "{'attention'" "$OUT/logs/latency_mla_new.json.log"
  [ -z "${SKIP_BASE:-}" ] && PYTHONPATH=$PWD python3 -m benchmarks.compare_latency "$OUT/latency_mla_base.json" \
    "$OUT/latency_mla_new.json" --tol 0.03
  if [ -n "${PDL_AB:-}" ]; then  # this tree again with PDL off (pdl_step.patch's switch): new is PDL on
    LAT_ENV="MOEC_PDL=0" lat . latency_mla_new_nopdl.json --no-breakdown
    PYTHONPATH=$PWD python3 -m benchmarks.compare_latency "$OUT/latency_mla_new_nopdl.json" \
      "$OUT/latency_mla_new.json" --tol 0.03
  fi
fi
if [ -n "${BUILD:-}" ]; then
  timeout 150 bash benchmarks/peers/llamacpp_peer.sh "$OUT/peer" deepseek-v2-lite > "$OUT/logs/peer.log" 2>&1
  echo "peer rc=$? at $((SECONDS - T0)) s"; tail -4 "$OUT/logs/peer.log"
  PYTHONPATH=$PWD python3 -m benchmarks.peers.speedup_vs_llamacpp "$OUT/latency_mla_new.json" "$OUT/peer" \
    "$OUT/latency_mla_new_peer.json" --same-device
fi
(cd "$OUT" && mv peer/llama_bench_*.json . 2>/dev/null; mv peer/* logs/ 2>/dev/null; rm -rf peer; tar czf logs.tgz logs && rm -rf logs)
