"""ops.packed_attention (causal attention per packed example, no dense mask) against the dense
block-causal reference in float64: outputs and the gradients of q, k and v; the GPU composition
(flash_attn_unpadded over cu_seqlens) through a reference of that call's contract; the segment
forms and their errors."""

import numpy as np
import paddle
import pytest
from paddle.nn.functional.flash_attention import flash_attn_unpadded

from helpers import DTYPE_IDS, DTYPES, as_float64_leaf, grads_of, random_tensor
from paddle_fastffn import ops
from paddle_fastffn.ops import varlen_attention as pa
from tolerances import assert_close

# (rows of example lengths, seq, q_heads, kv_heads, head_dim): several rows with trailing padding,
# one-token examples, one example filling its row, GQA groups of 2 and 4, MHA, LLaMA's head_dim.
CASES = [
    ([[5, 3, 9], [12, 1]], 20, 4, 2, 8),
    ([[1, 1, 1], [7]], 7, 8, 2, 16),
    ([[31, 2, 17, 40, 6]], 96, 2, 2, 128),
    ([[4]], 4, 1, 1, 2),
]


def attention_and_grads(fn, q, k, v, segments, upstream):
    out = fn(q, k, v, segments)
    return (out, *grads_of([out], [upstream], [q, k, v]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_packed_attention_matches_dense_block_causal_reference(case, dtype):
    rows, seq, hq, hk, d = case
    segments = ops.PackedSegments.from_row_lengths(rows, seq)
    q, k, v = (random_tensor((len(rows), seq, h, d), dtype) for h in (hq, hk, hk))
    upstream = random_tensor(q.shape, dtype, requires_grad=False)
    got = attention_and_grads(ops.packed_attention, q, k, v, segments, upstream.astype("float32"))
    q64, k64, v64 = (as_float64_leaf(t) for t in (q, k, v))
    ref = attention_and_grads(ops.packed_attention_ref, q64, k64, v64, segments, upstream.astype("float64"))
    assert got[0].dtype == dtype and list(got[0].shape) == list(q.shape)
    for name, actual, expected in zip(("out", "d_q", "d_k", "d_v"), got, ref):
        assert_close(actual, expected, dtype, f"packed attention {name}", reduced_rows=max(map(max, rows)))


@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_gpu_varlen_composition_matches_reference(case):
    """packed_attention_varlen, the GPU path's composition around flash_attn_unpadded (which cannot
    run on this CPU build), with the reference of that call: the same result as the dense mask; and
    its call binds to the installed Paddle's flash_attn_unpadded signature."""
    rows, seq, hq, hk, d = case
    segments = ops.PackedSegments.from_row_lengths(rows, seq)
    q, k, v = (as_float64_leaf(random_tensor((len(rows), seq, h, d), "float32")) for h in (hq, hk, hk))
    got = pa.packed_attention_varlen(q, k, v, segments, pa.flash_attn_unpadded_ref)
    assert_close(got, ops.packed_attention_ref(q, k, v, segments), paddle.float64, "varlen composition")
    assert pa.varlen_call_signature_error(flash_attn_unpadded) is None
    assert "too many positional arguments" in pa.varlen_call_signature_error(lambda query, key: None)


def test_segment_forms_round_trip():
    segments = ops.PackedSegments.from_row_lengths([[5, 3, 9], [12, 1]], 20)
    assert segments.lengths == [5, 3, 9, 3, 12, 1, 7]  # each row's padding is a segment of its own
    ends = segments.startend_row_indices()
    assert ends.dtype == np.int32 and ends.shape == (2, 1, 20, 1)
    assert ends[0, 0, :, 0].tolist() == [5] * 5 + [8] * 3 + [17] * 9 + [20] * 3
    again = ops.PackedSegments.from_startend_row_indices(paddle.to_tensor(ends))
    assert again.lengths == segments.lengths and (again.batch, again.seq) == (2, 20)
    assert segments.cu_seqlens().tolist() == [0, 5, 8, 17, 20, 32, 33, 40]
    mask = segments.dense_mask()
    assert mask[0, 0, 6, 5] and not mask[0, 0, 6, 4] and not mask[0, 0, 5, 6]


def test_segment_groups_cover_every_token_once_with_bounded_padding():
    lengths = [300, 12, 290, 7, 1, 64, 60, 2048 - 300 - 12 - 290 - 7 - 1 - 64 - 60]
    groups = pa._segment_groups(lengths)
    starts = sorted(start for _, members in groups for start, _ in members)
    assert starts == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    for longest, members in groups:
        exact = sum(n * n for _, n in members)
        assert longest == max(n for _, n in members)
        assert len(members) * longest * longest <= pa.GROUP_PADDED_WORK * exact


def test_bad_segments_and_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="int32 \\[batch, 1, seq, 1\\]"):
        ops.PackedSegments.from_startend_row_indices(paddle.zeros([2, 1, 4, 2], dtype="int32"))
    with pytest.raises(ValueError, match="all its columns must carry its end"):
        ops.PackedSegments.from_startend_row_indices(paddle.to_tensor([[2, 3, 3, 4]], dtype="int32"))
    with pytest.raises(ValueError, match="must end within the row"):
        ops.PackedSegments.from_startend_row_indices(paddle.to_tensor([[5, 5, 5, 5]], dtype="int32"))
    with pytest.raises(TypeError, match="paddle.Tensor"):
        ops.PackedSegments.from_startend_row_indices(np.zeros((1, 4), dtype=np.int32))
    with pytest.raises(ValueError, match="tile"):
        ops.PackedSegments([3, 2], batch=1, seq=4)
    segments = ops.PackedSegments.from_row_lengths([[3]], 4)
    q = random_tensor((1, 4, 3, 8), "float32")
    with pytest.raises(ValueError, match="heads must divide"):
        ops.packed_attention(q, random_tensor((1, 4, 2, 8), "float32"), random_tensor((1, 4, 2, 8), "float32"),
                             segments)
    with pytest.raises(ValueError, match="tile a 1 x 4 batch"):
        ops.packed_attention(*(random_tensor((1, 5, 2, 8), "float32") for _ in range(3)), segments)
