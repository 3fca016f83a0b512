#!/usr/bin/env bash
# The GPU smoke gate (issue 13): every shipped recipe's GPU path with default arguments against the torch
# reference, on the GPU machine, in one process (benchmarks/gpu_smoke.py says what is checked).
# Usage, from the repo root:  bash benchmarks/gpu_smoke.sh [OUT.json [--jobs N ...]]
# (default benchmarks/results/gpu_smoke_h200.json). Exit status 0 only when every check is ok.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu_smoke_h200.json}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# stand-in calibrations and the CLI's own messages only: keep the log to what failed
export MOEC_LOG=${MOEC_LOG:-WARNING}
timeout 330 python3 -m benchmarks.gpu_smoke --out "$OUT" "${@:2}"
