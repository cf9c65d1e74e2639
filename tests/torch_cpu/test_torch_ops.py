"""paddle_fastffn.torch.ops has a torch Function for every fused op of paddle_fastffn/core, derived
from the core modules (a new op's Function needs no edit there), and the harness's named Functions
are those entries; one of them runs forward and backward over the CPU kernels."""

import ast

import torch

from paddle_fastffn.core import rms_norm as core_rms_norm
from paddle_fastffn.core import swiglu as core_swiglu
from paddle_fastffn.torch import ops
from paddle_fastffn.torch.build import REPO


def test_every_core_fused_op_has_a_torch_function():
    declared = set()
    for path in sorted((REPO / "paddle_fastffn" / "core").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            bases = [getattr(base, "id", None) for base in getattr(node, "bases", ())]
            if isinstance(node, ast.ClassDef) and "FusedOp" in bases:
                declared.add(f"paddle_fastffn.core.{path.stem}.{node.name}")
    built = {f"{op.__module__}.{op.__name__}": fn for op, fn in ops.FUNCTIONS.items()}
    assert declared and declared <= set(built)
    assert all(fn.fused_op.__name__ == fn.__name__ for fn in built.values())


def test_the_named_functions_are_the_derived_ones():
    assert ops.SwiGLU is ops.FUNCTIONS[core_swiglu.SwiGLUPacked]
    assert ops.SwiGLUPair is ops.FUNCTIONS[core_swiglu.SwiGLU]
    assert ops.RMSNorm is ops.FUNCTIONS[core_rms_norm.RMSNorm]
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = ops.FUNCTIONS[core_rms_norm.RMSNorm].apply(x, w, 1e-6)
    y.sum().backward()
    ref = x.detach() * torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6) * w.detach()
    torch.testing.assert_close(y.detach(), ref)
    assert x.grad is not None and w.grad is not None
