#!/usr/bin/env bash
# A copy of another revision's moec/ (with its recipes), benchmarks/, scripts/ (and recipes/, where
# a revision before issue 34 kept them) in DIR (default base_tree/, which
# .gitignore keeps out of commits), so one GPU call can time this checkout against it:
#   bash scripts/base_tree.sh fd46df9 && run: bash benchmarks/gpu_latency_vs_base.sh base_tree $OUT  (carry base_tree)
# demo-moe's weights are left out (the latency shapes are random; the tree travels under the 64 MiB limit).
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: scripts/base_tree.sh REV [DIR]}
DIR=${2:-base_tree}
rm -rf "$DIR" && mkdir -p "$DIR"
PATHS=(moec benchmarks scripts)
git cat-file -e "$REV:recipes" 2>/dev/null && PATHS+=(recipes)
git archive "$REV" "${PATHS[@]}" | tar -x -C "$DIR"
rm -f "$DIR"/moec/builtin/demo-moe/*.safetensors
echo "$REV" > "$DIR/REVISION"
echo "$DIR: $(cat "$DIR/REVISION"), $(du -sh "$DIR" | cut -f1)"
