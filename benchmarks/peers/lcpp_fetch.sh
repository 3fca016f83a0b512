#!/usr/bin/env bash
# gpu/lcpp/src.tgz (git-ignored, ~6 MB): the llama.cpp sources vendored in the llama-cpp-python 0.3.36 sdist,
# minus the backends and UI a CUDA llama-bench build does not need; `carry` it to the GPU machine, where
# benchmarks/peers/llamacpp_peer.sh builds llama-bench from it. The sdist: $LCPP_SDIST if set, else pip download.
set -euo pipefail
cd "$(dirname "$0")/../.."
t=$(mktemp -d)
if [ -n "${LCPP_SDIST:-}" ]; then cp "$LCPP_SDIST" "$t/"; else
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$t"; fi
tar xzf "$t"/llama_cpp_python-0.3.36.tar.gz -C "$t"
mkdir -p gpu/lcpp
(cd "$t"/llama_cpp_python-0.3.36/vendor/llama.cpp && tar czf - \
  --exclude='ggml/src/ggml-vulkan' --exclude='ggml/src/ggml-sycl' --exclude='ggml/src/ggml-metal' \
  --exclude='ggml/src/ggml-cann' --exclude='ggml/src/ggml-musa' --exclude='ggml/src/ggml-opencl' \
  --exclude='ggml/src/ggml-kompute' --exclude='tools/server/public*' --exclude='tools/server/webui' \
  --exclude='tools/ui' CMakeLists.txt cmake ggml src include common vendor tools gguf-py LICENSE) > gpu/lcpp/src.tgz
rm -rf "$t"; ls -la gpu/lcpp/src.tgz
