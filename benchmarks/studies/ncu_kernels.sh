#!/usr/bin/env bash
# Nsight Compute on the decode kernels of benchmarks/studies/ncu_kernels.py, exported as CSV for reading off the GPU.
#   bash benchmarks/studies/ncu_kernels.sh OUT [cases]     (cases: comma-separated, default all)
# OUT gets: run.log (the case order), details.csv (every section's metrics and ncu's rule notes per kernel),
# raw.csv.gz (every collected metric), source_sass.csv.gz (per-SASS-instruction stall samples), ncu_version.txt.
set -u
OUT=${1:?usage: ncu_kernels.sh OUT [cases]}
CASES=${2:-all}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --version > "$OUT/ncu_version.txt" 2>&1
# --clock-control none: the GPU's own clocks (device notes: leave them alone); --set full: every section,
# source counters (warp stall sampling per instruction) included
"$NCU" --profile-from-start off --clock-control none --set full -f -o /tmp/ncu_kernels \
  python3 -m benchmarks.studies.ncu_kernels --cases "$CASES" > "$OUT/run.log" 2>&1
echo "ncu rc $?" >> "$OUT/run.log"
"$NCU" --import /tmp/ncu_kernels.ncu-rep --page details --csv > "$OUT/details.csv" 2>&1
"$NCU" --import /tmp/ncu_kernels.ncu-rep --page raw --csv 2>&1 | gzip > "$OUT/raw.csv.gz"
"$NCU" --import /tmp/ncu_kernels.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/source_sass.csv.gz"
ls -la "$OUT" /tmp/ncu_kernels.ncu-rep
