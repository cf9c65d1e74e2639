"""Causal attention over packed rows: several examples concatenated in one row of a batch, each
attending only to its own earlier tokens, without a dense [seq, seq] mask.

Segments come as PaddleNLP's ``attn_mask_startend_row_indices`` (FlashMask's causal form,
[batch, 1, seq, 1] int32: for key column j, the first query row that must not see it, i.e. the end
of j's example). ``PackedSegments`` turns that into the cumulative lengths of the examples over the
flattened batch (``cu_seqlens``, flash-attention's varlen form) and is what the LLaMA patch hands
down to attention in place of a mask.

Where it runs:
- CPU: the segments of the batch are gathered into padded [segments, longest, heads, head_dim]
  groups (sorted by length, so a group pads little) and each group is one causal
  ``F.scaled_dot_product_attention`` (GQA native), then gathered back. The padding sits after each
  segment's tokens, so a causal query never sees it; padded queries are dropped by the gather back
  (no gradient flows to or from them). Work is sum(len^2) per group, not seq^2 per row.
- GPU: ``paddle.nn.functional.flash_attention.flash_attn_unpadded`` on the [tokens, heads,
  head_dim] view with ``cu_seqlens`` (causal, GQA native). Paddle's GPU op cannot run here (no Paddle
  GPU build reaches sm_90) and the CPU wheel registers no dtype for it, so it cannot even be traced;
  the composition around it (``packed_attention_varlen``) is checked on CPU with
  ``flash_attn_unpadded_ref``, a pure-Paddle implementation of the same call and contract, and the
  call's arguments are bound against the installed Paddle's signature.

The row index form is a device tensor; turning it into segment lengths reads it to the host once
per forward (a synchronisation on GPU, where the fused loss already synchronises once per step).
"""

from __future__ import annotations

import inspect

import numpy as np
import paddle
import paddle.nn.functional as F

from ..core import packed_attention as core_packed_attention
from ..core.packed_attention import cu_seqlens_of, segment_lengths_from_row_ends
from ._backend import BACKEND

OP = "paddle_fastffn.ops.packed_attention"


class PackedSegments:
    """The examples of a packed batch: lengths (host ints, in row order, rows one after another;
    the padding at a row's end is a segment of its own), and the [batch, seq] they tile."""

    def __init__(self, lengths, batch: int, seq: int):
        lengths = [int(n) for n in lengths]
        if any(n <= 0 for n in lengths) or sum(lengths) != batch * seq:
            raise ValueError(f"{OP}: segment lengths must be positive and tile the batch's {batch} x {seq} "
                             f"tokens; got {len(lengths)} segments summing to {sum(lengths)}")
        self.lengths, self.batch, self.seq = lengths, int(batch), int(seq)
        self._device_cu_seqlens = None  # (place, tensor): one copy a forward, shared by every layer

    def cu_seqlens_on(self, place):
        """cu_seqlens as an int32 tensor on `place`, copied there once for this batch (every layer's
        attention, and a recompute's replay, reads the same copy)."""
        if self._device_cu_seqlens is None or self._device_cu_seqlens[0] != str(place):
            self._device_cu_seqlens = (str(place), paddle.to_tensor(self.cu_seqlens(), place=place))
        return self._device_cu_seqlens[1]

    @classmethod
    def from_startend_row_indices(cls, indices) -> "PackedSegments":
        """From PaddleNLP's causal ``attn_mask_startend_row_indices`` ([batch, 1, seq, 1], [batch,
        seq, 1] or [batch, seq]; int32/int64): for each key column, the row where its example ends.
        Columns of one example carry the same value; a new value starts a new example."""
        if not isinstance(indices, paddle.Tensor):
            raise TypeError(f"{OP}: `attn_mask_startend_row_indices` must be a paddle.Tensor, got "
                            f"{type(indices).__name__}")
        shape = list(indices.shape)
        if indices.dtype not in (paddle.int32, paddle.int64) or not (
                len(shape) == 2 or (len(shape) == 3 and shape[2] == 1)
                or (len(shape) == 4 and shape[1] == 1 and shape[3] == 1)):
            raise ValueError(f"{OP}: `attn_mask_startend_row_indices` must be int32 [batch, 1, seq, 1] (the causal "
                             f"FlashMask form, one shared head), got {indices.dtype} {shape}")
        batch, seq = shape[0], shape[2] if len(shape) == 4 else shape[1]
        lengths = segment_lengths_from_row_ends(indices.numpy().reshape(batch, seq), OP)
        return cls(lengths, batch, seq)

    @classmethod
    def from_row_lengths(cls, rows, seq: int) -> "PackedSegments":
        """rows: per batch row, its examples' lengths; a row shorter than seq ends in padding."""
        lengths = []
        for row in rows:
            lengths.extend(row)
            if sum(row) < seq:
                lengths.append(seq - sum(row))
        return cls(lengths, len(rows), seq)

    def startend_row_indices(self) -> np.ndarray:
        """The causal FlashMask form, int32 [batch, 1, seq, 1]."""
        ends = np.empty(self.batch * self.seq, dtype=np.int32)
        position = 0
        for n in self.lengths:
            row_start = position - position % self.seq
            ends[position:position + n] = position + n - row_start
            position += n
        return ends.reshape(self.batch, 1, self.seq, 1)

    def cu_seqlens(self) -> np.ndarray:
        return cu_seqlens_of(self.lengths)

    def dense_mask(self) -> np.ndarray:
        """bool [batch, 1, seq, seq], True where a query may attend: the block-causal mask PaddleNLP's
        InTokens datasets build (for references and tests)."""
        mask = np.zeros((self.batch, 1, self.seq, self.seq), dtype=bool)
        position = 0
        for n in self.lengths:
            row, start = divmod(position, self.seq)
            mask[row, 0, start:start + n, start:start + n] = np.tril(np.ones((n, n), dtype=bool))
            position += n
        return mask

    def __repr__(self):
        return f"PackedSegments(batch={self.batch}, seq={self.seq}, segments={len(self.lengths)})"


# A group pads its segments to its longest; a segment joins the current group while the group's
# padded work (count * longest^2) stays within this factor of its exact work (sum of len^2).
GROUP_PADDED_WORK = 1.25


def _segment_groups(lengths):
    """[(longest, [(segment start, length), ...]), ...]: segments sorted longest first, cut into
    groups whose padding costs at most GROUP_PADDED_WORK of their exact attention work."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups = []
    for i in order:
        n = lengths[i]
        if groups:
            longest, members, work = groups[-1]
            if (len(members) + 1) * longest * longest <= GROUP_PADDED_WORK * (work + n * n):
                members.append((int(starts[i]), n))
                groups[-1][2] = work + n * n
                continue
        groups.append([n, [(int(starts[i]), n)], n * n])
    return [(longest, members) for longest, members, _ in groups]


def _check_qkv(q, k, v):
    if len(q.shape) != 4 or len(k.shape) != 4 or list(k.shape) != list(v.shape):
        raise ValueError(f"{OP}: q, k, v must be [batch, seq, heads, head_dim] with k and v alike; got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"{OP}: k/v {list(k.shape)} must share batch, seq and head_dim with q {list(q.shape)}, "
                         f"and their heads must divide q's (grouped-query attention)")


def packed_attention(q, k, v, segments: PackedSegments):
    """Causal attention of each packed example with itself. q: [batch, seq, q_heads, head_dim],
    k/v: [batch, seq, kv_heads, head_dim] (kv_heads | q_heads); -> [batch, seq, q_heads, head_dim].
    Scale 1/sqrt(head_dim). GPU, fp16/bf16: flash_attn_unpadded; elsewhere per-group SDPA (CPU: fp32
    math, as Paddle's CPU SDPA; half inputs are upcast and the result cast back)."""
    _check_qkv(q, k, v)
    batch, seq = q.shape[:2]
    if (segments.batch, segments.seq) != (batch, seq):
        raise ValueError(f"{OP}: the segments tile a {segments.batch} x {segments.seq} batch, q is "
                         f"{batch} x {seq}")
    if not q.place.is_cpu_place() and q.dtype in (paddle.float16, paddle.bfloat16):  # flash attention's dtypes
        from paddle.nn.functional.flash_attention import flash_attn_unpadded

        return packed_attention_varlen(q, k, v, segments, flash_attn_unpadded)
    return _packed_attention_grouped(q, k, v, segments)


def _packed_attention_grouped(q, k, v, segments: PackedSegments):
    batch, seq, q_heads, head_dim = q.shape
    compute = paddle.float32 if q.dtype in (paddle.float16, paddle.bfloat16) else q.dtype
    flat = [t.reshape([batch * seq, t.shape[2], head_dim]) for t in (q, k, v)]
    flat = [t if t.dtype == compute else t.astype(compute) for t in flat]
    outputs, back = [], np.empty(batch * seq, dtype=np.int64)
    offset = 0
    for longest, members in _segment_groups(segments.lengths):
        # Token index of each padded slot; padding slots repeat the segment's first token (any
        # real index: causal queries never read them, and their own outputs are dropped).
        gather = np.empty((len(members), longest), dtype=np.int64)
        for slot, (start, n) in enumerate(members):
            gather[slot, :n] = np.arange(start, start + n)
            gather[slot, n:] = start
            back[start:start + n] = offset + slot * longest + np.arange(n)
        index = paddle.to_tensor(gather.reshape(-1))
        q_g, k_g, v_g = (paddle.gather(t, index).reshape([len(members), longest, t.shape[1], head_dim])
                         for t in flat)
        out = F.scaled_dot_product_attention(q_g, k_g, v_g, is_causal=True)
        outputs.append(out.reshape([len(members) * longest, q_heads, head_dim]))
        offset += len(members) * longest
    out = paddle.gather(paddle.concat(outputs) if len(outputs) > 1 else outputs[0], paddle.to_tensor(back))
    out = out.reshape([batch, seq, q_heads, head_dim])
    return out if out.dtype == q.dtype else out.astype(q.dtype)


def packed_attention_varlen(q, k, v, segments: PackedSegments, varlen_attention):
    """The GPU composition, core.packed_attention.varlen_attention (the torch harness runs the same
    function): q/k/v as [tokens, heads, head_dim] views, one causal ``varlen_attention`` call with
    flash_attn_unpadded's signature over the segments' cu_seqlens, back to [batch, seq, heads,
    head_dim]. CPU tests pass flash_attn_unpadded_ref."""
    cu_seqlens = segments.cu_seqlens_on(q.place)

    def varlen(q_t, k_t, v_t, cu, longest, scale):
        out, _ = varlen_attention(q_t, k_t, v_t, cu, cu, longest, longest, scale, dropout=0.0, causal=True,
                                  return_softmax=False, training=True)
        return out

    return core_packed_attention.varlen_attention(BACKEND, varlen, q, k, v, cu_seqlens, max(segments.lengths))


def flash_attn_unpadded_ref(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                            dropout=0.0, causal=False, return_softmax=False, training=True):
    """flash_attn_unpadded's contract in plain Paddle, for checking the GPU composition on CPU:
    [tokens, heads, head_dim] q (k/v with heads dividing q's), each cu_seqlens interval attends to
    itself (causal: top-left aligned, equal q/k lengths here), softmax(scale * q k^T) v, fp32 math
    (float64 for float64 inputs)."""
    if dropout != 0.0 or return_softmax:
        raise ValueError(f"{OP}: the reference covers dropout 0 without the softmax")
    if cu_seqlens_q.numpy().tolist() != cu_seqlens_k.numpy().tolist():
        raise ValueError(f"{OP}: the reference covers self-attention (equal q and k intervals)")
    bounds = cu_seqlens_q.numpy().tolist()
    groups = query.shape[1] // key.shape[1]
    compute = paddle.float64 if query.dtype == paddle.float64 else paddle.float32
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end - start > max_seqlen_q or end - start > max_seqlen_k:
            raise ValueError(f"{OP}: a segment of {end - start} tokens exceeds max_seqlen")
        q_s = query[start:end].astype(compute).transpose([1, 0, 2])
        k_s = paddle.repeat_interleave(key[start:end].astype(compute), groups, axis=1).transpose([1, 0, 2])
        v_s = paddle.repeat_interleave(value[start:end].astype(compute), groups, axis=1).transpose([1, 0, 2])
        scores = paddle.matmul(q_s, k_s, transpose_y=True) * scale
        if causal:
            n = end - start
            blocked = paddle.triu(paddle.ones([n, n], dtype=paddle.bool), diagonal=1)
            scores = paddle.where(blocked, paddle.full_like(scores, float("-inf")), scores)
        outputs.append(paddle.matmul(F.softmax(scores, axis=-1), v_s).transpose([1, 0, 2]))
    return paddle.concat(outputs).astype(query.dtype), None


def varlen_call_signature_error(varlen_attention) -> str | None:
    """None when packed_attention_varlen's call binds to `varlen_attention`'s signature (the
    installed Paddle's flash_attn_unpadded), else why not."""
    try:
        inspect.signature(varlen_attention).bind(*range(8), dropout=0.0, causal=True, return_softmax=False,
                                                 training=True)
    except TypeError as error:
        return str(error)
    return None


def packed_attention_ref(q, k, v, segments: PackedSegments):
    """Dense reference: SDPA over the whole row with the block-causal additive mask (fp32 math,
    float64 for float64 inputs)."""
    compute = paddle.float64 if q.dtype == paddle.float64 else paddle.float32
    mask = paddle.to_tensor(segments.dense_mask())
    additive = paddle.where(mask, paddle.zeros(mask.shape, compute),
                            paddle.full(mask.shape, float(np.finfo(np.float64 if compute == paddle.float64
                                                                   else np.float32).min), compute))
    return F.scaled_dot_product_attention(*(t.astype(compute) for t in (q, k, v)),
                                          attn_mask=additive).astype(q.dtype)
