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


# (batch, seq, num_heads, num_kv_heads, head_dim): GQA groups of 1 (MHA), 2 and 3.
QKV_SHAPES = [(2, 7, 4, 4, 6), (2, 9, 8, 4, 16), (1, 33, 6, 2, 10)]


def _fused_qkv_linear(hidden, heads, kv_heads, d, dtype):
    """PaddleNLP's own fused qkv_proj weight (fuse_param_func, is_qkv) from separate q/k/v
    weights, and the projection's output: the interleaved layout qkv_rotary reads."""
    from paddlenlp.transformers.conversion_utils import fuse_param_func

    h = hidden.shape[-1]
    weights = [random_tensor((h, n * d), "float32", scale=h ** -0.5, requires_grad=False)
               for n in (heads, kv_heads, kv_heads)]
    fused = fuse_param_func()(weights, is_qkv=True, num_heads=heads, num_key_value_heads=kv_heads)
    return paddle.matmul(hidden, fused).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", QKV_SHAPES, ids=str)
@pytest.mark.parametrize("explicit_positions", [True, False], ids=["position_ids", "default_positions"])
def test_qkv_rotary_matches_reference(shape, dtype, explicit_positions, kernel_calls):
    b, s, h, hk, d = shape
    qkv = random_tensor((b, s, (h + 2 * hk) * d), dtype)
    rows = s + 4
    cos, sin = _cos_sin("plain", d, rows, qkv)
    position_ids = None
    if explicit_positions:
        position_ids = paddle.to_tensor(np.random.randint(0, rows, size=(b, s)), dtype="int64")
    outs = ops.qkv_rotary(qkv, h, hk, cos, sin, position_ids)
    qkv64 = as_float64_leaf(qkv)
    refs = ops.qkv_rotary_ref(qkv64, h, hk, cos, sin, position_ids)
    for got, want, name in zip(outs, refs, ("q", "k", "v")):
        assert list(got.shape) == list(want.shape) and got.dtype == qkv.dtype, name
        assert_close(got, want, dtype, f"qkv_rotary {name}")
    ups = [random_tensor(t.shape, dtype, requires_grad=False) for t in outs]
    (d_qkv,) = grads_of(list(outs), [u.astype("float32") for u in ups], [qkv])
    (r_qkv,) = grads_of(list(refs), [u.astype("float64") for u in ups], [qkv64])
    assert_close(d_qkv, r_qkv, dtype, "qkv_rotary d_qkv (d_q, d_k and d_v)")
    # One launch forward (q, k rotated and v copied), one backward (all of d_qkv).
    assert kernel_calls() == {"fastffn_rotary": 2}


@pytest.mark.parametrize("shape", QKV_SHAPES, ids=str)
def test_qkv_rotary_equals_paddlenlp_fused_attention_input(shape):
    """What LlamaAttention computes with fuse_attention_qkv (PaddleNLP's fused weight, its reshape
    to [b, s, kv_heads, (G + 2) d], paddle.split, apply_rotary_pos_emb), forward and the gradient
    into the projection output and the hidden states."""
    b, s, h, hk, d = shape
    groups = h // hk
    hidden = random_tensor((b, s, 24), "float32")
    qkv = _fused_qkv_linear(hidden, h, hk, d, "float32")
    cos, sin = _cos_sin("ntk", d, s + 3, qkv)
    position_ids = paddle.to_tensor(np.random.randint(0, s + 3, size=(b, s)), dtype="int64")
    ours = ops.qkv_rotary(qkv, h, hk, cos, sin, position_ids)
    mixed = qkv.reshape([0, 0, hk, (groups + 2) * d])
    q, k, v = paddle.split(mixed, [groups * d, d, d], axis=-1)
    q = q.reshape([0, 0, h, d])
    stock = (*apply_rotary_pos_emb(q, k, cos, sin, position_ids), v)
    for got, want, name in zip(ours, stock, ("q", "k", "v")):
        assert_close(got, want, paddle.float32, f"qkv_rotary {name} vs PaddleNLP")
    ups = [random_tensor(t.shape, "float32", requires_grad=False) for t in ours]
    got_grads = grads_of(list(ours), ups, [qkv, hidden])
    want_grads = grads_of(list(stock), ups, [qkv, hidden])
    for got, want, name in zip(got_grads, want_grads, ("d_qkv", "d_hidden")):
        assert_close(got, want, paddle.float32, f"qkv_rotary {name} vs PaddleNLP")


def test_qkv_rotary_float64_backward_is_the_exact_transpose():
    qkv = random_tensor((1, 4, 3 * 2 + 2 * 2 * 1, 4), "float64").reshape([1, 4, -1])
    qkv = qkv.detach()
    qkv.stop_gradient = False
    cos, sin = _cos_sin("plain", 4, 4, qkv)
    outs = ops.qkv_rotary(qkv, 6, 2, cos, sin)
    ups = [random_tensor(t.shape, "float64", requires_grad=False) for t in outs]
    (d_qkv,) = grads_of(list(outs), ups, [qkv])
    # <f(x), u> = <x, f^T u> for the linear map x -> (R q, R k, v).
    forward_dot = sum(float((o * u).sum()) for o, u in zip(outs, ups))
    np.testing.assert_allclose(forward_dot, float((qkv * d_qkv).sum()), rtol=1e-12)


def test_qkv_rotary_gradient_of_q_alone_leaves_k_and_v_slots_zero():
    """With only q used, the backward still writes every element of d_qkv: exact zeros in the k
    and v slots (nothing uninitialised leaks out of the unfilled buffer), the reference's d_q in
    the q slots."""
    b, s, h, hk, d = 1, 5, 4, 2, 8
    qkv = random_tensor((b, s, (h + 2 * hk) * d), "float32")
    cos, sin = _cos_sin("plain", d, s, qkv)
    q, _, _ = ops.qkv_rotary(qkv, h, hk, cos, sin)
    (d_qkv,) = grads_of([q], [paddle.ones_like(q)], [qkv])
    qkv64 = as_float64_leaf(qkv)
    q_ref, _, _ = ops.qkv_rotary_ref(qkv64, h, hk, cos, sin)
    (r_qkv,) = grads_of([q_ref], [paddle.ones_like(q_ref)], [qkv64])
    groups = h // hk
    slots = d_qkv.reshape([b, s, hk, groups + 2, d]).numpy()
    np.testing.assert_array_equal(slots[:, :, :, groups:], 0.0)
    assert_close(d_qkv, r_qkv, paddle.float32, "d_qkv from q alone")


def test_rotary_position_flag_is_read_once_per_step_on_the_loss_or_backward(monkeypatch):
    """The kernel flags out-of-table ids into one pending device flag; reading it is deferred to
    the loss's readback or the backward of the call that created it (on CPU: at once). Forced to
    the GPU's path here (no immediate read), a bad id still raises by the end of the step."""
    from paddle_fastffn.core import rotary as core_rotary
    from paddle_fastffn.ops._backend import PaddleBackend

    monkeypatch.setattr(PaddleBackend, "is_cpu", staticmethod(lambda t: False))
    reads = []
    real_read = PaddleBackend.read_flag
    monkeypatch.setattr(PaddleBackend, "read_flag",
                        staticmethod(lambda flag: reads.append(1) or real_read(flag)))
    b, s, h, hk, d = 1, 3, 2, 1, 4
    cos, sin = _cos_sin("plain", d, 8, random_tensor((1, 8, 1, d), "float32"))
    bad = paddle.to_tensor([[0, 1, 8]], dtype="int64")
    good = paddle.to_tensor([[0, 1, 7]], dtype="int64")
    qkv = random_tensor((b, s, (h + 2 * hk) * d), "float32")
    # The bad ids in the first call: on CPU a later call's backward kernel would re-check its own
    # ids (no flag there) before the flag's creator reads it.
    layers = [ops.qkv_rotary(qkv, h, hk, cos, sin, ids) for ids in (bad, good, good)]
    assert reads == []  # three forwards, no host read yet
    assert np.isnan(layers[0][0].numpy()[0, 2]).all() and np.isfinite(layers[0][0].numpy()[0, :2]).all()
    assert np.isfinite(layers[0][2].numpy()).all()  # v is copied whatever the position
    total = sum(t.sum() for outs in layers for t in outs)
    # Paddle re-raises an error from a PyLayer backward as an OSError with the message inside.
    with pytest.raises(Exception, match=r"`position_ids` holds a position outside the cos/sin table \[0, 8\)"):
        total.backward()
    assert reads == [1]  # once, by the backward of the first call (the flag's creator)
    assert core_rotary.POSITION_CHECK.flag is None
    # A clean step reads once too and raises nothing.
    layers = [ops.qkv_rotary(qkv, h, hk, cos, sin, good) for _ in range(3)]
    sum(t.sum() for outs in layers for t in outs).backward()
    assert reads == [1, 1]


def test_rotary_position_flag_rides_in_the_fused_loss_readback(monkeypatch):
    """With the fused loss the pending flag is read in the loss's own copy to the host, at the
    start of the step's backward, before any rotary backward."""
    from paddle_fastffn.core import rotary as core_rotary
    from paddle_fastffn.ops._backend import PaddleBackend

    monkeypatch.setattr(PaddleBackend, "is_cpu", staticmethod(lambda t: False))
    reads = []
    monkeypatch.setattr(PaddleBackend, "read_flag", staticmethod(lambda flag: reads.append(1)))
    d = 4
    cos, sin = _cos_sin("plain", d, 8, random_tensor((1, 8, 1, d), "float32"))
    qkv = random_tensor((1, 3, 4 * d), "float32")
    q, k, v = ops.qkv_rotary(qkv, 2, 1, cos, sin, paddle.to_tensor([[0, 9, 1]], dtype="int64"))
    assert core_rotary.POSITION_CHECK.flag is not None
    hidden = paddle.nan_to_num(q.reshape([3, 2 * d])) + 0 * (k.sum() + v.sum())
    weight = random_tensor((2 * d, 11), "float32")
    loss = ops.linear_cross_entropy(hidden, weight, paddle.to_tensor([1, 2, 3], dtype="int64"))
    with pytest.raises(Exception, match=r"`position_ids` holds a position outside the cos/sin table \[0, 8\)"):
        loss.backward()
    assert reads == [] and core_rotary.POSITION_CHECK.flag is None  # read by the loss, not rotary


def test_rotary_position_flag_of_a_pass_without_backward_is_read_by_the_next_backward(monkeypatch):
    """A forward whose graph is freed without a backward hands the pending flag to the next
    forward, whose backward reads it."""
    from paddle_fastffn.ops._backend import PaddleBackend

    monkeypatch.setattr(PaddleBackend, "is_cpu", staticmethod(lambda t: False))
    d = 4
    cos, sin = _cos_sin("plain", d, 8, random_tensor((1, 8, 1, d), "float32"))
    qkv = random_tensor((1, 3, 4 * d), "float32")
    dropped = ops.qkv_rotary(qkv, 2, 1, cos, sin, paddle.to_tensor([[0, 8, 1]], dtype="int64"))
    del dropped  # its graph (and the flag's owner) is gone without a backward
    outs = ops.qkv_rotary(qkv, 2, 1, cos, sin, paddle.to_tensor([[0, 1, 2]], dtype="int64"))
    with pytest.raises(Exception, match=r"`position_ids` holds a position outside the cos/sin table \[0, 8\)"):
        sum(t.sum() for t in outs).backward()
