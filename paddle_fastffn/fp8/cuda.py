"""The CUDA FP8 backend of Fp8Linear: y = x @ W (+ b) with cuBLASLt FP8 GEMMs and the FP8
quantisation kernels of csrc/ (fastffn/scaled_tensor.h), through the ops of csrc/paddle/fp8_op.cc.

What is verified where. This Paddle glue is compile-checked on the CPU machines
(tests/build_checks compiles fp8_op.cc with PADDLE_WITH_CUDA and checks every kernel symbol it calls
is defined), its argument checks and CPU refusal run in CPU CI through the compiled ops
(tests/fp8/test_cuda_backend.py), and its pure logic (the GEMM table below, the padding, the backend
choice) is unit-tested there. The kernels it calls are proven on the H200 through the ctypes harness
(paddle_fastffn/torch/fp8/c_api.py, tests/gpu/), composed the same way as here by paddle_fastffn/torch/fp8/ffn.py.
This Paddle path itself has not run on a GPU: PyPI has no Paddle wheel for sm_90 (shared/design.md).

Shapes and precision (x [T, in] bf16/fp16/fp32, Paddle's weight layout W [in, out], T tokens;
e4m3 for x and W, e5m2 for dy, Transformer Engine's HYBRID):

  forward   q(x) [T, in] (+ q(x)^T [in, T16])  e4m3 = quantize(x)        one pass (two: current)
            q(W) [in, out], q(W)^T [out, in]   e4m3, once per weight version (WeightCache)
            y [T, out]                         x.dtype = gemm(q(x), q(W)^T), fast accumulation;
                                               + b in x.dtype (the emulated path adds it in fp32)
            kept for backward: q(x)^T and its scale_inv, q(W) and its scale_inv
  backward  q(dy) [T, out], q(dy)^T [out, T16] e5m2 = quantize(dy)
            dx [T, in]                         x.dtype = gemm(q(dy), q(W))
            dW [in, out]                       W.dtype = gemm(q(x)^T, q(dy)^T)
            db [out]                           sum over tokens of dy in fp32 (unquantised, as TE)

Which stored copy each GEMM reads. fastffn_gemm_cuda computes D[M, N] = A[M, K] @ B[N, K]^T and
takes FP8 operands K-major only (cuBLASLt's TN, its only FP8 layout on Hopper), so each operand is
the stored copy whose rows run along that GEMM's K (LINEAR_GEMMS, checked numerically by the tests):

  | GEMM     | D [M, N]      | K   | A, stored [M, K]        | B, stored [N, K]                   |
  |----------|---------------|-----|-------------------------|------------------------------------|
  | forward  | y  [T, out]   | in  | q(x)     [T, in]        | q(W)^T  [out, in]   (transposed)   |
  | dgrad    | dx [T, in]    | out | q(dy)    [T, out]       | q(W)    [in, out]   (as stored)    |
  | wgrad    | dW [in, out]  | T16 | q(x)^T   [in, T16]      | q(dy)^T [out, T16]  (transposed)   |

  Paddle's [in, out] weight is the transpose of torch's [out, in], so the forward reads the
  weight's transposed copy and dgrad its row-wise one (paddle_fastffn/torch/fp8/ffn.py, in torch's
  layout, has them the other way round).

Tokens that are not a multiple of 16. T is the K of wgrad and the row length of the transposed
copies, which cuBLASLt needs as a multiple of 16. The transposed copies q(x)^T and q(dy)^T are
written into [.., T16] buffers (T16 = T rounded up to 16) whose extra columns the op zeroes: zero
tokens, which change no amax and add nothing to dW. Nothing is copied or padded on the row-wise
side (the forward and dgrad have M = T, which has no alignment rule), so no token count falls back.
in and out must be multiples of 16 (Fp8Linear keeps other weights in bf16).

Scaling: core/fp8/scaling.py's ScalingState, its tensors moved to the input's GPU once, updated on the device
with no host synchronisation. current: zero the amax slot, an amax-only pass, the scale from it
(fastffn_fp8_compute_scale_cuda), then the quantising pass. delayed: quantise with the scale of the
earlier steps, the amax into history[0], then (after every use, as recipe.py does)
fastffn_fp8_update_amax_history_cuda; its warm start (recipe.py) runs the first quantisation of a
tensor as current scaling (a host-side flag, no device read). Both are recipe.py's formulas (see
scale_from_amax). Weights use current scaling under both recipes (recipe.py says why). That state
machine is core/fp8/scaling.py's, run over CudaFp8Backend (the ops); the FP8 FFN (ffn.py) runs its
SwiGLU kernels through it too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import paddle

from ..core.fp8.linear import ROWWISE, TRANSPOSED, WEIGHT_COPIES, Fp8LinearOp
from ._autograd import pylayer
from .emulated import PaddleFp8Tensors
from .recipe import LinearScalingStates, ScalingState

# Every K and every FP8 row stride of the three GEMMs must be a multiple of 16 bytes (1-byte FP8).
GEMM_ALIGNMENT = 16
# The device the kernels are built for (build_definition.CUDA_ARCHS: sm_90a); cuBLASLt's FP8
# GEMMs run on sm_89/sm_90 only, and sm_90a code runs on sm_90 alone.
SUPPORTED_CAPABILITY = (9, 0)

# (A, B) of each GEMM: the tensor (x [T, in], weight [in, out], dy [T, out]) and its stored copy;
# the weight's are core/fp8/linear.py's WEIGHT_COPIES for Paddle's [in, out] layout, which the op reads.
LINEAR_GEMMS = {
    "forward": (("x", ROWWISE), ("weight", WEIGHT_COPIES["in_out"]["forward"])),
    "dgrad": (("dy", ROWWISE), ("weight", WEIGHT_COPIES["in_out"]["dgrad"])),
    "wgrad": (("x", TRANSPOSED), ("dy", TRANSPOSED)),
}
_OUT_DTYPES = {paddle.bfloat16: "bfloat16", paddle.float16: "float16", paddle.float32: "float32"}


def gemms_run(need_dx: bool, need_dw: bool) -> tuple[str, ...]:
    return ("forward",) + (("dgrad",) if need_dx else ()) + (("wgrad",) if need_dw else ())


def copies_needed(need_dx: bool, need_dw: bool) -> dict[str, frozenset]:
    """{tensor: the stored copies (ROWWISE / TRANSPOSED) that the GEMMs which run read}."""
    needed: dict[str, set] = {"x": set(), "weight": set(), "dy": set()}
    for gemm in gemms_run(need_dx, need_dw):
        for tensor, copy in LINEAR_GEMMS[gemm]:
            needed[tensor].add(copy)
    return {tensor: frozenset(copies) for tensor, copies in needed.items()}


def padded_tokens(tokens: int) -> int:
    """The column count of the transposed copies: tokens rounded up to GEMM_ALIGNMENT."""
    return -(-tokens // GEMM_ALIGNMENT) * GEMM_ALIGNMENT


# --- where the backend runs --------------------------------------------------------------------

def unavailable_reason(compiled_with_cuda: bool, capability: tuple[int, int] | None,
                       ops_error: str | None) -> tuple[str, str] | None:
    """Why the CUDA backend cannot run, as (key, reason), or None when it can. `capability` is
    the device's (major, minor), None without a visible GPU; `ops_error` why the operator library
    cannot be used (None: it loaded). Keys: "no_cuda" (Paddle has no CUDA), "arch" (no GPU, or
    not sm_90), "ops" (the operators did not build)."""
    if not compiled_with_cuda:
        return "no_cuda", "this Paddle build has no CUDA"
    if capability is None:
        return "arch", "no CUDA device is visible"
    if tuple(capability) != SUPPORTED_CAPABILITY:
        major, minor = capability
        return "arch", f"this device is sm_{major}{minor}; the FP8 kernels are built for sm_90 (Hopper)"
    if ops_error is not None:
        return "ops", f"the paddle_fastffn operators cannot be used: {ops_error}"
    return None


def device_capability(device_id: int | None = None) -> tuple[int, int] | None:
    try:
        return tuple(paddle.device.cuda.get_device_capability(device_id))
    except Exception:  # no visible device, or a Paddle without CUDA
        return None


def ops_error() -> str | None:
    """Why the compiled operators cannot be used (None: they load, CUDA kernels included)."""
    from ..ops._loader import FastFFNBuildError, ensure_loaded, with_cuda

    if not with_cuda():
        return "they are built without CUDA (this Paddle has none)"
    try:
        ensure_loaded()
    except FastFFNBuildError as error:
        return str(error)
    return None


@functools.lru_cache(maxsize=None)
def device_unavailable_reason(device_id: int | None = None) -> tuple[str, str] | None:
    """unavailable_reason for this process and GPU `device_id` (cached: neither changes)."""
    compiled = paddle.is_compiled_with_cuda()
    capability = device_capability(device_id) if compiled else None
    return unavailable_reason(compiled, capability, ops_error() if capability == SUPPORTED_CAPABILITY else None)


def choose_backend(requested: str, on_gpu: bool, reason: tuple[str, str] | None) -> str:
    """Fp8Linear's backend for one call: "cuda" or "emulated". requested "auto" takes CUDA for a
    GPU tensor where it can run (reason None) and emulates otherwise (CPU CI, other GPUs);
    "emulated" always emulates; "cuda" raises where CUDA cannot run."""
    if requested == "emulated":
        return "emulated"
    usable = on_gpu and reason is None
    if requested == "cuda" and not usable:
        why = "the input is not a CUDA tensor" if not on_gpu else reason[1]
        raise RuntimeError(f"Fp8Linear(backend='cuda'): the CUDA FP8 backend cannot run: {why}")
    if requested not in ("auto", "cuda"):
        raise ValueError(f"Fp8Linear backend must be 'auto', 'cuda' or 'emulated', got {requested!r}")
    return "cuda" if usable else "emulated"


def backend_for(requested: str, x: paddle.Tensor) -> str:
    on_gpu = x.place.is_gpu_place()
    reason = device_unavailable_reason(x.place.gpu_device_id()) if on_gpu else None
    return choose_backend(requested, on_gpu, reason)


# --- the ops -----------------------------------------------------------------------------------

def _run(name: str, *args):
    from ..ops._loader import run_op

    return run_op(name, *args)


@dataclass
class CudaQuantized:
    """FP8 copies of one tensor [R, C] with the scale_inv they were written with (fp32 [1], on
    the device): data [R, C] and/or data_t [C, Rp] (Rp >= R, zero columns past R)."""

    data: paddle.Tensor | None
    data_t: paddle.Tensor | None
    scale_inv: paddle.Tensor
    fmt: str


def _state_on(state: ScalingState, place) -> None:
    """Move a ScalingState's tensors to `place` (once: later calls find them there). The ops then
    update them in place on the device."""
    scale_place = state.scale.place
    if scale_place.is_gpu_place() and scale_place.gpu_device_id() == place.gpu_device_id():
        return
    for name in ("scale", "scale_inv", "amax_history"):
        setattr(state, name, getattr(state, name).cuda(place.gpu_device_id()))


def states_on(states, place) -> None:
    """Move every ScalingState of `states` (LinearScalingStates, FfnScalingStates) to `place`."""
    for role in states.roles():
        _state_on(getattr(states, role), place)


class CudaFp8Backend(PaddleFp8Tensors):
    """core/fp8/backend.py's kernels through the compiled Paddle ops (the state tensors are Paddle
    tensors as the emulated backend's, moved to the GPU by states_on)."""

    name = "paddle-cuda"

    def compute_scale(self, amax_history, scale, scale_inv, fmt_max: float, margin: float) -> None:
        _run("fastffn_fp8_compute_scale", amax_history, scale, scale_inv, fmt_max, margin)

    def update_amax_history(self, amax_history, scale, scale_inv, most_recent: bool, fmt_max: float,
                            margin: float) -> None:
        _run("fastffn_fp8_update_amax_history", amax_history, scale, scale_inv, most_recent, fmt_max, margin)

    def quantize(self, x, scale, amax, fmt: str, rowwise: bool = True, transpose: bool = False,
                 transpose_cols: int = 0, into=None):
        """fastffn_fp8_quantize: x [R, C] (contiguous, bf16/fp16/fp32 on the GPU); transpose_cols
        the column count of data_t (0: R), zero past R. into: data_t [C, R] is the storage's block
        at first_row (RowBlocks: joined by one concat, where the torch harness's kernel writes
        into the whole copy's columns directly)."""
        out = _run("fastffn_fp8_quantize", x, scale, amax, fmt, rowwise, transpose, int(transpose_cols))
        if not (rowwise or transpose):
            return None
        data, data_t, scale_inv = out[:3]
        if into is not None:
            storage, first_row = into
            storage.add(first_row, data_t)
            data_t = None
        return CudaQuantized(data if rowwise else None, data_t if transpose else None, scale_inv, fmt)

    def transposed_rows_value(self, storage, scale_inv, fmt: str):
        """The blocks' transposed copies [C, r] side by side: the [C, rows] copy."""
        return CudaQuantized(None, storage.joined(axis=1), scale_inv, fmt)

    def quantize_weight(self, weight, state, copies=(ROWWISE, TRANSPOSED), amax_recorded=False):
        """The named copies of a weight [in, out]: q(W) for dgrad, q(W)^T for the forward."""
        return quantize(weight, state, rowwise=ROWWISE in copies, transpose=TRANSPOSED in copies,
                        amax_recorded=amax_recorded)

    def fp8_transpose(self, data):
        """fastffn_fp8_transpose: the quantisation kernels' tiled byte transpose (an element-wise
        transpose copy runs FP8 at a fraction of the bandwidth)."""
        return _run("fastffn_fp8_transpose", data)[0]

    def transpose_cols(self, tokens: int) -> int:
        return padded_tokens(tokens)

    def fp8_parts(self, q, copy: str):
        return (q.data if copy == ROWWISE else q.data_t), q.scale_inv

    def fp8_join(self, data, scale_inv, fmt: str, copy: str):
        rowwise = copy == ROWWISE
        return CudaQuantized(data if rowwise else None, None if rowwise else data, scale_inv, fmt)

    def swiglu_fwd_fp8(self, gate_up, h_scale, h_amax, gate_up_scale, gate_up_amax, fmt: str, quantize: bool):
        """fastffn_swiglu_fwd_fp8: q(h) [T, I] and, with gate_up_scale, q(gate_up) [T, 2I] (row-wise);
        quantize False: the amax-only pass (both amaxes)."""
        copy = gate_up_scale is not None
        out = _run("fastffn_swiglu_fwd_fp8", gate_up, h_scale, h_amax, gate_up_scale, gate_up_amax, fmt, quantize,
                   False, 0, quantize and copy)
        if not quantize:
            return None
        return (CudaQuantized(out[0], None, out[2], fmt),
                CudaQuantized(out[3], None, out[4], fmt) if copy else None)

    def swiglu_bwd_fp8(self, gate_up, gate_up_scale_inv, d_h, scale, amax, fmt: str, quantize: bool,
                       h_scale=None, h_fmt: str = "", transpose_cols: int = 0):
        """fastffn_swiglu_bwd_fp8: q(d_gate_up) and its transpose [2I, transpose_cols] and, with
        h_fmt, q(h)^T [I, transpose_cols], from gate_up in d_h's dtype or its FP8 copy (with
        gate_up_scale_inv); quantize False: d_gate_up's amax-only pass."""
        out = _run("fastffn_swiglu_bwd_fp8", gate_up, d_h, scale, amax, h_scale, gate_up_scale_inv, fmt, quantize,
                   quantize, h_fmt, False, bool(h_fmt), transpose_cols if quantize else 0)
        if not quantize:
            return None
        return (CudaQuantized(out[0], out[1], out[2], fmt),
                CudaQuantized(None, out[4], out[5], h_fmt) if h_fmt else None)

    def fp8_gemm(self, a, a_copy: str, b, b_copy: str, out_dtype, fast_accum: bool = False, bias=None, out=None):
        """fastffn_gemm on the named stored copies (the table in the module docstring), + bias in
        out_dtype; with out, fastffn_gemm_accumulate into it."""
        a_data, b_data = (a.data if a_copy == ROWWISE else a.data_t), (b.data if b_copy == ROWWISE else b.data_t)
        if out is not None:
            _run("fastffn_gemm_accumulate", a_data, b_data, a.scale_inv, b.scale_inv, out, False, False,
                 bool(fast_accum), 1.0)
            return out
        d = gemm(a_data, b_data, out_dtype, a.scale_inv, b.scale_inv, fast_accum=fast_accum)
        return d if bias is None else d + bias.astype(d.dtype)


CUDA = CudaFp8Backend()


def quantize(x: paddle.Tensor, state: ScalingState, rowwise: bool = True, transpose: bool = True,
             transpose_cols: int = 0, end_step: bool = True, amax_recorded: bool = False) -> CudaQuantized:
    """x [R, C] (contiguous, bf16/fp16/fp32 on the GPU) -> FP8 in state's format and scaling
    (module docstring). transpose_cols: the column count of data_t (0: R), zero past R.
    amax_recorded: ScalingState.quantize's."""
    return state.quantize(x, end_step, backend=CUDA, amax_recorded=amax_recorded, rowwise=rowwise,
                          transpose=transpose, transpose_cols=transpose_cols)


quantize_weight = CUDA.quantize_weight


def gemm(a: paddle.Tensor, b: paddle.Tensor, out_dtype, a_scale_inv=None, b_scale_inv=None,
         fast_accum: bool = False) -> paddle.Tensor:
    """D[M, N] = (sa * a[M, K]) @ (sb * b[N, K])^T in out_dtype (bf16/fp16/fp32), fp32
    accumulation; a and b FP8 with their scale_inv, or both 16-bit without."""
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"paddle_fastffn.fp8.gemm: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    return _run("fastffn_gemm", a, b, a_scale_inv, b_scale_inv, _OUT_DTYPES[out_dtype], False, False,
                bool(fast_accum), 1.0)[0]


# --- the linear layer ------------------------------------------------------------------------------

# The core's FP8 linear (core/fp8/linear.py) over the CUDA ops.
_CudaFp8Linear = pylayer(Fp8LinearOp, CUDA)


def prepare_cuda_linear(x: paddle.Tensor, weight, frozen_weight, states) -> None:
    """fp8_linear_cuda's checks of its operands, then its states moved to x's place: what every CUDA
    FP8 linear (alone, or the base of core/lora.py's LoraLinear) does before its op."""
    in_features, out_features = weight.shape if frozen_weight is None else frozen_weight.shape
    if in_features % GEMM_ALIGNMENT or out_features % GEMM_ALIGNMENT:
        raise ValueError(f"fp8_linear_cuda: weight [{in_features}, {out_features}] must be a multiple of "
                         f"{GEMM_ALIGNMENT} in both dimensions (cuBLASLt's FP8 alignment)")
    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"fp8_linear_cuda: x must be bfloat16, float16 or float32, got {x.dtype}")
    states_on(states, x.place)


def fp8_linear_cuda(x: paddle.Tensor, weight: paddle.Tensor | None, bias: paddle.Tensor | None = None, *,
                    states: LinearScalingStates, weight_cache, frozen_weight=None) -> paddle.Tensor:
    """FP8 linear on a Hopper GPU: x [..., in] (bf16/fp16/fp32) @ weight [in, out] (+ bias [out]),
    in and out multiples of 16, any token count. y and dx in x.dtype, dW in weight.dtype, db in
    bias.dtype; fp32 accumulation. The same states and WeightCache semantics as fp8_linear (the
    emulated path): see the module docstring for the GEMMs and the scaling. frozen_weight: a
    FrozenFp8Weight in place of weight (None), for a frozen weight held only in FP8."""
    prepare_cuda_linear(x, weight, frozen_weight, states)
    return _CudaFp8Linear.apply(x, weight, bias, states, weight_cache, frozen_weight)
