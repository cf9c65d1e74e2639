"""The optimizer step's backend (paddle_fastffn/core/optimizer.py) in torch: what Paddle's ops are
on the GPU, and our AdamW kernel through c_api.Kernels. paddle_fastffn.torch.llama.FusedMasterAdamW executes the
core's step over it, as Paddle's FastAdamW executes it over PaddleOptimizerBackend."""

from __future__ import annotations

import numpy as np
import torch

from paddle_fastffn.core import optimizer as core_optimizer
from paddle_fastffn.torch import c_api

_PRECISION = {torch.float16: core_optimizer.HALF, torch.bfloat16: core_optimizer.HALF,
              torch.float32: core_optimizer.SINGLE}
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class TorchOptimizerBackend:
    def precision(self, t):
        return _PRECISION.get(t.dtype, core_optimizer.DOUBLE)

    def squared_norm(self, grad):
        # g . g: one cuBLAS dot (fp32 accumulation, the result in grad's dtype), as Paddle's
        # squared_l2_norm (fp32 accumulation, the result in grad's dtype) on a GPU.
        flat = grad.reshape(-1)
        return torch.dot(flat, flat)

    def stack(self, scalars):
        return torch.stack(scalars)

    def sum(self, t, dtype):
        return torch.sum(t, dtype=_DTYPES[dtype])

    def sqrt(self, t):
        return torch.sqrt(t)

    def maximum(self, a, b):
        return torch.maximum(a, b)

    def divide(self, a, b):
        return torch.div(a, b)

    def greater(self, a, b):
        return torch.gt(a, b)

    def where(self, condition, a, b):
        return torch.where(condition, a, b)

    def full(self, value, dtype, like):
        return torch.full((1,), value, dtype=_DTYPES[dtype], device=like.device)

    def to_float32(self, t):
        return t.float()

    def dtype_name(self, t):
        return str(t.dtype).removeprefix("torch.")

    def same_device(self, a, b):
        return a.device == b.device

    def fill_(self, t, value):
        t.fill_(value)

    def adamw(self, update, learning_rate, grad_scale, hyper):
        scalars = dict(lr=learning_rate, beta1_pow=update.beta1_pow, beta2_pow=update.beta2_pow, beta1=hyper.beta1,
                       beta2=hyper.beta2, eps=hyper.epsilon, weight_decay=hyper.weight_decay, lr_ratio=update.lr_ratio,
                       with_decay=update.with_decay, grad_scale=1.0 if grad_scale is None else grad_scale)
        tensors = (update.param, update.grad, update.moment1, update.moment2, update.master)
        if update.compensation is None and update.moment1_absmax is None and update.param_amax is None:
            c_api.kernels().adamw(*tensors, **scalars)  # Paddle's layout: the entry the traces record
        else:
            c_api.kernels().adamw_with_state(*tensors, update.compensation, update.moment1_absmax,
                                             update.moment2_absmax, update.param_amax, **scalars)
        advance_beta_pows(update.beta1_pow, update.beta2_pow, hyper.beta1, hyper.beta2)


def new_state(param: torch.Tensor, state: core_optimizer.StateFormat) -> dict:
    """One parameter's optimizer state in the layout `state` asks for (fastffn/optimizer.h):
    {"master": fp32 copy or None, "compensation": zeros in param's dtype or None (16-bit params
    only), "moment1"/"moment2": fp32 zeros, or uint8 codes of 0.0, "moment1_absmax"/"moment2_absmax":
    fp32 zeros per 256 elements or None}."""
    half = param.dtype != torch.float32
    compensated = half and state.master_weights == "compensated"
    flat = dict(dtype=torch.float32, device=param.device)
    out = {"master": param.detach().float() if half and not compensated else None,
           "compensation": torch.zeros_like(param) if compensated else None,
           "moment1_absmax": None, "moment2_absmax": None}
    n = param.numel()
    if state.quantizes(n):
        blocks = core_optimizer.absmax_blocks(n)
        zero_code = core_optimizer.dynamic_map(True).index(0.0)
        out.update(moment1=torch.full((n,), zero_code, dtype=torch.uint8, device=param.device),
                   moment2=torch.zeros(n, dtype=torch.uint8, device=param.device),
                   moment1_absmax=torch.zeros(blocks, **flat), moment2_absmax=torch.zeros(blocks, **flat))
    else:
        out.update(moment1=torch.zeros(param.shape, **flat), moment2=torch.zeros(param.shape, **flat))
    return out


def host_beta_pows(beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A parameter's beta powers before its first step (beta1, beta2), as Paddle keeps them: one-element
    fp32 tensors on the host (the kernel receives their values; no device memory, no kernel)."""
    return (torch.tensor([beta1], dtype=torch.float32), torch.tensor([beta2], dtype=torch.float32))


def advance_beta_pows(beta1_pow: torch.Tensor, beta2_pow: torch.Tensor, beta1: float, beta2: float) -> None:
    """beta_pow *= beta in fp32 on the host, as Paddle's adamw kernel does to its CPU beta powers
    (through numpy views of the tensors' memory: host arithmetic, no torch op)."""
    beta1_pow.numpy()[...] *= np.float32(beta1)
    beta2_pow.numpy()[...] *= np.float32(beta2)
