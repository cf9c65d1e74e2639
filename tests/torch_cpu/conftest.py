"""The CPU smoke of the GPU benchmarks (benchmarks/gpu): run by scripts/test.sh in the torch venv
(scripts/setup_torch_env.sh), not in the Paddle venv. Every test here runs the harness on the CPU
(paddle_fastffn/torch/cpu_kernels.select())."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # smoke.py

from paddle_fastffn.torch import cpu_kernels


@pytest.fixture(scope="session", autouse=True)
def harness_on_cpu():
    cpu_kernels.select()
