"""The FP8 FFN (LLaMA's SwiGLU MLP) composed from the C entry points of fastffn/scaled_tensor.h
through the ctypes harness, the composition the Paddle GPU path makes of the same calls. torch
only allocates, supplies the stream and runs autograd around it.

Shapes, precision, and where precision changes (W_gu [2I, H] = [W_gate; W_up], W_d [H, I], the
torch Linear layout; T tokens; e4m3 for activations and weights, e5m2 for gradients, TE's HYBRID):

  forward   q(x), q(x)^T        e4m3 = quantize(x [T, H] 16/32-bit)          one pass
            gate_up [T, 2I]     x.dtype = gemm(q(x), q(W_gu))              fast accumulation
            q(h), q(gate_up)    e4m3 = swiglu_fwd_fp8(gate_up)             h only in fp32 registers;
                                gate_up's own copy in the same pass (saved_gate_up "fp8")
            y [T, H]            x.dtype = gemm(q(h), q(W_d))               fast accumulation
            kept for backward:  q(x)^T, q(gate_up) (for the SwiGLU recompute; the 16-bit gate_up
                                with saved_gate_up "activation"), h's scale; the cached weight
                                copies. x itself and q(x) are dropped, and so is the 16-bit
                                gate_up where its copy is kept.
  backward  q(dy), q(dy)^T      e5m2 = quantize(dy)                        one pass
            d_h [T, I]          x.dtype = gemm(q(dy), q(W_d)^T)
            q(d_gu), q(d_gu)^T  e5m2 and q(h)^T e4m3 = swiglu_bwd_fp8(q(gate_up), d_h)   h recomputed
            d_W_d [H, I]        = gemm(q(dy)^T, q(h)^T)
            d_x [T, H]          = gemm(q(d_gu), q(W_gu)^T)
            d_W_gu [2I, H]      = gemm(q(d_gu)^T, q(x)^T)
  Backward GEMMs accumulate with cuBLASLt's periodic fp32 promotion (TE: fast accumulation in the
  forward only); weight gradients come out in the weight's dtype, d_x in x's.

Which copy each GEMM reads. fastffn_gemm_cuda computes D[M, N] = A[M, K] @ B[N, K]^T and takes FP8
operands K-major only (cuBLASLt's TN, its only FP8 layout on sm_89/sm_90: no transpose flags), so
every operand is a stored copy whose rows run along that GEMM's K:

  | GEMM            | D [M, N]       | K  | A, stored [M, K]   | B, stored [N, K]                 |
  |-----------------|----------------|----|--------------------|----------------------------------|
  | fwd gate_up     | gate_up [T,2I] | H  | q(x)     [T, H]    | q(W_gu)   [2I, H]  (as stored)   |
  | fwd down        | y [T, H]       | I  | q(h)     [T, I]    | q(W_d)    [H, I]   (as stored)   |
  | dgrad down      | d_h [T, I]     | H  | q(dy)    [T, H]    | q(W_d)^T  [I, H]   (transposed)  |
  | wgrad down      | d_W_d [H, I]   | T  | q(dy)^T  [H, T]    | q(h)^T    [I, T]   (transposed)  |
  | dgrad gate_up   | d_x [T, H]     | 2I | q(d_gu)  [T, 2I]   | q(W_gu)^T [H, 2I]  (transposed)  |
  | wgrad gate_up   | d_W_gu [2I, H] | T  | q(d_gu)^T [2I, T]  | q(x)^T    [H, T]   (transposed)  |

  So every tensor is needed in both layouts, each written in the pass that quantises it:
  x, dy (fastffn_fp8_quantize_cuda: out + out_t), W_gu, W_d (the same, once per step into the
  weight cache), d_gu (swiglu_bwd_fp8: d_gate_up + d_gate_up_t), h (row-wise by swiglu_fwd_fp8 in
  the forward; the transpose by swiglu_bwd_fp8 from the recomputed h, quantised with the forward's
  scale, so its bytes are the forward's transposed and no [I, T] copy lives between the passes).
  q(x) row-wise is read by the first GEMM only, so only q(x)^T is kept. Each K is one of H, I, 2I
  and T, and each FP8 row stride one of them in bytes: all must be multiples of 16 (cuBLASLt),
  so a token count T % 16 != 0 is rejected up front (pad the batch).

Scaling recipes (per tensor, Transformer Engine's semantics; state in fp32 device tensors, no
host synchronisation anywhere in a step):
  current  each quantisation computes the tensor's own amax in a first pass (the kernels' amax-only
           mode), fastffn_fp8_compute_scale_cuda turns it into scale = fmt_max * 2^-margin / amax
           on the device, and a second pass quantises with it.
  delayed  each activation and gradient quantisation uses the scale the tensor's amax history
           gave; its amax goes into history[0]; at the end of the forward (x, h) and of the
           backward (dy, d_gu), fastffn_fp8_update_amax_history_cuda takes
           max(history) (or history[0] for amax_compute_algo="most_recent"), sets the next scale
           and rolls the history. Warm start (delayed_warm_start, the default, as
           paddle_fastffn/core/fp8/recipe.py): a tensor's first quantisation, whose history holds no
           amax yet, runs as current scaling, and its amax seeds the history; without it scales
           start at 1 as TE's, and the first steps' e5m2 gradients underflow (recipe.py has the
           numbers). Weights are current-scaled under both recipes (Fp8Recipe.ffn_states).
  h and gate_up's copy are quantised by one pass: its amax-only pass gives both amaxes, and each
  has its own scale (and history).
  An amax of 0 or not finite keeps the previous scale (TE's delayed rule, used for both here).

Weights are quantised once per weight version into an Fp8WeightCache (both layouts): torch's version
counter sees every in-place update, optimizer steps included, so a changed weight is re-quantised
at its next use.

The recipe, the scaling state machine, the weight cache and the forward/backward orchestration are
the product's own (paddle_fastffn/core/fp8: recipe.py, scaling.py, weight_cache.py, ffn.py's
Fp8FFNOp, the class the Paddle emulated and CUDA paths run), over the torch FP8 backend
(fp8/backend.py: the kernels, torch's [out, in] weight layout, and `function`, the autograd
adapter). This file keeps the harness's state object, its shape checks and the public names.
"""

from __future__ import annotations

import torch

from paddle_fastffn.core.fp8.ffn import Fp8FFNOp
from paddle_fastffn.core.fp8.recipe import Fp8Recipe
from paddle_fastffn.core.fp8.scaling import ScalingState
from paddle_fastffn.torch.fp8.backend import Fp8WeightCache, TorchFp8Backend, function

__all__ = ["DEFAULT_RECIPE", "E4M3", "E5M2", "GEMM_ALIGNMENT", "Fp8FFN", "Fp8FFNState", "Fp8Recipe", "Fp8WeightCache",
           "ScalingState", "check_shapes", "fp8_ffn", "misaligned"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GEMM_ALIGNMENT = 16  # every K and every FP8 row stride of the six GEMMs (see the table above)
# The harness's recipe when none is given: current scaling (the product's Fp8Recipe defaults to
# delayed, the training default; the kernel benchmarks time current scaling's two passes).
DEFAULT_RECIPE = Fp8Recipe(scaling="current")


class Fp8FFNState:
    """Everything an FP8 FFN layer keeps between steps: the recipe, one core ScalingState per
    quantised tensor (Fp8Recipe.ffn_states: x, w_gate_up, w_down, h, dy, d_gate_up and gate_up's
    saved copy, None with saved_gate_up "activation"), on `device`, and the weight cache.
    `record`, when set to a dict, receives the intermediates of each forward and backward (tests
    check every stage with them)."""

    def __init__(self, recipe: Fp8Recipe | None = None, device="cuda"):
        self.recipe = recipe or DEFAULT_RECIPE
        self.states = self.recipe.ffn_states(TorchFp8Backend(device))
        states = self.states
        self.x, self.w_gate_up, self.w_down = states.x, states.w_gate_up, states.w_down
        self.h, self.dy, self.d_gate_up, self.gate_up = states.h, states.dy, states.d_gate_up, states.gate_up
        self.cache = Fp8WeightCache()
        self.record: dict | None = None


def misaligned(sizes) -> str:
    """"name = size" for each (name, size) that is not a positive multiple of GEMM_ALIGNMENT."""
    return ", ".join(f"{name} = {size}" for name, size in sizes if size <= 0 or size % GEMM_ALIGNMENT)


def check_shapes(tokens: int, w_gate_up: torch.Tensor, w_down: torch.Tensor, hidden: int):
    inter = w_down.shape[1]
    if tuple(w_gate_up.shape) != (2 * inter, hidden) or w_down.shape[0] != hidden:
        raise ValueError(f"Fp8FFN: W_gate_up {tuple(w_gate_up.shape)} and W_down {tuple(w_down.shape)} "
                         f"do not fit hidden {hidden} (need [2I, H] and [H, I])")
    sizes = (("tokens T", tokens), ("hidden H", hidden), ("intermediate I", inter))
    bad = misaligned(sizes)
    if bad:
        raise ValueError(
            f"Fp8FFN: {bad} not a positive multiple of {GEMM_ALIGNMENT}. cuBLASLt's FP8 GEMMs need "
            f"every K and every FP8 row stride to be one (T is the K of both weight-gradient GEMMs "
            f"and the row length of the transposed copies); pad the tokens to a multiple of "
            f"{GEMM_ALIGNMENT}")


# The product's FP8 FFN (paddle_fastffn/core/fp8/ffn.py: Fp8FFNOp) over the torch backend.
Fp8FFN = function(Fp8FFNOp)


def fp8_ffn(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
            state: Fp8FFNState) -> torch.Tensor:
    """The FP8 FFN: x [..., H] (bf16; fp16/fp32 work too), W_gate_up [2I, H], W_down [H, I] ->
    y [..., H] in x's dtype. T = x.numel() // H, H and I must be multiples of 16."""
    hidden = x.shape[-1]
    check_shapes(x.numel() // hidden if hidden else 0, w_gate_up, w_down, hidden)
    cache = state.cache if state.recipe.caches_weight(w_gate_up.requires_grad or w_down.requires_grad) else None
    return Fp8FFN.apply(x, w_gate_up, w_down, state.states, cache, state.record)
