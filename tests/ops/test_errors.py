"""Bad input gets a clear error naming the argument and the expectation."""

import paddle
import pytest

from helpers import random_tensor
from paddle_fastffn import ops
from paddlenlp.transformers.llama.modeling import LlamaRotaryEmbedding


def test_packed_swiglu_rejects_odd_last_axis():
    with pytest.raises(ValueError, match=r"`x` packs \[gate \| up\].*even"):
        ops.swiglu(random_tensor((3, 7), "float32"))


def test_swiglu_rejects_integer_input():
    with pytest.raises(TypeError, match="`x` must be float32, float16, bfloat16 or float64"):
        ops.swiglu(paddle.ones([2, 4], dtype="int32"))


def test_swiglu_rejects_mismatched_pair():
    with pytest.raises(ValueError, match="`y` must have the shape of `x`"):
        ops.swiglu(random_tensor((2, 4), "float32"), random_tensor((2, 5), "float32"))
    with pytest.raises(TypeError, match="`y` must have the dtype of `x`"):
        ops.swiglu(random_tensor((2, 4), "float32"), random_tensor((2, 4), "float16"))


def test_swiglu_rejects_non_tensor():
    with pytest.raises(TypeError, match="`x` must be a paddle.Tensor"):
        ops.swiglu([[1.0, 2.0]])


def test_rms_norm_rejects_wrong_weight():
    x = random_tensor((2, 8), "float32")
    with pytest.raises(ValueError, match="`weight` must be 1-D of size x.shape\\[-1\\]"):
        ops.rms_norm(x, random_tensor((7,), "float32"))
    with pytest.raises(TypeError, match="`weight` .* must have the dtype of `x`"):
        ops.rms_norm(x, random_tensor((8,), "bfloat16"))
    with pytest.raises(ValueError, match="`residual` must have the shape of `x`"):
        ops.fused_add_rms_norm(x, random_tensor((3, 8), "float32"), random_tensor((8,), "float32"))


def test_rms_norm_rejects_negative_epsilon():
    with pytest.raises(ValueError, match="`epsilon` must be a non-negative float"):
        ops.rms_norm(random_tensor((2, 8), "float32"), random_tensor((8,), "float32"), -1.0)


def _cos_sin(d=6, rows=8):
    q = random_tensor((1, rows, 1, d), "float32")
    return LlamaRotaryEmbedding(d, rows)(q, seq_len=rows)


def test_rotary_rejects_odd_head_dim():
    q, k = random_tensor((1, 2, 2, 5), "float32"), random_tensor((1, 2, 2, 5), "float32")
    with pytest.raises(ValueError, match="head_dim must be even"):
        ops.rotary_embedding(q, k, *_cos_sin(5))


def test_rotary_rejects_mismatched_batch_and_heads():
    cos, sin = _cos_sin()
    with pytest.raises(ValueError, match="must share batch, seq and head_dim"):
        ops.rotary_embedding(random_tensor((2, 3, 2, 6), "float32"), random_tensor((1, 3, 2, 6), "float32"), cos, sin)
    with pytest.raises(ValueError, match=r"k heads \(3\) must divide q heads \(4\)"):
        ops.rotary_embedding(random_tensor((1, 3, 4, 6), "float32"), random_tensor((1, 3, 3, 6), "float32"), cos, sin)


def test_rotary_rejects_positions_outside_the_table():
    cos, sin = _cos_sin(rows=8)
    q, k = random_tensor((1, 3, 2, 6), "float32"), random_tensor((1, 3, 2, 6), "float32")
    with pytest.raises(Exception, match="position_ids.*outside the cos/sin table"):
        ops.rotary_embedding(q, k, cos, sin, paddle.to_tensor([[0, 1, 8]], dtype="int64"))
    with pytest.raises(ValueError, match=r"seq \(9\) exceeds the cos/sin table"):
        ops.rotary_embedding(random_tensor((1, 9, 2, 6), "float32"), random_tensor((1, 9, 2, 6), "float32"), cos, sin)


def test_rotary_rejects_float_position_ids_and_bad_tables():
    cos, sin = _cos_sin()
    q, k = random_tensor((1, 3, 2, 6), "float32"), random_tensor((1, 3, 2, 6), "float32")
    with pytest.raises(TypeError, match="`position_ids` must be int64 or int32"):
        ops.rotary_embedding(q, k, cos, sin, paddle.zeros([1, 3], dtype="float32"))
    with pytest.raises(ValueError, match="`cos` must be \\[1, seq, 1, head_dim\\]"):
        ops.rotary_embedding(q, k, cos.reshape([8, 1, 6]), sin)


def test_only_devices_and_dtypes_the_kernels_cover_take_the_kernel_path():
    from paddle_fastffn.ops import _checks

    assert _checks.kernel_supports_place(paddle.ones([2], dtype="float64"))  # CPU: all float dtypes
    assert _checks.kernel_supports_place(paddle.ones([2], dtype="bfloat16"))


def test_a_fallback_nobody_asked_for_is_an_error_in_strict_mode():
    from paddle_fastffn.ops import _fallback

    with pytest.raises(_fallback.UnrequestedFallbackError, match="reference path"):
        _fallback.warn_fallback("paddle_fastffn.ops.swiglu", "Place(xpu:0)")


def test_an_asked_for_fallback_warns_once(allow_fallback, recwarn):
    from paddle_fastffn.ops import _fallback

    for _ in range(2):
        _fallback.warn_fallback("paddle_fastffn.ops.test_only_op", "Place(xpu:0)")
    assert sum("test_only_op" in str(w.message) for w in recwarn) == 1


def test_qkv_rotary_rejects_bad_heads_widths_and_positions():
    cos, sin = _cos_sin(rows=8)
    qkv = random_tensor((1, 3, (4 + 2 * 2) * 6), "float32")
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        ops.qkv_rotary(qkv, 4, 3, cos, sin)
    with pytest.raises(ValueError, match="`num_heads` must be a positive int"):
        ops.qkv_rotary(qkv, 0, 2, cos, sin)
    with pytest.raises(ValueError, match=r"last axis 48 must be \(num_heads \+ 2 \* num_kv_heads\) = 10"):
        ops.qkv_rotary(qkv, 6, 2, cos, sin)
    with pytest.raises(ValueError, match=r"`qkv` must be the fused projection \[batch, seq"):
        ops.qkv_rotary(qkv.reshape([1, 3, 8, 6]), 4, 2, cos, sin)
    with pytest.raises(ValueError, match="`position_ids` must be \\[batch, seq\\]"):
        ops.qkv_rotary(qkv, 4, 2, cos, sin, paddle.zeros([2, 3], dtype="int64"))
    # On CPU the step's position flag is read at once: the call itself raises.
    with pytest.raises(ValueError, match=r"`position_ids` holds a position outside the cos/sin table \[0, 8\)"):
        ops.qkv_rotary(qkv, 4, 2, cos, sin, paddle.to_tensor([[0, 8, 1]], dtype="int64"))
    with pytest.raises(ValueError, match=r"`position_ids` holds a position outside the cos/sin table \[0, 8\)"):
        ops.qkv_rotary(qkv, 4, 2, cos, sin, paddle.to_tensor([[0, -1, 1]], dtype="int64"))


def test_rotary_binding_rejects_heads_layouts_outside_their_tensor():
    """The binding checks every heads layout against its tensor before the kernel runs (the core
    layer computes layouts; a wrong one must not read or write out of bounds)."""
    from paddle_fastffn.core.rotary import dense_heads, interleaved_qkv_heads
    from paddle_fastffn.ops._backend import BACKEND

    cos, sin = _cos_sin(d=6, rows=8)
    cos, sin = cos.reshape([8, 6]).astype("float32"), sin.reshape([8, 6]).astype("float32")
    qkv = random_tensor((1, 3, (4 + 2 * 2) * 6), "float32", requires_grad=False)
    q, k, v = (paddle.empty([1, 3, n, 6], dtype="float32") for n in (4, 2, 2))
    q_in, k_in, v_in = interleaved_qkv_heads(4, 2, 6)
    too_far = (k_in[0] + 7,) + k_in[1:]  # the last token's last k head would end 1 past qkv
    with pytest.raises(Exception, match="argument `k` .* is too small for its heads layout"):
        BACKEND.rotary((qkv, qkv, qkv), (q, k, v), (1, 3, 4, 2, 6),
                       (q_in, too_far, v_in, dense_heads(4, 6), dense_heads(2, 6), dense_heads(2, 6)),
                       cos, sin, None, None, inverse=False)
    with pytest.raises(Exception, match="`q_out` heads layout is invalid"):
        BACKEND.rotary((qkv, qkv, qkv), (q, k, v), (1, 3, 4, 2, 6),
                       (q_in, k_in, v_in, (0, 24, 24, 3, 6), dense_heads(2, 6), dense_heads(2, 6)),
                       cos, sin, None, None, inverse=False)


# The C layer checks its own rules and says why (fastffn_last_error); the bindings pass that on.
# These call the compiled ops directly, past the Python checks, to reach the C checks.

def test_the_c_rms_norm_check_reaches_the_user_with_its_message():
    from paddle_fastffn.ops._loader import run_op

    x, weight = random_tensor((2, 8), "float32"), random_tensor((8,), "float32")
    with pytest.raises(Exception, match=r"paddle_fastffn.ops.rms_norm: invalid argument: "
                                        r"fastffn_rms_norm_fwd_cpu: epsilon must be a non-negative "
                                        r"float, got -1"):
        run_op("fastffn_rms_norm_fwd", x, None, weight, -1.0)


def test_the_c_adamw_dtype_rules_reach_the_user_with_their_message():
    from paddle_fastffn.optim.adamw import _adamw_op

    def step(param_dtype, grad_dtype):
        param = paddle.zeros([4], param_dtype)
        moments = [paddle.zeros([4], "float32") for _ in range(2)]
        pows = [paddle.full([1], 0.9, "float32") for _ in range(2)]
        _adamw_op(param, paddle.zeros([4], grad_dtype), paddle.full([1], 0.1, "float32"), *moments,
                  *pows, None, None, 0.9, 0.999, 1e-8, 1.0, 0.0, False)

    with pytest.raises(Exception, match=r"unsupported dtype: fastffn_adamw_with_state_cpu: param_dtype is "
                                        r"FLOAT64 \(3\); this kernel stores FLOAT32, FLOAT16, BFLOAT16"):
        step("float64", "float64")
    with pytest.raises(Exception, match=r"fastffn_adamw_with_state_cpu: grad_dtype is FLOAT16; it must be the "
                                        r"param's dtype \(BFLOAT16\) or FLOAT32"):
        step("bfloat16", "float16")
