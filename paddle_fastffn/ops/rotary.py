"""Rotary position embedding for q and k (grouped-query attention) in one pass.

Stack: compiled op call -> autograd (PyLayer) -> public ``rotary_embedding`` -> ``rotary_embedding_ref``.
Signature and result of ``paddlenlp.transformers.llama.modeling.apply_rotary_pos_emb``.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from . import _checks
from ._fallback import warn_fallback
from ._loader import run_op

OP = "paddle_fastffn.ops.rotary_embedding"


class _Rotary(PyLayer):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids):
        _checks.remember_grad_needs(ctx, q, k, cos, sin, position_ids)
        q_out, k_out = run_op("fastffn_rotary", q, k, cos, sin, position_ids, False)
        ctx.save_for_backward(cos, sin, position_ids)
        return q_out, k_out

    @staticmethod
    def backward(ctx, d_q_out, d_k_out):
        cos, sin, position_ids = ctx.saved_tensor()
        d_q, d_k = run_op("fastffn_rotary", _checks.contiguous(d_q_out),
                          _checks.contiguous(d_k_out), cos, sin, position_ids, True)
        grads = _checks.needed_grads(ctx, d_q, d_k, None, None, None)
        return grads[: 4 if position_ids is None else 5]


def cos_sin_table(table: paddle.Tensor, head_dim: int, name: str) -> paddle.Tensor:
    """PaddleNLP's cos/sin ([1, rows, 1, head_dim] or [rows, head_dim], any float dtype) as the
    kernel's contiguous fp32 [rows, head_dim] table."""
    _checks.check_float(table, OP, name)
    shape = list(table.shape)
    if len(shape) == 4 and shape[0] == 1 and shape[2] == 1:
        table = table.reshape([shape[1], shape[3]])
    elif len(shape) != 2:
        raise ValueError(f"{OP}: `{name}` must be [1, seq, 1, head_dim] (PaddleNLP's rotary "
                         f"embedding output) or [seq, head_dim]; got {shape}")
    if table.shape[-1] != head_dim:
        raise ValueError(f"{OP}: `{name}` has last axis {table.shape[-1]}, expected head_dim "
                         f"{head_dim}")
    return _checks.contiguous(table.astype(paddle.float32))


def _token_dense(t: paddle.Tensor) -> paddle.Tensor:
    """Keeps a strided view (q/k sliced from a fused QKV output) when each token is dense."""
    if t.is_contiguous():
        return t
    strides = t.strides
    b, s, h, d = t.shape
    if strides[3] == 1 and strides[2] == d and strides[0] == strides[1] * s:
        return t
    return t.contiguous()


def _check_rotary_inputs(q, k, position_ids):
    _checks.check_float(q, OP, "q")
    _checks.check_like(q, "q", k, OP, "k", same_shape=False)
    if len(q.shape) != 4 or len(k.shape) != 4:
        raise ValueError(f"{OP}: `q` and `k` must be [batch, seq, heads, head_dim]; got "
                         f"{list(q.shape)} and {list(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{OP}: `k` {list(k.shape)} must share batch, seq and head_dim with `q` "
                         f"{list(q.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"{OP}: k heads ({k.shape[2]}) must divide q heads ({q.shape[2]}) for "
                         f"grouped-query attention")
    if q.shape[3] % 2 != 0:
        raise ValueError(f"{OP}: head_dim must be even for rotate_half, got {q.shape[3]}")
    if position_ids is not None:
        _checks.check_tensor(position_ids, OP, "position_ids")
        if position_ids.dtype not in (paddle.int64, paddle.int32):
            raise TypeError(f"{OP}: `position_ids` must be int64 or int32, got {position_ids.dtype}")
        if list(position_ids.shape) not in ([q.shape[0], q.shape[1]], [q.shape[1]]):
            raise ValueError(f"{OP}: `position_ids` must be [batch, seq] = {q.shape[:2]}, got "
                             f"{list(position_ids.shape)}")


def rotary_embedding(q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor,
                     position_ids: paddle.Tensor | None = None):
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` at each position.

    q: [batch, seq, q_heads, head_dim], k: [batch, seq, k_heads, head_dim] (k_heads | q_heads);
    cos/sin as PaddleNLP's LlamaRotaryEmbedding (plain, linear or NTK scaled) returns them,
    [1, seq_cached, 1, head_dim]; position_ids [batch, seq] or None (positions 0..seq-1).
    fp32 math with fp32 cos/sin -> q.dtype. Gradients for q and k.
    """
    _check_rotary_inputs(q, k, position_ids)
    if not _checks.kernel_supports_place(q):
        warn_fallback(OP, q.place)
        return rotary_embedding_ref(q, k, cos, sin, position_ids)
    head_dim = q.shape[3]
    cos_table = cos_sin_table(cos, head_dim, "cos")
    sin_table = cos_sin_table(sin, head_dim, "sin")
    if position_ids is not None:
        position_ids = _checks.contiguous(
            position_ids.astype(paddle.int64).expand([q.shape[0], q.shape[1]]))
    elif q.shape[1] > cos_table.shape[0]:
        raise ValueError(f"{OP}: seq ({q.shape[1]}) exceeds the cos/sin table ({cos_table.shape[0]} "
                         f"rows); build the rotary embedding with a larger max_position_embeddings")
    return _Rotary.apply(_token_dense(q), _token_dense(k), cos_table, sin_table, position_ids)


def rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


def rotary_embedding_ref(q, k, cos, sin, position_ids=None):
    """apply_rotary_pos_emb of PaddleNLP, computed in fp32 (Paddle CPU has no half add)."""
    compute = paddle.float64 if q.dtype == paddle.float64 else paddle.float32
    head_dim = q.shape[3]
    cos_table = cos_sin_table(cos, head_dim, "cos").astype(compute)
    sin_table = cos_sin_table(sin, head_dim, "sin").astype(compute)
    if position_ids is None:
        cos_at = cos_table[: q.shape[1]].unsqueeze([0, 2])
        sin_at = sin_table[: q.shape[1]].unsqueeze([0, 2])
    else:
        cos_at = cos_table[position_ids].unsqueeze(2)
        sin_at = sin_table[position_ids].unsqueeze(2)

    def rotate(x):
        xc = x.astype(compute)
        return (xc * cos_at + rotate_half(xc) * sin_at).astype(x.dtype)

    return rotate(q), rotate(k)
