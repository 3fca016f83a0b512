#!/usr/bin/env bash
# llama.cpp against moec in one GPU call (issue 31): bench_latency (50 steps, 4k and 32k, batch 1 and 16, the
# default latency recipe and the bf16 peer) with the shipped launch configs, then the same with the Gluon KV
# kernel at 4 warps per program (a device file in MOEC_KERNEL_CONFIG_DIR: the candidate default, compared row by
# row), then llama.cpp's llama-bench on both shapes (peers/llamacpp_peer.sh; carry gpu/lcpp/src.tgz), and
# speedup_vs_llamacpp attached to the batch-1 rows of both latency files (peers/speedup_vs_llamacpp.py).
# Usage, from the repo root on the GPU machine:  bash benchmarks/gpu_peer_speedup.sh OUT_DIR   (~9 min; W4=0 in
# the environment leaves the 4-warp run out, ~8 min; PF2=1 adds the Gluon kernel with two tiles in flight,
# benchmarks/studies/gluon_prefetch2.patch applied to a copy of the tree and swept at 32k, ~1 min)
# Brings back at most 8 files: the two latency files with the peer attached, llama-bench's JSONs, one log.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_peer_speedup.sh OUT_DIR}
mkdir -p "$OUT" /tmp/peer
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LOG="$OUT/run.log"
T0=$SECONDS
LAT=(--steps 50 --contexts 4096,32768 --prefill none --budget 120 --no-breakdown --recipes moec/recipes/latency-hls2-nuq2.yaml)
python3 -m benchmarks.bench_latency --out /tmp/peer/latency_default.json "${LAT[@]}" > /tmp/peer/lat1.log 2>&1
echo "latency (shipped configs) rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"
KEY=$(python3 -c "import torch; from moec.kernels.launch_config import device_key; print(device_key(torch.cuda.get_device_name()))")
if [ "${W4:-1}" = 1 ]; then
mkdir -p /tmp/w4 && echo '{"kv_decode_attention": {"gluon": {"warps": 4}}}' > "/tmp/w4/$KEY.json"
MOEC_KERNEL_CONFIG_DIR=/tmp/w4 python3 -m benchmarks.bench_latency --out /tmp/peer/latency_w4.json "${LAT[@]}" \
  > /tmp/peer/lat2.log 2>&1
echo "latency (gluon warps 4) rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"
{ echo "shipped -> gluon warps 4:"; python3 -m benchmarks.compare_latency /tmp/peer/latency_default.json /tmp/peer/latency_w4.json --tol 0.02; } 2>&1 | tee -a "$LOG"
fi
if [ "${PF2:-0}" = 1 ]; then  # the study patch (two tiles in flight) on a copy of the tree: the shipped tree untouched
  rm -rf /tmp/pf2 && mkdir -p /tmp/pf2 && cp -r moec benchmarks /tmp/pf2/
  (cd /tmp/pf2 && { git apply "$OLDPWD/benchmarks/studies/gluon_prefetch2.patch" 2>/dev/null \
     || patch -p1 < "$OLDPWD/benchmarks/studies/gluon_prefetch2.patch"; } > /dev/null \
   && PYTHONPATH=/tmp/pf2 timeout 120 python3 -m benchmarks.bench_gluon_kv_attention --out "$OUT/gluon_prefetch2.json" \
        --sweep --contexts 32768 --batches 1,16 > /tmp/peer/pf2.log 2>&1)
  echo "prefetch-2 study rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"
  grep -E "^check" /tmp/peer/pf2.log | cut -c1-400 >> "$LOG"
fi
LEFT=$((585 - SECONDS + T0))
timeout "$LEFT" bash benchmarks/peers/llamacpp_peer.sh /tmp/peer mixtral qwen3 2>&1 | tee -a "$LOG"
for f in latency_default latency_w4; do
  [ -f "/tmp/peer/$f.json" ] || continue
  python3 -m benchmarks.peers.speedup_vs_llamacpp "/tmp/peer/$f.json" /tmp/peer "$OUT/$f.json" 2>&1 | tee -a "$LOG"
  [ -f "$OUT/$f.json" ] || cp "/tmp/peer/$f.json" "$OUT/$f.json"
done
cp /tmp/peer/llama_bench_*.json "$OUT/" 2>/dev/null
for f in lat1 lat2; do { echo "== $f"; tail -25 "/tmp/peer/$f.log"; } >> "$LOG"; done
echo "done at $((SECONDS - T0)) s" | tee -a "$LOG"
