#!/usr/bin/env bash
# Baseline quality of the built-in models on PTB test (docs/benchmarks.md protocol, fp32 on the CPU).
# Writes benchmarks/results/baseline_<model>_<windows>[_<mode>].json. The whole test set in decode
# mode for SmolLM2 (99 windows of 1024 tokens) takes about an hour on two idle cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
for model in demo-moe smollm2-135m; do
  moec eval "$model" --data ptb --split test --mode both --max-windows 8 --json "$out/baseline_${model}_w8.json"
done
moec eval demo-moe --data ptb --split test --mode both --max-windows 0 --json "$out/baseline_demo-moe_all.json"
moec eval smollm2-135m --data ptb --split test --mode tf --max-windows 0 --json "$out/baseline_smollm2-135m_all_tf.json"
moec eval smollm2-135m --data ptb --split test --mode dec --max-windows 0 --json "$out/baseline_smollm2-135m_all_dec.json"
