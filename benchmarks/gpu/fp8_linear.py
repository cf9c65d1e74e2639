"""The FP8 linear layer (LLaMA's attention projections q/k/v fused and o) composed from the C entry
points of fastffn/scaled_tensor.h through the ctypes harness, with fp8_ffn's recipes, scaling
states and weight cache. torch only allocates, supplies the stream and runs autograd around it.

y [T, N] = x [T, K] @ W^T, W [N, K] in torch's Linear layout; e4m3 for x and W, e5m2 for dy:

  forward   q(x), q(x)^T   e4m3 = quantize(x)                 one pass (two with current scaling)
            y [T, N]       x.dtype = gemm(q(x), q(W))         fast accumulation (the recipe's)
            kept for backward: q(x)^T and its scale_inv (1 byte per element; x itself is dropped)
  backward  q(dy), q(dy)^T e5m2 = quantize(dy)
            dx [T, K]      = gemm(q(dy), q(W)^T)
            dW [N, K]      = gemm(q(dy)^T, q(x)^T)

Which stored copy each GEMM reads (fastffn_gemm_cuda: D[M, N] = A[M, K] @ B[N, K]^T, FP8 operands
K-major only):

  | GEMM   | D [M, N]   | K | A, stored [M, K]  | B, stored [N, K]            |
  |--------|------------|---|-------------------|-----------------------------|
  | fwd    | y  [T, N]  | K | q(x)    [T, K]    | q(W)   [N, K] (as stored)   |
  | dgrad  | dx [T, K]  | N | q(dy)   [T, N]    | q(W)^T [K, N] (weight cache)|
  | wgrad  | dW [N, K]  | T | q(dy)^T [N, T]    | q(x)^T [K, T] (kept)        |

So T, K and N must all be multiples of 16 (fp8_ffn.GEMM_ALIGNMENT). Scaling is the core's
ScalingState (paddle_fastffn/core/fp8/scaling.py), the delayed recipe's warm start included (the
first quantisation of x and dy is current-scaled and seeds their histories).
"""

from __future__ import annotations

import torch

from benchmarks.gpu import fp8_harness as fp8
from benchmarks.gpu.fp8_ffn import DEFAULT_RECIPE, GEMM_ALIGNMENT, Fp8Recipe, misaligned
from benchmarks.gpu.torch_fp8_backend import Fp8WeightCache, TorchFp8Backend, quantize_weight
from paddle_fastffn.core.fp8.recipe import FAST_ACCUM_FORWARD


class Fp8LinearState:
    """What one FP8 linear keeps between steps: the core's ScalingStates (Fp8Recipe.linear_states)
    for x, W (current-scaled under both recipes) and dy, on `device`, and the weight cache."""

    def __init__(self, recipe: Fp8Recipe | None = None, device="cuda"):
        self.recipe = recipe or DEFAULT_RECIPE
        states = self.recipe.linear_states(TorchFp8Backend(device))
        self.x, self.weight, self.dy = states.input, states.weight, states.grad_output
        self.cache = Fp8WeightCache()


def check_linear_shapes(tokens: int, weight: torch.Tensor, in_features: int):
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"Fp8Linear: weight {tuple(weight.shape)} does not fit inputs of width {in_features} "
                         f"(need [out, in])")
    sizes = (("tokens T", tokens), ("in_features K", in_features), ("out_features N", weight.shape[0]))
    bad = misaligned(sizes)
    if bad:
        raise ValueError(f"Fp8Linear: {bad} not a positive multiple of {GEMM_ALIGNMENT} (cuBLASLt's FP8 "
                         f"GEMMs: T is the K of the weight-gradient GEMM); pad the tokens")


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, state: Fp8LinearState):
        k = fp8.kernels()
        width = x.shape[-1]
        x2 = x.reshape(-1, width)
        check_linear_shapes(x2.shape[0], weight, width)
        qx = state.x.quantize(x2.contiguous(), end_step=False, rowwise=True, transpose=True)
        qw = state.cache.get(weight, state.weight, quantize_weight)
        y = k.gemm_q(qx, qw, x.dtype, fast_accum=FAST_ACCUM_FORWARD)
        state.x.end_step()
        ctx.save_for_backward(qx.data_t, qx.scale_inv)
        ctx.qw, ctx.state, ctx.x_shape, ctx.dtypes = qw, state, x.shape, (x.dtype, weight.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        k = fp8.kernels()
        q_x_t, x_scale_inv = ctx.saved_tensors
        qw, state = ctx.qw, ctx.state
        x_dtype, w_dtype = ctx.dtypes
        need_x, need_w = ctx.needs_input_grad[:2]
        qdy = state.dy.quantize(dy.reshape(-1, dy.shape[-1]).to(x_dtype).contiguous(), end_step=False,
                                rowwise=need_x, transpose=need_w)
        dx = dw = None
        if need_x:
            dx = k.gemm(qdy.data, qw.data_t, x_dtype, a_scale_inv=qdy.scale_inv,
                        b_scale_inv=qw.scale_inv).reshape(ctx.x_shape)
        if need_w:
            dw = k.gemm(qdy.data_t, q_x_t, w_dtype, a_scale_inv=qdy.scale_inv, b_scale_inv=x_scale_inv)
        state.dy.end_step()
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, state: Fp8LinearState) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T with FP8 GEMMs -> [..., N] in x's dtype."""
    return Fp8LinearFunction.apply(x, weight, state)
