"""PaddleBackend: core.backend.Backend over Paddle tensors (weights in Paddle's [in, out] layout)."""

from __future__ import annotations

import paddle


class PaddleBackend:
    name = "paddle"

    def shape(self, t):
        return tuple(t.shape)

    def rows(self, t):
        return t.reshape([-1, t.shape[-1]])

    def reshape(self, t, shape):
        return t.reshape(list(shape))

    def contiguous(self, t):
        return t if t.is_contiguous() else t.contiguous()

    def detach(self, t):
        return t.detach()

    def linear(self, x, weight):
        return paddle.matmul(x, weight)

    def linear_grad_input(self, dy, weight):
        return paddle.matmul(dy, weight, transpose_y=True)

    def linear_grad_weight(self, x, dy):
        return paddle.matmul(self.rows(x), self.rows(dy), transpose_x=True)

