#!/usr/bin/env bash
# Set up and run the whole test suite (CPU). Where nvcc exists, the CUDA math-library headers are
# fetched first so that tests/build_checks can compile the Paddle GPU bindings (in CI a missing nvcc or
# header fetch fails those tests). GPU kernel tests (tests/gpu) skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
venv=${FASTFFN_VENV:-.venv}
if command -v nvcc >/dev/null; then
  export FASTFFN_CUDA_MATH_HEADERS=${FASTFFN_CUDA_MATH_HEADERS:-$HOME/.cache/paddle_fastffn/cuda_math_headers}
  bash scripts/fetch_cuda_headers.sh "$FASTFFN_CUDA_MATH_HEADERS" >/dev/null
fi
"$venv/bin/python" -m pytest tests -q -p no:cacheprovider "$@"
