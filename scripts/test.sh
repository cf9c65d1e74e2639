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
# PaddleFormers' side (tests/paddleformers) in its own environment: PaddleNLP and PaddleFormers cannot
# share one (pyproject.toml says why). FASTFFN_SKIP_PADDLEFORMERS=1 leaves it out of a local run.
if [[ ${FASTFFN_SKIP_PADDLEFORMERS:-0} != 1 ]]; then
  bash scripts/setup_paddleformers_env.sh
  pf_venv=${FASTFFN_PF_VENV:-.pf-venv}
  "$pf_venv/bin/python" -m pytest tests/paddleformers -q -p no:cacheprovider
fi
# The GPU benchmarks' CPU smoke (tests/torch_cpu, and tests/benchmarks_logic's torch tests): every section's contenders built and stepped at tiny
# shapes in the GPU machine's torch (its own venv: that machine has no Paddle; the benchmarks import
# paddle_fastffn from the tree). FASTFFN_SKIP_TORCH_SMOKE=1 leaves it out of a local run.
if [[ ${FASTFFN_SKIP_TORCH_SMOKE:-0} != 1 ]]; then
  bash scripts/setup_torch_env.sh
  torch_venv=${FASTFFN_TORCH_VENV:-.torch-venv}
  PYTHONPATH=$PWD "$torch_venv/bin/python" -c "import paddle_fastffn, paddle_fastffn.torch.llama" \
    || { echo "test.sh: paddle_fastffn must import without Paddle (the GPU machine has none)" >&2; exit 1; }
  PYTHONPATH=$PWD "$torch_venv/bin/python" -m pytest tests/torch_cpu tests/benchmarks_logic -q -p no:cacheprovider \
    -W ignore::UserWarning
fi
