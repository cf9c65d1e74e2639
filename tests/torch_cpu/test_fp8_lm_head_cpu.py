"""The FP8 LM head of the harness (paddle_fastffn.torch.ops.linear_cross_entropy with fp8_recipe) on
the CPU kernels (cpu_kernels: the FP8 kernels' contract in torch ops), against the GPU test's float64
reference of the same quantisation (tests/gpu/test_fp8_lm_head.py), at shapes the CPU runs quickly:
the product's core/fp8/lm_head.py composition, run by the harness before any GPU session."""

import pytest
import torch

from tests.gpu.test_fp8_lm_head import (check_against_reference, check_frozen_hidden_gives_the_same_d_weight,
                                        check_rejections)

# (tokens, hidden, vocab, chunk): several chunks with a padded last one; one chunk of a token count
# that is not a multiple of 16.
SHAPES = [(300, 64, 256, 100), (45, 32, 96, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("transpose_weight", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize("tokens,width,vocab,chunk", SHAPES, ids=str)
def test_fp8_head_on_the_cpu_harness_matches_the_reference(tokens, width, vocab, chunk, transpose_weight, dtype):
    check_against_reference(tokens, width, vocab, chunk, transpose_weight, dtype, device="cpu")


def test_fp8_head_argument_errors_on_the_cpu_harness():
    check_rejections(device="cpu")


def test_fp8_head_of_frozen_hidden_states_on_the_cpu_harness():
    check_frozen_hidden_gives_the_same_d_weight(device="cpu")
