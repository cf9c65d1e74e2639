"""The FP8 linear layer (LLaMA's attention projections q/k/v fused and o) composed from the C entry
points of fastffn/scaled_tensor.h through the ctypes harness, with fp8_ffn's recipes, scaling
states and weight cache. torch only allocates, supplies the stream and runs autograd around it.

y [T, N] = x [T, K] @ W^T, W [N, K] in torch's Linear layout; e4m3 for x and W, e5m2 for dy:

  forward   q(x), q(x)^T   e4m3 = quantize(x)                 one pass (two with current scaling);
                                                              q(x)^T only where W wants a gradient
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

So T, K and N must all be multiples of 16 (fp8_ffn.GEMM_ALIGNMENT). The forward and backward are
the product's Fp8LinearOp (paddle_fastffn/core/fp8/linear.py) over the torch FP8 backend
(fp8/backend.py: its `function` adapter), the same class the Paddle emulated and CUDA paths
run (the weight-layout column of its table is torch's). Scaling is the core's
ScalingState (paddle_fastffn/core/fp8/scaling.py), the delayed recipe's warm start included (the
first quantisation of x and dy is current-scaled and seeds their histories).
"""

from __future__ import annotations

import torch

from paddle_fastffn.core.fp8.linear import Fp8LinearOp, FrozenFp8Weight
from paddle_fastffn.core.lora import Fp8Base
from paddle_fastffn.torch.fp8.backend import TORCH as TORCH_FP8
from paddle_fastffn.torch.fp8.backend import Fp8WeightCache, TorchFp8Backend, function
from paddle_fastffn.torch.fp8.ffn import DEFAULT_RECIPE, GEMM_ALIGNMENT, Fp8Recipe, misaligned


class Fp8LinearState:
    """What one FP8 linear keeps between steps: the core's ScalingStates (Fp8Recipe.linear_states)
    for x, W (current-scaled under both recipes) and dy, on `device`, and the weight cache."""

    def __init__(self, recipe: Fp8Recipe | None = None, device="cuda"):
        self.recipe = recipe or DEFAULT_RECIPE
        self.states = self.recipe.linear_states(TorchFp8Backend(device))
        self.x, self.weight, self.dy = self.states.input, self.states.weight, self.states.grad_output
        self.cache = Fp8WeightCache()


def check_linear_shapes(tokens: int, weight_shape, in_features: int):
    if len(weight_shape) != 2 or weight_shape[1] != in_features:
        raise ValueError(f"Fp8Linear: weight {tuple(weight_shape)} does not fit inputs of width {in_features} "
                         f"(need [out, in])")
    sizes = (("tokens T", tokens), ("in_features K", in_features), ("out_features N", weight_shape[0]))
    bad = misaligned(sizes)
    if bad:
        raise ValueError(f"Fp8Linear: {bad} not a positive multiple of {GEMM_ALIGNMENT} (cuBLASLt's FP8 "
                         f"GEMMs: T is the K of the weight-gradient GEMM); pad the tokens")


# The product's FP8 linear (paddle_fastffn/core/fp8/linear.py: Fp8LinearOp) over the torch backend.
Fp8LinearFunction = function(Fp8LinearOp)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor | FrozenFp8Weight, state: Fp8LinearState) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T with FP8 GEMMs -> [..., N] in x's dtype; weight may be a
    FrozenFp8Weight (freeze_weight: a frozen weight held only in FP8)."""
    base = fp8_base_of(x, weight, state)
    # Rows in, rows out: the Function's output is then its GEMM's result itself, not a view made
    # inside it, so that the LoRA sum may accumulate into it in place (core/lora.py). Rows given are
    # taken as they are: a same-shape reshape would add a view and its backward node per call.
    width = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(x.numel() // width if width else 0, width)
    tensor = None if base.frozen_weight is not None else weight
    y = Fp8LinearFunction.apply(rows, tensor, None, base.states, base.weight_cache, base.frozen_weight)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def fp8_base_of(x: torch.Tensor, weight: torch.Tensor | FrozenFp8Weight, state: Fp8LinearState) -> Fp8Base:
    """What Fp8LinearOp takes for x @ weight^T beside x and the weight tensor, after the shape checks:
    fp8_linear's options, and the FP8 base of a LoRA projection (core/lora.py LoraLinear's
    fp8_base)."""
    width = x.shape[-1]
    check_linear_shapes(x.numel() // width if width else 0, tuple(weight.shape), width)
    if isinstance(weight, FrozenFp8Weight):
        return Fp8Base(TORCH_FP8, state.states, None, weight)
    cache = state.cache if state.recipe.caches_weight(weight.requires_grad) else None
    return Fp8Base(TORCH_FP8, state.states, cache, None)


def freeze_weight(weight: torch.Tensor, state: Fp8LinearState, both_copies: bool = False) -> FrozenFp8Weight:
    """`weight` [N, K] (frozen) as the FP8 copy its forward GEMM reads (and, both_copies, its
    input-gradient GEMM's), quantised once with the linear's weight scaling state
    (Fp8Recipe.frozen_weights "fp8" / "fp8_both")."""
    return FrozenFp8Weight.freeze(state.weight.backend, weight.detach(), state.weight, both_copies)
