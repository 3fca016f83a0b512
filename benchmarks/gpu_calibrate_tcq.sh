#!/usr/bin/env bash
# Calibration time of the trellis (tcq) recipes on the GPU (issue 38): demo-moe whole (calibrate, pack, ppl),
# SmolLM2-135M's shape (random weights, SmolLM2's tokenization of the PTB windows; gpu_calibrate_demo_moe.py
# says what such a time means) and the fit of one Mixtral-8x7B layer (bench_calibrate_scale.py, fits only; 2 of
# its 8 experts, extrapolated; MOEC_TCQ_VITERBI=torch times the torch search instead of the kernel).
# Each part under its own timeout, its record in OUT_DIR as soon as it is made.
# Usage, from the repo root:  bash benchmarks/gpu_calibrate_tcq.sh OUT_DIR [demo] [smollm2] [mixtral]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_calibrate_tcq.sh OUT_DIR [demo] [smollm2] [mixtral]}
shift
PARTS=${*:-demo smollm2 mixtral}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MOEC_LOG=${MOEC_LOG:-WARNING}
R=moec/recipes
rc=0
for part in $PARTS; do
  case $part in
    demo) timeout 200 python3 -m benchmarks.gpu_calibrate_demo_moe --device cuda --out "$OUT/calib_time_tcq_gpu.json" \
            --recipes $R/experts-tcq2-had-tuned.yaml $R/experts-tcq3-had-tuned.yaml || rc=1 ;;
    smollm2) timeout 330 python3 -m benchmarks.gpu_calibrate_demo_moe --model smollm2-135m-shape --device cuda \
            --out "$OUT/calib_time_tcq_smollm2_shape_gpu.json" \
            --recipes $R/smollm2-mlp-tcq3-had.yaml $R/smollm2-mlp-tcq2-had-tuned.yaml || rc=1 ;;
    mixtral) timeout 300 python3 -m benchmarks.bench_calibrate_scale --shape mixtral-8x7b --layers 1 --experts 2 --device cuda \
            --recipe $R/experts-tcq2-had-tuned.yaml --out "$OUT/calibrate_scale_tcq2.json" || rc=1 ;;
    *) echo "unknown part: $part (demo, smollm2, mixtral)" >&2; exit 2 ;;
  esac
done
exit $rc
