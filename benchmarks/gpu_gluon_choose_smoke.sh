#!/usr/bin/env bash
# The Gluon KV kernel's launch knobs chosen on the GPU that will carry the smoke record, then the smoke, in one
# call (issue 31): bench_gluon_kv_attention --sweep (checks against the torch reference; 4 warps per program and
# two tiles in flight among the swept knobs), choose_gluon_config writes the winner (if any) into
# moec/kernels/configs/<device>.json, and gpu_smoke.sh runs on the tree as changed, so its source_tree is the
# tree that ships once the returned config file is copied back (scripts/source_tree.sh must then agree).
# Usage, from the repo root on the GPU machine:  bash benchmarks/gpu_gluon_choose_smoke.sh OUT_DIR   (~4.5 min)
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_gluon_choose_smoke.sh OUT_DIR}
mkdir -p "$OUT/configs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$SECONDS
python3 -m benchmarks.bench_gluon_kv_attention --out "$OUT/gluon_kv_attention.json" --sweep > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $((SECONDS - T0)) s"
python3 -m benchmarks.choose_gluon_config "$OUT/gluon_kv_attention.json" moec/kernels/configs 2>&1 | tee "$OUT/choose.log"
cp moec/kernels/configs/*.json "$OUT/configs/"
bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" > "$OUT/smoke.log" 2>&1
echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -2 "$OUT/smoke.log"
bash scripts/source_tree.sh
