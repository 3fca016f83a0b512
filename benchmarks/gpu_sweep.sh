#!/usr/bin/env bash
# The whole GPU benchmark sweep in one device call (../.library/device: few, full calls).
# Usage on the GPU machine, from the repo root:  bash benchmarks/gpu_sweep.sh OUT_DIR
# Runs the GPU smoke (benchmarks/gpu_smoke.sh; stops here if it fails), the kernel tests at full size, then
# every GPU benchmark, each under its own time limit, in two
# lanes when two GPUs are present (lane A on GPU 0, lane B on GPU 1); on one GPU a trimmed list runs
# in turn. Each benchmark writes one JSON file into OUT_DIR (at most 8 files come back from a device
# call, so the per-step logs are joined into OUT_DIR/sweep.log at the end). A failure is logged and
# the sweep goes on. A subset: LANE_A="kernel_tests 150;kv_attention 90" LANE_B="latency 300" bash ... OUT
set -uo pipefail
OUT=${1:?usage: gpu_sweep.sh OUT_DIR}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{
  echo "sweep: $(date -u +%FT%TZ) gpus=$NGPU $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} | tee "$LOGS/00-head.log"

# The smoke gate first (issue 13): if any shipped GPU path fails its check, nothing else runs.
if ! bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" 2>&1 | tee "$LOGS/01-smoke.log"; then
  echo "sweep stopped: the GPU smoke failed ($OUT/gpu_smoke_h200.json)" | tee -a "$LOGS/01-smoke.log"
  cat "$LOGS"/*.log > "$OUT/sweep.log"
  exit 1
fi

step() {  # step GPU SECONDS NAME CMD...
  local gpu=$1 secs=$2 name=$3; shift 3
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$gpu timeout "$secs" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $((SECONDS - t0))s (limit ${secs}s, gpu $gpu): $*" | tee -a "$LOGS/$name.log"
}

kernel_tests() { step "$1" "$2" kernel_tests python3 -m pytest -q -rs tests/kernels; }
kv_attention() { step "$1" "$2" kv_attention python3 -m benchmarks.bench_kv_attention --recipe moec/recipes/ablations/kv-nuq2-outlier-post.yaml --out "$OUT/kv_attention_h200.json"; }
kv_sweep() { step "$1" "$2" kv_sweep python3 -m benchmarks.bench_kv_attention --sweep --out "$OUT/kv_attention_sweep_h200.json"; }
kv_tests() { step "$1" "$2" kv_tests python3 -m pytest -q -rs tests/kernels/test_fused_decode.py tests/kernels/test_kv_decode_attention.py tests/kernels/test_kv_quantize_pack.py tests/kernels/test_moe_decode.py::test_split_and_paths_agree; }
moe_kernel() { step "$1" "$2" moe_kernel python3 -m benchmarks.bench_moe_kernel --out "$OUT/moe_kernel_h200.json"; }
# packed_gpu/kv-rvq-tiered, packed_gpu/kv-latent-*: demo-moe packed with those recipes on the CPU, carried in
# (no PTB here); their fused-kernel checks run when present
runtime_check() { step "$1" "$2" runtime_check python3 -m benchmarks.check_runtime_gpu --out "$OUT/runtime_gpu_check_h200.json" \
  $([ -d packed_gpu/kv-rvq-tiered ] && echo --rvq-packed packed_gpu/kv-rvq-tiered) \
  $(ls -d packed_gpu/kv-latent-* 2>/dev/null | sed 's/^/--latent-packed /' | tr '\n' ' '); }
latency() { step "$1" "$2" latency python3 -m benchmarks.bench_latency --budget $(( $2 - 60 )) --out "$OUT/latency_h200.json"; }
latent_attention() { step "$1" "$2" latent_attention python3 -m benchmarks.bench_latent_attention --out "$OUT/latent_attention_h200.json"; }
rvq_attention() { step "$1" "$2" rvq_attention python3 -m benchmarks.bench_rvq_attention --out "$OUT/rvq_attention_h200.json"; }
gpu_fit() {  # k-means (issue 7) and calibration (issue 4) times on the GPU, merged into one file
  step "$1" "$2" kmeans python3 -m benchmarks.bench_kmeans --device cuda --out "$LOGS/kmeans.json"
  step "$1" 100 gpu_calib python3 -m benchmarks.gpu_calibrate_demo_moe --device cuda --recipes moec/recipes/experts-hls2.yaml --out "$LOGS/calib.json"
  python3 -c 'import json, sys, os; print(json.dumps(sum((json.load(open(f)) for f in sys.argv[2:] if os.path.exists(f)), []), indent=1), file=open(sys.argv[1], "w"))' \
    "$OUT/fit_gpu_h200.json" "$LOGS/kmeans.json" "$LOGS/calib.json"
}

if [ -n "${LANE_A:-}${LANE_B:-}" ]; then  # a chosen subset: LANE_A / LANE_B = "step secs; step secs; ..."
  run_lane() { local gpu=$1 items item; IFS=';' read -ra items <<< "$2"; for item in "${items[@]}"; do eval "${item%% *} $gpu ${item#* }"; done; }
  ( run_lane 0 "${LANE_A:-}" ) &
  ( run_lane $(( NGPU >= 2 ? 1 : 0 )) "${LANE_B:-}" ) &
  wait
elif [ "$NGPU" -ge 2 ]; then
  ( kv_attention 0 60; moe_kernel 0 160; rvq_attention 0 110; latent_attention 0 110; kernel_tests 0 120 ) &
  ( latency 1 260; runtime_check 1 90; gpu_fit 1 80 ) &
  wait
else
  kv_attention 0 45; moe_kernel 0 140; latency 0 200; rvq_attention 0 60; latent_attention 0 60; runtime_check 0 50
fi
echo "sweep done: $(date -u +%FT%TZ)" | tee "$LOGS/zz-tail.log"
cat "$LOGS"/*.log > "$OUT/sweep.log"
