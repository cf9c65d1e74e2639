"""ops.linear_cross_entropy against PaddleNLP's own LM head + LlamaPretrainingCriterion in fp32:
the loss and both gradients, on awkward shapes and chunkings, ignored and dropped tokens, tied
weights, half-precision storage and bad input."""

import importlib
import math

import numpy as np
import paddle
import pytest
from paddlenlp.transformers import LlamaConfig
from paddlenlp.transformers.llama.modeling import LlamaLMHead, LlamaPretrainingCriterion

from paddle_fastffn import ops
from paddle_fastffn.ops._backend import BACKEND
from tolerances import assert_close, assert_close_to_scale

core_lce = importlib.import_module("paddle_fastffn.core.linear_cross_entropy")
IGNORE = -100


def make_inputs(tokens, hidden, vocab, dtype="float32", seed=0, ignored=0.25, batch=None, tied=False,
                logit_scale=3.0):
    """hidden [T, H] (or [B, S, H]), weight [H, V] (or [V, H] tied), labels with a fraction
    ignored. Values are upcast-exact in `dtype`, so the fp32 reference sees the same numbers."""
    rng = np.random.default_rng(seed)
    shape = (tokens, hidden) if batch is None else (batch, tokens // batch, hidden)
    h = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    w_shape = (vocab, hidden) if tied else (hidden, vocab)
    w = paddle.to_tensor((rng.standard_normal(w_shape) * logit_scale / math.sqrt(hidden)).astype(np.float32))
    w = w.astype(dtype)
    labels = rng.integers(0, vocab, size=shape[:-1])
    labels[rng.random(shape[:-1]) < ignored] = IGNORE
    h.stop_gradient = w.stop_gradient = False
    return h, w, paddle.to_tensor(labels, dtype="int64")


def paddlenlp_loss_and_grads(hidden, weight, labels, tied=False):
    """PaddleNLP's LlamaLMHead (tensor_parallel_degree 1) and LlamaPretrainingCriterion, in fp32,
    on a copy of the inputs. A tied embedding weight [V, H] is applied transposed, as PaddleNLP's
    later LlamaLMHead(transpose_y=True) does (2.8.1's head only knows [H, V]). Returns (loss,
    d_hidden, d_weight)."""
    h = hidden.astype("float32").detach()
    h.stop_gradient = False
    h3 = h if len(h.shape) == 3 else h.unsqueeze(0)
    vocab = weight.shape[0] if tied else weight.shape[1]
    config = LlamaConfig(vocab_size=vocab, hidden_size=h.shape[-1])
    if tied:
        w = weight.astype("float32").detach()
        w.stop_gradient = False
        logits = paddle.matmul(h3, w, transpose_y=True)
    else:
        head = LlamaLMHead(config)
        head.weight.set_value(weight.astype("float32"))
        w = head.weight
        logits = head(h3)
    loss = LlamaPretrainingCriterion(config)(logits, labels.reshape(h3.shape[:-1]))
    loss.backward()
    return loss, h.grad.reshape(hidden.shape), w.grad


def fused_loss_and_grads(hidden, weight, labels, **kwargs):
    loss = ops.linear_cross_entropy(hidden, weight, labels, **kwargs)
    loss.backward()
    return loss, hidden.grad, weight.grad


def check_against_paddlenlp(hidden, weight, labels, dtype=paddle.float32, tied=False, **kwargs):
    loss, d_h, d_w = fused_loss_and_grads(hidden, weight, labels, transpose_weight=tied, **kwargs)
    ref_loss, ref_d_h, ref_d_w = paddlenlp_loss_and_grads(hidden, weight, labels, tied=tied)
    assert loss.dtype == paddle.float32 and loss.shape == []
    assert d_h.dtype == hidden.dtype and d_w.dtype == weight.dtype
    assert_close(loss, ref_loss, paddle.float32, "loss")  # fp32 math for every storage dtype
    assert_close_to_scale(d_h, ref_d_h, dtype, "d_hidden")
    assert_close_to_scale(d_w, ref_d_w, dtype, "d_weight")


# (tokens, hidden, vocab, chunk_tokens): one token, chunks that do not divide T, a chunk of one
# token, a chunk larger than T, LLaMA-2's 32000 vocabulary, and the default chunk.
SHAPES = [(1, 16, 1000, None), (37, 24, 1000, 8), (37, 24, 1000, 1), (37, 20, 1000, 64),
          (64, 32, 32000, 24), (45, 40, 32000, None)]


@pytest.mark.parametrize("tokens,hidden,vocab,chunk", SHAPES, ids=str)
def test_loss_and_gradients_match_paddlenlp_criterion_in_fp32(tokens, hidden, vocab, chunk, kernel_calls):
    h, w, labels = make_inputs(tokens, hidden, vocab, ignored=0.0 if tokens == 1 else 0.25)
    check_against_paddlenlp(h, w, labels, chunk_tokens=chunk)
    # Only the labelled tokens reach the LM head: the chunks cover them, not every token.
    labelled = int((labels != -100).astype("int64").sum())
    chunks = math.ceil(labelled / (chunk or core_lce.default_chunk_tokens(vocab, on_gpu=False)))
    assert kernel_calls() == {"fastffn_cross_entropy": chunks}


def test_batch_sequence_layout_and_odd_chunks():
    h, w, labels = make_inputs(39, 24, 1000, batch=3)  # [3, 13, 24], labels [3, 13]
    check_against_paddlenlp(h, w, labels, chunk_tokens=10)


def test_chunk_size_does_not_change_the_result():
    results = []
    for chunk in (1, 7, 37, None):
        h, w, labels = make_inputs(37, 24, 1000)
        loss, d_h, d_w = fused_loss_and_grads(h, w, labels, chunk_tokens=chunk)
        results.append((float(loss), d_h.numpy(), d_w.numpy()))
    for loss, d_h, d_w in results[1:]:
        # The same math per token; only the GEMMs' blocking (which depends on the chunk's row
        # count) and d_weight's chunk sums change the rounding.
        assert abs(loss - results[0][0]) <= 1e-6 * abs(results[0][0])
        np.testing.assert_allclose(d_h, results[0][1], rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(d_w, results[0][2], rtol=1e-5, atol=1e-8)


def test_tied_embedding_weight_is_applied_transposed():
    h, e, labels = make_inputs(37, 24, 1000, tied=True)
    check_against_paddlenlp(h, e, labels, tied=True, chunk_tokens=9)


@pytest.mark.parametrize("dtype", [paddle.float16, paddle.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
def test_half_precision_storage_computes_in_fp32(dtype, tied):
    # hidden and weight stored in fp16/bf16: logits, loss and gradients in fp32 (the reference
    # runs the same fp32 math on the exactly upcast values); the gradients round once to dtype.
    h, w, labels = make_inputs(37, 24, 1000, dtype=dtype, tied=tied)
    check_against_paddlenlp(h, w, labels, dtype=dtype, tied=tied, chunk_tokens=16)


def test_every_label_ignored_gives_paddlenlp_nan_and_zero_gradients():
    h, w, labels = make_inputs(11, 16, 1000, ignored=1.0)
    loss, d_h, d_w = fused_loss_and_grads(h, w, labels, chunk_tokens=4)
    ref_loss, ref_d_h, ref_d_w = paddlenlp_loss_and_grads(h, w, labels)
    # The criterion's mean over an empty selection is NaN (what PaddleNLP 2.8.1 returns) and
    # gives no gradient to any logit.
    assert math.isnan(float(ref_loss)) and math.isnan(float(loss))
    assert not ref_d_h.numpy().any() and not ref_d_w.numpy().any()
    assert not d_h.numpy().any() and not d_w.numpy().any()


def test_tokens_whose_loss_is_exactly_zero_are_dropped_as_paddlenlp_drops_them():
    # PaddleNLP keeps `masked_lm_loss[masked_lm_loss > 0]`: a labelled token whose fp32 loss is
    # exactly 0 (a logit margin above ~17 makes log(sum exp) round to the max) leaves the mean and
    # gets no gradient. Tokens 0 and 3 are such tokens here.
    h, w, labels = make_inputs(12, 16, 1000, ignored=0.0)
    h_np = h.numpy()
    h_np[:, 0] = 0.0  # feature 0 reaches only tokens 0 and 3
    h_np[[0, 3]] = 0.0
    h_np[[0, 3], 0] = 1.0
    w_np = w.numpy()
    w_np[0, :] = 0.0
    w_np[0, 7] = 200.0
    labels_np = labels.numpy()
    labels_np[[0, 3]] = 7
    h = paddle.to_tensor(h_np, stop_gradient=False)
    w = paddle.to_tensor(w_np, stop_gradient=False)
    labels = paddle.to_tensor(labels_np)
    ref_loss, ref_d_h, ref_d_w = paddlenlp_loss_and_grads(h, w, labels)
    loss, d_h, d_w = fused_loss_and_grads(h, w, labels, chunk_tokens=5)
    assert_close(loss, ref_loss, paddle.float32, "loss with dropped tokens")
    assert_close_to_scale(d_h, ref_d_h, paddle.float32, "d_hidden with dropped tokens")
    assert_close_to_scale(d_w, ref_d_w, paddle.float32, "d_weight with dropped tokens")
    assert not d_h.numpy()[[0, 3]].any()


def test_huge_losses_are_exact_where_paddles_cpu_softmax_caps_them():
    # Paddle's CPU softmax clips logits more than 64 below the row max to -64 (ValueClip in phi's
    # SoftmaxEigen), so stock CPU training reports min(loss, ~64) for such a token; the fused op
    # computes the loss itself. Gradients agree (the clipped probability is below 1e-27).
    h, w, labels = make_inputs(6, 16, 100, ignored=0.0)
    h_np, w_np, labels_np = h.numpy(), w.numpy(), labels.numpy()
    h_np[:, 0] = 0.0
    h_np[2, 0] = 1.0
    w_np[0, :] = 0.0
    w_np[0, 5] = 90.0  # token 2's logit 5 is ~90 above the others
    labels_np[2] = 6
    h, w = paddle.to_tensor(h_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=False)
    labels = paddle.to_tensor(labels_np)
    logits = paddle.matmul(h.astype("float64"), w.astype("float64")).numpy()
    exact = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1) - logits[np.arange(6), labels_np]
    loss, d_h, d_w = fused_loss_and_grads(h, w, labels)
    ref_loss, ref_d_h, ref_d_w = paddlenlp_loss_and_grads(h, w, labels)
    assert_close(loss, exact.mean(), paddle.float32, "loss with a 90-nat token")
    assert float(ref_loss) < exact.mean() - 3  # stock CPU's capped value
    assert_close_to_scale(d_h, ref_d_h, paddle.float32, "d_hidden with a 90-nat token")
    assert_close_to_scale(d_w, ref_d_w, paddle.float32, "d_weight with a 90-nat token")


def test_upstream_gradient_scales_both_gradients():
    h, w, labels = make_inputs(20, 16, 1000)
    loss, d_h, d_w = fused_loss_and_grads(h, w, labels)
    d_h, d_w = d_h.numpy().copy(), d_w.numpy().copy()
    h.clear_gradient()
    w.clear_gradient()
    (ops.linear_cross_entropy(h, w, labels) * 2.5).backward()
    np.testing.assert_allclose(h.grad.numpy(), 2.5 * d_h, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), 2.5 * d_w, rtol=1e-6)


def test_frozen_inputs_get_no_gradient_and_no_graph_without_grad():
    h, w, labels = make_inputs(20, 16, 1000)
    ref_loss, ref_d_h, ref_d_w = paddlenlp_loss_and_grads(h, w, labels)
    w.stop_gradient = True
    loss = ops.linear_cross_entropy(h, w, labels, chunk_tokens=6)
    loss.backward()
    assert w.grad is None
    assert_close_to_scale(h.grad, ref_d_h, paddle.float32, "d_hidden, frozen weight")
    w.stop_gradient, h.stop_gradient = False, True
    ops.linear_cross_entropy(h, w, labels, chunk_tokens=6).backward()
    assert_close_to_scale(w.grad, ref_d_w, paddle.float32, "d_weight, frozen hidden")
    with paddle.no_grad():
        plain = ops.linear_cross_entropy(h, w, labels)
    assert plain.stop_gradient
    assert_close(plain, ref_loss, paddle.float32, "loss under no_grad")


def test_int32_labels_are_accepted():
    h, w, labels = make_inputs(20, 16, 1000)
    check_against_paddlenlp(h, w, labels.astype("int32"), chunk_tokens=6)


@pytest.mark.parametrize("dtype", [paddle.float32, paddle.float16, paddle.bfloat16, paddle.float64],
                         ids=["fp32", "fp16", "bf16", "fp64"])
def test_cpu_kernel_on_each_logits_dtype(dtype):
    # The op hands the CPU kernel fp32 logits (float64 for float64 inputs); the kernel itself also
    # takes fp16/bf16 logits (the CUDA path's storage), fp32 math inside.
    rng = np.random.default_rng(1)
    logits = paddle.to_tensor((rng.standard_normal((9, 1003)) * 3).astype(np.float32)).astype(dtype)
    labels_np = rng.integers(0, 1003, size=9)
    labels_np[[2, 7]] = IGNORE
    labels = paddle.to_tensor(labels_np)
    x = logits.astype("float64").numpy()
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    valid = labels_np != IGNORE
    ref_loss = np.where(valid, lse - x[np.arange(9), np.where(valid, labels_np, 0)], 0.0)
    ref_grad = np.exp(x - lse[:, None])
    ref_grad[np.arange(9)[valid], labels_np[valid]] -= 1.0
    ref_grad *= 0.25 * valid[:, None]
    grad = logits.clone()
    loss = BACKEND.cross_entropy(grad, labels, IGNORE, 0.25, True, None)
    assert_close(loss, ref_loss, paddle.float32, f"kernel loss on {dtype} logits")
    assert_close_to_scale(grad, ref_grad, dtype, f"kernel gradient on {dtype} logits")
    unchanged = logits.clone()
    BACKEND.cross_entropy(unchanged, labels, IGNORE, 0.25, False, None)
    np.testing.assert_array_equal(unchanged.astype("float64").numpy(), x)  # loss only: untouched


def test_float64_inputs_accumulate_in_float64():
    h, w, labels = make_inputs(21, 16, 500, dtype="float64")
    loss, d_h, d_w = fused_loss_and_grads(h, w, labels, chunk_tokens=5)
    h_ref, w_ref = h.detach(), w.detach()
    h_ref.stop_gradient = w_ref.stop_gradient = False
    ref = ops.linear_cross_entropy_ref(h_ref, w_ref, labels)
    ref.backward()
    assert d_h.dtype == paddle.float64 and d_w.dtype == paddle.float64
    assert_close(loss, ref, paddle.float32, "float64 loss (fp32 per-token losses)")
    assert_close_to_scale(d_h, h_ref.grad, paddle.float64, "float64 d_hidden")
    assert_close_to_scale(d_w, w_ref.grad, paddle.float64, "float64 d_weight")


def test_default_chunk_bounds_the_fp32_logits():
    assert core_lce.default_chunk_tokens(32000, on_gpu=False) * 32000 * 4 <= core_lce.CPU_CHUNK_BYTES
    assert core_lce.default_chunk_tokens(128256, on_gpu=True) * 128256 * 4 <= core_lce.GPU_CHUNK_BYTES
    assert core_lce.default_chunk_tokens(10**9, on_gpu=False) == 1
    # a frozen head (LoRA) on a GPU: a smaller budget, the logits being its only per-chunk cost
    frozen = core_lce.default_chunk_tokens(128256, on_gpu=True, weight_trainable=False)
    assert frozen * 128256 * 4 <= core_lce.GPU_FROZEN_HEAD_CHUNK_BYTES < core_lce.GPU_CHUNK_BYTES
    assert frozen == 261 and core_lce.default_chunk_tokens(32000, on_gpu=True, weight_trainable=False) == 1048
    assert core_lce.default_chunk_tokens(32000, on_gpu=False, weight_trainable=False) == \
        core_lce.default_chunk_tokens(32000, on_gpu=False)  # the CPU budget is already small


@pytest.mark.parametrize("frozen", [False, True], ids=["trained_head", "frozen_head"])
def test_the_op_picks_the_chunk_by_whether_the_head_trains(frozen, monkeypatch):
    """The Paddle op asks for its default chunk by whether the head trains (weight.stop_gradient);
    on this CPU both answers are the CPU budget, on a GPU a frozen head gets the smaller one."""
    asked = []
    real = core_lce.default_chunk_tokens

    def recorded(vocab, on_gpu, weight_trainable=True):
        asked.append(weight_trainable)
        return real(vocab, on_gpu, weight_trainable)

    monkeypatch.setattr(core_lce, "default_chunk_tokens", recorded)
    h, w, labels = make_inputs(37, 24, 1000)
    w.stop_gradient = frozen
    ops.linear_cross_entropy(h, w, labels)
    assert asked == [not frozen]


def test_reference_matches_paddlenlp_criterion():
    h, w, labels = make_inputs(37, 24, 1000)
    ref_loss, _, _ = paddlenlp_loss_and_grads(h, w, labels)
    assert_close(ops.linear_cross_entropy_ref(h, w, labels), ref_loss, paddle.float32, "reference")


# --- bad input ---------------------------------------------------------------------------------

def test_rejects_a_weight_that_does_not_fit_hidden():
    h, w, labels = make_inputs(5, 16, 100)
    with pytest.raises(ValueError, match=r"`weight` must be \[H, V\].*H = hidden.shape\[-1\] = 16.*transpose_weight=True"):
        ops.linear_cross_entropy(h, w.T, labels)
    with pytest.raises(ValueError, match=r"`weight` must be \[V, H\]"):
        ops.linear_cross_entropy(h, w, labels, transpose_weight=True)
    with pytest.raises(ValueError, match="`weight` must be"):
        ops.linear_cross_entropy(h, w.reshape([-1]), labels)


def test_rejects_mismatched_dtypes_and_devices():
    h, w, labels = make_inputs(5, 16, 100)
    with pytest.raises(TypeError, match="`weight` must have the dtype of `hidden`"):
        ops.linear_cross_entropy(h, w.astype("bfloat16"), labels)
    with pytest.raises(TypeError, match="`hidden` must be float32, float16, bfloat16 or float64"):
        ops.linear_cross_entropy(labels, w, labels)
    with pytest.raises(TypeError, match="`hidden` must be a paddle.Tensor"):
        ops.linear_cross_entropy(h.numpy(), w, labels)


def test_rejects_bad_labels():
    h, w, labels = make_inputs(5, 16, 100)
    with pytest.raises(TypeError, match="`labels` must be int64"):
        ops.linear_cross_entropy(h, w, labels.astype("float32"))
    with pytest.raises(ValueError, match=r"`labels` must be \[5\]"):
        ops.linear_cross_entropy(h, w, labels[:4])
    with pytest.raises(ValueError, match=r"`labels` must be \[3, 2\]"):
        ops.linear_cross_entropy(make_inputs(6, 16, 100, batch=3)[0], w, labels)


@pytest.mark.parametrize("bad", [100, -1, -101, 10**12])
def test_labels_outside_the_vocabulary_raise_naming_the_label(bad):
    h, w, labels = make_inputs(9, 16, 100)
    labels_np = labels.numpy()
    labels_np[6] = bad
    # The C layer's message (fastffn_last_error), which checks every label before writing.
    with pytest.raises(ValueError, match=rf"labels holds {bad} \(row \d+ of this call\), outside the "
                                         rf"vocabulary \[0, 100\) and not ignore_index \(-100\)"):
        ops.linear_cross_entropy(h, w, paddle.to_tensor(labels_np), chunk_tokens=4)


def test_custom_ignore_index():
    h, w, labels = make_inputs(12, 16, 100, ignored=0.0)
    labels_np = labels.numpy()
    labels_np[[2, 5]] = -1
    labels = paddle.to_tensor(labels_np)
    with pytest.raises(ValueError, match=r"holds -1.*ignore_index \(-100\)"):
        ops.linear_cross_entropy(h, w, labels)
    loss = ops.linear_cross_entropy(h, w, labels, ignore_index=-1)
    kept = paddle.to_tensor(labels_np != -1)
    ref = ops.linear_cross_entropy_ref(h[kept], w, labels[kept])
    assert_close(loss, ref, paddle.float32, "loss with ignore_index=-1")


def test_rejects_a_bad_chunk_size():
    h, w, labels = make_inputs(5, 16, 100)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="`chunk_tokens` must be a positive int or None"):
            ops.linear_cross_entropy(h, w, labels, chunk_tokens=bad)


def test_the_label_error_flag_must_be_one_int32_where_the_logits_are():
    logits = paddle.randn([4, 10])
    labels = paddle.to_tensor([1, 2, 3, 4], dtype="int64")
    for bad in (paddle.zeros([1], dtype="float32"), paddle.zeros([2], dtype="int32")):
        with pytest.raises(ValueError, match=r"argument `label_error` must be one int32"):
            BACKEND.cross_entropy(logits.clone(), labels, IGNORE, 1.0, True, bad)


@pytest.mark.parametrize("needs_grad", [False, True], ids=["loss_only", "with_grad"])
def test_a_nan_row_stays_out_of_the_mean_as_paddlenlps_selection_drops_it(needs_grad):
    """The mean over kept tokens is a masked sum over a count (no synchronising boolean index): a
    token whose loss is NaN must still be dropped, as `loss[loss > 0]` drops it."""
    h, w, labels = make_inputs(10, 16, 50, ignored=0.0)
    h_np = h.numpy()
    h_np[3, 0] = np.nan
    h = paddle.to_tensor(h_np)
    h.stop_gradient = not needs_grad
    loss = ops.linear_cross_entropy(h, w, labels, chunk_tokens=4)
    ref = ops.linear_cross_entropy_ref(h.detach(), w.detach(), labels)
    assert math.isfinite(float(loss)) and math.isfinite(float(ref))
    assert_close(loss, ref, paddle.float32, "loss with one NaN row")
