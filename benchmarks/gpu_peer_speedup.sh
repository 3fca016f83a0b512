#!/usr/bin/env bash
# llama.cpp against moec in one GPU call (issue 31): bench_latency (50 steps, 4k and 32k, batch 1 and 16, the
# default latency recipe and the bf16 peer) with the shipped launch configs; W4=1 adds the same with the Gluon KV
# kernel at 4 warps per program (a device file in MOEC_KERNEL_CONFIG_DIR: the candidate default, compared row by
# row); then llama.cpp's llama-bench on both shapes (peers/llamacpp_peer.sh; carry gpu/lcpp/src.tgz), its JSONs
# copied out as each shape finishes; PF2=1 then, in the time left, sweeps the Gluon kernel with two tiles in
# flight (benchmarks/studies/gluon_prefetch2.patch applied to a copy of the tree; the shipped tree untouched);
# last, speedup_vs_llamacpp attached to the batch-1 rows (peers/speedup_vs_llamacpp.py; also runnable afterwards
# on the returned files). Outputs land in OUT_DIR as they are made, so a call cut by its limit keeps what ran.
# Usage, from the repo root on the GPU machine:  [W4=1] [PF2=1] [PEER=0] [LIMIT=s] bash benchmarks/gpu_peer_speedup.sh OUT_DIR
# (~8 min; W4 +1 min, PF2 +1 min; LIMIT: the seconds the call may run, default 585). At most 8 files come back.
set -u
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_peer_speedup.sh OUT_DIR}
mkdir -p "$OUT" /tmp/peer
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LOG="$OUT/run.log"
T0=$SECONDS
LIMIT=${LIMIT:-585}
LAT=(--steps 50 --contexts 4096,32768 --prefill none --budget 120 --no-breakdown --recipes moec/recipes/latency-hls2-nuq2.yaml)
python3 -m benchmarks.bench_latency --out "$OUT/latency_default.json" "${LAT[@]}" > /tmp/peer/lat1.log 2>&1
echo "latency (shipped configs) rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"
if [ "${W4:-0}" = 1 ]; then
  KEY=$(python3 -c "import torch; from moec.kernels.launch_config import device_key; print(device_key(torch.cuda.get_device_name()))")
  mkdir -p /tmp/w4 && echo '{"kv_decode_attention": {"gluon": {"warps": 4}}}' > "/tmp/w4/$KEY.json"
  MOEC_KERNEL_CONFIG_DIR=/tmp/w4 python3 -m benchmarks.bench_latency --out "$OUT/latency_w4.json" "${LAT[@]}" \
    > /tmp/peer/lat2.log 2>&1
  echo "latency (gluon warps 4) rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"
  { echo "shipped -> gluon warps 4:"; python3 -m benchmarks.compare_latency "$OUT/latency_default.json" "$OUT/latency_w4.json" --tol 0.02; } 2>&1 | tee -a "$LOG"
fi
if [ "${PEER:-1}" = 1 ]; then
  ( while sleep 5; do cp /tmp/peer/llama_bench_*.json "$OUT/" 2>/dev/null; done ) &
  COPIER=$!
  timeout $((LIMIT - 60 - SECONDS + T0)) bash benchmarks/peers/llamacpp_peer.sh /tmp/peer mixtral qwen3 2>&1 | tee -a "$LOG"
  kill $COPIER 2>/dev/null; cp /tmp/peer/llama_bench_*.json "$OUT/" 2>/dev/null
fi
LEFT=$((LIMIT - 15 - SECONDS + T0))
if [ "${PF2:-0}" = 1 ] && [ $LEFT -gt 40 ]; then
  rm -rf /tmp/pf2 && mkdir -p /tmp/pf2 && cp -r moec benchmarks /tmp/pf2/
  (cd /tmp/pf2 && { git apply "$OLDPWD/benchmarks/studies/gluon_prefetch2.patch" 2>/dev/null \
     || patch -p1 < "$OLDPWD/benchmarks/studies/gluon_prefetch2.patch"; } > /dev/null \
   && PYTHONPATH=/tmp/pf2 timeout $LEFT python3 -m benchmarks.bench_gluon_kv_attention \
        --out "$OUT/gluon_prefetch2.json" --sweep --contexts "${PF2_CONTEXTS:-32768}" --batches 1,16 > /tmp/peer/pf2.log 2>&1)
  echo "prefetch-2 study rc=$? at $((SECONDS - T0)) s" | tee -a "$LOG"
  grep -E "^check" /tmp/peer/pf2.log | cut -c1-400 >> "$LOG"
fi
for f in latency_default latency_w4; do
  [ -f "$OUT/$f.json" ] && ls "$OUT"/llama_bench_*.json > /dev/null 2>&1 || continue
  python3 -m benchmarks.peers.speedup_vs_llamacpp "$OUT/$f.json" "$OUT" "$OUT/$f.json" 2>&1 | tee -a "$LOG"
done
for f in lat1 lat2; do [ -f "/tmp/peer/$f.log" ] && { echo "== $f"; tail -25 "/tmp/peer/$f.log"; } >> "$LOG"; done
echo "done at $((SECONDS - T0)) s" | tee -a "$LOG"
