"""Fused linear cross-entropy: the LM head GEMM and PaddleNLP's causal-LM loss in chunks of tokens,
as a fused op over a Backend (the contract: autograd.py). Paddle runs it as
ops.linear_cross_entropy, the torch binding as paddle_fastffn.torch.ops.linear_cross_entropy.

Per chunk of tokens the logits ``hidden_chunk @ weight`` are computed in the backend's GEMM dtype
(the inputs' on GPU, with fp32 accumulation as the stock head; fp32 on Paddle CPU), one kernel
pass per row finds the max, the log-sum-exp and the row's loss and overwrites the logits with the
gradient of the mean loss, and the two gradient GEMMs run at once (Liger's approach):
``d_hidden_chunk = d_logits @ weight^T`` (stored in hidden's dtype: each row is one GEMM) and
``d_weight += hidden_chunk^T @ d_logits`` summed over chunks in fp32 by one fp32-output GEMM with
accumulation (`Backend.gemm_fp32_accumulate`; on GPU the project's cuBLASLt provider), kept until
backward scales them by the upstream gradient. Only one ``[chunk, vocab]`` logits buffer exists at
a time.

With `fp8` (a core/fp8/lm_head.py Fp8LmHead: Fp8Recipe.lm_head "fp8") the three GEMMs run in FP8
instead, d_W as one GEMM over every chunk's rows (that module says how, with which scales and why);
the kernel pass and the reduction are the same.
"""

from __future__ import annotations

from .autograd import FusedOp
from .fp8 import lm_head as fp8_lm_head
from .rotary import POSITION_CHECK

# Budget of one chunk's logits counted in fp32, chunk_tokens * vocab * 4 bytes, when chunk_tokens
# is None.
# GPU: 1 GiB (2092 tokens at LLaMA-3's 128256 vocabulary). From a one-off probe through the harness
# on the H200, not a committed benchmark (bf16, T=8192, H=4096, V=128256, forward+backward, median
# of 7; re-measure with a committed benchmark before relying on it): 523-token
# chunks (256 MiB) 55.1 ms, 1024 46.1 ms, 2048 44.0 ms, 4096 42.3 ms, torch eager 47.6 ms; each
# chunk re-reads and re-writes the fp32 d_weight, so small chunks cost bandwidth. The peak (3.12
# GiB above the inputs at every chunk size, eager 11.7 GiB) is set by the fp32 d_weight (2 GiB)
# and the returned bf16 weight gradient, not by chunks up to half of d_weight's size.
GPU_CHUNK_BYTES = 1 << 30
# GPU, frozen head (LoRA: no d_weight, so no per-chunk re-read of an fp32 gradient): a chunk only
# bounds the transient logits, and they sit on top of every layer's saved activations at the step's
# peak. 128 MiB counted in fp32 (64 MiB of bf16 logits): 1048 tokens at a 32000 vocabulary, 261 at
# 128256, where the 1 GiB budget holds 0.16 GiB (2,664 labelled rows of a 4096-token packed row, one
# chunk) and 0.50 GiB (2092 rows). Liger's fused linear cross-entropy chunks to 128-512 rows at these
# sizes. Unmeasured on a GPU so far: what the smaller chunks cost in time (two GEMMs and a kernel
# per chunk, none re-reading a weight gradient).
GPU_FROZEN_HEAD_CHUNK_BYTES = 128 << 20
# CPU: 32 MiB (256 tokens at a 32000 vocabulary). On the 2-core dev machine (T=2048, V=32000,
# H=256, fp32, forward+backward, p50 of two runs each): 64-token chunks 2.85-2.91 s and 41 MiB of
# peak allocations, 256 2.53-2.63 s and 65 MiB, 1024 2.54-2.58 s and 160 MiB (stock: 2.6-2.8 s,
# 500 MiB): below ~256 tokens the GEMMs slow down, above it only the memory grows.
CPU_CHUNK_BYTES = 32 << 20


def default_chunk_tokens(vocab: int, on_gpu: bool, weight_trainable: bool = True) -> int:
    """Tokens per chunk under the device's budget; on a GPU a frozen head (weight_trainable False)
    takes GPU_FROZEN_HEAD_CHUNK_BYTES."""
    budget = (GPU_CHUNK_BYTES if weight_trainable else GPU_FROZEN_HEAD_CHUNK_BYTES) if on_gpu else CPU_CHUNK_BYTES
    return max(1, budget // (4 * max(int(vocab), 1)))


def label_error(vocab: int, ignore_index: int) -> ValueError:
    return ValueError(f"linear_cross_entropy: argument `labels` holds a label outside the vocabulary [0, "
                      f"{vocab}) that is not ignore_index ({ignore_index})")


def labelled_rows(be, hidden2d, labels1d, ignore_index: int):
    """(hidden rows, labels, their count): the rows whose label is not ignore_index, PaddleFormers'
    filtered label loss: prompt and padding tokens never reach the LM head GEMMs (the indexing's
    backward scatters the labelled rows' gradient into a zero [T, H]). Finding them is the
    forward's one synchronisation (the kernel's gradient scale, 1 / labelled tokens, is a host
    number). With no labelled token, or every token labelled, the rows stay as they are (no
    labelled token: PaddleNLP's NaN loss with zero gradients)."""
    labelled = be.indices_not_equal(labels1d, ignore_index)
    count = int(be.shape(labelled)[0])
    if count == 0 or count == int(be.shape(labels1d)[0]):
        return hidden2d, labels1d, count
    return be.take_rows(hidden2d, labelled), be.take_rows(labels1d, labelled), count


class PendingReadback:
    """What the loss leaves on the device for one later read: the count of tokens PaddleNLP's mean
    keeps (loss > 0) and the kernel's out-of-vocabulary flag. Backward reads them with the upstream
    gradient in one copy to the host; without a backward the forward reads them itself. Either way
    a step synchronises twice (the label count in the forward, this read), where it did five times
    (label count, the flag after every chunk, the mean's boolean mask, the kept count, d_loss)."""

    def __init__(self, n_labelled: int, n_kept, label_error_flag, vocab: int, ignore_index: int,
                 float64: bool):
        self.n_labelled, self.n_kept, self.label_error_flag = n_labelled, n_kept, label_error_flag
        self.vocab, self.ignore_index, self.float64 = vocab, ignore_index, float64

    def read(self, be, d_loss=None) -> float:
        """Raises for a flagged label; returns d_loss * factor, where factor (n_labelled / n_kept, 1
        almost always) turns the mean over the labelled tokens the gradients were computed for
        into PaddleNLP's mean over the tokens whose loss is > 0 (float64: the gradients are
        unscaled sums and the factor is 1 / n_kept)."""
        parts = [self.n_kept, self.label_error_flag] + ([] if d_loss is None else [d_loss])
        # The step's rotary position flag (core/rotary.py PositionCheck) rides in the same copy.
        rotary_rows, rotary_flag = POSITION_CHECK.table_rows, POSITION_CHECK.pending()
        values = be.to_host(parts + ([] if rotary_flag is None else [rotary_flag]))
        if rotary_flag is not None:
            POSITION_CHECK.raise_if_set(values[-1], rotary_rows)
        if values[1] != 0:
            raise label_error(self.vocab, self.ignore_index)
        n_kept = int(values[0])
        if self.float64:
            factor = 1.0 / n_kept if n_kept else 1.0
        else:
            factor = self.n_labelled / n_kept if n_kept and n_kept != self.n_labelled else 1.0
        return (float(values[2]) if d_loss is not None else 1.0) * factor


class LinearCrossEntropy(FusedOp):
    """LlamaPretrainingCriterion(hidden @ weight) for hidden [T, H] (the labelled rows), weight
    [H, V] (PaddleNLP's LM head) or, with transpose_weight, [V, H] (a tied embedding), labels int64
    [T] -> fp32 scalar. The gradients are computed in forward and held (d_hidden in hidden's dtype,
    d_weight in fp32; with a single chunk d_weight is the GEMM's output in its own dtype: one
    rounding, as a cast of the fp32 result would give, 2 GiB less traffic at a 128k vocab; the FP8
    head's is always one GEMM's output in W's dtype).

    n_labelled: the labelled rows' count (labelled_rows). Gradient scale: the mean over them,
    1 / n_labelled, applied by the kernel; fp16 logits keep the kernel's gradient unscaled (softmax
    values of a 128k vocabulary divided by the token count would underflow fp16) and apply it in
    the GEMMs; float64 (CPU checks) keeps unscaled sums and the readback's factor is 1 / n_kept."""

    inputs = ("hidden", "weight", "labels")
    options = ("ignore_index", "transpose_weight", "chunk_tokens", "n_labelled", "fp8")

    @staticmethod
    def forward(be, saved, hidden, weight, labels, ignore_index, transpose_weight, chunk_tokens, n_labelled,
                fp8=None):
        need_d_hidden, need_d_weight = saved.need(0), saved.need(1)
        with_grad = need_d_hidden or need_d_weight
        tokens, width = be.shape(hidden)
        vocab = be.shape(weight)[0] if transpose_weight else be.shape(weight)[1]
        compute = be.gemm_dtype(hidden)
        float64 = compute == be.float64
        if fp8 is not None and compute in (be.float16, be.float64):
            # fp16 keeps the kernel's gradient unscaled for the GEMMs to scale (the class docstring),
            # which FP8 GEMMs do not; float64 is for checks of the 16/32-bit path.
            raise ValueError("LinearCrossEntropy: the FP8 LM head takes bf16 or fp32 hidden states")
        mean_scale = 1.0 / n_labelled if n_labelled and not float64 else 1.0
        kernel_scale, gemm_scale = (1.0, mean_scale) if compute == be.float16 else (mean_scale, 1.0)
        d_hidden_dtype = be.float64 if float64 else be.dtype(hidden)
        unpadded = tokens
        if fp8 is not None:
            # FP8: chunks of whole multiples of 16 rows, the last one padded (core/fp8/lm_head.py).
            chunk_tokens = fp8_lm_head.chunk_rows(chunk_tokens)
            padding = fp8_lm_head.padded_rows(tokens) - tokens
            if padding:
                hidden = be.pad_rows(hidden, padding, 0)
                labels = be.pad_rows(labels, padding, ignore_index)
                tokens += padding
        single_chunk = tokens <= chunk_tokens
        if fp8 is None or tokens == 0:
            w, gemms = be.cast(weight, compute), None
        else:
            w, gemms = None, fp8_lm_head.Fp8HeadGemms(fp8, weight, transpose_weight, need_d_hidden, need_d_weight,
                                                      hidden, grad_bound=kernel_scale)
        d_weight = None
        # One chunk: d_hidden is its GEMM's own output. Several: each chunk's GEMM writes its rows
        # of one buffer (torch writes them in place; Paddle's matmul has no out=, so it copies).
        d_hidden = (be.empty((tokens, width), d_hidden_dtype, hidden)
                    if need_d_hidden and not single_chunk else None)
        flag = be.zeros((1,), be.int32, hidden)  # the kernel's out-of-vocabulary flag
        losses = []
        for start in range(0, tokens, chunk_tokens):
            end = min(tokens, start + chunk_tokens)
            h = be.cast(be.row_slice(hidden, start, end), compute)
            if gemms is None:
                logits = be.matmul(h, w, transpose_b=transpose_weight)  # [rows, V]
            else:
                logits = gemms.logits(h, compute)
            losses.append(be.cross_entropy(logits, be.row_slice(labels, start, end), ignore_index,
                                           kernel_scale, with_grad, flag))
            d_logits = logits  # overwritten in place by the kernel
            if gemms is not None:
                if with_grad:  # d_W: one GEMM over every chunk, after the loop
                    d_rows = gemms.gradients(d_logits, d_hidden_dtype)
                    if need_d_hidden:
                        d_hidden = d_rows if single_chunk else be.write_rows(d_hidden, start, d_rows)
            elif need_d_hidden:
                # d_hidden = d_logits @ W^T ([H, V] weight) or d_logits @ W (tied [V, H] weight).
                if single_chunk:
                    d_hidden = be.matmul(d_logits, w, transpose_b=not transpose_weight, alpha=gemm_scale)
                    if be.dtype(d_hidden) != d_hidden_dtype:
                        d_hidden = be.cast(d_hidden, d_hidden_dtype)
                else:
                    be.matmul_into_rows(d_hidden, start, d_logits, w, not transpose_weight, gemm_scale)
            if need_d_weight and gemms is None:
                # d_W = h^T @ d_logits ([H, V]) or d_logits^T @ h ([V, H]), summed over chunks.
                a, b = (d_logits, h) if transpose_weight else (h, d_logits)
                if single_chunk:
                    d_weight = be.matmul(a, b, transpose_a=True, alpha=gemm_scale)
                else:
                    d_weight = be.gemm_fp32_accumulate(d_weight, a, b, gemm_scale)
            del logits, d_logits, h
        if gemms is not None and need_d_weight:
            d_weight = gemms.weight_gradient(be.dtype(weight))
        if need_d_hidden and d_hidden is None:  # no tokens: an empty gradient
            d_hidden = be.empty((tokens, width), d_hidden_dtype, hidden)
        if need_d_hidden and tokens != unpadded:  # the FP8 head's padding rows
            d_hidden = be.row_slice(d_hidden, 0, unpadded)
        if need_d_weight and d_weight is None:  # no tokens: a zero gradient
            d_weight = be.zeros(be.shape(weight), be.float64 if float64 else be.float32, weight)
        loss_rows = (losses[0] if len(losses) == 1 else be.concat(losses) if losses
                     else be.zeros((0,), be.float32, hidden))
        # PaddleNLP's reduction: the mean of the tokens whose loss is > 0 (ignored ones have 0); NaN
        # when there are none (0 / 0: every label ignored), with zero gradients.
        loss, n_kept = be.positive_mean(loss_rows)
        readback = PendingReadback(n_labelled, n_kept, flag, vocab, ignore_index, float64)
        if not with_grad:  # no backward will read the flag: labels are checked here
            readback.read(be)
        # Held as attributes, not saved tensors: gradients this op made itself, which backward
        # releases as soon as each is scaled and cast (the fp32 d_weight is 2 GiB at a 128k
        # vocabulary; a framework keeps saved tensors until its graph node is freed).
        saved.gradients = (d_hidden, d_weight)
        saved.readback = readback
        saved.dtypes = (be.dtype(hidden), be.dtype(weight))
        return loss

    @staticmethod
    def backward(be, saved, d_loss):
        # One copy to the host per step: the upstream gradient, the kept count and the label flag
        # (a bad label raises here, before any gradient leaves the op).
        scale = saved.readback.read(be, d_loss)
        d_hidden, d_weight = saved.gradients
        saved.gradients = saved.readback = None
        d_hidden = _scaled_in_dtype(be, d_hidden, scale, saved.dtypes[0])
        d_weight = _scaled_in_dtype(be, d_weight, scale, saved.dtypes[1])  # the fp32 buffer goes here
        return saved.only_needed(d_hidden, d_weight, None)


def _scaled_in_dtype(be, grad, scale: float, dtype):
    """grad * scale (in place) in `dtype`; None stays None."""
    if grad is None:
        return None
    if scale != 1.0:
        grad = be.scale_(grad, scale)
    return be.cast(grad, dtype)
