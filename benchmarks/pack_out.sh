#!/usr/bin/env bash
# The device brings back at most 8 files a call (../.library/device/README.md): a GPU call script that writes more ends
# with this, which keeps KEEP files (names under OUT_DIR, at most 7) as they are and moves everything else into one
# OUT_DIR/rest.tgz, so nothing is left behind. (The eleventh session's last call wrote 19 files and lost 11.)
# Usage, last line of a call script:  bash benchmarks/pack_out.sh OUT_DIR [KEEP ...]
set -euo pipefail
OUT=${1:?usage: pack_out.sh OUT_DIR [KEEP ...]}; shift
[ $# -le 7 ] || { echo "pack_out.sh: at most 7 files kept beside rest.tgz (got $#)" >&2; exit 2; }
cd "$OUT"
mapfile -t REST < <(find . -mindepth 1 -maxdepth 1 ! -name rest.tgz $(for k in "$@"; do printf -- "! -name %s " "$k"; done) -printf '%P\n' | sort)
[ ${#REST[@]} -eq 0 ] && exit 0
tar czf rest.tgz -- "${REST[@]}" && rm -rf -- "${REST[@]}"
echo "pack_out: kept $*; ${#REST[@]} entries in rest.tgz ($(du -h rest.tgz | cut -f1))"
