"""SwiGLU, ``silu(gate) * up``, and SwiGLU followed by the down projection, as fused ops over a
Backend (the contract: autograd.py). Paddle runs them as ops.swiglu / ops.swiglu_down_proj, the GPU
harness as paddle_fastffn.torch.ops.SwiGLU / SwiGLUDownProj; core/ffn.py builds the whole FFN on the same
backward (`down_proj_swiglu_grad`)."""

from __future__ import annotations

from .autograd import FusedOp


class SwiGLUPacked(FusedOp):
    """x [..., 2I] packing [gate | up] -> [..., I]; backward from the saved x."""

    inputs = ("x",)

    @staticmethod
    def forward(be, saved, x):
        saved.save(x)
        return be.swiglu(x)

    @staticmethod
    def backward(be, saved, d_out):
        (x,) = saved.tensors
        d_x, _, _ = be.swiglu_grad(x, None, be.contiguous(d_out), False)
        return saved.only_needed(d_x)


class SwiGLU(FusedOp):
    """Two inputs x, y [..., I] -> silu(x) * y; backward from the saved inputs.

    reuse_input_memory: the backward writes d_x over x and d_y over y (the kernel reads each element
    before writing it), so it allocates no [tokens, 2I] of its own; only for inputs nothing else
    reads after this op (the unfused MLP's gate_proj and up_proj outputs, under LoRA). Liger's
    SiLU-mul backward works in place the same way: without it the LoRA step's peak held these two
    extra [tokens, I] (full-depth LoRA row, benchmarks/results/run16/full_depth.json: +0.17 GiB
    against HF + Liger + PEFT)."""

    inputs = ("x", "y")
    options = ("reuse_input_memory",)

    @staticmethod
    def forward(be, saved, x, y, reuse_input_memory):
        saved.save(x, y)
        saved.reuse_input_memory = reuse_input_memory
        return be.swiglu(x, y)

    @staticmethod
    def backward(be, saved, d_out):
        x, y = saved.tensors
        if saved.reuse_input_memory:
            d_x, d_y = be.detach(x), be.detach(y)  # same memory; only this op holds it
            be.swiglu_grad_in_place(d_x, d_y, be.contiguous(d_out), False)
        else:
            d_x, d_y, _ = be.swiglu_grad(x, y, be.contiguous(d_out), False)
        return saved.only_needed(d_x, d_y)


def down_proj_swiglu_grad(be, gate, up, d_hidden, hidden, in_place: bool):
    """The SwiGLU backward under a down projection: (d_gate, d_up, hidden), d_gate packed when up
    is None. hidden None (recompute): the SwiGLU output is rewritten in the same pass as the
    gradient, for the down projection's weight gradient, instead of having been stored.
    in_place: gate (and up) become their gradients and d_hidden the recomputed output, so the
    backward allocates no [tokens, 3I] of its own (detach: same memory, no autograd in-place
    bookkeeping for tensors only this op holds)."""
    recompute = hidden is None
    if in_place:
        d_gate, d_up, d_hidden = be.detach(gate), None if up is None else be.detach(up), be.detach(d_hidden)
        be.swiglu_grad_in_place(d_gate, d_up, d_hidden, recompute)
        return d_gate, d_up, d_hidden if recompute else hidden
    d_gate, d_up, recomputed = be.swiglu_grad(gate, up, d_hidden, recompute)
    return d_gate, d_up, recomputed if recompute else hidden


class SwiGLUDownProj(FusedOp):
    """out = swiglu(gate_up) @ W_down (the Linear weight in the framework's layout): what the
    LLaMA patch's MLP runs after its gate_up_fused_proj GEMM.

    recompute: only gate_up (and the weight) are kept for backward and the backward kernel
    rewrites the SwiGLU output in the same pass that computes its gradient ([tokens, I] saved per
    layer); otherwise the output is stored. reuse_gate_up_memory: the backward writes gate_up's
    gradient over gate_up itself and the recomputed output over d_hidden; only for a gate_up
    nothing else reads after this op (the fused MLP's projection output)."""

    inputs = ("gate_up", "weight")
    options = ("recompute", "reuse_gate_up_memory")

    @staticmethod
    def forward(be, saved, gate_up, weight, recompute, reuse_gate_up_memory):
        hidden = be.swiglu(gate_up)
        saved.save(gate_up, weight, None if recompute else hidden)
        saved.reuse_gate_up_memory = reuse_gate_up_memory
        return be.linear(hidden, weight)

    @staticmethod
    def backward(be, saved, d_out):
        gate_up, weight, hidden = saved.tensors
        d_hidden = be.contiguous(be.linear_grad_input(d_out, weight))
        d_gate_up, _, hidden = down_proj_swiglu_grad(be, gate_up, None, d_hidden, hidden,
                                                     saved.reuse_gate_up_memory)
        # needs, not the saved weight's own flag: a recompute replay's copy is detached.
        d_weight = be.linear_grad_weight(hidden, d_out) if saved.need("weight", SwiGLUDownProj.inputs) else None
        return saved.only_needed(d_gate_up, d_weight)
