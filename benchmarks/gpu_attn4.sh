#!/usr/bin/env bash
# Issue 32's attn4 row in one GPU call: the 4-bit decode GEMV sweep (bench_gluon_qlinear.py), then decode latency
# at 32k batch 1 of `latency-hls2-nuq2` and `latency-hls2-nuq2-attn4` with the `tl` 4-bit GEMV (qlinear.gemv.gluon4
# off) and of `latency-hls2-nuq2-attn4` with the Gluon one (on), each through a config dir of its own
# (MOEC_KERNEL_CONFIG_DIR: this device's shipped file with that one knob set), so the attn4 saving is read in one
# call.
# Usage, from the repo root on the GPU machine:  bash benchmarks/gpu_attn4.sh OUT_DIR [SHAPES]
# (SHAPES: bench_latency's --shapes, default mixtral-8x7b; SKIP_SWEEP=1 leaves the GEMV sweep out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_attn4.sh OUT_DIR [SHAPES]}
SHAPES=${2:-mixtral-8x7b}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
[ "${SKIP_SWEEP:-0}" = 1 ] || python3 -m benchmarks.bench_gluon_qlinear --out "$OUT/gluon_qlinear.json" \
  > "$OUT/gluon_qlinear.log" 2>&1
LAT=(--steps 50 --contexts 32768 --batches 1 --prefill none --no-breakdown --no-peer --shapes "$SHAPES" --budget 300)
# a config dir per setting: this device's shipped file (if any) with qlinear.gemv.gluon4 forced
cfgdir() {
  local dir; dir=$(mktemp -d)
  python3 - "$dir" "$1" <<'PY'
import json, sys, torch
from moec.kernels import launch_config
key = launch_config.device_key(torch.cuda.get_device_name())
path = launch_config.config_files().joinpath(f"{key}.json")
cfg = json.loads(path.read_text()) if path.is_file() else {"device": {"name": torch.cuda.get_device_name()}}
cfg.setdefault("qlinear", {}).setdefault("gemv", {})["gluon4"] = sys.argv[2] == "on"
open(f"{sys.argv[1]}/{key}.json", "w").write(json.dumps(cfg))
PY
  echo "$dir"
}
MOEC_KERNEL_CONFIG_DIR=$(cfgdir off) python3 -m benchmarks.bench_latency --out "$OUT/latency_attn4_tl.json" "${LAT[@]}" \
  --recipes moec/recipes/latency-hls2-nuq2.yaml moec/recipes/latency-hls2-nuq2-attn4.yaml > "$OUT/latency_tl.log" 2>&1
MOEC_KERNEL_CONFIG_DIR=$(cfgdir on) python3 -m benchmarks.bench_latency --out "$OUT/latency_attn4_gluon.json" \
  "${LAT[@]}" --recipes moec/recipes/latency-hls2-nuq2-attn4.yaml > "$OUT/latency_gluon.log" 2>&1
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for f in ("latency_attn4_tl.json", "latency_attn4_gluon.json"):
    try:
        rows = json.load(open(f"{out}/{f}"))
    except Exception as e:
        print(f, "unreadable:", e)
        continue
    for r in rows:
        print(f, r.get("recipe"), r.get("shape"), r.get("context"), r.get("batch"), r.get("method"),
              r.get("ms_median"), r.get("pct_of_floor"))
PY
