"""Fused linear cross-entropy: the LM head GEMM and PaddleNLP's causal-LM loss, in chunks of tokens.

``linear_cross_entropy(hidden, weight, labels)`` is ``LlamaPretrainingCriterion(LlamaLMHead(hidden),
labels)`` (tensor_parallel_degree 1) without the logits of the whole batch. Per chunk of tokens
the logits ``hidden_chunk @ weight`` are computed, one kernel pass per row finds the max, the
log-sum-exp and the row's loss and writes the gradient of the mean loss over the logits, and the
two gradient GEMMs run at once (Liger's approach): ``d_hidden_chunk = d_logits @ weight^T`` and
``d_weight += hidden_chunk^T @ d_logits`` (the sum over chunks in fp32), kept until backward
scales them by the upstream gradient. Only one ``[chunk, vocab]`` logits buffer exists at a time.

Stack: core op (paddle_fastffn/core/linear_cross_entropy.py, over ops/_backend.py) -> autograd
(``pylayer(core op)``) -> public ``linear_cross_entropy`` -> ``linear_cross_entropy_ref``.

The GEMMs are ``paddle.matmul`` for the logits and d_hidden: on CPU in fp32 (Paddle CPU has no
half-precision matmul), on GPU in the inputs' dtype with fp32 accumulation inside cuBLAS, as the
stock LM head computes them. d_weight (16-bit head) is summed over chunks by one fp32-output GEMM per chunk: on
CPU Paddle's fp32 matmul (addmm_ in place), on GPU the project's cuBLASLt provider
(fastffn_gemm_accumulate: bf16 inputs, fp32 output accumulated in place), the call the GPU
harness makes. The GPU path of this file cannot run here (no Paddle GPU build reaches sm_90).
"""

from __future__ import annotations

import threading

import paddle
import paddle.nn.functional as F

from ..core import linear_cross_entropy as core
from . import _checks
from ._autograd import pylayer
from ._backend import BACKEND
from ._fallback import warn_fallback

OP = "paddle_fastffn.ops.linear_cross_entropy"

_LinearCrossEntropy = pylayer(core.LinearCrossEntropy)


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


def fp8_head_unsupported(dtype, weight, transpose_weight: bool) -> str | None:
    """Why the FP8 head cannot take hidden states of `dtype` and this head weight ([H, V], or [V, H]
    with transpose_weight), or None: bf16 or fp32 hidden states (the loss kernel's fp16 path scales
    the gradient in the GEMMs, which FP8 GEMMs do not) and H, V aligned (core/fp8/lm_head.py)."""
    from ..core.fp8.lm_head import sizes_error

    if dtype not in (paddle.bfloat16, paddle.float32):
        return f"the hidden states are {dtype}, not bfloat16 or float32"
    width, vocab = (weight.shape[1], weight.shape[0]) if transpose_weight else weight.shape
    return sizes_error(width, vocab)


def _fp8_head(recipe, hidden, weight, transpose_weight):
    """The core's Fp8LmHead for this call: the CUDA FP8 backend where it runs, else the emulation
    (one warning); the recipe's LM head states, made once per (formats, margin, device, thread) and
    reused, since current scaling carries nothing from one call to the next (core/fp8/lm_head.py);
    per thread, since a call writes its scales between their computation and their use."""
    from ..core.fp8.lm_head import Fp8LmHead
    from ..fp8.cuda import CUDA, backend_for, states_on
    from ..fp8.emulated import EMULATED
    from ..fp8.linear import warn_emulated

    why_not = fp8_head_unsupported(hidden.dtype, weight, transpose_weight)
    if why_not is not None:
        raise ValueError(f"{OP}: `hidden` and `weight` cannot run the FP8 LM head (fp8_recipe): {why_not}")
    cuda = backend_for("auto", hidden) == "cuda"
    key = (recipe.forward_format, recipe.backward_format, recipe.margin, str(hidden.place) if cuda else "cpu")
    held = _FP8_HEAD_STATES.__dict__.setdefault("by_key", {})
    states = held.get(key)
    if states is None:
        states = held[key] = recipe.lm_head_states(EMULATED)
    if cuda:
        states_on(states, hidden.place)
    else:
        warn_emulated()
    return Fp8LmHead(CUDA if cuda else EMULATED, states)


_FP8_HEAD_STATES = threading.local()  # by_key: this thread's states (_fp8_head)


def linear_cross_entropy(hidden: paddle.Tensor, weight: paddle.Tensor, labels: paddle.Tensor,
                         ignore_index: int = -100, transpose_weight: bool = False,
                         chunk_tokens: int | None = None, fp8_recipe=None) -> paddle.Tensor:
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
    GEMM with fp32 accumulation), d_weight summed over chunks in fp32 (the FP8 head: one GEMM over
    every chunk, in W's dtype); returned in the inputs' dtypes.
    Memory: one [chunk_tokens, V] logits chunk at a time; chunk_tokens None bounds it at
    core.linear_cross_entropy's GPU_CHUNK_BYTES (GPU_FROZEN_HEAD_CHUNK_BYTES for a frozen head) /
    CPU_CHUNK_BYTES of fp32. The gradients are computed in forward (so the
    backward needs no second pass): d_hidden [T, H] and d_weight (fp32; the FP8 head's in W's
    dtype) are held until backward.
    Labels outside [0, V) that are not ignore_index raise ValueError: on CPU at once; on GPU, where
    the kernel flags them on the device, when backward reads its one value per step back (in the
    forward when no gradient is needed), so the forward synchronises only to count the labels.
    One difference from stock on CPU: Paddle's CPU softmax clips logits more than 64 below the
    row's max (phi SoftmaxEigen's ValueClip), so stock reports about 64 for a token whose loss is
    larger; this op computes the loss itself (the gradients agree).
    fp8_recipe: an Fp8Recipe; the three GEMMs then run in FP8 (core/fp8/lm_head.py: the recipe's
    formats, h and W current-scaled over the call with its margin, d_logits by its bound 1/n, d_W
    one GEMM over every chunk), cuBLASLt's on an sm_90 GPU with the
    CUDA operators, emulated elsewhere; bf16 or fp32 `hidden`, H and V multiples of 16.
    """
    _check_inputs(hidden, weight, labels, transpose_weight, chunk_tokens)
    fp8 = None if fp8_recipe is None else _fp8_head(fp8_recipe, hidden, weight, transpose_weight)
    if not _checks.kernel_supports_place(hidden):
        warn_fallback(OP, hidden.place)
        return linear_cross_entropy_ref(hidden, weight, labels, ignore_index, transpose_weight)
    hidden2d, labels1d, n_labelled = core.labelled_rows(
        BACKEND, _checks.contiguous(hidden).reshape([-1, hidden.shape[-1]]),
        _checks.contiguous(labels.astype(paddle.int64).reshape([-1])), int(ignore_index))
    vocab = weight.shape[0] if transpose_weight else weight.shape[1]
    chunk = chunk_tokens or core.default_chunk_tokens(vocab, not hidden.place.is_cpu_place(),
                                                      weight_trainable=not weight.stop_gradient)
    return _LinearCrossEntropy.apply(hidden2d, weight, labels1d, int(ignore_index), bool(transpose_weight),
                                     chunk, n_labelled, fp8)


def linear_cross_entropy_ref(hidden: paddle.Tensor, weight: paddle.Tensor, labels: paddle.Tensor,
                             ignore_index: int = -100, transpose_weight: bool = False) -> paddle.Tensor:
    """Pure-Paddle reference: LlamaLMHead + LlamaPretrainingCriterion (tensor_parallel_degree 1),
    materialising the [T, V] logits, in fp32 (float64 for float64 inputs)."""
    compute = paddle.float64 if hidden.dtype == paddle.float64 else paddle.float32
    logits = paddle.matmul(hidden.astype(compute), weight.astype(compute), transpose_y=transpose_weight)
    labels = labels.astype(paddle.int64).reshape(logits.shape[:-1])
    loss = F.cross_entropy(logits, labels.unsqueeze(-1), reduction="none", ignore_index=ignore_index)
    return paddle.mean(loss[loss > 0]).astype(paddle.float32)
