"""The tensor backend the core layer is written over: the few things it asks of a framework.

Two implementations: paddle_fastffn/ops/_backend.py (PaddleBackend: the compiled Paddle custom ops,
CPU and CUDA, and Paddle's matmul) and paddle_fastffn/torch/backend.py (TorchBackend: the same C
kernels through ctypes, torch's cuBLAS). A method belongs here only if the core layer calls it;
each says what it must do, so a backend is checked against this text and the trace test
(tests/integration/test_trace.py) checks that both execute the same list.

Layout rule: a Linear weight is in the framework's own layout (Paddle [in, out], torch [out, in]);
the core never transposes one itself, it asks `linear`, `linear_grad_input`, `linear_grad_weight`.

Kernel methods allocate their outputs (dense, the input's dtype and device) unless they say "in
place"; tensors handed to a kernel must be dense (`contiguous`) where the method says so.
"""

from __future__ import annotations

from typing import Protocol, Any

Tensor = Any
DType = Any


class Backend(Protocol):
    name: str  # "paddle" or "torch"
    # The framework's dtype objects the core names (for comparisons and allocations).
    float16: DType
    float32: DType
    float64: DType
    int32: DType

    # --- tensors ------------------------------------------------------------------------------
    def shape(self, t: Tensor) -> tuple[int, ...]: ...
    def dtype(self, t: Tensor) -> DType: ...
    def rows(self, t: Tensor) -> Tensor:
        """t as 2-D [prod(shape[:-1]), shape[-1]] (a view: no copy)."""
    def reshape(self, t: Tensor, shape) -> Tensor: ...
    def contiguous(self, t: Tensor) -> Tensor:
        """t itself when already dense, else one copy."""
    def detach(self, t: Tensor) -> Tensor:
        """The same memory without autograd history (for a tensor only this op holds)."""
    def empty(self, shape, dtype: DType, like: Tensor) -> Tensor:
        """An uninitialised tensor on `like`'s device."""
    def zeros(self, shape, dtype: DType, like: Tensor) -> Tensor:
        """A zero-filled tensor on `like`'s device."""
    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """a + b, elementwise, into a new tensor (same shape and dtype)."""
    def cast(self, t: Tensor, dtype: DType) -> Tensor:
        """t itself when it already has `dtype`, else a converted copy."""
    def scale_(self, t: Tensor, factor: float) -> Tensor:
        """t *= factor in place; returns t."""
    def row_slice(self, t: Tensor, start: int, end: int) -> Tensor:
        """Rows [start, end) of a 2-D (or 1-D) tensor as a view."""
    def pad_rows(self, t: Tensor, count: int, value) -> Tensor:
        """t (2-D or 1-D) with `count` rows of `value` after its own (a new tensor)."""
    def write_rows(self, out: Tensor, start: int, rows: Tensor) -> Tensor:
        """out[start : start + rows] = rows (same dtype) in place; returns out."""
    def concat(self, tensors: list) -> Tensor:
        """The 1-D tensors one after another (a new tensor)."""
    def indices_not_equal(self, t: Tensor, value: int) -> Tensor:
        """The int64 positions of a 1-D tensor's entries that differ from `value` (its length is
        known on the host afterwards: one synchronisation)."""
    def take_rows(self, t: Tensor, index: Tensor) -> Tensor:
        """t[index] for a 2-D or 1-D t, by the framework's own differentiable indexing (its
        backward scatters the rows' gradient into zeros of t's shape)."""
    def positive_mean(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """(mean of the entries > 0, their count), both fp32 device scalars, with no host
        synchronisation; the mean is NaN when no entry is > 0, and a NaN entry counts as not > 0
        (a masked sum: `where`, not a product with the mask)."""
    def to_host(self, scalars: list) -> list[float]:
        """The values of one-element tensors as Python floats, in ONE copy to the host."""

    # --- kernels (csrc/kernels, through the framework's binding) ---------------------------------
    def swiglu(self, gate: Tensor, up: Tensor | None = None) -> Tensor:
        """silu(gate) * up in fp32 math, stored in the inputs' dtype. With up None, gate is
        [..., 2I] packing [gate | up] and the result is [..., I]. Dense inputs."""
    def swiglu_grad(self, gate: Tensor, up: Tensor | None, d_out: Tensor,
                    recompute: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(d_gate, d_up, recomputed) into new buffers: d_gate packed [..., 2I] like gate when up
        is None (d_up None then); recomputed is the forward output written in the same pass, None
        unless `recompute`. Dense inputs."""
    def swiglu_grad_in_place(self, gate: Tensor, up: Tensor | None, d_out: Tensor,
                             recompute: bool) -> None:
        """The same backward in place: gate (and up) are overwritten by their gradients and, with
        `recompute`, d_out by the recomputed forward output (each element is read before it is
        written). Only for tensors nothing else reads afterwards."""
    def rms_norm(self, x: Tensor, weight: Tensor, epsilon: float,
                 residual: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
        """(out, total, rstd): with residual, total = x + residual rounded to x's dtype and
        normalised (else total None and x normalised); rstd fp32 [rows]. LlamaRMSNorm casting."""
    def rms_norm_grad(self, x: Tensor, weight: Tensor, rstd: Tensor, d_out: Tensor, epsilon: float,
                      d_total: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(d_x, d_weight) of rms_norm from its input (the total when a residual was added) and
        rstd; d_total (the gradient reaching the sum itself) is added into d_x. Dense d_out."""
    def cross_entropy(self, logits: Tensor, labels: Tensor, ignore_index: int, grad_scale: float,
                      with_grad: bool, label_error: Tensor) -> Tensor:
        """The fused cross-entropy kernel on logits [rows, V]: returns fp32 [rows] losses (0 for
        ignored rows); with_grad, logits is overwritten in place by (softmax - onehot) *
        grad_scale (0 on rows whose loss is not > 0). A label outside [0, V) that is not
        ignore_index: raises ValueError where the backend can see it at once (CPU), else sets
        label_error (int32 [1], zeroed by the caller) for one later read."""

    # --- rotary (core/rotary.py) ---------------------------------------------------------------
    def is_cpu(self, t: Tensor) -> bool:
        """Whether t lives in host memory (the rotary position flag is read at once there)."""
    def token_stride(self, t: Tensor) -> int:
        """Elements between consecutive tokens of a [b, s, heads, head_dim] tensor as the kernel
        will see it (heads dense within a token): a token-strided view passes as it is where the
        binding hands the kernel its pointer (torch), else the dense heads * head_dim (Paddle's
        custom-op call copies a strided input dense)."""
    def position_flag(self, like: Tensor) -> Tensor:
        """A zeroed int32 [1] on `like`'s device: the rotary kernels' out-of-table position flag."""
    def read_flag(self, flag: Tensor) -> int:
        """The flag's value on the host (one copy)."""
    def rotary(self, sources, outputs, dims, layouts, cos: Tensor, sin: Tensor,
               position_ids: Tensor | None, position_error: Tensor | None, inverse: bool) -> None:
        """The rotary kernel, writing into `outputs`: sources (q, k, v) and outputs (q_out, k_out,
        v_out), one tensor may serve several slots, v and v_out None for no v; dims (b, s, hq, hk,
        d); six heads layouts (offset, token_stride, group_stride, heads_per_group, head_stride) in
        elements of their tensor (None for an absent v); cos/sin fp32 [rows, d]; position_ids
        int64 [b, s] or None; position_error a zeroed position_flag or None; inverse applies the
        transposed rotation (the backward)."""

    # --- GEMMs through the framework's BLAS ------------------------------------------------------
    def gemm_dtype(self, t: Tensor) -> DType:
        """The dtype in which this backend runs t's GEMMs: t's own where the device has GEMMs for
        it, fp32 for 16-bit tensors where it has none (Paddle CPU)."""
    def autocast_changes_gemm(self, t: Tensor) -> bool:
        """Whether the framework's autocast (AMP) is on and runs a GEMM of t in another dtype than
        t's (AMP O1: fp32 activations and weights, 16-bit GEMMs)."""
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """x @ W as a Linear layer of this framework computes it (weight in its own layout)."""
    def linear_accumulate(self, base: Tensor, x: Tensor, weight: Tensor, alpha: float) -> Tensor:
        """base + alpha * linear(x, weight) for 2-D base [rows, out] and x [rows, in], as one GEMM
        accumulating (addmm, beta 1) into base itself where the framework allows writing it in place
        (base is the frozen projection's fresh output, read by nothing else), else into a copy of
        it; differentiable by the framework's autograd: its backward carries alpha inside the GEMMs
        and hands base the output gradient as it is (core/lora.py: LoRA's adapter added to the
        frozen output)."""
    def linear_grad_input(self, dy: Tensor, weight: Tensor, alpha: float = 1.0) -> Tensor:
        """alpha * dy @ W^T in the math sense: the gradient of `linear` with respect to x; alpha
        inside the GEMM where the framework's GEMM takes one (torch), else a scale of the product
        (Paddle)."""
    def linear_grad_input_accumulate(self, out: Tensor, dy: Tensor, weight: Tensor) -> None:
        """out += linear_grad_input(dy, weight), in place: one accumulating GEMM (beta 1) where the
        framework has one (torch's addmm_), else a product and an add (Paddle)."""
    def linear_grad_weight(self, x: Tensor, dy: Tensor, alpha: float = 1.0) -> Tensor:
        """alpha times the gradient of `linear` with respect to weight, in the framework's weight
        layout (alpha as linear_grad_input applies it); x and dy are taken as 2-D rows."""
    def linear_output_halves(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        """Views of a Linear weight's first and second halves of its outputs ([gate | up])."""
    def linear_grad_weight_of_halves(self, x: Tensor, dy_first: Tensor, dy_second: Tensor) -> Tensor:
        """The weight gradient of a Linear whose output is [dy_first | dy_second]'s layer: each
        half's GEMM written straight into its half of one buffer (no concatenation copy)."""
    def matmul(self, a: Tensor, b: Tensor, transpose_a: bool = False, transpose_b: bool = False,
               alpha: float = 1.0) -> Tensor:
        """alpha * op(a) @ op(b) (op = transpose where asked) for 2-D a, b of one dtype, in that
        dtype with fp32 accumulation inside the GEMM."""
    def matmul_into_rows(self, out: Tensor, start: int, a: Tensor, b: Tensor, transpose_b: bool,
                         alpha: float = 1.0) -> None:
        """out[start : start + rows(a)] = alpha * a @ op(b), converted to out's dtype, written into
        out's rows (where the framework can, by the GEMM itself: no [rows, N] temporary)."""
    def gemm_fp32_accumulate(self, out: Tensor | None, a: Tensor, b: Tensor,
                             alpha: float = 1.0) -> Tensor:
        """The weight-gradient GEMM summed in fp32: alpha * a^T @ b for a [K, M], b [K, N] of one
        dtype, with an fp32 [M, N] result: into a new tensor when out is None, else added to out
        in place (out += ...), each call's product never rounded to a 16-bit dtype first. Returns
        the result. GPU: the project's cuBLASLt provider (fastffn_gemm_cuda) with fp32 output and
        accumulation; where the inputs are already fp32 (Paddle CPU), the framework's fp32 GEMM
        (float64 inputs, for checks: a float64 result)."""


class IndexingBackend:
    """The Backend methods that Paddle and torch tensors answer alike (.shape, .dtype, .detach(),
    Python indexing), written once for both backends to inherit."""

    @staticmethod
    def shape(t):
        return tuple(t.shape)

    @staticmethod
    def dtype(t):
        return t.dtype

    @staticmethod
    def detach(t):
        return t.detach()

    @staticmethod
    def row_slice(t, start, end):
        return t[start:end]

    @staticmethod
    def take_rows(t, index):
        return t[index]
