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


def test_the_fused_loss_takes_the_frozen_head_budget_when_the_head_does_not_train(monkeypatch):
    """A LoRA step's head is frozen: the harness's fused loss chunks it under the frozen-head GPU
    budget (core.linear_cross_entropy.GPU_FROZEN_HEAD_CHUNK_BYTES), a trained head under the other;
    the chunk it hands the Function is recorded here (the CPU kernels then run it)."""
    from paddle_fastffn.core import linear_cross_entropy as core_lce

    chunks = []
    apply = ops.LinearCrossEntropy.apply

    def recorded(hidden, weight, labels, ignore_index, transpose_weight, chunk, n_labelled, fp8):
        chunks.append(chunk)
        return apply(hidden, weight, labels, ignore_index, transpose_weight, chunk, n_labelled, fp8)

    monkeypatch.setattr(ops.LinearCrossEntropy, "apply", recorded)
    vocab = 128256
    hidden, labels = torch.randn(5, 8, requires_grad=True), torch.randint(0, vocab, (5,))
    for trains in (True, False):
        weight = (torch.randn(8, vocab) * 0.1).requires_grad_(trains)
        ops.linear_cross_entropy(hidden, weight, labels).backward()
    assert chunks == [core_lce.default_chunk_tokens(vocab, on_gpu=True),
                      core_lce.default_chunk_tokens(vocab, on_gpu=True, weight_trainable=False)] == [2092, 261]
