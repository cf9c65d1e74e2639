"""The harness's FP8 FFN (paddle_fastffn/torch/fp8/ffn.py) issues the C entry-point calls that
paddle_fastffn/integration/composition.py lists (fp8_ffn_calls), the list the Paddle FFN is traced
against on CPU (tests/integration/test_composition.py): what is benchmarked is what Paddle runs.

Each call of the Fp8Kernels methods the FFN uses is recorded as the composition names it: the
tensor by the scaling state whose scale or amax the call receives (one per role), the FP8 copies a
GEMM reads by the call that wrote them (device pointers)."""

from __future__ import annotations

import math

import pytest
import torch

from paddle_fastffn.torch.fp8 import ffn as fp8_ffn
from paddle_fastffn.torch.fp8 import c_api as fp8
from paddle_fastffn.torch.llama import COMPOSITION

ROLES = ("x", "w_gate_up", "w_down", "h", "dy", "d_gate_up", "gate_up")


class HarnessTracer:
    """Wraps the FFN's Fp8Kernels methods (instance attributes, undone by monkeypatch)."""

    def __init__(self, k: fp8.Fp8Kernels, state: fp8_ffn.Fp8FFNState, monkeypatch):
        self.calls: list = []
        self.copy_of: dict[int, tuple[str, str]] = {}  # data_ptr of an FP8 copy -> (tensor, copy)
        self.role_of = {}
        for role in ROLES:
            scaling = getattr(state, role)
            if scaling is not None:  # gate_up: only with saved_gate_up "fp8"
                self.role_of[scaling.scale.data_ptr()] = self.role_of[scaling.amax_history.data_ptr()] = role
        for name in ("quantize", "swiglu_fwd_fp8", "swiglu_fwd_fp8_with_gate_up", "swiglu_bwd_fp8", "gemm",
                     "compute_scale", "update_amax_history"):
            monkeypatch.setattr(k, name, getattr(self, f"_{name}")(getattr(k, name)))

    def _wrote(self, role, q: fp8.Quantized, rowwise: bool, transposed: bool):
        """The (tensor, copy) pairs q holds: torch's weights are stored [out, in]."""
        row, col = (COMPOSITION.OUT_IN, COMPOSITION.IN_OUT) if role.startswith("w_") else (
            COMPOSITION.ROWWISE, COMPOSITION.TRANSPOSED)
        writes = []
        for wanted, data, copy in ((rowwise, q.data, row), (transposed, q.data_t, col)):
            if wanted:
                assert data is not None, (role, copy)
                self.copy_of[data.data_ptr()] = (role, copy)
                writes.append((role, copy))
        return tuple(writes)

    def _quantizing(self, kernel, original, transpose_default):
        """fastffn_fp8_quantize / fastffn_swiglu_fwd_fp8: (input, fmt, scale, rowwise, transpose,
        amax=...); an amax-only pass writes no copy."""
        def wrapped(x, fmt, scale=None, rowwise=True, transpose=transpose_default, amax=None, **kw):
            q = original(x, fmt, scale, rowwise, transpose, amax=amax, **kw)
            role = self.role_of[amax.data_ptr()]
            self.calls.append((kernel, role, self._wrote(role, q, rowwise, transpose)))
            return q
        return wrapped

    def _quantize(self, original):
        return self._quantizing("fp8_quantize", original, transpose_default=True)

    def _swiglu_fwd_fp8(self, original):
        return self._quantizing("swiglu_fwd_fp8", original, transpose_default=False)

    def _swiglu_fwd_fp8_with_gate_up(self, original):
        def with_gate_up(gate_up, fmt, scale=None, rowwise=True, transpose=False, amax=None, **kw):
            q, q_gu = original(gate_up, fmt, scale, rowwise, transpose, amax=amax, **kw)
            assert self.role_of[kw["gate_up_amax"].data_ptr()] == "gate_up"
            writes = self._wrote("h", q, rowwise, transpose)
            if kw.get("gate_up_rowwise"):
                writes += self._wrote("gate_up", q_gu, True, False)
            self.calls.append(("swiglu_fwd_fp8", self.role_of[amax.data_ptr()], writes))
            return q, q_gu
        return with_gate_up

    def _swiglu_bwd_fp8(self, original):
        def swiglu_bwd_fp8(gate_up, d_h, fmt=fp8_ffn.E5M2, scale=None, rowwise=True, transpose=True, amax=None,
                           **kw):
            # gate_up: the forward's FP8 copy (with its scale_inv) or the 16-bit one
            from_copy = self.copy_of.get(gate_up.data_ptr()) == ("gate_up", COMPOSITION.ROWWISE)
            assert from_copy == (kw.get("gate_up_scale_inv") is not None) == (gate_up.dtype in fp8.FP8_DTYPES)
            q, q_h = original(gate_up, d_h, fmt, scale, rowwise, transpose, amax=amax, **kw)
            role = self.role_of[amax.data_ptr()]
            writes = self._wrote(role, q, rowwise, transpose)
            if kw.get("h") in fp8.FP8_DTYPES:
                writes += self._wrote("h", q_h, kw.get("h_rowwise", False), kw.get("h_transpose", True))
            self.calls.append(("swiglu_bwd_fp8", role, writes))
            return q, q_h
        return swiglu_bwd_fp8

    def _gemm(self, original):
        def gemm(a, b, *args, **kw):
            self.calls.append(("gemm", (self.copy_of[a.data_ptr()], self.copy_of[b.data_ptr()])))
            return original(a, b, *args, **kw)
        return gemm

    def _compute_scale(self, original):
        def compute_scale(amax, *args, **kw):
            self.calls.append(("fp8_compute_scale", self.role_of[amax.data_ptr()], ()))
            return original(amax, *args, **kw)
        return compute_scale

    def _update_amax_history(self, original):
        def update_amax_history(history, *args, **kw):
            self.calls.append(("fp8_update_amax_history", self.role_of[history.data_ptr()], ()))
            return original(history, *args, **kw)
        return update_amax_history


@pytest.mark.parametrize("kind, warm_start, saved_gate_up", [
    ("current", True, "fp8"), ("delayed", True, "fp8"), ("delayed", False, "fp8"),
    ("current", True, "activation"), ("delayed", True, "activation")])
@pytest.mark.parametrize("weight_copies", ["per_use", "cached"])
def test_harness_fp8_ffn_issues_the_composition_calls(monkeypatch, kind, warm_start, saved_gate_up, weight_copies):
    """Two steps (the first, then one after the weights changed) of the harness's FFN against
    composition.fp8_ffn_calls, call by call."""
    k = fp8.kernels()
    state = fp8_ffn.Fp8FFNState(fp8_ffn.Fp8Recipe(kind, amax_history_len=4, delayed_warm_start=warm_start,
                                                  saved_gate_up=saved_gate_up, weight_copies=weight_copies))
    tracer = HarnessTracer(k, state, monkeypatch)
    t, hidden, inter = 64, 256, 688
    for step in range(2):
        x = torch.randn(t, hidden, device="cuda").to(torch.bfloat16).requires_grad_()
        w_gu = (torch.randn(2 * inter, hidden, device="cuda") / math.sqrt(hidden)).to(torch.bfloat16).requires_grad_()
        w_d = (torch.randn(hidden, inter, device="cuda") / math.sqrt(inter)).to(torch.bfloat16).requires_grad_()
        tracer.calls.clear()
        fp8_ffn.fp8_ffn(x, w_gu, w_d, state).backward(torch.randn(t, hidden, device="cuda").to(torch.bfloat16))
        state.cache.invalidate()
        expected = COMPOSITION.fp8_ffn_calls(kind, first_step=step == 0, delayed_warm_start=warm_start,
                                             saved_gate_up=saved_gate_up, weight_copies=weight_copies)
        assert COMPOSITION.comparable(tracer.calls) == COMPOSITION.comparable(expected), f"step {step}: {tracer.calls}"
