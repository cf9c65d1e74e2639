#!/usr/bin/env bash
# Creates .torch-venv (or $FASTFFN_TORCH_VENV): the GPU machine's PyTorch side, for the CPU smoke of the
# GPU benchmarks (tests/torch_cpu). Versions are the GPU machine's (shared/gpu.md): torch 2.11.0,
# transformers 5.17.0, and the peers' wheels the benchmarks carry there (liger-kernel 0.8.5, torchao 0.18.0,
# peft 0.21.2 with accelerate 1.15.0 and psutil 7.2.2). Paddle is not installed here: the benchmarks import
# paddle_fastffn from the source tree (PYTHONPATH), as they do on the GPU machine, which has no Paddle.
# PyPI's Linux torch wheel is the CUDA build (it pulls the nvidia-* runtime packages); on a machine without
# a GPU it runs on the CPU, which is what the smoke needs.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FASTFFN_TORCH_VENV:-.torch-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q \
  torch==2.11.0 transformers==5.17.0 liger-kernel==0.8.5 torchao==0.18.0 peft==0.21.2 accelerate==1.15.0 \
  psutil==7.2.2 numpy pytest
"$venv/bin/python" -c "import torch, transformers, liger_kernel, torchao, peft; print('torch', torch.__version__, 'ready')"
