"""Fused linear cross-entropy: the LM head GEMM and PaddleNLP's causal-LM loss, in chunks of tokens.

``linear_cross_entropy(hidden, weight, labels)`` is ``LlamaPretrainingCriterion(LlamaLMHead(hidden),
labels)`` (tensor_parallel_degree 1) without the logits of the whole batch. Per chunk of tokens
the logits ``hidden_chunk @ weight`` are computed, one kernel pass per row finds the max, the
log-sum-exp and the row's loss and writes the gradient of the mean loss over the logits, and the
two gradient GEMMs run at once (Liger's approach): ``d_hidden_chunk = d_logits @ weight^T`` and
``d_weight += hidden_chunk^T @ d_logits`` (the sum over chunks in fp32), kept until backward
scales them by the upstream gradient. Only one ``[chunk, vocab]`` logits buffer exists at a time.

Stack: compiled op call -> autograd (PyLayer) -> public ``linear_cross_entropy`` ->
``linear_cross_entropy_ref``.

The GEMMs are ``paddle.matmul``: on CPU in fp32 (Paddle CPU has no half-precision matmul), on GPU
in the inputs' dtype with fp32 accumulation inside cuBLAS, as the stock LM head computes them. The
GPU path of this file cannot run here (no Paddle GPU build reaches sm_90); its composition is the
one benchmarks/gpu/harness.py runs on the H200. Routing the GPU GEMMs through the project's
cuBLASLt provider (fastffn_gemm_cuda: fp32 output with accumulation, so d_weight would not round
each chunk's contribution to bf16 first) is left for when the Paddle GPU bindings call it.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from ..core.rotary import POSITION_CHECK
from . import _checks
from ._fallback import warn_fallback
from ._loader import run_op

OP = "paddle_fastffn.ops.linear_cross_entropy"

# Budget of one chunk's logits counted in fp32, chunk_tokens * vocab * 4 bytes, when chunk_tokens
# is None.
# GPU: 1 GiB (2093 tokens at LLaMA-3's 128256 vocabulary). From a one-off probe through the harness
# on the H200, not yet a committed benchmark (2026-12-02; bf16, T=8192, H=4096, V=128256,
# forward+backward, median of 7; re-measure with a committed benchmark before relying on it): 523-token
# chunks (256 MiB) 55.1 ms, 1024 46.1 ms, 2048 44.0 ms, 4096 42.3 ms, torch eager 47.6 ms; each
# chunk re-reads and re-writes the fp32 d_weight, so small chunks cost bandwidth. The peak (3.12
# GiB above the inputs at every chunk size, eager 11.7 GiB) is set by the fp32 d_weight (2 GiB)
# and the returned bf16 weight gradient, not by chunks up to half of d_weight's size.
GPU_CHUNK_BYTES = 1 << 30
# CPU: 32 MiB (256 tokens at a 32000 vocabulary). On the 2-core dev machine (T=2048, V=32000,
# H=256, fp32, forward+backward, p50 of two runs each): 64-token chunks 2.85-2.91 s and 41 MiB of
# peak allocations, 256 2.53-2.63 s and 65 MiB, 1024 2.54-2.58 s and 160 MiB (stock: 2.6-2.8 s,
# 500 MiB): below ~256 tokens the GEMMs slow down, above it only the memory grows.
CPU_CHUNK_BYTES = 32 << 20


def default_chunk_tokens(vocab: int, on_gpu: bool) -> int:
    budget = GPU_CHUNK_BYTES if on_gpu else CPU_CHUNK_BYTES
    return max(1, budget // (4 * max(int(vocab), 1)))


def _cross_entropy_chunk(logits, labels, ignore_index: int, grad_scale: float, with_grad: bool,
                         label_error=None):
    """The fused kernel on one chunk: returns fp32 [rows] losses; with_grad, `logits` now holds
    (softmax - onehot) * grad_scale (0 on rows the mean drops). `label_error` (a zeroed int32 [1]):
    on GPU a label outside the vocabulary is flagged there for the caller to read once; without
    it, and always on CPU, it raises here."""
    loss = paddle.empty([logits.shape[0]], dtype=paddle.float32)
    try:
        run_op("fastffn_cross_entropy", logits, labels, loss, label_error, int(ignore_index),
               float(grad_scale), bool(with_grad))
    except OSError as error:  # the binding's PD_CHECK / PD_THROW; its first line names the argument
        raise ValueError(str(error).strip().splitlines()[0]) from None
    return loss


class _PendingReadback:
    """What the loss leaves on the device for one later read: the count of tokens PaddleNLP's mean
    keeps (loss > 0) and the kernel's out-of-vocabulary flag. Backward reads them with the upstream
    gradient in one copy to the host; without a backward the forward reads them itself. Either way
    a step synchronises twice (the label count in the forward, this read), where it did five times
    (label count, the flag after every chunk, the mean's boolean mask, the kept count, d_loss)."""

    def __init__(self, n_labelled: int, n_kept, label_error, vocab: int, ignore_index: int,
                 float64: bool):
        self.n_labelled, self.n_kept, self.label_error = n_labelled, n_kept, label_error
        self.vocab, self.ignore_index, self.float64 = vocab, ignore_index, float64

    def read(self, d_loss=None) -> float:
        """Raises for a flagged label; returns d_loss * factor, where factor (n_labelled / n_kept, 1
        almost always) turns the mean over the labelled tokens the gradients were computed for
        into PaddleNLP's mean over the tokens whose loss is > 0 (float64: the gradients are
        unscaled sums and the factor is 1 / n_kept)."""
        parts = [self.n_kept.astype(paddle.float64).reshape([1]),
                 self.label_error.astype(paddle.float64).reshape([1])]
        if d_loss is not None:
            parts.append(d_loss.astype(paddle.float64).reshape([1]))
        # The step's rotary position flag (core/rotary.py PositionCheck) rides in the same copy.
        rotary_rows = POSITION_CHECK.table_rows
        rotary_flag = POSITION_CHECK.pending()
        if rotary_flag is not None:
            parts.append(rotary_flag.astype(paddle.float64).reshape([1]))
        values = paddle.concat(parts).numpy()  # the one copy to the host
        if rotary_flag is not None:
            POSITION_CHECK.raise_if_set(values[-1], rotary_rows)
        if values[1] != 0:
            raise ValueError(f"{OP}: argument `labels` holds a label outside the vocabulary [0, "
                             f"{self.vocab}) that is not ignore_index ({self.ignore_index})")
        n_kept = int(values[0])
        if self.float64:
            factor = 1.0 / n_kept if n_kept else 1.0
        else:
            factor = self.n_labelled / n_kept if n_kept and n_kept != self.n_labelled else 1.0
        return (float(values[2]) if d_loss is not None else 1.0) * factor


def _chunked_loss_and_grads(hidden, weight, labels, ignore_index, transpose_weight, chunk,
                            need_d_hidden, need_d_weight, n_labelled: int):
    """(loss fp32 scalar, d_hidden [T, H] or None, d_weight (fp32; with a single chunk the GEMM's
    dtype) or None, _PendingReadback), float64 throughout for float64 inputs. The gradients are
    those of the mean over the labelled tokens; the readback's factor makes them PaddleNLP's."""
    tokens = hidden.shape[0]
    on_gpu = not hidden.place.is_cpu_place()
    # Matmul dtype: fp32 on CPU (float64 stays float64, for checks); the inputs' dtype on GPU.
    if on_gpu:
        compute = hidden.dtype
    else:
        compute = paddle.float64 if hidden.dtype == paddle.float64 else paddle.float32
    w = weight if weight.dtype == compute else weight.astype(compute)
    label_error = paddle.zeros([1], dtype=paddle.int32)
    with_grad = need_d_hidden or need_d_weight
    # The kernel's scale is an fp32 attribute: float64 inputs take 1 / n in backward instead.
    grad_scale = 1.0 / n_labelled if n_labelled and compute != paddle.float64 else 1.0
    accumulate = paddle.float64 if compute == paddle.float64 else paddle.float32
    # Each chunk's d_hidden rows are one GEMM (K = V, fp32 accumulation inside), so they are stored
    # in the inputs' dtype at once; only d_weight sums over chunks and is held in fp32. (An fp32
    # [T, H] buffer cost 128 MiB at 8192 x 4096 for nothing: the GPU GEMM returns the inputs' dtype.)
    hidden_grad_dtype = paddle.float64 if compute == paddle.float64 else hidden.dtype
    d_hidden = paddle.empty([tokens, hidden.shape[1]], dtype=hidden_grad_dtype) if need_d_hidden else None
    # d_weight starts as the first chunk's product (no zero fill, no read of zeros); with more chunks
    # to come it is held in `accumulate`, with one chunk it stays in the GEMM's dtype: on GPU the
    # same bf16 values that a cast to fp32 and back would give, 2 GiB less traffic at a 128k vocab.
    d_weight = None
    single_chunk = tokens <= chunk
    losses = []
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        h = hidden[start:end]
        h = h if h.dtype == compute else h.astype(compute)
        logits = paddle.matmul(h, w, transpose_y=transpose_weight)  # [rows, V]
        losses.append(_cross_entropy_chunk(logits, labels[start:end], ignore_index, grad_scale,
                                           with_grad, label_error))
        d_logits = logits  # overwritten in place by the kernel
        if need_d_hidden:
            # d_hidden = d_logits @ W^T ([H, V] weight) or d_logits @ W (tied [V, H] weight).
            part = paddle.matmul(d_logits, w, transpose_y=not transpose_weight)
            d_hidden[start:end] = part if part.dtype == hidden_grad_dtype else part.astype(hidden_grad_dtype)
        if need_d_weight:
            # d_W += h^T @ d_logits ([H, V]) or d_logits^T @ h ([V, H]); the first chunk's product
            # is d_W. On GPU each chunk's product is rounded to the inputs' dtype before the fp32
            # sum (see the module note).
            if d_weight is not None and not transpose_weight and compute == accumulate:
                # In place, no [H, V] temporary (CPU, T=2048/V=32000/H=256 chunks of 256: 98 ms
                # per chunk against 112 ms for matmul + add_, which allocates [H, V]).
                d_weight.addmm_(h.T, d_logits)
            else:
                # Tied [V, H]: addmm_ would copy d_logits^T ([V, chunk]) and was slower.
                part = (paddle.matmul(d_logits, h, transpose_x=True) if transpose_weight
                        else paddle.matmul(h, d_logits, transpose_x=True))
                if d_weight is None:
                    d_weight = part if single_chunk or part.dtype == accumulate else part.astype(accumulate)
                else:
                    d_weight.add_(part if part.dtype == accumulate else part.astype(accumulate))
        del logits, d_logits
    if need_d_weight and d_weight is None:  # no tokens: a zero gradient
        d_weight = paddle.zeros(weight.shape, dtype=accumulate)
    loss_rows = paddle.concat(losses) if losses else paddle.zeros([0], dtype=paddle.float32)
    # PaddleNLP's reduction: the mean of the tokens whose loss is > 0 (ignored ones have 0); NaN
    # when there are none (0 / 0: every label ignored), with zero gradients. A masked sum over a
    # count on the device, because boolean indexing would synchronise; `where`, not a product with
    # the mask, so that a NaN row stays out of the sum as the selection drops it.
    kept_mask = loss_rows > 0
    n_kept = kept_mask.astype(paddle.float32).sum()
    loss = paddle.where(kept_mask, loss_rows, paddle.zeros_like(loss_rows)).sum() / n_kept
    readback = _PendingReadback(n_labelled, n_kept, label_error, weight.shape[0] if transpose_weight
                                else weight.shape[1], ignore_index, compute == paddle.float64)
    return loss, d_hidden, d_weight, readback


class _LinearCrossEntropy(PyLayer):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, transpose_weight, chunk, need_d_hidden,
                need_d_weight, n_labelled):
        loss, d_hidden, d_weight, readback = _chunked_loss_and_grads(
            hidden, weight, labels, ignore_index, transpose_weight, chunk, need_d_hidden, need_d_weight,
            n_labelled)
        ctx.grads = (d_hidden, d_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.readback = readback
        return loss

    @staticmethod
    def backward(ctx, d_loss):
        # One copy to the host per step: the upstream gradient, the kept count and the label flag
        # (a bad label raises here, before any gradient leaves the op).
        scale = ctx.readback.read(d_loss)
        grads = []
        for grad, dtype in zip(ctx.grads, ctx.dtypes):
            if grad is not None:
                if scale != 1.0:
                    grad = grad.scale_(scale)
                grad = grad if grad.dtype == dtype else grad.astype(dtype)
            grads.append(grad)
        ctx.grads = ctx.readback = None
        return grads[0], grads[1], None


def _labelled_rows(hidden2d, labels1d, ignore_index: int):
    """(hidden rows, labels, their count): the rows whose label is not ignore_index, PaddleFormers' filtered label
    loss: prompt and padding tokens never reach the LM head GEMMs (gather's backward scatters the
    labelled rows' gradient into a zero [T, H]). Finding them is the forward's one synchronisation
    (the kernel's gradient scale, 1 / labelled tokens, is a host number). With no labelled token
    the rows stay as they are: PaddleNLP's NaN loss with zero gradients."""
    labelled = paddle.nonzero(labels1d != ignore_index).reshape([-1])
    count = int(labelled.shape[0])
    if count == 0 or count == int(labels1d.shape[0]):
        return hidden2d, labels1d, count
    # Indexing, not paddle.gather: Paddle's CPU gather has no float16 kernel.
    return hidden2d[labelled], labels1d[labelled], count


def _check_inputs(hidden, weight, labels, transpose_weight, chunk_tokens):
    _checks.check_float(hidden, OP, "hidden")
    _checks.check_like(hidden, "hidden", weight, OP, "weight", same_shape=False)
    if len(hidden.shape) < 2:
        raise ValueError(f"{OP}: `hidden` must be [tokens, hidden] or [batch, seq, hidden]; got "
                         f"{list(hidden.shape)}")
    width = hidden.shape[-1]
    layout = "[V, H] (a tied embedding weight)" if transpose_weight else "[H, V] (LlamaLMHead.weight)"
    h_axis = 1 if transpose_weight else 0
    if len(weight.shape) != 2 or weight.shape[h_axis] != width:
        hint = ("" if transpose_weight else
                "; a tied embedding weight [V, H] needs transpose_weight=True")
        raise ValueError(f"{OP}: `weight` must be {layout} with H = hidden.shape[-1] = {width}; got "
                         f"{list(weight.shape)}{hint}")
    _checks.check_tensor(labels, OP, "labels")
    if labels.dtype not in (paddle.int64, paddle.int32):
        raise TypeError(f"{OP}: `labels` must be int64 (or int32) token ids, got {labels.dtype}")
    tokens = 1
    for size in hidden.shape[:-1]:
        tokens *= size
    if list(labels.shape) != list(hidden.shape[:-1]) and list(labels.shape) != [tokens]:
        raise ValueError(f"{OP}: `labels` must be {list(hidden.shape[:-1])} (one per token of "
                         f"`hidden`), got {list(labels.shape)}")
    _checks.check_same_device(hidden, "hidden", labels, OP, "labels")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"{OP}: `chunk_tokens` must be a positive int or None, got {chunk_tokens!r}")


def linear_cross_entropy(hidden: paddle.Tensor, weight: paddle.Tensor, labels: paddle.Tensor,
                         ignore_index: int = -100, transpose_weight: bool = False,
                         chunk_tokens: int | None = None) -> paddle.Tensor:
    """PaddleNLP's causal-LM loss of the LM head, ``LlamaPretrainingCriterion(hidden @ weight)``,
    without materialising the logits of the whole batch.

    hidden: [T, H] or [B, S, H], float32/float16/bfloat16 (float64 for checks);
    weight: [H, V] (LlamaLMHead.weight), or [V, H] with transpose_weight (a tied embedding);
    labels: int64 (int32 accepted) [T] or [B, S], labels[i] the token that follows position i
    (PaddleNLP's criterion does not shift, paddle_fastffn.finetune.data shifts when it builds
    them), ignore_index for positions outside the loss.
    -> float32 scalar: the mean of the per-token losses that are > 0, as PaddleNLP computes it
    (ignored tokens have loss 0; NaN when every label is ignored, with zero gradients).
    Precision: logits fp32 on CPU, hidden.dtype on GPU (fp32 accumulation in the GEMM, as the stock
    head); max, log-sum-exp and gradient in fp32; d_hidden stored in hidden's dtype (each row is one
    GEMM with fp32 accumulation), d_weight summed over chunks in fp32; returned in the inputs' dtypes.
    Memory: one [chunk_tokens, V] logits chunk at a time; chunk_tokens None bounds it at
    GPU_CHUNK_BYTES / CPU_CHUNK_BYTES of fp32. The gradients are computed in forward (so the
    backward needs no second pass): d_hidden [T, H] and the fp32 d_weight are held until backward.
    Labels outside [0, V) that are not ignore_index raise ValueError: on CPU at once; on GPU, where
    the kernel flags them on the device, when backward reads its one value per step back (in the
    forward when no gradient is needed), so the forward synchronises only to count the labels.
    One difference from stock on CPU: Paddle's CPU softmax clips logits more than 64 below the
    row's max (phi SoftmaxEigen's ValueClip), so stock reports about 64 for a token whose loss is
    larger; this op computes the loss itself (the gradients agree).
    """
    _check_inputs(hidden, weight, labels, transpose_weight, chunk_tokens)
    if not _checks.kernel_supports_place(hidden):
        warn_fallback(OP, hidden.place)
        return linear_cross_entropy_ref(hidden, weight, labels, ignore_index, transpose_weight)
    hidden2d, labels1d, n_labelled = _labelled_rows(_checks.contiguous(hidden).reshape([-1, hidden.shape[-1]]),
                                                    _checks.contiguous(labels.astype(paddle.int64).reshape([-1])),
                                                    int(ignore_index))
    vocab = weight.shape[0] if transpose_weight else weight.shape[1]
    chunk = chunk_tokens or default_chunk_tokens(vocab, not hidden.place.is_cpu_place())
    grad_on = paddle.is_grad_enabled()
    need_d_hidden = grad_on and not hidden.stop_gradient
    need_d_weight = grad_on and not weight.stop_gradient
    if not (need_d_hidden or need_d_weight):  # loss only: no graph, no gradient GEMMs
        loss, _, _, readback = _chunked_loss_and_grads(hidden2d, weight, labels1d, int(ignore_index),
                                                       bool(transpose_weight), chunk, False, False, n_labelled)
        readback.read()  # no backward will: labels are checked here
        return loss
    return _LinearCrossEntropy.apply(hidden2d, weight, labels1d, int(ignore_index),
                                     bool(transpose_weight), chunk, need_d_hidden, need_d_weight, n_labelled)


def linear_cross_entropy_ref(hidden: paddle.Tensor, weight: paddle.Tensor, labels: paddle.Tensor,
                             ignore_index: int = -100, transpose_weight: bool = False) -> paddle.Tensor:
    """Pure-Paddle reference: LlamaLMHead + LlamaPretrainingCriterion (tensor_parallel_degree 1),
    materialising the [T, V] logits, in fp32 (float64 for float64 inputs)."""
    compute = paddle.float64 if hidden.dtype == paddle.float64 else paddle.float32
    logits = paddle.matmul(hidden.astype(compute), weight.astype(compute), transpose_y=transpose_weight)
    labels = labels.astype(paddle.int64).reshape(logits.shape[:-1])
    loss = F.cross_entropy(logits, labels.unsqueeze(-1), reduction="none", ignore_index=ignore_index)
    return paddle.mean(loss[loss > 0]).astype(paddle.float32)
