"""The FP8 FFN: LLaMA's SwiGLU MLP, y = swiglu(x @ W_gu) @ W_d, with FP8 GEMMs and SwiGLU fused
with the quantisation of its output; the composition the GPU benchmarks time
(benchmarks/gpu/fp8_ffn.py), call for call (integration/composition.py: FP8_FFN_CALLS).

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

Two backends with these quantisation points and formats:
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
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from . import cuda as fp8_cuda
from ..core.fp8.recipe import FAST_ACCUM_FORWARD
from ..core.fp8.scaling import quantize_with
from .cuda import CUDA, GEMM_ALIGNMENT, backend_for, gemm, padded_tokens, quantize_weight, states_on
from .formats import dequantize, from_fp8, quantize_dequantize
from .linear import warn_emulated
from .recipe import FfnScalingStates, Fp8Recipe
from .weight_cache import WeightCache


# --- SwiGLU in fp32 (swiglu_fp8.cu's expressions) --------------------------------------------------

def _gate_and_up(gate_up: paddle.Tensor):
    return paddle.chunk(gate_up.astype(paddle.float32), 2, axis=-1)


def swiglu_fwd32(gate_up: paddle.Tensor) -> paddle.Tensor:
    """h = silu(gate) * up in fp32 from gate_up [T, 2I] ([gate | up]) of any float dtype."""
    gate, up = _gate_and_up(gate_up)
    return gate * F.sigmoid(gate) * up


def swiglu_bwd32(gate_up: paddle.Tensor, d_h: paddle.Tensor):
    """(d_gate_up [T, 2I] = [d_gate | d_up], the recomputed h [T, I]) in fp32; h is the bits of
    swiglu_fwd32's."""
    gate, up = _gate_and_up(gate_up)
    d_h = d_h.astype(paddle.float32)
    sig = F.sigmoid(gate)
    silu = gate * sig
    d_gate_up = paddle.concat([d_h * up * sig * (1 + gate * (1 - sig)), d_h * silu], axis=-1)
    return d_gate_up, silu * up


def _weight(weight, state, weight_cache, quantize=None):
    if weight_cache is None:
        return state.quantize(weight) if quantize is None else quantize(weight, state)
    return weight_cache.get(weight, state, quantize=quantize)


def _dy2d(grad_output, dtype):
    """The output gradient [T, H] in the activation dtype (the GEMMs' and the kernels' input)."""
    dy = grad_output.reshape([-1, grad_output.shape[-1]])
    return dy if dy.dtype == dtype else dy.astype(dtype)


class _FfnContext:
    """What both backends keep beside their saved tensors: dtypes, shapes, needed gradients."""

    @staticmethod
    def save(ctx, x, w_gate_up, w_down, states):
        ctx.states = states
        ctx.dtypes = (x.dtype, w_gate_up.dtype, w_down.dtype)
        ctx.x_shape = x.shape
        ctx.needs = (not x.stop_gradient, not w_gate_up.stop_gradient, not w_down.stop_gradient)


# --- emulated ------------------------------------------------------------------------------------

def _forward_states(states: FfnScalingStates):
    """The states whose steps end with the forward: x, h and (kept in FP8) gate_up."""
    return [s for s in (states.x, states.h, states.gate_up) if s is not None]


class _Fp8FFNFunction(PyLayer):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, states: FfnScalingStates, weight_cache):
        qx = states.x.quantize(x.reshape([-1, x.shape[-1]]), end_step=False)
        q_gu = _weight(w_gate_up, states.w_gate_up, weight_cache)
        q_d = _weight(w_down, states.w_down, weight_cache)
        gate_up = paddle.matmul(dequantize(qx), dequantize(q_gu)).astype(x.dtype)
        qh = states.h.quantize(swiglu_fwd32(gate_up), end_step=False)
        h_scale = states.h.scale_used.clone()  # the backward re-quantises the recomputed h with it
        saved_gate_up, saved_scale_inv = gate_up, None
        if states.gate_up is not None:  # the copy the SwiGLU forward pass writes beside q(h)
            q_saved = states.gate_up.quantize(gate_up, end_step=False)
            saved_gate_up, saved_scale_inv = q_saved.data, q_saved.scale_inv
        y = paddle.matmul(dequantize(qh), dequantize(q_d)).astype(x.dtype)
        for state in _forward_states(states):
            state.end_step()
        ctx.save_for_backward(qx.data, qx.scale_inv, saved_gate_up, h_scale, q_gu.data, q_gu.scale_inv, q_d.data,
                              q_d.scale_inv)
        ctx.saved_scale_inv = saved_scale_inv
        _FfnContext.save(ctx, x, w_gate_up, w_down, states)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_output):
        x_data, x_scale_inv, gate_up, h_scale, gu_data, gu_scale_inv, d_data, d_scale_inv = ctx.saved_tensor()
        if ctx.saved_scale_inv is not None:
            gate_up = from_fp8(gate_up, ctx.saved_scale_inv)  # fp32, as the kernel reads the copy
        states = ctx.states
        x_dtype, gu_dtype, d_dtype = ctx.dtypes
        need_dx, need_dgu, need_dd = ctx.needs
        dy = dequantize(states.dy.quantize(_dy2d(grad_output, x_dtype), end_step=False))
        d_h = paddle.matmul(dy, from_fp8(d_data, d_scale_inv), transpose_y=True).astype(x_dtype)
        d_gate_up, h = swiglu_bwd32(gate_up, d_h)
        d_gu = dequantize(states.d_gate_up.quantize(d_gate_up, end_step=False))
        dx = d_w_gu = d_w_d = None
        if need_dd:
            h_q = quantize_dequantize(h, h_scale, states.h.fmt)  # recomputed, at the forward's scale
            d_w_d = paddle.matmul(h_q, dy, transpose_x=True).astype(d_dtype)
        if need_dx:
            dx = paddle.matmul(d_gu, from_fp8(gu_data, gu_scale_inv), transpose_y=True)
            dx = dx.astype(x_dtype).reshape(ctx.x_shape)
        if need_dgu:
            d_w_gu = paddle.matmul(from_fp8(x_data, x_scale_inv), d_gu, transpose_x=True).astype(gu_dtype)
        states.dy.end_step()
        states.d_gate_up.end_step()
        return dx, d_w_gu, d_w_d


# --- CUDA ----------------------------------------------------------------------------------------

def _contiguous(t: paddle.Tensor) -> paddle.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _swiglu_fwd_fp8(gate_up, state, gate_up_state, rowwise: bool):
    """q(h) [T, I] and, with gate_up_state, q(gate_up) [T, 2I] (rowwise) by fastffn_swiglu_fwd_fp8,
    or its amax-only pass (both amaxes). Returns (q(h), h's scale_inv, q(gate_up), its scale_inv)."""
    # scale_used / kernel_amax: scale and amax_history, except in a recompute's replay (the forward's
    # scale, a scratch amax), which runs no amax-only pass.
    gu = gate_up_state
    out = fp8_cuda._run("fastffn_swiglu_fwd_fp8", gate_up, state.scale_used, state.kernel_amax,
                        None if gu is None else gu.scale_used, None if gu is None else gu.kernel_amax,
                        state.fmt, rowwise, False, 0, rowwise and gu is not None)
    return out[0], out[2], out[3], out[4]


def _swiglu_bwd_fp8(gate_up, d_h, state, h_scale=None, h_fmt: str = "", tokens16: int = 0, gate_up_scale_inv=None):
    """q(d_gate_up) and its transpose [2I, tokens16] and, with h_fmt, q(h)^T [I, tokens16] by
    fastffn_swiglu_bwd_fp8, from gate_up in d_h's dtype or its FP8 copy (with gate_up_scale_inv);
    tokens16 0 is d_gate_up's amax-only pass. Returns (d_gate_up, d_gate_up^T, its scale_inv,
    h^T, h's scale_inv)."""
    quantise = tokens16 > 0
    out = fp8_cuda._run("fastffn_swiglu_bwd_fp8", gate_up, d_h, state.scale, state.amax_history, h_scale,
                        gate_up_scale_inv, state.fmt, quantise, quantise, h_fmt, False, bool(h_fmt), tokens16)
    return out[0], out[1], out[2], out[4], out[5]


class _CudaFp8FFNFunction(PyLayer):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, states: FfnScalingStates, weight_cache):
        x2d = _contiguous(x.reshape([-1, x.shape[-1]]))
        states_on(states, x.place)
        tokens16 = padded_tokens(x2d.shape[0])
        qx = fp8_cuda.quantize(x2d, states.x, transpose_cols=tokens16, end_step=False)
        q_gu = _weight(w_gate_up, states.w_gate_up, weight_cache, quantize_weight)
        q_d = _weight(w_down, states.w_down, weight_cache, quantize_weight)
        gate_up = gemm(qx.data, q_gu.data_t, x.dtype, qx.scale_inv, q_gu.scale_inv, fast_accum=FAST_ACCUM_FORWARD)
        h, gu_state = states.h, states.gate_up
        # One pass quantises h and (saved_gate_up "fp8") gate_up's copy; their scales together.
        h_data, h_scale_inv, gu_data, gu_scale_inv = quantize_with(
            CUDA, [h] if gu_state is None else [h, gu_state], lambda: _swiglu_fwd_fp8(gate_up, h, gu_state, False),
            lambda: _swiglu_fwd_fp8(gate_up, h, gu_state, True), end_step=False)
        y = gemm(h_data, q_d.data_t, x.dtype, h_scale_inv, q_d.scale_inv, fast_accum=FAST_ACCUM_FORWARD)
        h_scale = h.scale_used.clone()  # the backward re-quantises the recomputed h with it
        for state in _forward_states(states):
            state.end_step(CUDA)
        saved = (gate_up, None) if gu_state is None else (gu_data, gu_scale_inv)
        # Kept as attributes: FP8 copies (the weights' live in the cache anyway) and fp32 scalars.
        ctx.kept = (qx.data_t, qx.scale_inv, saved, h_scale, q_gu, q_d)
        ctx.tokens16 = tokens16
        _FfnContext.save(ctx, x, w_gate_up, w_down, states)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_output):
        x_t, x_scale_inv, (gate_up, gate_up_scale_inv), h_scale, q_gu, q_d = ctx.kept
        states, tokens16 = ctx.states, ctx.tokens16
        x_dtype, gu_dtype, d_dtype = ctx.dtypes
        need_dx, need_dgu, need_dd = ctx.needs
        qdy = fp8_cuda.quantize(_contiguous(_dy2d(grad_output, x_dtype)), states.dy, transpose_cols=tokens16,
                                end_step=False)
        d_h = gemm(qdy.data, q_d.data, x_dtype, qdy.scale_inv, q_d.scale_inv)
        dgu_state, h_fmt = states.d_gate_up, states.h.fmt if need_dd else ""
        d_gu, d_gu_t, d_gu_scale_inv, h_t, h_scale_inv = quantize_with(
            CUDA, [dgu_state], lambda: _swiglu_bwd_fp8(gate_up, d_h, dgu_state, gate_up_scale_inv=gate_up_scale_inv),
            lambda: _swiglu_bwd_fp8(gate_up, d_h, dgu_state, h_scale, h_fmt, tokens16, gate_up_scale_inv),
            end_step=False)
        d_h = None  # [T, I]: released before the remaining GEMMs allocate their outputs
        dx = d_w_gu = d_w_d = None
        if need_dd:
            d_w_d = gemm(h_t, qdy.data_t, d_dtype, h_scale_inv, qdy.scale_inv)
        if need_dx:
            dx = gemm(d_gu, q_gu.data, x_dtype, d_gu_scale_inv, q_gu.scale_inv).reshape(ctx.x_shape)
        if need_dgu:
            d_w_gu = gemm(x_t, d_gu_t, gu_dtype, x_scale_inv, d_gu_scale_inv)
        states.dy.end_step(CUDA)
        states.d_gate_up.end_step(CUDA)
        return dx, d_w_gu, d_w_d


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
    (without one they are quantised on every call). Any shape (Fp8FFN decides what runs in FP8)."""
    _check_shapes("fp8_ffn", x, w_gate_up, w_down)
    warn_emulated()
    return _Fp8FFNFunction.apply(x, w_gate_up, w_down, states, weight_cache)


def fp8_ffn_cuda(x: paddle.Tensor, w_gate_up: paddle.Tensor, w_down: paddle.Tensor, *, states: FfnScalingStates,
                 weight_cache: WeightCache) -> paddle.Tensor:
    """The FP8 FFN on a Hopper GPU: fp8_ffn's contract through the C entry points (module
    docstring). H and I multiples of 16, any token count; x bf16, fp16 or fp32."""
    hidden, inter = _check_shapes("fp8_ffn_cuda", x, w_gate_up, w_down)
    if hidden % GEMM_ALIGNMENT or inter % GEMM_ALIGNMENT:
        raise ValueError(f"fp8_ffn_cuda: H = {hidden} and I = {inter} must be multiples of {GEMM_ALIGNMENT} "
                         f"(cuBLASLt's FP8 alignment)")
    if x.dtype not in (paddle.bfloat16, paddle.float16, paddle.float32):
        raise ValueError(f"fp8_ffn_cuda: x must be bfloat16, float16 or float32, got {x.dtype}")
    return _CudaFp8FFNFunction.apply(x, w_gate_up, w_down, states, weight_cache)


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
        if math.prod(x.shape[:-1]) > 0 and backend_for(self.backend, x) == "cuda":
            return fp8_ffn_cuda(x, w_gate_up, w_down, states=self.states, weight_cache=self.weight_cache)
        return fp8_ffn(x, w_gate_up, w_down, states=self.states, weight_cache=self.weight_cache)

    def fp8_state_dict(self) -> dict:
        return self.states.state_dict()

    def set_fp8_state_dict(self, state: dict):
        self.states.set_state_dict(state)
