"""The tensor backend the core layer is written over: the few things it asks of a framework.

Two implementations: paddle_fastffn/ops/_backend.py (PaddleBackend: the compiled Paddle custom ops,
CPU and CUDA, and Paddle's matmul) and benchmarks/gpu/torch_backend.py (TorchBackend: the same C
kernels through ctypes, torch's cuBLAS). A method belongs here only if the core layer calls it;
each says what it must do, so a backend is checked against this text and the trace test
(tests/integration/test_trace.py) checks that both execute the same list.

Layout rule: a Linear weight is in the framework's own layout (Paddle [in, out], torch [out, in]);
the core never transposes one itself, it asks `linear`, `linear_grad_input`, `linear_grad_weight`.
"""

from __future__ import annotations

from typing import Protocol, Any

Tensor = Any


class Backend(Protocol):
    name: str  # "paddle" or "torch"

    # --- tensors ------------------------------------------------------------------------------
    def shape(self, t: Tensor) -> tuple[int, ...]: ...
    def rows(self, t: Tensor) -> Tensor:
        """t as 2-D [prod(shape[:-1]), shape[-1]] (a view: no copy)."""
    def reshape(self, t: Tensor, shape) -> Tensor: ...
    def contiguous(self, t: Tensor) -> Tensor:
        """t itself when already dense, else one copy."""
    def detach(self, t: Tensor) -> Tensor:
        """The same memory without autograd history (for a tensor only this op holds)."""

    # --- GEMMs through the framework's BLAS ------------------------------------------------------
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """x @ W as a Linear layer of this framework computes it (weight in its own layout)."""
    def linear_grad_input(self, dy: Tensor, weight: Tensor) -> Tensor:
        """dy @ W^T in the math sense: the gradient of `linear` with respect to x."""
    def linear_grad_weight(self, x: Tensor, dy: Tensor) -> Tensor:
        """The gradient of `linear` with respect to weight, in the framework's weight layout; x and
        dy are taken as 2-D rows."""

    # --- allocation and addressing (core/rotary.py) ------------------------------------------
    def empty(self, shape, like: Tensor) -> Tensor:
        """An uninitialised dense tensor of `like`'s dtype on `like`'s device."""
    def token_stride(self, t: Tensor) -> int:
        """Elements between consecutive tokens (axis 1) of a [b, s, heads, d] tensor whose heads
        are dense within each token, as the kernel will see it (Paddle's custom ops receive
        their inputs contiguous: heads * d; torch passes a token-strided view as it is)."""
    def is_cpu(self, t: Tensor) -> bool: ...

    # --- kernels -----------------------------------------------------------------------------
    def rotary(self, sources, outputs, dims, layouts, cos: Tensor, sin: Tensor,
               position_ids: Tensor | None, position_error: Tensor | None, inverse: bool) -> None:
        """fastffn_rotary_* (c_api.h) in place. sources = (q, k, v), outputs = (q_out, k_out,
        v_out): tensors, where the same tensor may appear several times (q, k and v read from one
        fused qkv; one d_qkv written); v and v_out both None = no v. dims = (batch, seq, q_heads,
        k_heads, head_dim); layouts = six (offset, token_stride, group_stride, heads_per_group,
        head_stride) for q, k, v, q_out, k_out, v_out in elements of their tensors (None for an
        absent v). cos/sin fp32 [rows, head_dim]; position_ids int64 [b, s] or None;
        position_error a flag from position_flag (or None: ids already checked)."""
    def position_flag(self, like: Tensor) -> Tensor:
        """One zeroed int32 on `like`'s device, for kernels to flag bad input into."""
    def read_flag(self, flag: Tensor) -> int:
        """The flag's value on the host (a synchronising copy on a GPU)."""
