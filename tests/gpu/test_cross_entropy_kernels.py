"""The fused cross-entropy CUDA kernel and the chunked linear cross-entropy of the harness (the
Paddle op's composition) against torch's cross_entropy in float64. Loss buffers and d_hidden are
poisoned with NaN before each run (c_api.POISON_OUTPUTS), and the kernel rewrites the logits in
place, so an element it skips keeps a logit and fails the comparison with the gradient."""

import math

import pytest
import torch
import torch.nn.functional as F

from paddle_fastffn.torch import ops

from gpu_checks import DTYPES, IDS, close

IGNORE = -100


def close_to_scale(actual, expected, dtype, what):
    """As tests/tolerances.py's assert_close_to_scale: gradients of a mean loss relative to their
    largest reference entry."""
    scale = expected.abs().max().item() or 1.0
    close(actual.double() / scale, expected.double() / scale, dtype, f"{what} (relative to {scale:.3g})")


def labels_for(rows, vocab, ignored=0.25):
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[torch.rand(rows, device="cuda") < ignored] = IGNORE
    return labels


def reference_rows(logits, labels, grad_scale):
    """float64 per-row loss and the gradient the kernel writes."""
    x = logits.double()
    valid = labels != IGNORE
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    loss = torch.where(valid, torch.logsumexp(x, 1) - x.gather(1, safe[:, None])[:, 0], torch.zeros_like(x[:, 0]))
    grad = torch.softmax(x, 1)
    grad[torch.arange(len(labels), device="cuda"), safe] -= 1.0
    grad = grad * grad_scale * (valid & (loss > 0))[:, None]
    return loss, grad


# (rows, vocab): one row, odd rows, LLaMA-2's and LLaMA-3's vocabularies, widths that are not a
# multiple of the 16-byte vector (the tail loop; fp32 1001 is not 16-byte aligned per row: the
# scalar kernel).
KERNEL_SHAPES = [(1, 1000), (37, 1000), (5, 32000), (3, 128256), (7, 1001), (4, 32003), (130, 4096)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,vocab", KERNEL_SHAPES, ids=str)
def test_kernel_loss_and_gradient_match_float64(rows, vocab, dtype):
    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
    labels = labels_for(rows, vocab, ignored=0.0 if rows == 1 else 0.25)
    scale = 1.0 / max(int((labels != IGNORE).sum()), 1)
    ref_loss, ref_grad = reference_rows(logits, labels, scale)
    grad = logits.clone()
    loss = ops.cross_entropy(grad, labels, IGNORE, scale)
    close(loss, ref_loss, torch.float32, "loss")  # fp32 math on the stored logits
    close_to_scale(grad, ref_grad, dtype, "gradient")


def test_kernel_without_gradient_leaves_the_logits_and_gives_the_same_loss():
    logits = (torch.randn(9, 32000, device="cuda") * 3).to(torch.bfloat16)
    labels = labels_for(9, 32000)
    kept = logits.clone()
    loss = ops.cross_entropy(kept, labels, IGNORE, 1.0, with_grad=False)
    assert torch.equal(kept, logits)
    close(loss, reference_rows(logits, labels, 1.0)[0], torch.float32, "loss only")


def test_kernel_strided_rows_leave_the_gap_alone():
    base = (torch.randn(6, 1024, device="cuda") * 2).to(torch.bfloat16)
    logits = base[:, :1001]  # row stride 1024 elements: the vector path, and a one-element tail
    before = base[:, 1001:].clone()
    labels = labels_for(6, 1001)
    ref_loss, ref_grad = reference_rows(logits, labels, 0.5)
    loss = ops.cross_entropy(logits, labels, IGNORE, 0.5)
    close(loss, ref_loss, torch.float32, "strided loss")
    close_to_scale(logits, ref_grad, torch.bfloat16, "strided gradient")
    assert torch.equal(base[:, 1001:], before)


def test_kernel_ignored_rows_and_extreme_logits():
    logits = torch.randn(5, 2000, device="cuda") * 3
    logits[1, 7] = 200.0  # label 7: loss exactly 0 in fp32, dropped (PaddleNLP keeps loss > 0)
    logits[2, :] = -float("inf")
    logits[2, 3] = 0.0  # one finite logit: softmax is onehot, loss 0 for label 3
    logits[3, 11] = 90.0  # label elsewhere: a 90-nat loss, exact (no -64 clip as Paddle's CPU softmax)
    labels = torch.tensor([IGNORE, 7, 3, 5, 9], device="cuda")
    grad = logits.clone()
    loss = ops.cross_entropy(grad, labels, IGNORE, 1.0)
    ref_loss, ref_grad = reference_rows(logits, labels, 1.0)
    assert loss[0] == 0 and loss[1] == 0 and loss[2] == 0
    close(loss, ref_loss, torch.float32, "extreme rows loss")
    assert not grad[:3].any()
    close_to_scale(grad[3:], ref_grad[3:], torch.float32, "extreme rows gradient")


def test_kernel_labels_outside_the_vocabulary_raise():
    for bad in (1000, -1, -101):
        labels = torch.tensor([1, bad, IGNORE], device="cuda")
        with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 1000\)"):
            ops.cross_entropy(torch.randn(3, 1000, device="cuda"), labels)


# --- the chunked composition -------------------------------------------------------------------

def reference_loss(hidden, weight, labels, transpose_weight):
    """PaddleNLP's LM head and criterion in float64 (mean of the per-token losses that are > 0),
    with the logits rounded to the inputs' dtype as the stock LM head stores them (its cast to
    fp32 in the criterion passes the gradient straight through). Without that rounding the
    reference would differ from any 16-bit LM head: fp16 logits of |x| ~ 10 are 2^-7 apart, which
    moves softmax probabilities by ~0.4% (measured on the H200: 1e-3 of the largest d_hidden)."""
    h = hidden.double().detach().requires_grad_()
    w = weight.double().detach().requires_grad_()
    logits = h @ (w.t() if transpose_weight else w)
    logits = logits + (logits.to(hidden.dtype).double() - logits).detach()
    rows = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
    loss = rows[rows > 0].mean()
    loss.backward()
    return loss, h.grad, w.grad


# (tokens, hidden, vocab, chunk): chunks that do not divide T, one token, LLaMA-3's vocabulary
# with the default chunk (2093 tokens: two chunks).
CHUNKED_SHAPES = [(37, 64, 1000, 8), (1, 64, 1000, None), (300, 128, 32000, 128), (2500, 128, 128256, None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("transpose_weight", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize("tokens,width,vocab,chunk", CHUNKED_SHAPES, ids=str)
def test_chunked_linear_cross_entropy_matches_float64(tokens, width, vocab, chunk, transpose_weight, dtype):
    hidden = torch.randn(tokens, width, device="cuda").to(dtype).requires_grad_()
    w_shape = (vocab, width) if transpose_weight else (width, vocab)
    weight = (torch.randn(w_shape, device="cuda") * 3 / math.sqrt(width)).to(dtype).requires_grad_()
    labels = labels_for(tokens, vocab, ignored=0.0 if tokens == 1 else 0.25)
    loss = ops.linear_cross_entropy(hidden, weight, labels, IGNORE, transpose_weight, chunk)
    loss.backward()
    ref_loss, ref_d_h, ref_d_w = reference_loss(hidden, weight, labels, transpose_weight)
    # The reference rounds the logits as the GEMM stores them; a logit whose fp32 accumulation
    # rounds the other way (one ulp of the dtype) moves its token's loss by at most that ulp.
    close(loss, ref_loss, dtype, "loss")
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    close_to_scale(hidden.grad, ref_d_h, dtype, "d_hidden")
    close_to_scale(weight.grad, ref_d_w, dtype, "d_weight")


def test_chunked_all_ignored_is_nan_with_zero_gradients():
    hidden = torch.randn(10, 32, device="cuda").requires_grad_()
    weight = torch.randn(32, 500, device="cuda").requires_grad_()
    labels = torch.full((10,), IGNORE, device="cuda")
    loss = ops.linear_cross_entropy(hidden, weight, labels, chunk_tokens=3)
    loss.backward()
    assert math.isnan(loss.item())
    assert not hidden.grad.any() and not weight.grad.any()


def test_chunked_upstream_gradient_and_bad_labels():
    hidden = torch.randn(20, 32, device="cuda").requires_grad_()
    weight = torch.randn(32, 500, device="cuda").requires_grad_()
    labels = labels_for(20, 500)
    (ops.linear_cross_entropy(hidden, weight, labels, chunk_tokens=6) * 3.0).backward()
    _, ref_d_h, ref_d_w = reference_loss(hidden, weight, labels, False)
    close_to_scale(hidden.grad, 3.0 * ref_d_h, torch.float32, "3 * d_hidden")
    close_to_scale(weight.grad, 3.0 * ref_d_w, torch.float32, "3 * d_weight")
    labels[4] = 500
    # Flagged on the device, raised by backward's one readback (no synchronisation per chunk) ...
    loss = ops.linear_cross_entropy(hidden, weight, labels, chunk_tokens=6)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        loss.backward()
    # ... or by the forward itself when no backward will come.
    with torch.no_grad(), pytest.raises(ValueError, match="outside the vocabulary"):
        ops.linear_cross_entropy(hidden, weight, labels, chunk_tokens=6)


def test_chunked_nan_row_stays_out_of_the_mean():
    """The masked sum over a count drops a token whose loss is NaN, as PaddleNLP's loss[loss > 0]."""
    hidden = torch.randn(12, 32, device="cuda")
    hidden[5, 0] = math.nan
    weight = torch.randn(32, 500, device="cuda") / math.sqrt(32)
    labels = labels_for(12, 500, ignored=0.0)
    loss = ops.linear_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    ref_loss, _, _ = reference_loss(hidden, weight, labels, False)
    assert math.isfinite(loss.item())
    close(loss, ref_loss, torch.float32, "loss with one NaN row")
