#!/usr/bin/env bash
# Issue 31's evidence in one GPU call on the final tree: the GPU smoke (both KV kernel paths, gpu_smoke.sh), the
# latency gate against another tree (gpu_latency_vs_base.sh at 4k and 32k, batch 1/16, 50 steps, per-kernel
# breakdown at 32k batch 1; build BASE_DIR first with scripts/base_tree.sh fd46df9 and carry it), then the
# Gluon decode-attention bench with its sweep in whatever time is left (~570 s in all).
# Usage, from the repo root on the GPU machine:  bash benchmarks/gpu_kv_gluon.sh BASE_DIR OUT_DIR
set -u
cd "$(dirname "$0")/.."
BASE=${1:?usage: gpu_kv_gluon.sh BASE_DIR OUT_DIR}
OUT=${2:?usage: gpu_kv_gluon.sh BASE_DIR OUT_DIR}
mkdir -p "$OUT"
T0=$SECONDS
bash benchmarks/gpu_smoke.sh "$OUT/gpu_smoke_h200.json" > "$OUT/smoke.log" 2>&1
echo "smoke rc=$? at $((SECONDS - T0)) s"; tail -4 "$OUT/smoke.log"
CONTEXTS=4096,32768 BREAKDOWN=1 bash benchmarks/gpu_latency_vs_base.sh "$BASE" "$OUT/gate" 0.03 > "$OUT/gate.log" 2>&1
echo "gate rc=$? at $((SECONDS - T0)) s"; grep -v "^\s*$" "$OUT/gate.log" | tail -30
LEFT=$((570 - SECONDS + T0))
if [ $LEFT -gt 60 ]; then
  timeout $LEFT python3 -m benchmarks.bench_gluon_kv_attention --out "$OUT/gluon_kv_attention_h200.json" --sweep \
    > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at $((SECONDS - T0)) s"; grep -E "^(check|time)" "$OUT/bench.log" | cut -c1-220 | tail -60
fi
