"""The FP8 LM head (ops.linear_cross_entropy with fp8_recipe: core/fp8/lm_head.py over the emulated
backend) against an independent float64 reference of the same quantisation (Paddle's own fp32 -> FP8
casts; h and W scaled by their own amax over the call, d_logits by its bound 1 / n), and against the unquantised
head within the FP8 budget of tests/tolerances.py; its argument errors; the recipe and option that
turn it on."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from paddle_fastffn import ops
from paddle_fastffn.core.fp8.lm_head import chunk_rows
from paddle_fastffn.fp8 import FP8_DTYPES, FP8_MAX, Fp8Recipe
from tolerances import FP8_HEAD_REFERENCE_RTOL, FP8_HEAD_VS_FP32_RTOL, assert_relative_norm_within

IGNORE = -100


def fp8_round(x: np.ndarray, fmt: str, bound: float | None = None) -> np.ndarray:
    """x quantised with its own amax (current scaling) or, given, a bound on |x| (the head's
    d_logits: the scale fmt_max / bound), and dequantised, in float64: Paddle's fp32 -> FP8 cast
    (round to nearest even) of x * scale clipped to the format's max, divided by the scale."""
    x32 = x.astype(np.float32)
    if bound is not None:
        scale = np.float32(FP8_MAX[fmt] / bound)
        q = paddle.to_tensor(np.clip(x32 * scale, -FP8_MAX[fmt], FP8_MAX[fmt])).astype(FP8_DTYPES[fmt])
        return q.astype(paddle.float32).numpy().astype(np.float64) / np.float64(scale)
    amax = float(np.abs(x32).max())
    scale = np.float32(FP8_MAX[fmt]) / np.float32(amax) if amax > 0 else np.float32(1.0)
    scaled = np.clip(x32 * scale, -FP8_MAX[fmt], FP8_MAX[fmt])
    q = paddle.to_tensor(scaled).astype(FP8_DTYPES[fmt]).astype(paddle.float32).numpy()
    return q.astype(np.float64) / np.float64(scale)


def reference(hidden, weight, labels, chunk_tokens, transpose_weight, quantized=True):
    """(loss, d_hidden, d_weight) in float64: the labelled rows in chunks of chunk_rows(chunk_tokens),
    h rounded by the amax of every labelled row (e4m3), d_logits per chunk under the bound 1 / n
    (e5m2), W once (e4m3): core/fp8/lm_head.py's scales; quantized False: the plain head."""
    h_all = hidden.astype(np.float64)
    w = weight.astype(np.float64).T if transpose_weight else weight.astype(np.float64)  # [H, V]
    keep = np.nonzero(labels != IGNORE)[0]
    n = len(keep)
    wq = fp8_round(w, "e4m3") if quantized else w
    if quantized and n:
        h_all = h_all.copy()
        h_all[keep] = fp8_round(h_all[keep], "e4m3")
    d_hidden, d_w, losses = np.zeros_like(h_all), np.zeros_like(w), []
    step = chunk_rows(chunk_tokens)
    for start in range(0, n, step):
        rows = keep[start:start + step]
        h = h_all[rows]
        logits = h @ wq
        top = logits.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        target = labels[rows]
        losses.append(lse - logits[np.arange(len(rows)), target])
        d_logits = np.exp(logits - lse[:, None])
        d_logits[np.arange(len(rows)), target] -= 1.0
        d_logits /= n
        dlq = fp8_round(d_logits, "e5m2", bound=1.0 / n) if quantized else d_logits
        d_hidden[rows] = dlq @ wq.T
        d_w += h.T @ dlq
    loss_rows = np.concatenate(losses)
    return loss_rows[loss_rows > 0].mean(), d_hidden, d_w.T if transpose_weight else d_w


def make_case(tokens, width, vocab, transpose_weight, ignored, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((tokens, width)).astype(np.float32)
    shape = (vocab, width) if transpose_weight else (width, vocab)
    weight = (rng.standard_normal(shape) / math.sqrt(width) * 2.0).astype(np.float32)
    labels = rng.integers(0, vocab, tokens)
    labels[rng.permutation(tokens)[:ignored]] = IGNORE
    h = paddle.to_tensor(hidden).astype(dtype)
    w = paddle.to_tensor(weight).astype(dtype)
    # The reference reads what the op reads: the inputs after their cast to `dtype`.
    return h, w, paddle.to_tensor(labels), h.astype("float32").numpy(), w.astype("float32").numpy(), labels


def run(h, w, labels, chunk_tokens, transpose_weight, recipe=None, grads=(True, True)):
    h, w = h.detach(), w.detach()
    h.stop_gradient, w.stop_gradient = not grads[0], not grads[1]
    loss = ops.linear_cross_entropy(h, w, labels, ignore_index=IGNORE, transpose_weight=transpose_weight,
                                    chunk_tokens=chunk_tokens, fp8_recipe=recipe or Fp8Recipe(lm_head="fp8"))
    if any(grads):
        loss.backward()
    return loss, h.grad, w.grad


# (tokens, H, V, chunk_tokens, ignored): one chunk; several chunks with a padded last one (37 labelled
# rows in chunks of 16); a chunk length that is not a multiple of 16 (rounded down to 32); every
# token labelled with a token count not a multiple of 16.
CASES = [(48, 32, 64, 4096, 5), (45, 64, 96, 16, 8), (70, 48, 80, 40, 0), (29, 16, 32, 4096, 0)]


@pytest.mark.parametrize("transpose_weight", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize("tokens, width, vocab, chunk, ignored", CASES, ids=str)
def test_matches_reference_of_the_same_quantisation(tokens, width, vocab, chunk, ignored, transpose_weight):
    h, w, labels, hidden, weight, labels_np = make_case(tokens, width, vocab, transpose_weight, ignored)
    loss, d_hidden, d_weight = run(h, w, labels, chunk, transpose_weight)
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels_np, chunk, transpose_weight)
    assert abs(float(loss) - ref_loss) <= FP8_HEAD_REFERENCE_RTOL * abs(ref_loss)
    assert d_hidden.shape == h.shape and d_weight.shape == w.shape
    assert_relative_norm_within(d_hidden, ref_dh, FP8_HEAD_REFERENCE_RTOL, "d_hidden")
    assert_relative_norm_within(d_weight, ref_dw, FP8_HEAD_REFERENCE_RTOL, "d_weight")
    assert np.all(d_hidden.numpy()[labels_np == IGNORE] == 0), "an ignored row got a gradient"


@pytest.mark.parametrize("transpose_weight", [False, True], ids=["head", "tied"])
def test_within_the_fp8_budget_of_the_unquantised_head(transpose_weight):
    h, w, labels, hidden, weight, labels_np = make_case(256, 64, 128, transpose_weight, 30, seed=3)
    loss, d_hidden, d_weight = run(h, w, labels, 64, transpose_weight)
    exact_loss, exact_dh, exact_dw = reference(hidden, weight, labels_np, 64, transpose_weight, quantized=False)
    assert abs(float(loss) - exact_loss) <= FP8_HEAD_VS_FP32_RTOL * abs(exact_loss)
    assert_relative_norm_within(d_hidden, exact_dh, FP8_HEAD_VS_FP32_RTOL, "d_hidden")
    assert_relative_norm_within(d_weight, exact_dw, FP8_HEAD_VS_FP32_RTOL, "d_weight")
    # FP8 did run: the quantised head is not the fp32 head's result.
    assert np.linalg.norm(d_weight.numpy() - exact_dw) > 1e-4 * np.linalg.norm(exact_dw)


def test_bfloat16_inputs_keep_their_dtypes():
    h, w, labels, hidden, weight, labels_np = make_case(40, 32, 48, False, 4, dtype="bfloat16")
    loss, d_hidden, d_weight = run(h, w, labels, 4096, False)
    assert loss.dtype == paddle.float32 and d_hidden.dtype == paddle.bfloat16 and d_weight.dtype == paddle.bfloat16
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels_np, 4096, False)
    assert abs(float(loss) - ref_loss) <= FP8_HEAD_REFERENCE_RTOL * abs(ref_loss)
    # the gradients' only further error: their rounding to bfloat16 (half an ulp, 2^-9 relative)
    assert_relative_norm_within(d_hidden, ref_dh, FP8_HEAD_REFERENCE_RTOL + 2.0**-9, "d_hidden")
    assert_relative_norm_within(d_weight, ref_dw, FP8_HEAD_REFERENCE_RTOL + 2.0**-9, "d_weight")


@pytest.mark.parametrize("grads", [(True, False), (False, True), (False, False)],
                         ids=["frozen_head", "frozen_hidden", "no_grad"])
def test_only_the_gradients_asked_for(grads):
    """A frozen head (LoRA) gets d_hidden alone; the loss is the same whichever gradients run."""
    h, w, labels, hidden, weight, labels_np = make_case(45, 64, 96, False, 8)
    loss, d_hidden, d_weight = run(h, w, labels, 16, False, grads=grads)
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, labels_np, 16, False)
    assert abs(float(loss) - ref_loss) <= FP8_HEAD_REFERENCE_RTOL * abs(ref_loss)
    assert (d_hidden is not None) == grads[0] and (d_weight is not None) == grads[1]
    if grads[0]:
        assert_relative_norm_within(d_hidden, ref_dh, FP8_HEAD_REFERENCE_RTOL, "d_hidden")
    if grads[1]:
        assert_relative_norm_within(d_weight, ref_dw, FP8_HEAD_REFERENCE_RTOL, "d_weight")


def test_every_label_ignored_gives_the_stock_nan_and_zero_gradients():
    h, w, labels, *_ = make_case(20, 16, 32, False, 20)
    loss, d_hidden, d_weight = run(h, w, labels, 4096, False)
    assert math.isnan(float(loss))
    assert not d_hidden.numpy().any() and not d_weight.numpy().any()


def test_arguments_fp8_cannot_take_are_named():
    h, w, labels, *_ = make_case(32, 32, 48, False, 0)
    with pytest.raises(ValueError, match=r"`hidden` and `weight` cannot run the FP8 LM head \(fp8_recipe\): the hidden "
                                         r"states are paddle.float16, not bfloat16 or float32"):
        run(h.astype("float16"), w.astype("float16"), labels, 4096, False)
    h, w, labels, *_ = make_case(32, 32, 40, False, 0)
    with pytest.raises(ValueError, match=r"FP8 LM head \(fp8_recipe\): hidden size 32 or vocabulary 40 is not a "
                                         r"multiple of 16"):
        run(h, w, labels, 4096, False)


def test_recipe_field_is_checked():
    assert Fp8Recipe().lm_head == "bf16"
    with pytest.raises(ValueError, match=r"Fp8Recipe.lm_head must be one of \['bf16', 'fp8'\], got 'e4m3'"):
        Fp8Recipe(lm_head="e4m3")
    states = Fp8Recipe(scaling="delayed", lm_head="fp8").lm_head_states()
    assert {s.mode for s in (states.input, states.weight, states.grad_output)} == {"current"}
    assert (states.input.fmt, states.grad_output.fmt) == ("e4m3", "e5m2")


def test_option_names_itself():
    from paddle_fastffn.integration.options import FastFFNOptions, OptionError

    assert FastFFNOptions(fp8_lm_head="fp8").fp8_recipe().lm_head == "fp8"
    with pytest.raises(OptionError, match="fp8_lm_head"):
        FastFFNOptions(fp8_lm_head="fp16")
    with pytest.raises(OptionError, match="fp8_lm_head must be \"bf16\" where fused_cross_entropy is off"):
        FastFFNOptions(fp8_lm_head="fp8", fused_cross_entropy=False)


def test_threads_each_get_their_own_scaling_states():
    """The head's states are reused between calls (current scaling keeps nothing), per thread: a
    call writes its scales between computing and using them, so two threads never share them."""
    import threading

    cases = [make_case(64 + 16 * i, 32, 48, False, 3, seed=i) for i in range(2)]
    alone = [float(run(h, w, labels, 32, False)[0]) for h, w, labels, *_ in cases]
    results, barrier = {}, threading.Barrier(2)

    def worker(i):
        h, w, labels, *_ = cases[i]
        barrier.wait()
        results[i] = [float(run(h, w, labels, 32, False)[0]) for _ in range(20)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert results[i] == [alone[i]] * 20, (i, alone[i], results[i])


@pytest.mark.parametrize("axis", [0, 1], ids=["emulated_rows", "cuda_transposed_columns"])
def test_row_blocks_join_in_row_order_and_refuse_a_gap(axis):
    """RowBlocks (the Paddle backends' transposed_rows storage): FP8 blocks added in any order come
    back concatenated in row order along their row axis (0: the emulated copies [r, C]; 1: the CUDA
    backend's transposed copies [C, r]); blocks that leave a gap or miss rows are an error."""
    from paddle_fastffn.fp8.emulated import RowBlocks

    def block(first, rows):
        values = np.arange(first, first + rows, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
        data = paddle.to_tensor(values if axis == 0 else values.T).astype(FP8_DTYPES["e4m3"])
        return first, data

    storage = RowBlocks(7)
    for first, rows in ((4, 3), (0, 4)):
        storage.add(*block(first, rows))
    joined = storage.joined(axis).astype(paddle.float32).numpy()
    rows_first = joined if axis == 0 else joined.T
    assert np.array_equal(rows_first[:, 0], np.arange(7, dtype=np.float32))
    gap = RowBlocks(7)
    gap.add(*block(0, 3))
    gap.add(*block(4, 3))
    with pytest.raises(ValueError, match="a block starts at row 4, expected 3"):
        gap.joined(axis)
    short = RowBlocks(7)
    short.add(*block(0, 4))
    with pytest.raises(ValueError, match="the blocks hold 4 rows of 7"):
        short.joined(axis)
