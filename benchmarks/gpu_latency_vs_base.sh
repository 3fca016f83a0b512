#!/usr/bin/env bash
# Decode latency of this checkout against another tree in the same GPU call (runs on different days differ by up
# to 8%, so a refactor's "behaviour unchanged" is checked in one call): bench_latency at 32k, batch 1 and 16,
# 50 steps, both shapes, the default latency recipe and the bf16 peer, on BASE_DIR (scripts/base_tree.sh REV),
# this tree, then BASE_DIR again (drift), and compare_latency between them.
# Usage, from the repo root on the GPU machine:  bash benchmarks/gpu_latency_vs_base.sh BASE_DIR OUT_DIR [TOL]
# CONTEXTS=4096,32768 (environment) times those contexts instead of 32k alone; BREAKDOWN=1 keeps the per-kernel
# breakdown (32k, batch 1) of both trees.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: gpu_latency_vs_base.sh BASE_DIR OUT_DIR [TOL]}
OUT=${2:?usage: gpu_latency_vs_base.sh BASE_DIR OUT_DIR [TOL]}
TOL=${3:-0.03}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LAT=(--steps 50 --contexts "${CONTEXTS:-32768}" --prefill none --budget 400)
[ "${BREAKDOWN:-0}" = 1 ] || LAT+=(--no-breakdown)
# the latency recipe of a tree: moec/recipes/ since issue 34, recipes/ before
recipe() { if [ -d moec/recipes ]; then echo moec/recipes/latency-hls2-nuq2.yaml; else echo recipes/latency-hls2-nuq2.yaml; fi; }
base() { (cd "$BASE" && PYTHONPATH=$PWD python3 -m benchmarks.bench_latency --out "$OUT/$1" "${LAT[@]}" --recipes "$(recipe)" \
          > "$OUT/$1.log" 2>&1); }
base latency_base.json
PYTHONPATH=$PWD python3 -m benchmarks.bench_latency --out "$OUT/latency_new.json" "${LAT[@]}" --recipes "$(recipe)" > "$OUT/latency_new.log" 2>&1
base latency_base2.json
echo "base vs base (drift):"; PYTHONPATH=$PWD python3 -m benchmarks.compare_latency "$OUT/latency_base.json" "$OUT/latency_base2.json" --tol "$TOL"
echo "base vs this tree:"; PYTHONPATH=$PWD python3 -m benchmarks.compare_latency "$OUT/latency_base.json" "$OUT/latency_new.json" --tol "$TOL"
