#!/usr/bin/env bash
# Baseline quality of the built-in models on PTB test (BENCHMARKS.md protocol, fp32 on the CPU).
# Writes benchmarks/results/baseline_<model>_<windows>.json. The whole test set (99 windows of 1024
# tokens for SmolLM2) takes about an hour on two cores in decode mode.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
for model in smollm2-135m demo-moe; do
  moec eval "$model" --data ptb --split test --mode both --max-windows 8 --json "$out/baseline_${model}_w8.json"
done
for model in demo-moe smollm2-135m; do
  moec eval "$model" --data ptb --split test --mode both --max-windows 0 --json "$out/baseline_${model}_all.json"
done
