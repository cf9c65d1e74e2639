"""The FP8 FFN: LLaMA's SwiGLU MLP, y = swiglu(x @ W_gu) @ W_d, with FP8 GEMMs and SwiGLU fused
with the quantisation of its output; the composition the GPU benchmarks time
(paddle_fastffn/torch/fp8/ffn.py), call for call (integration/composition.py: FP8_FFN_CALLS).

Paddle's layout: x [..., H]; W_gu = gate_up_fused_proj.weight [H, 2I], columns [gate | up];
W_d = down_proj.weight [I, H]; T tokens. e4m3 for activations and weights, e5m2 for gradients
(Transformer Engine's HYBRID), per-tensor scales (recipe.py), fp32 accumulation:

  forward   q(x), q(x)^T        e4m3 = quantize(x)                          (state x)
            q(W_gu), q(W_d)     e4m3, both layouts, once per weight version (WeightCache; w_gate_up,
                                w_down: current scaling under both recipes)
            gate_up [T, 2I]     x.dtype = q(x) @ q(W_gu)                     fast accumulation
            q(h) [T, I]         e4m3 = quantize(h = silu(gate) * up)        (state h) h in fp32 only,
                                                                            never rounded to 16 bits
            q(gate_up) [T, 2I]  e4m3 = quantize(gate_up), in the same pass  (state gate_up; with
                                Fp8Recipe.saved_gate_up "fp8", the default)
            y [T, H]            x.dtype = q(h) @ q(W_d)                      fast accumulation
            end of forward: delayed scaling updates x's, h's (and gate_up's) histories
            kept for backward: q(x)^T, q(gate_up) and its scale_inv (or gate_up in x.dtype with
                                saved_gate_up "activation"), h's scale
  backward  q(dy), q(dy)^T      e5m2 = quantize(dy in x.dtype)              (state dy)
            d_h [T, I]          x.dtype = q(dy) @ q(W_d)^T
            q(d_gate_up) [T, 2I], its transpose: e5m2 of [d_gate | d_up] in fp32 from the saved
                                gate_up (the FP8 copy dequantised in fp32, or the 16-bit one) and
                                d_h (state d_gate_up), and q(h)^T: h recomputed in fp32 and
                                quantised with the forward's h scale (from a 16-bit gate_up the
                                forward's bytes; from the FP8 copy within its rounding)
            dW_d [I, H]         W_d.dtype  = q(h)^T @ q(dy)
            dx [T, H]           x.dtype    = q(d_gate_up) @ q(W_gu)^T
            dW_gu [H, 2I]       W_gu.dtype = q(x)^T @ q(d_gate_up)
            end of backward: delayed scaling updates dy's and d_gate_up's histories
  SwiGLU's fp32 expressions are swiglu_fp8.cu's: h = silu(g) * u, d_gate = d_h * u * sig * (1 +
  g (1 - sig)), d_up = d_h * silu(g), sig = sigmoid(g).

The forward and backward are core/fp8/ffn.py's Fp8FFNOp (written once, also run by the torch
harness), over two Paddle backends with these quantisation points and formats:
  emulated (fp8_ffn; CPU CI, fast_ffn_fp8_emulate): fp32 GEMMs on the dequantised FP8 values
      (exact products; only the fp32 summation differs from the tensor cores'), 16-bit roundings
      where the GPU stores 16-bit tensors (gate_up, d_h, the outputs).
  CUDA (fp8_ffn_cuda; sm_90 with a CUDA Paddle): the C entry points through csrc/paddle/fp8_op.cc
      and swiglu_fp8_op.cc. fastffn_gemm_cuda computes D[M, N] = A[M, K] @ B[N, K]^T with both FP8
      operands K-major, so each operand is the stored copy whose rows run along K. Paddle's
      weights are [in, out] where torch's are [out, in], so the copy of a weight each GEMM reads
      is the other one than the harness's (cuda.py says the same of the linear), and the weight
      gradients, computed in Paddle's layout, have A and B the other way round:

  | GEMM          | D [M, N]        | K  | A, stored [M, K]        | B, stored [N, K]              |
  |---------------|-----------------|----|-------------------------|-------------------------------|
  | fwd gate_up   | gate_up [T, 2I] | H  | q(x)        [T, H]      | q(W_gu)^T [2I, H] (transposed) |
  | fwd down      | y [T, H]        | I  | q(h)        [T, I]      | q(W_d)^T  [H, I]  (transposed) |
  | dgrad down    | d_h [T, I]      | H  | q(dy)       [T, H]      | q(W_d)    [I, H]  (as stored)  |
  | wgrad down    | dW_d [I, H]     | T16| q(h)^T      [I, T16]    | q(dy)^T   [H, T16]             |
  | dgrad gate_up | dx [T, H]       | 2I | q(d_gu)     [T, 2I]     | q(W_gu)   [H, 2I] (as stored)  |
  | wgrad gate_up | dW_gu [H, 2I]   | T16| q(x)^T      [H, T16]    | q(d_gu)^T [2I, T16]            |

  Tokens: T is the K of the weight gradients and the row length of the transposed copies, which
  cuBLASLt needs as a multiple of 16: the transposed copies are written into [.., T16] buffers
  (T16 = T rounded up to 16) whose extra columns the ops zero (zero tokens change no amax and no
  GEMM result), as for the linear; any T runs (the harness, whose batches are aligned, rejects
  others). H and I must be multiples of 16 (the LLaMA patch keeps a misaligned FFN in bf16).
  The CUDA path is compile-checked and its call sequence traced on CPU (tests/fp8/test_ffn.py);
  its kernels are proven on the H200 through the harness; it has not run inside Paddle on a GPU.

fp8_ffn_ref: the formulas above with given scales (no autograd, no states), beside the op.
"""

from __future__ import annotations

import math

import paddle

from ..core.fp8.ffn import Fp8FFNOp
from ._autograd import pylayer
from .cuda import CUDA, GEMM_ALIGNMENT, backend_for, states_on
from .emulated import EMULATED, swiglu_bwd32, swiglu_fwd32
from .formats import quantize_dequantize
from .linear import warn_emulated
from .recipe import FfnScalingStates, Fp8Recipe
from .weight_cache import WeightCache

__all__ = ["Fp8FFN", "ffn_widths", "fp8_ffn", "fp8_ffn_cuda", "fp8_ffn_ref", "plain_linear", "swiglu_bwd32",
           "swiglu_fwd32"]


def _dy2d(grad_output, dtype):
    """The output gradient [T, H] in the activation dtype (the GEMMs' and the kernels' input)."""
    dy = grad_output.reshape([-1, grad_output.shape[-1]])
    return dy if dy.dtype == dtype else dy.astype(dtype)


# The core's FP8 FFN (core/fp8/ffn.py) over the emulated backend and over the CUDA ops.
_EmulatedFp8FFN = pylayer(Fp8FFNOp, EMULATED)
_CudaFp8FFN = pylayer(Fp8FFNOp, CUDA)


# --- public functions ----------------------------------------------------------------------------

def ffn_widths(op: str, w_gate_up, w_down) -> tuple[int, int]:
    """(H, I) of the weights [H, 2I] and [I, H]; ValueError naming them otherwise."""
    gate_up_shape, down_shape = list(w_gate_up.shape), list(w_down.shape)
    if len(gate_up_shape) != 2 or len(down_shape) != 2:
        raise ValueError(f"{op}: w_gate_up and w_down must be 2-D, got {gate_up_shape} and {down_shape}")
    hidden, inter = gate_up_shape[0], down_shape[0]
    if gate_up_shape[1] != 2 * inter or down_shape[1] != hidden:
        raise ValueError(f"{op}: w_gate_up {gate_up_shape} and w_down {down_shape} must be [H, 2I] and "
                         f"[I, H] (Paddle's [in, out] layout, gate_up packed [gate | up])")
    return hidden, inter


def _check_shapes(op: str, x, w_gate_up, w_down) -> tuple[int, int]:
    hidden, inter = ffn_widths(op, w_gate_up, w_down)
    if x.shape[-1] != hidden:
        raise ValueError(f"{op}: x's last dimension {x.shape[-1]} must be w_gate_up's H = {hidden}")
    return hidden, inter


def fp8_ffn(x: paddle.Tensor, w_gate_up: paddle.Tensor, w_down: paddle.Tensor, *, states: FfnScalingStates,
            weight_cache: WeightCache | None = None) -> paddle.Tensor:
    """The FP8 FFN, emulated: x [..., H] (fp32/bf16/fp16), w_gate_up [H, 2I] ([gate | up]),
    w_down [I, H] -> y [..., H] in x.dtype; dx in x.dtype, dW in each weight's dtype. The
    quantisation points and formats of the module docstring, fp32 GEMMs on the FP8 values. States
    are updated by every call; weight_cache reuses the weights' FP8 copies until they change
    (without one each GEMM's copy is quantised when it runs: core/fp8/linear.py weight_for_forward). Any shape (Fp8FFN decides what runs in FP8)."""
    _check_shapes("fp8_ffn", x, w_gate_up, w_down)
    warn_emulated()
    return _EmulatedFp8FFN.apply(x, w_gate_up, w_down, states, weight_cache, None)


def fp8_ffn_cuda(x: paddle.Tensor, w_gate_up: paddle.Tensor, w_down: paddle.Tensor, *, states: FfnScalingStates,
                 weight_cache: WeightCache | None) -> paddle.Tensor:
    """The FP8 FFN on a Hopper GPU: fp8_ffn's contract through the C entry points (module
    docstring). H and I multiples of 16, any token count; x bf16, fp16 or fp32."""
    hidden, inter = _check_shapes("fp8_ffn_cuda", x, w_gate_up, w_down)
    if hidden % GEMM_ALIGNMENT or inter % GEMM_ALIGNMENT:
        raise ValueError(f"fp8_ffn_cuda: H = {hidden} and I = {inter} must be multiples of {GEMM_ALIGNMENT} "
                         f"(cuBLASLt's FP8 alignment)")
    if x.dtype not in (paddle.bfloat16, paddle.float16, paddle.float32):
        raise ValueError(f"fp8_ffn_cuda: x must be bfloat16, float16 or float32, got {x.dtype}")
    states_on(states, x.place)
    return _CudaFp8FFN.apply(x, w_gate_up, w_down, states, weight_cache, None)


def fp8_ffn_ref(x, w_gate_up, w_down, grad_output=None, *, x_scale, w_gate_up_scale, w_down_scale, h_scale,
                grad_scale=None, d_gate_up_scale=None, gate_up_scale=None, forward_format: str = "e4m3",
                backward_format: str = "e5m2"):
    """Reference of fp8_ffn with given scales, by the formulas of the module docstring, no
    autograd. Returns y, or (y, dx, dW_gu, dW_d) when grad_output is given; gate_up_scale given:
    the backward reads gate_up's FP8 copy at that scale (saved_gate_up "fp8"), else gate_up."""
    def q(t, scale, fmt):
        return quantize_dequantize(t, scale, fmt)

    x2d = x.reshape([-1, x.shape[-1]])
    xq = q(x2d, x_scale, forward_format)
    w_gu = q(w_gate_up, w_gate_up_scale, forward_format)
    w_d = q(w_down, w_down_scale, forward_format)
    gate_up = (xq @ w_gu).astype(x.dtype)
    hq = q(swiglu_fwd32(gate_up), h_scale, forward_format)
    y = (hq @ w_d).astype(x.dtype).reshape(x.shape)
    if grad_output is None:
        return y
    dyq = q(_dy2d(grad_output, x.dtype), grad_scale, backward_format)
    d_h = paddle.matmul(dyq, w_d, transpose_y=True).astype(x.dtype)
    saved = gate_up if gate_up_scale is None else q(gate_up, gate_up_scale, forward_format)
    d_gate_up, h_recomputed = swiglu_bwd32(saved, d_h)
    d_gu = q(d_gate_up, d_gate_up_scale, backward_format)
    dx = paddle.matmul(d_gu, w_gu, transpose_y=True).astype(x.dtype).reshape(x.shape)
    d_w_gu = paddle.matmul(xq, d_gu, transpose_x=True).astype(w_gate_up.dtype)
    d_w_d = paddle.matmul(q(h_recomputed, h_scale, forward_format), dyq, transpose_x=True).astype(w_down.dtype)
    return y, dx, d_w_gu, d_w_d


# --- the layer -----------------------------------------------------------------------------------

def plain_linear(layer) -> bool:
    """A paddle.nn.Linear computing exactly x @ weight: no bias, no LoRA, not tensor parallel."""
    return type(layer) is paddle.nn.Linear and layer.bias is None


class Fp8FFN:
    """The FP8 FFN of one SwiGLU MLP whose gate_up_fused_proj ([H, 2I], [gate | up]) and down_proj
    ([I, H]) are plain Linear layers. Not a Layer: the Linears keep their parameters, names and
    checkpoints; this object holds the six scaling states (FfnScalingStates) and the weight cache,
    and fp8_state_dict / set_fp8_state_dict save and restore the states. H and I must be multiples
    of 16. uses_fp8(tokens) is the recipe's min_gemm_size rule (callers run their 16-bit MLP
    otherwise); backend as Fp8Linear's ("auto": CUDA where it can run, emulated elsewhere)."""

    def __init__(self, gate_up: paddle.nn.Linear, down: paddle.nn.Linear, recipe: Fp8Recipe,
                 backend: str = "auto"):
        for name, layer in (("gate_up", gate_up), ("down", down)):
            if not plain_linear(layer):
                raise TypeError(f"Fp8FFN: `{name}` must be a paddle.nn.Linear without bias (LoRA and tensor-parallel "
                                f"layers run through Fp8Linear), got {type(layer).__name__}")
        if backend not in ("auto", "cuda", "emulated"):
            raise ValueError(f"Fp8FFN backend must be 'auto', 'cuda' or 'emulated', got {backend!r}")
        self.hidden, self.intermediate = ffn_widths("Fp8FFN", gate_up.weight, down.weight)
        if self.hidden % GEMM_ALIGNMENT or self.intermediate % GEMM_ALIGNMENT:
            raise ValueError(f"Fp8FFN: H = {self.hidden} and I = {self.intermediate} must be multiples of "
                             f"{GEMM_ALIGNMENT} (cuBLASLt's FP8 alignment)")
        self.gate_up, self.down, self.recipe, self.backend = gate_up, down, recipe, backend
        self.states = recipe.ffn_states()
        self.weight_cache = WeightCache()

    def uses_fp8(self, tokens: int) -> bool:
        """Whether the FFN's smaller GEMM (down: tokens x H x I; gate_up is twice that) reaches
        the recipe's min_gemm_size."""
        return self.recipe.gemm_uses_fp8(tokens, self.hidden, self.intermediate)

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        w_gate_up, w_down = self.gate_up.weight, self.down.weight
        trained = not (w_gate_up.stop_gradient and w_down.stop_gradient)
        cache = self.weight_cache if self.recipe.caches_weight(trained) else None
        if math.prod(x.shape[:-1]) > 0 and backend_for(self.backend, x) == "cuda":
            return fp8_ffn_cuda(x, w_gate_up, w_down, states=self.states, weight_cache=cache)
        return fp8_ffn(x, w_gate_up, w_down, states=self.states, weight_cache=cache)

    def fp8_state_dict(self) -> dict:
        return self.states.state_dict()

    def set_fp8_state_dict(self, state: dict):
        self.states.set_state_dict(state)
