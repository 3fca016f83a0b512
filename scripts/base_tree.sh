#!/usr/bin/env bash
# A copy of another revision's moec/, benchmarks/, recipes/ and scripts/ in DIR (default base_tree/, which
# .gitignore keeps out of commits), so one GPU call can time this checkout against it:
#   bash scripts/base_tree.sh fd46df9 && run: bash benchmarks/gpu_latency_vs_base.sh base_tree $OUT  (carry base_tree)
# demo-moe's weights are left out (the latency shapes are random; the tree travels under the 64 MiB limit).
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: scripts/base_tree.sh REV [DIR]}
DIR=${2:-base_tree}
rm -rf "$DIR" && mkdir -p "$DIR"
git archive "$REV" moec benchmarks recipes scripts | tar -x -C "$DIR"
rm -f "$DIR"/moec/builtin/demo-moe/*.safetensors
echo "$REV" > "$DIR/REVISION"
echo "$DIR: $(cat "$DIR/REVISION"), $(du -sh "$DIR" | cut -f1)"
