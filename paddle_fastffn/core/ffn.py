"""The whole fused FFN, y = swiglu(x @ W_gate_up) @ W_down, on PaddleNLP's fused gate_up weight,
as a fused op over a Backend (the contract: autograd.py). The GPU harness runs it as
paddle_fastffn.torch.ops.fused_ffn; its SwiGLU backward is SwiGLUDownProj's (core/swiglu.py), which the Paddle
patch's MLP runs after its own gate_up Linear."""

from __future__ import annotations

from .autograd import FusedOp
from .swiglu import down_proj_swiglu_grad


class FusedFFN(FusedOp):
    """x [..., H] -> [..., H] through w_gate_up (Linear, outputs [gate | up], 2I) and w_down
    (Linear, I -> H), both in the framework's Linear layout.

    split_gemms=False: one [T, 2I] GEMM and the packed SwiGLU; True: two [T, I] GEMMs on the
    output halves of w_gate_up (views) and the two-input SwiGLU. recompute: the SwiGLU output is
    not stored; the backward kernel rewrites it in place over d_hidden. The gate/up gradients
    overwrite gate/up, and the SwiGLU output is released before the input-gradient GEMMs, so the
    backward's peak holds [T, 3I] activations, not [T, 6I]."""

    inputs = ("x", "w_gate_up", "w_down")
    options = ("recompute", "split_gemms")

    @staticmethod
    def forward(be, saved, x, w_gate_up, w_down, recompute, split_gemms):
        x2 = be.rows(x)
        if split_gemms:
            w_gate, w_up = be.linear_output_halves(w_gate_up)
            gate, up = be.linear(x2, w_gate), be.linear(x2, w_up)
        else:
            gate, up = be.linear(x2, w_gate_up), None
        hidden = be.swiglu(gate, up)
        out = be.linear(hidden, w_down)
        saved.save(x2, w_gate_up, w_down, gate, up, None if recompute else hidden)
        saved.x_shape = be.shape(x)
        return be.reshape(out, (*saved.x_shape[:-1], be.shape(out)[-1]))

    @staticmethod
    def backward(be, saved, d_out):
        x2, w_gate_up, w_down, gate, up, hidden = saved.tensors
        d_out = be.rows(d_out)
        d_hidden = be.linear_grad_input(d_out, w_down)
        d_gate, d_up, hidden = down_proj_swiglu_grad(be, gate, up, d_hidden, hidden, in_place=True)
        d_w_down = be.linear_grad_weight(hidden, d_out) if saved.need(2) else None
        del hidden, d_hidden  # release [T, I] before the [T, H] / [2I, H] outputs
        d_x = d_w_gate_up = None
        if d_up is not None:  # split GEMMs
            w_gate, w_up = be.linear_output_halves(w_gate_up)
            if saved.need(0):
                d_x = be.linear_grad_input(d_gate, w_gate)
                be.linear_grad_input_accumulate(d_x, d_up, w_up)
            if saved.need(1):
                d_w_gate_up = be.linear_grad_weight_of_halves(x2, d_gate, d_up)
        else:
            if saved.need(0):
                d_x = be.linear_grad_input(d_gate, w_gate_up)
            if saved.need(1):
                d_w_gate_up = be.linear_grad_weight(x2, d_gate)
        d_x = None if d_x is None else be.reshape(d_x, saved.x_shape)
        return saved.only_needed(d_x, d_w_gate_up, d_w_down)
