import numpy as np
import paddle
import pytest
from paddlenlp.transformers.llama.modeling import (
    LlamaLinearScalingRotaryEmbedding,
    LlamaNTKScalingRotaryEmbedding,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from helpers import DTYPE_IDS, DTYPES, as_float64_leaf, grads_of, random_tensor
from paddle_fastffn import ops
from tolerances import assert_close

# (batch, seq, q_heads, k_heads, head_dim): one token, GQA groups of 2 and 4, MHA, LLaMA's 128.
SHAPES = [(1, 1, 1, 1, 2), (2, 7, 4, 2, 6), (3, 5, 8, 8, 64), (2, 9, 8, 2, 128), (1, 33, 6, 3, 10)]
ROTARY_CLASSES = {
    "plain": lambda d, n: LlamaRotaryEmbedding(d, n),
    "linear": lambda d, n: LlamaLinearScalingRotaryEmbedding(d, n, scaling_factor=2.0),
    "ntk": lambda d, n: LlamaNTKScalingRotaryEmbedding(d, n, scaling_factor=2.0),
}


def _cos_sin(kind, head_dim, rows, like):
    return ROTARY_CLASSES[kind](head_dim, rows)(like, seq_len=rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("explicit_positions", [True, False], ids=["position_ids", "default_positions"])
def test_rotary_matches_reference(shape, dtype, explicit_positions, kernel_calls):
    b, s, hq, hk, d = shape
    q, k = random_tensor((b, s, hq, d), dtype), random_tensor((b, s, hk, d), dtype)
    rows = s + 11
    cos, sin = _cos_sin("plain", d, rows, q)
    position_ids = None
    if explicit_positions:
        position_ids = paddle.to_tensor(np.random.randint(0, rows, size=(b, s)), dtype="int64")
    q_out, k_out = ops.rotary_embedding(q, k, cos, sin, position_ids)
    q64, k64 = as_float64_leaf(q), as_float64_leaf(k)
    q_ref, k_ref = ops.rotary_embedding_ref(q64, k64, cos, sin, position_ids)
    assert_close(q_out, q_ref, dtype, "rotary q")
    assert_close(k_out, k_ref, dtype, "rotary k")
    up_q = random_tensor(q.shape, dtype, requires_grad=False)
    up_k = random_tensor(k.shape, dtype, requires_grad=False)
    d_q, d_k = grads_of([q_out, k_out], [up_q.astype("float32"), up_k.astype("float32")], [q, k])
    r_q, r_k = grads_of([q_ref, k_ref], [up_q.astype("float64"), up_k.astype("float64")], [q64, k64])
    assert_close(d_q, r_q, dtype, "rotary d_q")
    assert_close(d_k, r_k, dtype, "rotary d_k")
    assert kernel_calls() == {"fastffn_rotary": 2}  # forward and its transpose


@pytest.mark.parametrize("kind", sorted(ROTARY_CLASSES))
def test_rotary_equals_paddlenlp_apply_rotary_pos_emb(kind):
    q, k = random_tensor((2, 12, 4, 16), "float32"), random_tensor((2, 12, 2, 16), "float32")
    cos, sin = _cos_sin(kind, 16, 40, q)
    position_ids = paddle.to_tensor(np.random.randint(0, 40, size=(2, 12)), dtype="int64")
    ours = ops.rotary_embedding(q, k, cos, sin, position_ids)
    # PaddleNLP broadcasts cos over heads, so GQA k works in stock as well.
    stock = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
    for got, want, name in zip(ours, stock, "qk"):
        assert_close(got, want, paddle.float32, f"{kind} rope {name} vs PaddleNLP")


def test_rotary_reads_strided_views_of_a_fused_qkv_projection():
    b, s, hq, hk, d = 2, 5, 4, 2, 8
    qkv = random_tensor((b, s, (hq + 2 * hk) * d), "float32")
    q = qkv[:, :, : hq * d].reshape([b, s, hq, d])
    k = qkv[:, :, hq * d : (hq + hk) * d].reshape([b, s, hk, d])
    cos, sin = _cos_sin("plain", d, s, q)
    q_out, k_out = ops.rotary_embedding(q, k, cos, sin)
    q_ref, k_ref = ops.rotary_embedding_ref(q.astype("float64"), k.astype("float64"), cos, sin)
    assert_close(q_out, q_ref, paddle.float32, "strided q")
    assert_close(k_out, k_ref, paddle.float32, "strided k")
    (q_out.sum() + 2 * k_out.sum()).backward()
    qkv64 = as_float64_leaf(qkv)
    q64 = qkv64[:, :, : hq * d].reshape([b, s, hq, d])
    k64 = qkv64[:, :, hq * d : (hq + hk) * d].reshape([b, s, hk, d])
    rq, rk = ops.rotary_embedding_ref(q64, k64, cos, sin)
    (rq.sum() + 2 * rk.sum()).backward()
    assert_close(qkv.grad, qkv64.grad, paddle.float32, "gradient into the fused qkv tensor")


def test_rotary_float64_is_exactly_linear_in_q():
    q, k = random_tensor((1, 3, 2, 4), "float64"), random_tensor((1, 3, 1, 4), "float64")
    cos, sin = _cos_sin("plain", 4, 3, q)
    up_q = random_tensor((1, 3, 2, 4), "float64", requires_grad=False)
    q_out, k_out = ops.rotary_embedding(q, k, cos, sin)
    d_q, _ = grads_of([q_out, k_out], [up_q, paddle.zeros_like(k)], [q, k])
    # For a linear map R, <R q, u> = <q, R^T u>: the backward must be the exact transpose.
    np.testing.assert_allclose(float((q_out * up_q).sum()), float((q * d_q).sum()), rtol=1e-12)


def test_packed_rows_with_restarting_positions_equal_each_example_alone():
    """A packed row (position ids restarting at each example, as the packing collator gives them)
    rotates each example exactly as the example alone at positions 0..n-1, forward and backward."""
    lengths = [5, 1, 9, 3]
    q, k = random_tensor((1, sum(lengths), 4, 16), "float32"), random_tensor((1, sum(lengths), 2, 16), "float32")
    cos, sin = _cos_sin("plain", 16, 16, q)
    position_ids = paddle.to_tensor([[p for n in lengths for p in range(n)]], dtype="int64")
    q_out, k_out = ops.rotary_embedding(q, k, cos, sin, position_ids)
    d_q, d_k = grads_of([q_out, k_out], [q_out.detach(), k_out.detach()], [q, k])
    start = 0
    for n in lengths:
        q_alone = q[:, start:start + n].detach()
        k_alone = k[:, start:start + n].detach()
        q_alone.stop_gradient = k_alone.stop_gradient = False
        q_ref, k_ref = ops.rotary_embedding(q_alone, k_alone, cos, sin)
        r_q, r_k = grads_of([q_ref, k_ref], [q_out[:, start:start + n].detach(), k_out[:, start:start + n].detach()],
                            [q_alone, k_alone])
        np.testing.assert_array_equal(q_out[:, start:start + n].numpy(), q_ref.numpy())
        np.testing.assert_array_equal(k_out[:, start:start + n].numpy(), k_ref.numpy())
        np.testing.assert_array_equal(d_q[:, start:start + n].numpy(), r_q.numpy())
        np.testing.assert_array_equal(d_k[:, start:start + n].numpy(), r_k.numpy())
        start += n
