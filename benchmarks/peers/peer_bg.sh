# Sourced by a GPU call script (bash): starts, in the background, llama-bench's build (llamacpp_peer.sh build; carry
# gpu/lcpp) and, once its sources are unpacked, the random GGUF of SHAPE at TYPE (llamacpp_moe.py; a full GLM-4.5-Air
# is ~45 GB on /tmp). Sets BUILD and GGUF (their pids); logs to $OUT/logs/build.log and gguf.log.
#   source benchmarks/peers/peer_bg.sh SHAPE [TYPE]     (then wait on both and run llama-bench on /tmp/SHAPE.gguf)
PEER_SHAPE=$1
PEER_TYPE=${2:-Q2_K}
mkdir -p /tmp/peer "$OUT/logs"
nice -n 10 bash benchmarks/peers/llamacpp_peer.sh /tmp/peer build > "$OUT/logs/build.log" 2>&1 &
BUILD=$!
(while [ ! -f /tmp/lc/gguf-py/gguf/__init__.py ]; do sleep 1; done; sleep 2
 PYTHONPATH=/tmp/lc/gguf-py nice -n 5 python3 benchmarks/peers/llamacpp_moe.py "/tmp/$PEER_SHAPE.gguf" "$PEER_TYPE" \
   "$PEER_SHAPE" > "$OUT/logs/gguf.log" 2>&1; echo "gguf rc=$?" >> "$OUT/logs/gguf.log") &
GGUF=$!
