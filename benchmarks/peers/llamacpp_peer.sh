#!/usr/bin/env bash
# The llama.cpp peer on the GPU machine (issue 31): build llama-bench (CUDA, sm_90) from gpu/lcpp/src.tgz
# (benchmarks/peers/lcpp_fetch.sh; carry it), then for each SHAPE write a random-weight GGUF of that shape
# (benchmarks/peers/llamacpp_moe.py: Q2_K experts and attention as random blocks with finite fp16 scales), time
# decode of 64 tokens after depths 4096 and 32768 (f16 KV, flash attention, batch 1, 2 repetitions) and delete
# the GGUF before the next one (the machine's disk holds one). ~4.5 min to build, ~1 min per shape.
# Usage, from the repo root:  bash benchmarks/peers/llamacpp_peer.sh OUT_DIR [SHAPE ...]   (mixtral qwen3; also deepseek-v2-lite, glm-4.5-air;
# the one word `build`: build llama-bench and stop)
# QTYPE=MXFP4|Q4_0 (default Q2_K) and LAYERS=N (the shape's first N layers) in the environment pass to the writer.
# Writes OUT_DIR/llama_bench_SHAPE[_QTYPE][_LN].json (llama-bench's own JSON) and prints ms/token per depth.
set -u
OUT=${1:?usage: llamacpp_peer.sh OUT_DIR [SHAPE ...]}; shift
SHAPES=${*:-mixtral qwen3}
HERE=$(cd "$(dirname "$0")" && pwd)
t0=$SECONDS; mkdir -p "$OUT"
if [ ! -x /tmp/lc/build/bin/llama-bench ]; then
  mkdir -p /tmp/lc && tar xzf "${LCPP_SRC:-gpu/lcpp/src.tgz}" -C /tmp/lc
  printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' > /tmp/lc/tools/CMakeLists.txt
  cmake -S /tmp/lc -B /tmp/lc/build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  cmake --build /tmp/lc/build --target llama-bench -j "$(nproc)" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
echo "built in $((SECONDS - t0)) s"
[ "$SHAPES" = build ] && exit 0
QTYPE=${QTYPE:-Q2_K}
# the file's name says what differs from the default: llama_bench_SHAPE[_TYPE][_LN].json
SUFFIX=$([ "$QTYPE" = Q2_K ] || echo "_$QTYPE")${LAYERS:+_L$LAYERS}
for S in $SHAPES; do
  PYTHONPATH=/tmp/lc/gguf-py python3 "$HERE/llamacpp_moe.py" /tmp/$S.gguf "$QTYPE" $S > "$OUT/gguf_$S.log" 2>&1 || { tail -20 "$OUT/gguf_$S.log"; continue; }
  timeout 200 /tmp/lc/build/bin/llama-bench -m /tmp/$S.gguf -ngl 99 -fa 1 -p 0 -n 64 -d 4096,32768 -ctk f16 -ctv f16 \
    -r 2 -o json > "$OUT/llama_bench_$S$SUFFIX.json" 2> "$OUT/bench_$S.err"
  echo "bench $S$SUFFIX rc=$? at $((SECONDS - t0)) s"; rm -f /tmp/$S.gguf
  python3 -c "
import json; d = json.load(open('$OUT/llama_bench_$S$SUFFIX.json'))
for r in d: print('$S', 'depth', r.get('n_depth'), round(1000 / max(r.get('avg_ts', 1e-9), 1e-9), 3), 'ms/token')"
done
