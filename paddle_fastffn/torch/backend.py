"""TorchBackend: the core layer's Backend (paddle_fastffn/core/backend.py says what each method must
do) over the C API's kernels through ctypes (c_api.py: the same csrc/kernels the Paddle bindings
call), torch's cuBLAS for the GEMMs Paddle runs through paddle.matmul, and the project's cuBLASLt
provider (fp8/c_api.py) for the fp32-accumulated weight gradient (the call the Paddle path makes).
torch's Linear weight layout is [out, in]. `function(op, backend)` is torch's autograd for a core
fused op, as paddle_fastffn/ops/_autograd.py's `pylayer(op)` is Paddle's.

The kernels are passed in (ops.py builds its backend over c_api.kernels), so the CPU variant
(cpu_kernels.select) swaps them without touching this module.
"""

from __future__ import annotations

import torch

from paddle_fastffn.core.autograd import FusedOp, run_backward, run_forward
from paddle_fastffn.core.backend import IndexingBackend
from paddle_fastffn.torch.fp8 import c_api as fp8_c_api


def _gemm_zero(like: torch.Tensor) -> torch.Tensor:
    """A 0-d zero on like's device and dtype: the input addmm needs beside beta 0 (broadcast, never
    read), made once per device and dtype."""
    key = (like.device, like.dtype)
    zero = _GEMM_ZEROS.get(key)
    if zero is None:
        zero = _GEMM_ZEROS[key] = torch.zeros((), dtype=like.dtype, device=like.device)
    return zero


_GEMM_ZEROS: dict = {}


class TorchBackend(IndexingBackend):
    name = "torch"
    float16, float32, float64, int32 = torch.float16, torch.float32, torch.float64, torch.int32

    def __init__(self, kernels, empty):
        """kernels: a callable returning c_api's Kernels (built on first use); empty(shape,
        dtype, device): its output allocator (NaN-poisoned under its test switch)."""
        self._kernels = kernels
        self._empty = empty

    # --- tensors ------------------------------------------------------------------------------
    @staticmethod
    def rows(t):
        return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])  # no view where none is needed

    @staticmethod
    def reshape(t, shape):
        shape = tuple(shape)
        return t if tuple(t.shape) == shape else t.reshape(shape)

    @staticmethod
    def contiguous(t):
        return t.contiguous()

    def empty(self, shape, dtype, like):
        return self._empty(tuple(shape), dtype, like.device)

    @staticmethod
    def zeros(shape, dtype, like):
        return torch.zeros(tuple(shape), dtype=dtype, device=like.device)

    @staticmethod
    def add(a, b):
        return torch.add(a, b)

    @staticmethod
    def cast(t, dtype):
        return t if t.dtype == dtype else t.to(dtype)

    @staticmethod
    def scale_(t, factor):
        return t.mul_(factor)

    @staticmethod
    def pad_rows(t, count, value):
        return torch.cat([t, torch.full((count, *t.shape[1:]), value, dtype=t.dtype, device=t.device)])

    @staticmethod
    def write_rows(out, start, rows):
        out[start:start + rows.shape[0]].copy_(rows)
        return out

    @staticmethod
    def concat(tensors):
        return torch.cat(tensors)

    @staticmethod
    def indices_not_equal(t, value):
        # Against a one-element tensor, as the Paddle backend must compare (Paddle has no
        # tensor-scalar compare kernel): the same two ops on both sides.
        return torch.nonzero(t != torch.full((1,), value, dtype=t.dtype, device=t.device)).reshape(-1)

    @staticmethod
    def positive_mean(values):
        # The Paddle backend's ops (the trace test compares both; Paddle has no tensor-scalar
        # compare and its where expands a broadcast operand): a one-element zero to compare
        # against, a full one to select from.
        kept = values > torch.zeros(1, dtype=values.dtype, device=values.device)
        count = kept.sum(dtype=torch.float32)
        return torch.where(kept, values, torch.zeros_like(values)).sum() / count, count

    @staticmethod
    def to_host(scalars):
        return torch.cat([s.double().reshape(1) for s in scalars]).tolist()  # the one copy to the host

    # --- kernels ------------------------------------------------------------------------------
    def swiglu(self, gate, up=None):
        return self._kernels().swiglu_fwd(gate, up)

    def swiglu_grad(self, gate, up, d_out, recompute):
        grads, recomputed = self._kernels().swiglu_bwd(gate, d_out, up=up, recompute=recompute)
        d_gate, d_up = (grads, None) if up is None else grads
        return d_gate, d_up, recomputed

    def swiglu_grad_in_place(self, gate, up, d_out, recompute):
        self._kernels().swiglu_bwd(gate, d_out, up=up, recompute=recompute, in_place=True)

    def rms_norm(self, x, weight, epsilon, residual=None):
        return self._kernels().rms_norm_fwd(x, weight, epsilon, residual=residual)

    def rms_norm_grad(self, x, weight, rstd, d_out, epsilon, d_total=None):
        return self._kernels().rms_norm_bwd(x, weight, rstd, d_out, epsilon, d_total)

    def cross_entropy(self, logits, labels, ignore_index, grad_scale, with_grad, label_error):
        return self._kernels().cross_entropy(logits, labels, ignore_index, grad_scale, with_grad, label_error)

    # --- rotary -------------------------------------------------------------------------------
    @staticmethod
    def is_cpu(t):
        return not t.is_cuda

    @staticmethod
    def token_stride(t):
        # A token-strided view (q or k sliced from a fused projection) is passed as it is.
        b, s, h, d = t.shape
        if t.stride(3) != 1 or t.stride(2) != d or t.stride(0) != t.stride(1) * s:
            raise ValueError(f"token_stride: a [b, s, heads, head_dim] tensor with dense heads was "
                             f"expected, got strides {t.stride()}")
        return t.stride(1)

    @staticmethod
    def position_flag(like):
        return torch.zeros(1, dtype=torch.int32, device=like.device)

    @staticmethod
    def read_flag(flag):
        return int(flag.item())

    def rotary(self, sources, outputs, dims, layouts, cos, sin, position_ids, position_error, inverse):
        self._kernels().rotary(sources, outputs, dims, layouts, cos, sin, position_ids, position_error,
                               inverse)

    # --- GEMMs --------------------------------------------------------------------------------
    @staticmethod
    def gemm_dtype(t):
        return t.dtype

    @staticmethod
    def autocast_changes_gemm(t):
        device = t.device.type
        return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != t.dtype

    @staticmethod
    def linear(x, weight):
        return x @ weight.t()

    @staticmethod
    def linear_accumulate(base, x, weight, alpha):
        # In place, as Paddle's, where base is a tensor of its own (a projection's fresh output,
        # which its backward does not read): no second [tokens, out] buffer. Not into a view: torch
        # would record the write as CopySlices, whose backward copies the whole output gradient
        # (and refuses a view made inside a custom Function); there addmm writes a new result.
        if base._base is not None:
            return torch.addmm(base, x, weight.t(), alpha=alpha)
        return base.addmm_(x, weight.t(), alpha=alpha)

    @staticmethod
    def linear_grad_input(dy, weight, alpha=1.0):
        if alpha == 1.0:
            return dy @ weight
        # addmm with beta 0 reads nothing of its input (torch's contract, NaN included): alpha inside
        # the GEMM, one op (Paddle scales the product after its matmul)
        return torch.addmm(_gemm_zero(dy), dy, weight, beta=0, alpha=alpha)

    @staticmethod
    def linear_grad_input_accumulate(out, dy, weight):
        out.addmm_(dy, weight)

    @staticmethod
    def linear_grad_weight(x, dy, alpha=1.0):
        if x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])
        if dy.dim() != 2:
            dy = dy.reshape(-1, dy.shape[-1])
        if alpha == 1.0:
            return dy.t() @ x
        return torch.addmm(_gemm_zero(dy), dy.t(), x, beta=0, alpha=alpha)

    @staticmethod
    def linear_output_halves(weight):
        half = weight.shape[0] // 2
        return weight[:half], weight[half:]

    def linear_grad_weight_of_halves(self, x, dy_first, dy_second):
        rows = x.numel() // x.shape[-1]
        x2 = x.reshape(rows, -1)
        first = dy_first.shape[-1]
        out = self._empty((first + dy_second.shape[-1], x2.shape[1]), x.dtype, x.device)
        torch.mm(dy_first.reshape(rows, -1).t(), x2, out=out[:first])
        torch.mm(dy_second.reshape(rows, -1).t(), x2, out=out[first:])
        return out

    def matmul(self, a, b, transpose_a=False, transpose_b=False, alpha=1.0):
        a, b = (a.t() if transpose_a else a), (b.t() if transpose_b else b)
        if alpha == 1.0:
            return a @ b
        out = self._empty((a.shape[0], b.shape[1]), a.dtype, a.device)
        return torch.addmm(out, a, b, beta=0.0, alpha=alpha, out=out)  # beta 0: out is not read

    @staticmethod
    def matmul_into_rows(out, start, a, b, transpose_b, alpha=1.0):
        rows = out[start:start + a.shape[0]]
        b = b.t() if transpose_b else b
        if alpha == 1.0:
            torch.mm(a, b, out=rows)
        else:
            torch.addmm(rows, a, b, beta=0.0, alpha=alpha, out=rows)

    @staticmethod
    def gemm_fp32_accumulate(out, a, b, alpha=1.0):
        if a.dtype in (torch.float32, torch.float64):
            if out is None:
                return torch.mm(a.t(), b) if alpha == 1.0 else torch.mm(a.t(), b).mul_(alpha)
            return out.addmm_(a.t(), b, alpha=alpha)
        # 16-bit inputs: the project's cuBLASLt provider (fastffn_gemm_cuda), fp32 output, with
        # accumulation into out: D = alpha * A @ B^T with A = a^T, B = b^T (both stored [K, .]).
        return fp8_c_api.kernels().gemm(a, b, torch.float32, transpose_a=True, transpose_b=True,
                                        alpha=alpha, out=out, accumulate=out is not None)


def function(op: type[FusedOp], backend: TorchBackend) -> type[torch.autograd.Function]:
    """A torch.autograd.Function running `op` over `backend`. Call it as
    ``cls.apply(*tensor_inputs, *options)`` (op.inputs then op.options, all positional)."""
    n_inputs = len(op.inputs)

    class FusedFunction(torch.autograd.Function):
        fused_op = op

        @classmethod
        def apply(cls, *args):
            # forward runs with gradients off and ctx.needs_input_grad follows requires_grad even
            # under torch.no_grad(): the caller's grad mode is passed in (as the Paddle adapter
            # does), so an op that computes gradients in forward (the fused loss) skips them.
            return super().apply(torch.is_grad_enabled(), *args)

        @staticmethod
        def forward(ctx, grad_enabled, *args):
            # needs recorded in forward (core/autograd.py's Saved says why); index 0 is grad_enabled.
            needs = [grad_enabled and ctx.needs_input_grad[1 + i] for i in range(n_inputs)]
            outputs, ctx.fused_saved = run_forward(op, backend, needs, args, ctx.save_for_backward)
            return outputs

        @staticmethod
        def backward(ctx, *output_grads):
            grads = run_backward(op, backend, ctx.fused_saved, ctx.saved_tensors, output_grads)
            return (None, *grads, *(None,) * len(op.options))

    FusedFunction.__name__ = FusedFunction.__qualname__ = op.__name__
    FusedFunction.__doc__ = op.__doc__
    return FusedFunction
