"""Rotary position embedding as fused ops of the core layer: on separate q and k (`Rotary`), and
straight out of PaddleNLP's fused, interleaved qkv projection (`QKVRotary`).

PaddleNLP's LlamaAttention with fuse_attention_qkv reshapes its qkv_proj output to
[b, s, kv_heads, (G + 2) * d] (G = heads / kv_heads: per KV group its G query heads, then its k
head, then its v head) and `paddle.split` copies q, k and v out of it, then concatenates their
gradients in backward. QKVRotary reads q and k through the kernel's heads layouts instead (one
launch: rotated dense q and k, and v copied dense) and its backward writes the inverse-rotated d_q,
d_k and d_v straight into one d_qkv buffer at the interleaved offsets (one launch; no zero fill, no
concat).

Layouts: a heads layout is (offset, token_stride, group_stride, heads_per_group, head_stride) in
elements of its tensor; head i of token t starts at offset + t * token_stride +
(i // heads_per_group) * group_stride + (i % heads_per_group) * head_stride (c_api.h,
fastffn_heads_layout, plus the offset the backend adds to the pointer).

Position ids outside the cos/sin table: the kernel writes NaN over those tokens and sets a device
flag instead of making the host wait for it in every layer. `POSITION_CHECK` holds that one flag
for the step and raises once it is read: with the fused loss's own readback (the same copy to the
host), in the backward of the rotary call that created the flag, or by `check()`; on CPU at once
(no synchronisation to save there).
"""

from __future__ import annotations

import weakref

from .autograd import FusedOp, Saved

OP = "paddle_fastffn.ops.rotary_embedding"


def dense_heads(heads: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """A dense [..., heads, head_dim] tensor."""
    return (0, heads * head_dim, heads * head_dim, heads, head_dim)


def token_strided_heads(heads: int, head_dim: int, token_stride: int) -> tuple[int, ...]:
    """Heads dense within each token, tokens `token_stride` elements apart."""
    return (0, token_stride, heads * head_dim, heads, head_dim)


def interleaved_qkv_heads(heads: int, kv_heads: int, head_dim: int):
    """q, k and v inside PaddleNLP's fused qkv [b, s, kv_heads * (G + 2) * head_dim]."""
    groups = heads // kv_heads
    group_width = (groups + 2) * head_dim
    token = kv_heads * group_width
    return ((0, token, group_width, groups, head_dim),
            (groups * head_dim, token, group_width, 1, head_dim),
            ((groups + 1) * head_dim, token, group_width, 1, head_dim))


class PositionCheck:
    """The step's pending position flag: one zeroed device int32 that every rotary forward with
    position ids flags into (the kernels only ever write 1 to it), read to the host once.

    Who reads it: the fused loss's readback (ops/linear_cross_entropy.py, in the copy it makes
    anyway), else the backward of the forward that created it (with or without PaddleNLP's default
    non-reentrant recompute that is the first layer's, the last backward of the step), else an
    explicit `check()`; on CPU the forward reads it at once. Under reentrant recompute the
    forwards run without grad, so each replay in backward creates and reads its own flag (one
    read per layer there; the replays' ids are the ones the forward already flagged). When the
    owner's graph is freed without a backward (a forward-only pass), the next forward takes the
    flag over, so its backward reads it; a pass that never runs a backward reads it by check()."""

    def __init__(self):
        self.flag = None
        self.table_rows = None
        self.owner = None
        self.backend = None

    def flag_for(self, be, like, table_rows: int, owner: Saved) -> object:
        if self.flag is None:
            self.flag, self.backend, self.table_rows = be.position_flag(like), be, table_rows
        if self.owner is None or self.owner() is None:  # none yet, or freed without a backward
            self.owner = weakref.ref(owner)
        self.table_rows = min(self.table_rows, table_rows)
        return self.flag

    def pending(self):
        """The flag to read (or None), and forget it: the reader must call raise_if_set."""
        flag, self.flag, self.owner = self.flag, None, None
        return flag

    def raise_if_set(self, value, table_rows: int | None = None) -> None:
        if value:
            rows = self.table_rows if table_rows is None else table_rows
            raise ValueError(f"{OP}: `position_ids` holds a position outside the cos/sin table "
                             f"[0, {rows}) (a rotary call of this step; the rows it touched are "
                             f"NaN). Build the rotary embedding with a larger "
                             f"max_position_embeddings or fix the ids.")

    def check(self, be=None) -> None:
        """Reads the pending flag (one copy to the host) and raises if any call flagged."""
        be = be or self.backend
        rows = self.table_rows
        flag = self.pending()
        if flag is not None:
            self.raise_if_set(be.read_flag(flag), rows)

    # The trace recorders set this: on CPU too the flag is then read as on a GPU (once a step), so
    # a CPU-recorded trace shows the GPU path's host reads.
    defer_on_cpu = False

    def after_forward(self, be, like) -> None:
        if be.is_cpu(like) and not self.defer_on_cpu:
            self.check(be)

    def after_backward(self, be, owner: Saved) -> None:
        if self.flag is not None and self.owner is not None and self.owner() is owner:
            self.check(be)


POSITION_CHECK = PositionCheck()


def _cos_sin_positions(saved):
    cos, sin, position_ids = saved.tensors[:3]
    return cos, sin, position_ids


class Rotary(FusedOp):
    """(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin) at each token's position.

    q [b, s, hq, d] and k [b, s, hk, d] dense within each token (token-strided views allowed);
    cos/sin fp32 [rows, d]; position_ids int64 [b, s] or None (positions 0..s-1; s <= rows
    checked by the caller). Outputs dense; backward applies the transposed rotation."""

    inputs = ("q", "k", "cos", "sin", "position_ids")
    options = ()

    @staticmethod
    def forward(be, saved: Saved, q, k, cos, sin, position_ids):
        b, s, hq, d = be.shape(q)
        hk = be.shape(k)[2]
        q_out = be.empty([b, s, hq, d], be.dtype(q), q)
        k_out = be.empty([b, s, hk, d], be.dtype(k), k)
        flag = None
        if position_ids is not None:
            flag = POSITION_CHECK.flag_for(be, q, be.shape(cos)[0], saved)
        be.rotary((q, k, None), (q_out, k_out, None), (b, s, hq, hk, d),
                  (token_strided_heads(hq, d, be.token_stride(q)),
                   token_strided_heads(hk, d, be.token_stride(k)), None,
                   dense_heads(hq, d), dense_heads(hk, d), None),
                  cos, sin, position_ids, flag, inverse=False)
        if flag is not None:
            POSITION_CHECK.after_forward(be, q)
        saved.save(cos, sin, position_ids)
        return q_out, k_out

    @staticmethod
    def backward(be, saved: Saved, d_q_out, d_k_out):
        cos, sin, position_ids = _cos_sin_positions(saved)
        POSITION_CHECK.after_backward(be, saved)  # before the kernel: the ids' error comes first
        d_q_out, d_k_out = be.contiguous(d_q_out), be.contiguous(d_k_out)
        b, s, hq, d = be.shape(d_q_out)
        hk = be.shape(d_k_out)[2]
        d_q = be.empty([b, s, hq, d], be.dtype(d_q_out), d_q_out)
        d_k = be.empty([b, s, hk, d], be.dtype(d_k_out), d_k_out)
        be.rotary((d_q_out, d_k_out, None), (d_q, d_k, None), (b, s, hq, hk, d),
                  (dense_heads(hq, d), dense_heads(hk, d), None,
                   dense_heads(hq, d), dense_heads(hk, d), None),
                  cos, sin, position_ids, None, inverse=True)
        return saved.only_needed(d_q, d_k, None, None, None)


class QKVRotary(FusedOp):
    """PaddleNLP's fused qkv [b, s, kv_heads * (G + 2) * d] (interleaved per KV group) ->
    (rotated q [b, s, heads, d], rotated k [b, s, kv_heads, d], v [b, s, kv_heads, d]), all dense.

    v is one dense copy made by the same launch, not a view of qkv: attention keeps v for its
    backward, and a view would keep the whole qkv output (q and k too, (G + 1) / (G + 2) of it
    dead by then) alive as long; the copy costs what PaddleNLP's split of v already cost. The
    backward writes d_q and d_k (inverse rotation) and d_v into their interleaved slots of one
    d_qkv buffer in one launch, so every element of d_qkv is written once and nothing is zeroed
    or concatenated."""

    inputs = ("qkv", "cos", "sin", "position_ids")
    options = ("num_heads", "num_kv_heads")

    @staticmethod
    def forward(be, saved: Saved, qkv, cos, sin, position_ids, num_heads, num_kv_heads):
        b, s, width = be.shape(qkv)
        d = width // (num_heads + 2 * num_kv_heads)
        q = be.empty([b, s, num_heads, d], be.dtype(qkv), qkv)
        k = be.empty([b, s, num_kv_heads, d], be.dtype(qkv), qkv)
        v = be.empty([b, s, num_kv_heads, d], be.dtype(qkv), qkv)
        flag = None
        if position_ids is not None:
            flag = POSITION_CHECK.flag_for(be, qkv, be.shape(cos)[0], saved)
        q_in, k_in, v_in = interleaved_qkv_heads(num_heads, num_kv_heads, d)
        be.rotary((qkv, qkv, qkv), (q, k, v), (b, s, num_heads, num_kv_heads, d),
                  (q_in, k_in, v_in, dense_heads(num_heads, d), dense_heads(num_kv_heads, d),
                   dense_heads(num_kv_heads, d)),
                  cos, sin, position_ids, flag, inverse=False)
        if flag is not None:
            POSITION_CHECK.after_forward(be, qkv)
        saved.save(cos, sin, position_ids)
        saved.heads = (num_heads, num_kv_heads)
        return q, k, v

    @staticmethod
    def backward(be, saved: Saved, d_q, d_k, d_v):
        cos, sin, position_ids = _cos_sin_positions(saved)
        POSITION_CHECK.after_backward(be, saved)  # before the kernel: the ids' error comes first
        num_heads, num_kv_heads = saved.heads
        d_q, d_k, d_v = be.contiguous(d_q), be.contiguous(d_k), be.contiguous(d_v)
        b, s, _, d = be.shape(d_q)
        d_qkv = be.empty([b, s, (num_heads + 2 * num_kv_heads) * d], be.dtype(d_q), d_q)
        q_out, k_out, v_out = interleaved_qkv_heads(num_heads, num_kv_heads, d)
        be.rotary((d_q, d_k, d_v), (d_qkv, d_qkv, d_qkv), (b, s, num_heads, num_kv_heads, d),
                  (dense_heads(num_heads, d), dense_heads(num_kv_heads, d),
                   dense_heads(num_kv_heads, d), q_out, k_out, v_out),
                  cos, sin, position_ids, None, inverse=True)
        return saved.only_needed(d_qkv, None, None, None)
