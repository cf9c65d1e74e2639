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
