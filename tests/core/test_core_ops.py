"""The framework-neutral core layer (paddle_fastffn/core): it imports without Paddle or torch, and
every Paddle op wrapper runs a core op through the one PyLayer adapter (ops/_autograd.pylayer), so
no op keeps a second autograd of its own. The GPU harness builds its Functions from the same core
classes (paddle_fastffn/torch/backend.function; tests/gpu run them on the H200)."""

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Every module of core/ (a new op's module is checked without being listed here).
CORE_MODULES = sorted(p.stem for p in (REPO / "paddle_fastffn" / "core").glob("*.py") if p.stem != "__init__")
# Every public op module of paddle_fastffn.ops (the private ones, _*.py, are the adapter and helpers).
OP_MODULES = sorted(f"paddle_fastffn.ops.{p.stem}" for p in (REPO / "paddle_fastffn" / "ops").glob("*.py")
                    if not p.stem.startswith("_") and p.stem != "build_definition")
needs_paddle = pytest.mark.skipif(importlib.util.find_spec("paddle") is None, reason="needs Paddle")


def test_core_imports_without_paddle_or_torch():
    """A None entry in sys.modules makes any import of that name fail, as on a machine without it."""
    imports = "; ".join(f"import paddle_fastffn.core.{name}" for name in CORE_MODULES)
    code = ("import sys; sys.modules['paddle'] = None; sys.modules['torch'] = None; "
            f"{imports}; print('CORE_OK')")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 0 and "CORE_OK" in result.stdout, result.stderr


@needs_paddle
@pytest.mark.parametrize("module_name", OP_MODULES)
def test_every_paddle_op_autograd_is_pylayer_of_a_core_op(module_name):
    from paddle.autograd import PyLayer

    from paddle_fastffn.core.autograd import FusedOp

    module = importlib.import_module(module_name)
    layers = [value for value in vars(module).values() if inspect.isclass(value) and issubclass(value, PyLayer)]
    defined_here = [cls.__name__ for cls in layers if cls.__module__ == module_name]
    assert not defined_here, f"{module_name} defines PyLayers of its own: {defined_here}"
    for cls in layers:
        assert cls.__module__ == "paddle_fastffn.ops._autograd", cls  # built by pylayer()
        assert issubclass(cls.fused_op, FusedOp) and cls.fused_op.__module__.startswith("paddle_fastffn.core.")


@needs_paddle
def test_the_public_ops_run_the_core_ops_forward_and_backward(monkeypatch):
    """Each public function's autograd goes through its core op (a spy on the core classes)."""
    import paddle

    from paddle_fastffn import ops
    from paddle_fastffn.core import linear_cross_entropy, rms_norm, swiglu

    calls = []
    for op in (swiglu.SwiGLUPacked, swiglu.SwiGLU, swiglu.SwiGLUDownProj, rms_norm.RMSNorm,
               rms_norm.AddRMSNorm, linear_cross_entropy.LinearCrossEntropy):
        for phase in ("forward", "backward"):
            original = getattr(op, phase)

            def spy(*args, _original=original, _name=f"{op.__name__}.{phase}"):
                calls.append(_name)
                return _original(*args)

            monkeypatch.setattr(op, phase, staticmethod(spy))

    def leaf(*shape):
        t = paddle.randn(list(shape))
        t.stop_gradient = False
        return t

    x, y, w = leaf(5, 8), leaf(5, 8), leaf(8)
    ops.swiglu(x).sum().backward()
    ops.swiglu(x, y).sum().backward()
    ops.swiglu_down_proj(x * 1.0, leaf(4, 6), reuse_gate_up_memory=True).sum().backward()
    ops.rms_norm(x, w).sum().backward()
    out, total = ops.fused_add_rms_norm(x, y, w)
    (out.sum() + total.sum()).backward()
    ops.linear_cross_entropy(x, leaf(8, 11), paddle.to_tensor([1, 2, -100, 3, 4])).backward()
    expected = [f"{name}.{phase}" for name in ("SwiGLUPacked", "SwiGLU", "SwiGLUDownProj", "RMSNorm",
                                              "AddRMSNorm", "LinearCrossEntropy")
                for phase in ("forward", "backward")]
    assert calls == expected


@needs_paddle
def test_the_harness_ffn_composition_matches_the_reference_on_paddle_cpu():
    """core.ffn.FusedFFN (the GPU harness's FFN) over the Paddle backend, in fp32 on CPU: the packed
    GEMM with recompute and the in-place SwiGLU backward, the configuration both paths run, against
    PaddleNLP's unfused math. The harness runs the same class over torch on the H200 (tests/gpu)."""
    import paddle
    import paddle.nn.functional as F

    from paddle_fastffn.core.ffn import FusedFFN
    from paddle_fastffn.ops._autograd import pylayer
    from tolerances import assert_close

    tokens, hidden, inter = 7, 12, 10  # odd sizes

    def leaves():
        paddle.seed(3)
        tensors = [paddle.randn([1, tokens, hidden]), paddle.randn([hidden, 2 * inter]) * 0.3,
                   paddle.randn([inter, hidden]) * 0.3]
        for t in tensors:
            t.stop_gradient = False
        return tensors

    x, w_gate_up, w_down = leaves()
    out = pylayer(FusedFFN).apply(x, w_gate_up, w_down, True, False)
    d_out = paddle.randn(out.shape)
    (out * d_out).sum().backward()
    rx, rw_gate_up, rw_down = leaves()
    gate, up = paddle.chunk(paddle.matmul(rx, rw_gate_up), 2, axis=-1)
    ref = paddle.matmul(F.silu(gate) * up, rw_down)
    (ref * d_out).sum().backward()
    assert_close(out, ref, paddle.float32, "fused FFN output")
    assert_close(x.grad, rx.grad, paddle.float32, "d_x")
    assert_close(w_gate_up.grad, rw_gate_up.grad, paddle.float32, "d_w_gate_up", reduced_rows=tokens)
    assert_close(w_down.grad, rw_down.grad, paddle.float32, "d_w_down", reduced_rows=tokens)


@needs_paddle
def test_the_paddle_weight_gradient_gemm_passes_the_providers_argument_checks():
    """PaddleBackend.gemm_fp32_accumulate's 16-bit branch (the loss's d_weight on GPU) calls the
    cuBLASLt provider's binding, which checks every argument before refusing a CPU tensor: on CPU
    the call must get as far as that device check (a wrong `out` shape is caught before it)."""
    import paddle

    from paddle_fastffn.ops._backend import BACKEND

    a = paddle.randn([5, 3]).astype(paddle.bfloat16)  # [K, M]: the chunk's hidden rows
    b = paddle.randn([5, 4]).astype(paddle.bfloat16)  # [K, N]: the chunk's d_logits
    with pytest.raises(Exception, match="got a tensor on Place\\(cpu\\)"):
        BACKEND.gemm_fp32_accumulate(None, a, b)
    with pytest.raises(Exception, match="got a tensor on Place\\(cpu\\)"):
        BACKEND.gemm_fp32_accumulate(paddle.zeros([3, 4]), a, b, 0.5)
    with pytest.raises(Exception, match=r"argument `d` must be \[3, 4\]"):
        BACKEND.gemm_fp32_accumulate(paddle.zeros([4, 3]), a, b)
