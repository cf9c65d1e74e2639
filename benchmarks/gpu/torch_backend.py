"""TorchBackend: paddle_fastffn.core.backend.Backend over torch tensors (weights in torch's [out, in]
layout), what the harness hands the core layer."""

from __future__ import annotations

import torch


class TorchBackend:
    name = "torch"

    def shape(self, t):
        return tuple(t.shape)

    def rows(self, t):
        return t.view(-1, t.shape[-1])

    def reshape(self, t, shape):
        return t.view(*shape)

    def contiguous(self, t):
        return t.contiguous()

    def detach(self, t):
        return t.detach()

    def linear(self, x, weight):
        return x @ weight.t()

    def linear_grad_input(self, dy, weight):
        return dy @ weight

    def linear_grad_weight(self, x, dy):
        return self.rows(dy).t() @ self.rows(x)
