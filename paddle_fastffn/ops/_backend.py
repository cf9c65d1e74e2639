"""PaddleBackend: the core layer's Backend (paddle_fastffn/core/backend.py says what each method
must do) over the compiled Paddle custom ops (CPU and CUDA) and Paddle's own tensor ops and matmul.
Paddle's Linear weight layout is [in, out]."""

from __future__ import annotations

import paddle

from ..core.backend import IndexingBackend
from ._loader import run_op


_NO_LAYOUT = (0, 1, 1, 1, 1)  # an absent v's heads layout: ignored by the rotary kernel (with_v false)


def _on_gpu(t) -> bool:
    return not t.place.is_cpu_place()


# Float dtypes by width, for the promotion LoRA's sum does (linear_accumulate).
_FLOAT_RANK = {paddle.float16: 1, paddle.bfloat16: 1, paddle.float32: 2, paddle.float64: 3}

class PaddleBackend(IndexingBackend):
    # take_rows is IndexingBackend's indexing, not paddle.gather: Paddle's CPU gather has no float16
    # kernel.
    name = "paddle"
    float16, float32, float64, int32 = paddle.float16, paddle.float32, paddle.float64, paddle.int32

    # --- tensors ------------------------------------------------------------------------------
    @staticmethod
    def rows(t):
        return t.reshape([-1, t.shape[-1]])

    @staticmethod
    def reshape(t, shape):
        return t.reshape(list(shape))

    @staticmethod
    def contiguous(t):
        return t if t.is_contiguous() else t.contiguous()

    # On `like`'s device: the rotary ops hand these buffers to their kernel as outputs, and a CPU
    # tensor under a GPU Paddle must not get a buffer on Paddle's current device.
    @staticmethod
    def empty(shape, dtype, like):
        return paddle.empty(list(shape), dtype=dtype, device=like.place)

    @staticmethod
    def zeros(shape, dtype, like):
        return paddle.zeros(list(shape), dtype=dtype)

    @staticmethod
    def add(a, b):
        return paddle.add(a, b)

    @staticmethod
    def cast(t, dtype):
        return t if t.dtype == dtype else t.astype(dtype)

    @staticmethod
    def scale_(t, factor):
        return t.scale_(factor)

    @staticmethod
    def pad_rows(t, count, value):
        # full_like of a row: on t's place (t has at least one row wherever the core pads)
        return paddle.concat([t, paddle.full_like(t[:1], value).expand([count] + list(t.shape[1:]))])

    @staticmethod
    def write_rows(out, start, rows):
        out[start:start + rows.shape[0]] = rows
        return out

    @staticmethod
    def concat(tensors):
        return paddle.concat(tensors)

    @staticmethod
    def indices_not_equal(t, value):
        # Against a one-element tensor, as the torch backend compares: Paddle would otherwise
        # materialise the scalar as a full [n] tensor first (the trace test compares both).
        return paddle.nonzero(t != paddle.full([1], value, t.dtype)).reshape([-1])

    @staticmethod
    def positive_mean(values):
        # The same ops as the torch backend's (the trace test compares both): a one-element zero to
        # compare against, a full one to select from (Paddle's where would expand a broadcast one).
        kept = values > paddle.zeros([1], values.dtype)
        count = paddle.sum(kept, dtype=paddle.float32)
        return paddle.where(kept, values, paddle.zeros_like(values)).sum() / count, count

    @staticmethod
    def to_host(scalars):
        parts = [s.astype(paddle.float64).reshape([1]) for s in scalars]
        return [float(v) for v in paddle.concat(parts).numpy()]  # the one copy to the host

    # --- kernels ------------------------------------------------------------------------------
    @staticmethod
    def swiglu(gate, up=None):
        return run_op("fastffn_swiglu_fwd", gate, up)[0]

    @staticmethod
    def swiglu_grad(gate, up, d_out, recompute):
        d_gate, d_up, recomputed = run_op("fastffn_swiglu_bwd", gate, up, d_out, bool(recompute))
        return d_gate, (d_up if up is not None else None), (recomputed if recompute else None)

    @staticmethod
    def swiglu_grad_in_place(gate, up, d_out, recompute):
        # The bindings' in-place backwards: packed with recompute (swiglu_down_proj with
        # reuse_gate_up_memory) and two inputs without (the unfused MLP's swiglu).
        if up is None and recompute:
            run_op("fastffn_swiglu_bwd_inplace", gate, d_out)
        elif up is not None and not recompute:
            run_op("fastffn_swiglu_pair_bwd_inplace", gate, up, d_out)
        else:
            raise ValueError("paddle_fastffn.ops.swiglu: the in-place backward takes a packed [gate | up] "
                             "with recompute, or two inputs without")

    @staticmethod
    def rms_norm(x, weight, epsilon, residual=None):
        out, total, rstd = run_op("fastffn_rms_norm_fwd", x, residual, weight, float(epsilon))
        return out, (total if residual is not None else None), rstd

    @staticmethod
    def rms_norm_grad(x, weight, rstd, d_out, epsilon, d_total=None):
        d_x, d_weight = run_op("fastffn_rms_norm_bwd", x, weight, rstd, d_out, d_total, float(epsilon))
        return d_x, d_weight

    @staticmethod
    def cross_entropy(logits, labels, ignore_index, grad_scale, with_grad, label_error):
        loss = paddle.empty([logits.shape[0]], dtype=paddle.float32)
        try:
            run_op("fastffn_cross_entropy", logits, labels, loss, label_error, int(ignore_index),
                   float(grad_scale), bool(with_grad))
        except OSError as error:  # the binding's PD_CHECK / PD_THROW; its first line names the argument
            raise ValueError(str(error).strip().splitlines()[0]) from None
        return loss

    # --- rotary -------------------------------------------------------------------------------
    @staticmethod
    def is_cpu(t):
        return t.place.is_cpu_place()

    @staticmethod
    def token_stride(t):
        # Paddle's custom-op call hands a kernel its inputs contiguous (a strided view is copied
        # there), so the kernel always sees heads * head_dim between tokens.
        return t.shape[2] * t.shape[3]

    @staticmethod
    def position_flag(like):
        return paddle.zeros([1], dtype=paddle.int32, device=like.place)

    @staticmethod
    def read_flag(flag):
        return int(flag.numpy()[0])

    @staticmethod
    def rotary(sources, outputs, dims, layouts, cos, sin, position_ids, position_error, inverse):
        q, k, v = sources
        q_out, k_out, v_out = outputs
        with_v = v is not None
        flat = [int(x) for layout in layouts for x in (layout or _NO_LAYOUT)]
        # The binding's optional k/v (and k_out/v_out) slots: absent = the same tensor as q (out).
        run_op("fastffn_rotary", q, None if k is q else k, None if v is None or v is q else v,
               cos, sin, position_ids, q_out, None if k_out is q_out else k_out,
               None if v_out is None or v_out is q_out else v_out, position_error,
               [int(x) for x in dims], flat, with_v, bool(inverse))

    # --- GEMMs --------------------------------------------------------------------------------
    @staticmethod
    def gemm_dtype(t):
        # Paddle CPU has no half-precision matmul; float64 stays float64 (for checks).
        if _on_gpu(t) or t.dtype == paddle.float64:
            return t.dtype
        return paddle.float32

    @staticmethod
    def autocast_changes_gemm(t):
        tracer = paddle.base.framework._dygraph_tracer()
        if tracer is None or tracer._amp_level == paddle.base.core.AmpLevel.O0:
            return False
        return str(t.dtype).removeprefix("paddle.") != tracer._amp_dtype

    @staticmethod
    def linear(x, weight):
        return paddle.matmul(x, weight)

    @staticmethod
    def linear_accumulate(base, x, weight, alpha):
        # In the wider of base's and x's dtypes, as LoRALinear's `base + ...` promotes: under AMP O1
        # the FP8 linear's base comes out in fp32 beside a bf16 adapter product, and stays fp32;
        # a 16-bit base keeps x's dtype (addmm is on neither AMP list, so an fp32 LoRA weight would
        # otherwise promote it: cast as autocast casts the matmul's operands).
        dtype = base.dtype if _FLOAT_RANK.get(base.dtype, 0) > _FLOAT_RANK.get(x.dtype, 0) else x.dtype
        return base.astype(dtype).addmm_(x.astype(dtype), weight.astype(dtype), beta=1.0, alpha=alpha)

    @staticmethod
    def linear_grad_input(dy, weight, alpha=1.0):
        # Paddle's matmul takes no alpha (and its addmm rounds alpha to the tensors' dtype): the
        # product is scaled after it, in the scale op's fp32 arithmetic (torch's GEMM applies alpha
        # inside; the two round the scaled product once and twice)
        out = paddle.matmul(dy, weight, transpose_y=True)
        return out if alpha == 1.0 else out.scale_(alpha)

    @staticmethod
    def linear_grad_input_accumulate(out, dy, weight):
        # A product and an add: Paddle's matmul has no accumulating form, and its addmm_ copies its
        # input into the output before a beta-1 GEMM (the same traffic, more launches)
        out.add_(paddle.matmul(dy, weight, transpose_y=True))

    @staticmethod
    def linear_grad_weight(x, dy, alpha=1.0):
        out = paddle.matmul(x.reshape([-1, x.shape[-1]]), dy.reshape([-1, dy.shape[-1]]), transpose_x=True)
        return out if alpha == 1.0 else out.scale_(alpha)  # as linear_grad_input

    @staticmethod
    def linear_output_halves(weight):
        half = weight.shape[1] // 2
        return weight[:, :half], weight[:, half:]

    @staticmethod
    def linear_grad_weight_of_halves(x, dy_first, dy_second):
        # Paddle's [in, out] layout puts the halves side by side in each row: no GEMM writes a
        # strided half, so the two products are concatenated.
        return paddle.concat([PaddleBackend.linear_grad_weight(x, dy_first),
                              PaddleBackend.linear_grad_weight(x, dy_second)], axis=1)

    @staticmethod
    def matmul(a, b, transpose_a=False, transpose_b=False, alpha=1.0):
        out = paddle.matmul(a, b, transpose_x=transpose_a, transpose_y=transpose_b)
        return out if alpha == 1.0 else out.scale_(alpha)

    @staticmethod
    def matmul_into_rows(out, start, a, b, transpose_b, alpha=1.0):
        part = PaddleBackend.matmul(a, b, transpose_b=transpose_b, alpha=alpha)
        out[start:start + a.shape[0]] = part if part.dtype == out.dtype else part.astype(out.dtype)

    @staticmethod
    def gemm_fp32_accumulate(out, a, b, alpha=1.0):
        if a.dtype in (paddle.float32, paddle.float64):
            # fp32 (CPU) inputs: Paddle's own GEMM. addmm_ accumulates with no [M, N] temporary
            # but copies a^T; when a is the wider operand (the tied [V, H] head's d_logits) a
            # product and add_ is faster (CPU, T=2048/V=32000/H=256, chunks of 256: 98 ms per chunk
            # for addmm_ against 112 ms for matmul + add_ on the [H, V] head).
            if out is None:
                return PaddleBackend.matmul(a, b, transpose_a=True, alpha=alpha)
            if a.shape[1] <= b.shape[1]:
                return out.addmm_(a.T, b, beta=1.0, alpha=alpha)
            return out.add_(PaddleBackend.matmul(a, b, transpose_a=True, alpha=alpha))
        # 16-bit inputs (GPU): the cuBLASLt provider, fp32 output, accumulating in place; D =
        # alpha * A @ B^T with A = a^T, B = b^T (both stored [K, .], dense rows).
        a, b = PaddleBackend.contiguous(a), PaddleBackend.contiguous(b)
        if out is None:
            return run_op("fastffn_gemm", a, b, None, None, "float32", True, True, False, float(alpha))[0]
        run_op("fastffn_gemm_accumulate", a, b, None, None, out, True, True, False, float(alpha))
        return out


BACKEND = PaddleBackend()
