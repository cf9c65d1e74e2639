"""Rotary position embedding for q and k (grouped-query attention) in one pass, and the same read
straight out of PaddleNLP's fused, interleaved qkv projection.

Stack: compiled op -> core op (paddle_fastffn/core/rotary.py: Rotary, QKVRotary) -> PyLayer
adapter (_autograd.pylayer over PaddleBackend) -> public ``rotary_embedding`` / ``qkv_rotary`` -> ``*_ref``.
``rotary_embedding`` has the signature and result of
``paddlenlp.transformers.llama.modeling.apply_rotary_pos_emb``; ``qkv_rotary`` that of LlamaAttention's
fused-qkv reshape + split + apply_rotary_pos_emb, without the split's copies.
"""

from __future__ import annotations

import paddle

from ..core import rotary as core_rotary
from . import _checks
from ._fallback import warn_fallback
from ._autograd import pylayer

OP = core_rotary.OP
_Rotary = pylayer(core_rotary.Rotary)
_QKVRotary = pylayer(core_rotary.QKVRotary)


def check_rotary_positions() -> None:
    """Reads the step's pending position-range flag now (one copy to the host on a GPU) and
    raises if a rotary call of the step got a position outside its cos/sin table. The fused loss
    and the backward read it without this call (core/rotary.py, PositionCheck)."""
    core_rotary.POSITION_CHECK.check()


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
    _check_position_ids(position_ids, q.shape[0], q.shape[1])


def _check_position_ids(position_ids, batch: int, seq: int) -> None:
    if position_ids is None:
        return
    _checks.check_tensor(position_ids, OP, "position_ids")
    if position_ids.dtype not in (paddle.int64, paddle.int32):
        raise TypeError(f"{OP}: `position_ids` must be int64 or int32, got {position_ids.dtype}")
    if list(position_ids.shape) not in ([batch, seq], [seq]):
        raise ValueError(f"{OP}: `position_ids` must be [batch, seq] = {[batch, seq]}, got "
                         f"{list(position_ids.shape)}")


def _kernel_tables(cos, sin, position_ids, batch: int, seq: int, head_dim: int):
    """The kernel's fp32 [rows, head_dim] tables and contiguous int64 [batch, seq] ids (or None,
    after checking that seq fits the table)."""
    cos_table = cos_sin_table(cos, head_dim, "cos")
    sin_table = cos_sin_table(sin, head_dim, "sin")
    if position_ids is not None:
        position_ids = position_ids.astype(paddle.int64)
        if list(position_ids.shape) != [batch, seq]:  # Paddle's expand copies even to the same shape
            position_ids = position_ids.expand([batch, seq])
        position_ids = _checks.contiguous(position_ids)
    elif seq > cos_table.shape[0]:
        raise ValueError(f"{OP}: seq ({seq}) exceeds the cos/sin table ({cos_table.shape[0]} "
                         f"rows); build the rotary embedding with a larger max_position_embeddings")
    return cos_table, sin_table, position_ids


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
    tables = _kernel_tables(cos, sin, position_ids, q.shape[0], q.shape[1], q.shape[3])
    # Paddle's custom-op call makes a strided view (q/k sliced from a fused projection) contiguous
    # anyway; the copy is made here, visibly. qkv_rotary reads a fused projection without one.
    return _Rotary.apply(_checks.contiguous(q), _checks.contiguous(k), *tables)


def _check_qkv_inputs(qkv, num_heads, num_kv_heads, position_ids) -> int:
    """head_dim, after checking qkv [batch, seq, num_kv_heads * (num_heads / num_kv_heads + 2) *
    head_dim] and the head counts."""
    _checks.check_float(qkv, OP, "qkv")
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{OP}: `{name}` must be a positive int, got {value!r}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{OP}: num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    if len(qkv.shape) != 3:
        raise ValueError(f"{OP}: `qkv` must be the fused projection [batch, seq, (num_heads + 2 * "
                         f"num_kv_heads) * head_dim]; got {list(qkv.shape)}")
    width = qkv.shape[2]
    heads = num_heads + 2 * num_kv_heads
    if width % heads != 0 or (width // heads) % 2 != 0:
        raise ValueError(f"{OP}: `qkv` last axis {width} must be (num_heads + 2 * num_kv_heads) = "
                         f"{heads} times an even head_dim")
    _check_position_ids(position_ids, qkv.shape[0], qkv.shape[1])
    return width // heads


def qkv_rotary(qkv: paddle.Tensor, num_heads: int, num_kv_heads: int, cos: paddle.Tensor,
               sin: paddle.Tensor, position_ids: paddle.Tensor | None = None):
    """PaddleNLP's fused-qkv attention input: ``qkv`` [batch, seq, num_kv_heads * (G + 2) *
    head_dim] (G = num_heads / num_kv_heads; per KV group its G query heads, its k head, its v
    head: what LlamaAttention's qkv_proj gives with fuse_attention_qkv) ->
    ``(q_rot [b, s, num_heads, d], k_rot [b, s, num_kv_heads, d], v [b, s, num_kv_heads, d])``,
    q and k rotated as ``rotary_embedding``. One kernel launch reads qkv and writes all three
    (v a dense copy, see core/rotary.py QKVRotary); the backward writes the one d_qkv. cos/sin and
    position_ids as for ``rotary_embedding``."""
    head_dim = _check_qkv_inputs(qkv, num_heads, num_kv_heads, position_ids)
    if not _checks.kernel_supports_place(qkv):
        warn_fallback(OP, qkv.place)
        return qkv_rotary_ref(qkv, num_heads, num_kv_heads, cos, sin, position_ids)
    tables = _kernel_tables(cos, sin, position_ids, qkv.shape[0], qkv.shape[1], head_dim)
    return _QKVRotary.apply(_checks.contiguous(qkv), *tables, num_heads, num_kv_heads)


def qkv_rotary_ref(qkv, num_heads, num_kv_heads, cos, sin, position_ids=None):
    """LlamaAttention's fused-qkv path: reshape to [b, s, kv_heads, (G + 2) d], split, rotate."""
    groups = num_heads // num_kv_heads
    head_dim = qkv.shape[2] // (num_heads + 2 * num_kv_heads)
    mixed = qkv.reshape([qkv.shape[0], qkv.shape[1], num_kv_heads, (groups + 2) * head_dim])
    q, k, v = paddle.split(mixed, [groups * head_dim, head_dim, head_dim], axis=-1)
    q = q.reshape([qkv.shape[0], qkv.shape[1], num_heads, head_dim])
    q_rot, k_rot = rotary_embedding_ref(q, k, cos, sin, position_ids)
    return q_rot, k_rot, v


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
