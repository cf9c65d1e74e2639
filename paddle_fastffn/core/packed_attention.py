"""Causal attention over packed rows, written once: several examples share a row (or, flattened, the
whole batch is one row) and each attends only to its own earlier tokens. The examples are given as
flash-attention's varlen form, ``cu_seqlens`` (int32 [segments + 1], cumulative lengths over the
flattened batch, a row's padding a segment of its own), and one variable-length attention call runs
over the [tokens, heads, head_dim] views: Paddle's ``flash_attn_unpadded`` on its GPU, torch's
built-in flash-attention varlen kernel in the GPU harness, a plain per-segment reference elsewhere.
Grouped-query attention is native to that call (k/v keep their kv_heads), as in flash-attention.

A side supplies ``varlen(q, k, v, cu_seqlens, longest, scale) -> out`` over [tokens, heads, d]
tensors, causal, top-left aligned, dropout 0.
"""

from __future__ import annotations

import numpy as np

OP = "packed_attention"


def cu_seqlens_of(lengths) -> np.ndarray:
    """Segment lengths (host ints, rows one after another) -> int32 cumulative lengths from 0."""
    return np.concatenate([[0], np.cumsum([int(n) for n in lengths])]).astype(np.int32)


def segment_lengths_from_row_ends(ends, op: str = OP) -> list[int]:
    """PaddleNLP's causal ``attn_mask_startend_row_indices`` read to the host as [batch, seq] ints (for
    each key column, the row where its example ends) -> the segment lengths, rows one after another.
    Columns of one example carry the same value; a new value starts a new example. A column whose
    value is its own index is seen by no row (PaddleFormers' collator pads a row that way: column j
    carries j); a run of them is one padding segment, whose outputs no real token reads."""
    ends = np.asarray(ends, dtype=np.int64)
    batch, seq = ends.shape
    lengths = []
    for row in range(batch):
        start = 0
        while start < seq:
            end = int(ends[row, start])
            if end == start:
                padding = start
                while padding < seq and ends[row, padding] == padding:
                    padding += 1
                lengths.append(padding - start)
                start = padding
                continue
            if not start < end <= seq or np.any(ends[row, start:end] != end):
                raise ValueError(f"{op}: `attn_mask_startend_row_indices` row {row}: the example starting at "
                                 f"column {start} must end within the row and all its columns must carry its "
                                 f"end ({end}); got {ends[row, start:min(max(end, start + 1), seq)].tolist()}")
            lengths.append(end - start)
            start = end
    return lengths


def check_cu_seqlens(cu_seqlens, tokens: int) -> np.ndarray:
    """The host bounds as int32 numpy, or ValueError naming `cu_seqlens` and what was expected: a 1-D
    sequence rising strictly from 0 to the batch's tokens (batch * seq)."""
    bounds = np.asarray(cu_seqlens)
    if (bounds.ndim != 1 or bounds.size < 2 or not np.issubdtype(bounds.dtype, np.integer) or bounds[0] != 0
            or bounds[-1] != tokens or (np.diff(bounds) <= 0).any()):
        shown = bounds.ravel().tolist()
        raise ValueError(f"{OP}: cu_seqlens must be integers rising strictly from 0 to the batch's {tokens} tokens "
                         f"(batch * seq; a row's padding is a segment of its own), got "
                         f"{shown[:8]}{'...' if len(shown) > 8 else ''} ({len(shown)} values)")
    return bounds.astype(np.int32)


def check_qkv(be, q, k, v):
    """q [b, s, h, d], k and v [b, s, hk, d] with hk dividing h; ValueError otherwise."""
    qs, ks, vs = (list(be.shape(t)) for t in (q, k, v))
    if len(qs) != 4 or len(ks) != 4 or ks != vs or qs[:2] != ks[:2] or qs[3] != ks[3] or qs[2] % ks[2]:
        raise ValueError(f"{OP}: q must be [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] "
                         f"with kv_heads dividing heads; got q {qs}, k {ks}, v {vs}")


def varlen_attention(be, varlen, q, k, v, cu_seqlens, longest: int):
    """q [b, s, h, d], k/v [b, s, hk, d] -> [b, s, h, d]: one `varlen` call over the flattened batch's
    segments (cu_seqlens, a tensor of the side's device; longest: the longest segment, a host int),
    scale 1/sqrt(d). The views are reshapes, no copies."""
    check_qkv(be, q, k, v)
    b, s, h, d = be.shape(q)
    hk = be.shape(k)[2]
    tokens = b * s
    out = varlen(be.reshape(q, [tokens, h, d]), be.reshape(k, [tokens, hk, d]), be.reshape(v, [tokens, hk, d]),
                 cu_seqlens, int(longest), d ** -0.5)
    return be.reshape(out, [b, s, h, d])
