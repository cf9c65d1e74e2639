"""The LM head's three GEMMs in FP8, for the fused linear cross-entropy (core/linear_cross_entropy.py)
under Fp8Recipe.lm_head "fp8". Per chunk of tokens of that op:

    logits [rows, V]  = gemm(q(h), q(W))              e4m3 x e4m3, fast accumulation, in the GEMM dtype
    (the loss kernel overwrites the logits with d_logits, the mean's 1 / n applied)
    d_h    [rows, H]  = gemm(q(d_logits), q(W))        e5m2 x e4m3, in hidden's dtype
    d_W               = gemm(q(h)^T, q(d_logits)^T)     in W's dtype (one chunk) or fp32 summed over chunks

Scaling is current (each tensor's own amax) for all three: h and d_logits per chunk, W once per call
(both of its stored copies, from one amax). Nothing carries from one step to the next, so the head
has no scaling state to checkpoint, resume or replay under recompute. Why not delayed: the head's
gradient is scaled by 1 / (labelled tokens), which changes every batch, and a delayed scale set by
the last batch's would saturate or flush the next batch's gradient; h is one [rows, H] read, cheap
beside its GEMMs, and its amax pass costs less than the [rows, V] logits it saves in bf16.

Rows: cuBLASLt's FP8 GEMMs read K-major operands, and d_W's K is a chunk's row count, so chunks are
multiples of ROW_MULTIPLE rows and the op pads the labelled rows with zero rows labelled
ignore_index (the kernel gives them loss 0 and a zero gradient; the mean counts only losses > 0),
then drops the padding from d_h. H and V themselves must be multiples of 16 (the caller checks).

Which stored copy of the weight each GEMM reads is linear.py's WEIGHT_COPIES table, by the head's
own layout: an untied [H, V] head is the "in_out" layout (a linear from H to V), a tied [V, H]
embedding the "out_in" one, whatever the framework.
"""

from __future__ import annotations

from .linear import ROWWISE, WEIGHT_COPIES, weight_gradient
from .recipe import FAST_ACCUM_FORWARD

ROW_MULTIPLE = 16  # cuBLASLt's FP8 alignment of a GEMM's K (d_W's K is the chunk's rows)


def sizes_error(width: int, vocab: int) -> str | None:
    """Why a head of hidden size `width` and `vocab` rows cannot run in FP8 (H and V are the other
    GEMMs' K and N, under the same alignment as the rows), or None."""
    if width % ROW_MULTIPLE or vocab % ROW_MULTIPLE:
        return f"hidden size {width} or vocabulary {vocab} is not a multiple of {ROW_MULTIPLE}"
    return None


def padded_rows(tokens: int) -> int:
    return -(-tokens // ROW_MULTIPLE) * ROW_MULTIPLE


def chunk_rows(chunk_tokens: int) -> int:
    """The op's chunk length rounded down to a multiple of ROW_MULTIPLE (at least one multiple)."""
    return max(ROW_MULTIPLE, chunk_tokens // ROW_MULTIPLE * ROW_MULTIPLE)


class Fp8LmHead:
    """What the op's FP8 path is given: an FP8 backend (core/fp8/backend.py) and the head's
    LinearScalingStates (Fp8Recipe.lm_head_states: input = h, weight = W, grad_output = d_logits,
    all current-scaled), made by the framework's public op for each call."""

    def __init__(self, backend, states):
        if any(getattr(states, role).mode != "current" for role in ("input", "weight", "grad_output")):
            raise ValueError("Fp8LmHead: the LM head's scaling states must be current-scaled "
                             "(Fp8Recipe.lm_head_states; the module docstring says why)")
        self.backend, self.states = backend, states


class Fp8HeadGemms:
    """One call's FP8 GEMMs: q(W) made once (the forward's copy, and the input gradient's where
    d_h is wanted), then per chunk `logits`, then `gradients` of the same chunk."""

    def __init__(self, head: Fp8LmHead, weight, transpose_weight: bool, need_d_hidden: bool, need_d_weight: bool):
        self.be, self.states = head.backend, head.states
        self.need_d_hidden, self.need_d_weight = need_d_hidden, need_d_weight
        self.layout = "out_in" if transpose_weight else "in_out"
        self.copies = WEIGHT_COPIES[self.layout]
        wanted = (self.copies["forward"],) + ((self.copies["dgrad"],) if need_d_hidden else ())
        self.q_weight = self.be.quantize_weight(weight, self.states.weight, copies=wanted)
        self.q_hidden = None

    def logits(self, h, out_dtype):
        """q(h) (and its transposed copy for d_W), then the logits GEMM in out_dtype."""
        be = self.be
        rows = be.shape(h)[0]
        self.q_hidden = self.states.input.quantize(
            h, backend=be, rowwise=True, transpose=self.need_d_weight,
            transpose_cols=be.transpose_cols(rows) if self.need_d_weight else 0)
        return be.fp8_gemm(self.q_hidden, ROWWISE, self.q_weight, self.copies["forward"], out_dtype,
                           fast_accum=FAST_ACCUM_FORWARD)

    def gradients(self, d_logits, d_hidden_dtype, d_weight_dtype, d_weight_sum=None):
        """(d_h or None, d_W or None) of the chunk whose logits were last computed, from q(d_logits);
        d_weight_sum (fp32): the earlier chunks' d_W, which this chunk's GEMM adds into in place."""
        be = self.be
        rows = be.shape(d_logits)[0]
        q_grad = self.states.grad_output.quantize(
            d_logits, backend=be, rowwise=self.need_d_hidden, transpose=self.need_d_weight,
            transpose_cols=be.transpose_cols(rows) if self.need_d_weight else 0)
        d_hidden = d_weight = None
        if self.need_d_hidden:
            d_hidden = be.fp8_gemm(q_grad, ROWWISE, self.q_weight, self.copies["dgrad"], d_hidden_dtype)
        if self.need_d_weight:
            d_weight = weight_gradient(be, self.q_hidden, q_grad, d_weight_dtype, layout=self.layout, out=d_weight_sum)
        self.q_hidden = None
        return d_hidden, d_weight
