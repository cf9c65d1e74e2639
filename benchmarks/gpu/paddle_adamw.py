"""Stock Paddle's AdamW as Paddle users run it, in the GPU harness (the H200 has no Paddle), for the
optimizer benchmark's baseline: PaddleAdamW has paddle_fastffn.torch.llama.FusedMasterAdamW's interface and does
what Paddle 3.3.1's dygraph does for

    paddle.optimizer.AdamW(learning_rate, beta1, beta2, epsilon, parameters, weight_decay,
                           grad_clip=ClipGradByGlobalNorm(max_grad_norm) or None, multi_precision=True)

on 16-bit parameters (PaddleNLP's bf16 O2 training), launch for launch:

- the update: one launch per parameter of Paddle's AdamWKernelREG (paddle_adamw.cu: its operations in
  its order, its launch configuration): reads the 16-bit gradient, the fp32 master, m and v; writes
  m, v, the master and the 16-bit parameter: 28 bytes per parameter. The learning rate is a device
  fp32 tensor; beta1^t and beta2^t are per-parameter fp32 accumulators on the host (Paddle creates
  them on the CPU, passes them by value and multiplies them on the host after each launch).
- with a clip, first ClipGradByGlobalNorm._dygraph_clip (python/paddle/nn/clip.py): per gradient a
  squared-L2-norm reduction (_C_ops.squared_l2_norm: fp32 accumulation, the result in the
  gradient's dtype; paddle_adamw.cu), then stack + sum of those (in that dtype), a cast to fp32, a
  second stack + sum over the dtype groups, sqrt, full, maximum, divide; per gradient a cast of the
  coefficient to its dtype and an in-place multiply (g.multiply_): the gradients read twice and
  written once more, +6 bytes per parameter for bf16 gradients. The small scalar ops are torch's,
  one kernel each as Paddle's are.

The launches come from the harness (ctypes and torch), not from Paddle's dygraph dispatch: the
GPU work is Paddle's, the host cost per launch is the harness's, so the optimizer benchmark compares
graph replays (the GPU's time). Under CUDA graph capture the host beta powers are baked into the
graph: replays time the same work with the captured values.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from benchmarks.gpu import paddle_adamw_library
from paddle_fastffn.torch import c_api

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_LIBRARY: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = paddle_adamw_library.load()
    return _LIBRARY


# the harness's own stream read: the host cost per launch stays the harness's (module docstring)
_stream = c_api.current_stream


def squared_l2_norm(x: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """_C_ops.squared_l2_norm(x): sum(x^2) with fp32 accumulation, one element of x's dtype
    (shape [1]: Paddle's result for a tensor). workspace: uint8 CUDA tensor of
    paddle_squared_l2_norm_workspace_bytes()."""
    assert x.is_contiguous(), "squared_l2_norm: x must be contiguous"
    out = torch.empty(1, dtype=x.dtype, device=x.device)
    paddle_adamw_library.check(library().paddle_squared_l2_norm_cuda(
        x.numel(), _DTYPES[x.dtype], x.data_ptr(), out.data_ptr(), workspace.data_ptr(), _stream()),
        "paddle_squared_l2_norm_cuda")
    return out


class PaddleAdamW:
    """paddle.optimizer.AdamW(multi_precision=True) with an optional ClipGradByGlobalNorm, as
    Paddle 3.3.1's dygraph runs it (module docstring). fp32 parameters have no master and are
    updated in place."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=None):
        self.params = [p for p in params if p.requires_grad]
        self.beta1, self.beta2 = (np.float32(b) for b in betas)
        self.eps, self.weight_decay, self.max_grad_norm = eps, weight_decay, max_grad_norm
        device = self.params[0].device
        self.masters = [p.detach().float() if p.dtype != torch.float32 else None for p in self.params]
        self.m = [torch.zeros(p.shape, dtype=torch.float32, device=device) for p in self.params]
        self.v = [torch.zeros(p.shape, dtype=torch.float32, device=device) for p in self.params]
        self.lr = torch.tensor([lr], dtype=torch.float32, device=device)  # Paddle's learning-rate tensor
        # Paddle's beta1_pow_acc / beta2_pow_acc: one pair per parameter, fp32, on the host, starting at beta
        self.beta1_pows = [self.beta1] * len(self.params)
        self.beta2_pows = [self.beta2] * len(self.params)
        self.workspace = torch.empty(library().paddle_squared_l2_norm_workspace_bytes(), dtype=torch.uint8,
                                     device=device)

    def set_lr(self, lr):
        self.lr.fill_(lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def clip_grads(self, grads):
        """ClipGradByGlobalNorm._dygraph_clip: the gradients scaled in place by
        max_norm / max(global_norm, max_norm)."""
        squares = [squared_l2_norm(g, self.workspace) for g in grads]
        groups = {}  # Paddle's sum_square_list_fp16 (fp16 and bf16) / sum_square_list_fp32
        for square in squares:
            groups.setdefault("fp32" if square.dtype == torch.float32 else "16-bit", []).append(square)
        sums = [torch.stack(group).sum().to(torch.float32) for group in groups.values()]  # async_add_n, astype
        global_norm = torch.sqrt(torch.stack(sums).sum())
        max_norm = torch.full([1], self.max_grad_norm, dtype=torch.float32, device=global_norm.device)
        clip = torch.div(max_norm, torch.maximum(global_norm, max_norm))
        for g in grads:
            g.mul_(clip.to(g.dtype) if g.dtype != clip.dtype else clip)

    @torch.no_grad()
    def step(self):
        lib = library()
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if self.max_grad_norm is not None:
            self.clip_grads([self.params[i].grad for i in live])
        for i in live:
            p, g, master = self.params[i], self.params[i].grad, self.masters[i]
            assert p.is_contiguous() and g.is_contiguous() and g.numel() == p.numel(), "PaddleAdamW: layouts"
            paddle_adamw_library.check(lib.paddle_adamw_cuda(
                p.numel(), _DTYPES[p.dtype], _DTYPES[g.dtype], float(self.beta1), float(self.beta2), self.eps,
                self.weight_decay, 1.0, 1, float(self.beta1_pows[i]), float(self.beta2_pows[i]),
                self.lr.data_ptr(), g.data_ptr(), p.data_ptr(), master.data_ptr() if master is not None else None,
                self.m[i].data_ptr(), self.v[i].data_ptr(), _stream()), "paddle_adamw_cuda")
            # Paddle's "Cpu update": fp32 products on the host
            self.beta1_pows[i] = np.float32(self.beta1 * self.beta1_pows[i])
            self.beta2_pows[i] = np.float32(self.beta2 * self.beta2_pows[i])
