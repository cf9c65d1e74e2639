"""Paddle-side test helpers shared by the op and integration tests."""

import contextlib

import numpy as np
import paddle

DTYPES = [paddle.float32, paddle.float16, paddle.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def random_tensor(shape, dtype, scale=1.0, requires_grad=True):
    """Normal values, upcast-exact in `dtype`: the float64 reference sees the same numbers."""
    value = paddle.to_tensor(np.random.randn(*shape).astype(np.float32) * scale).astype(dtype)
    value.stop_gradient = not requires_grad
    return value


def as_float64_leaf(t):
    out = t.astype(paddle.float32).astype(paddle.float64).detach()
    out.stop_gradient = False
    return out


def grads_of(outputs, upstream, inputs):
    """Backward of sum(output * upstream) with respect to `inputs`; returns their gradients."""
    total = None
    for out, up in zip(outputs, upstream):
        term = (out.astype(up.dtype) * up).sum()
        total = term if total is None else total + term
    return paddle.grad(total, inputs, allow_unused=True)


@contextlib.contextmanager
def fp8_heads_made():
    """[(need_d_hidden, need_d_weight, layout)] of every core/fp8/lm_head.py Fp8HeadGemms made inside:
    one per fused-loss call whose GEMMs ran in FP8 (layout "in_out" for an [H, V] head, "out_in" for
    a tied [V, H] one)."""
    from paddle_fastffn.core.fp8 import lm_head

    made, init = [], lm_head.Fp8HeadGemms.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append((self.need_d_hidden, self.need_d_weight, self.layout))

    lm_head.Fp8HeadGemms.__init__ = recorded
    try:
        yield made
    finally:
        lm_head.Fp8HeadGemms.__init__ = init
