"""The LM head's three GEMMs in FP8, for the fused linear cross-entropy (core/linear_cross_entropy.py)
under Fp8Recipe.lm_head "fp8". Per chunk of tokens of that op:

    logits [rows, V]  = gemm(q(h), q(W))              e4m3 x e4m3, fast accumulation, in the GEMM dtype
    (the loss kernel overwrites the logits with d_logits, the mean's 1 / n applied)
    d_h    [rows, H]  = gemm(q(d_logits), q(W))        e5m2 x e4m3, in hidden's dtype
and once, after the last chunk, over every row of the call:
    d_W               = gemm(q(h)^T, q(d_logits)^T)     in W's dtype, K = all rows

Each chunk writes its rows of q(h)^T and q(d_logits)^T into storage for the whole call
(Fp8Backend.transposed_rows), so d_W is one GEMM. Summed per chunk instead, each chunk's GEMM has
K = its rows only (2080 at a 128256 vocabulary) and reads and writes the whole fp32 [H, V] sum (2.1 GB
each way at H 4096), which then needs a cast to W's dtype: on an H100 the four chunks of an 8192-token
Llama-3 batch took 12.5 ms against about 6 ms for the one GEMM's FLOPs (the step benchmark's GEMM
records, benchmarks/results/run24/README.md). The storage holds rows x (V + H) bytes (1.08 GB at
8192 tokens, V 128256, H 4096), half the fp32 sum it replaces (2.1 GB) where the kernel writes each
block in place (the torch harness); on Paddle, which has no kernel writing an FP8 tensor into part
of another, the blocks are concatenated at the end (fp8/emulated.py RowBlocks), holding both for
that moment.

One GEMM needs one scale per operand for the whole call:
- h: current scaling over every row (one amax pass over h, then each chunk's quantisation reads that
  scale).
- d_logits: bounded scaling. The kernel writes (softmax - onehot) * g with g = 1 / n (the mean over
  the n labelled rows) and every softmax entry in [0, 1], so |d_logits| <= g exactly: the scale is
  fmt_max / g, the bound's, for every chunk and no amax pass (a d_logits value rounded to the logits'
  dtype above g by half an ulp saturates to fmt_max, within e5m2's own rounding). The recipe's
  margin, headroom for an amax that may grow, does not apply to a bound that cannot be exceeded.
  Its amax is the bound's, not the data's: current scaling would use the data's amax, which a
  batch's confident rows can put below g; e5m2's normal range spans 30 binades below its max, so
  only entries 2^-30 g and smaller flush to zero (gradients of probabilities below 1e-9), where
  per-chunk current scaling would keep them.
- W: current, once per call (both of its stored copies, from one amax).
Nothing carries from one step to the next, so the head has no scaling state to checkpoint, resume
or replay under recompute. Why not delayed: the head's gradient is scaled by 1 / (labelled tokens),
which changes every batch, and a delayed scale set by the last batch's would saturate or flush the
next batch's gradient; h is one [rows, H] read, cheap beside its GEMMs.

Rows: cuBLASLt's FP8 GEMMs read K-major operands, and d_W's K is the call's row count, so chunks are
multiples of ROW_MULTIPLE rows and the op pads the labelled rows with zero rows labelled
ignore_index (the kernel gives them loss 0 and a zero gradient; the mean counts only losses > 0),
then drops the padding from d_h. H and V themselves must be multiples of 16 (the caller checks).

Which stored copy of the weight each GEMM reads is linear.py's WEIGHT_COPIES table, by the head's
own layout: an untied [H, V] head is the "in_out" layout (a linear from H to V), a tied [V, H]
embedding the "out_in" one, whatever the framework.
"""

from __future__ import annotations

from .linear import ROWWISE, TRANSPOSED, WEIGHT_COPIES, weight_gradient
from .recipe import FAST_ACCUM_FORWARD

ROW_MULTIPLE = 16  # cuBLASLt's FP8 alignment of a GEMM's K (d_W's K is the call's rows, each chunk's block of them)


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
    """One call's FP8 GEMMs over `hidden` (every row of the call, padded): q(W) and h's scale made
    once, then per chunk `logits` and `gradients` of the same chunk, then `weight_gradient`.
    grad_bound: g, the loss kernel's gradient scale (every |d_logits| <= g; module docstring)."""

    def __init__(self, head: Fp8LmHead, weight, transpose_weight: bool, need_d_hidden: bool, need_d_weight: bool,
                 hidden, grad_bound: float):
        self.be, self.states = be, states = head.backend, head.states
        self.need_d_hidden, self.need_d_weight = need_d_hidden, need_d_weight
        self.layout = "out_in" if transpose_weight else "in_out"
        self.copies = WEIGHT_COPIES[self.layout]
        wanted = (self.copies["forward"],) + ((self.copies["dgrad"],) if need_d_hidden else ())
        self.q_weight = be.quantize_weight(weight, states.weight, copies=wanted)
        h = states.input
        h.scale_from(hidden, backend=be)  # current scaling over every row of the call
        g = states.grad_output
        self.grad_scale = be.fp32_full(1, g.fmt_max / grad_bound, like=hidden)
        be.zero_(g.amax_history)  # the data's amax, recorded by the quantisations (not used for scaling)
        self.grad_scale_inv = None
        rows, width = be.shape(hidden)
        vocab = be.shape(weight)[0] if transpose_weight else be.shape(weight)[1]
        self.h_rows = be.transposed_rows(rows, width, h.fmt, hidden) if need_d_weight else None
        self.grad_rows = be.transposed_rows(rows, vocab, g.fmt, hidden) if need_d_weight else None
        self.rows, self.first_row = rows, 0

    def logits(self, h, out_dtype):
        """q(h) of the chunk (its transposed copy into the call's storage for d_W), then the
        logits GEMM in out_dtype."""
        be, state = self.be, self.states.input
        into = (self.h_rows, self.first_row) if self.need_d_weight else None
        q_hidden = be.quantize(h, state.scale, state.amax_history, state.fmt, rowwise=True,
                               transpose=self.need_d_weight, into=into)
        return be.fp8_gemm(q_hidden, ROWWISE, self.q_weight, self.copies["forward"], out_dtype,
                           fast_accum=FAST_ACCUM_FORWARD)

    def gradients(self, d_logits, d_hidden_dtype):
        """d_h of the chunk whose logits were last computed (None when not wanted), from
        q(d_logits) under the bound's scale; its transposed copy goes into the call's storage."""
        be, state = self.be, self.states.grad_output
        rows = be.shape(d_logits)[0]
        into = (self.grad_rows, self.first_row) if self.need_d_weight else None
        q_grad = be.quantize(d_logits, self.grad_scale, state.amax_history, state.fmt, rowwise=self.need_d_hidden,
                             transpose=self.need_d_weight, into=into)
        self.first_row += rows
        if self.grad_scale_inv is None:
            self.grad_scale_inv = be.fp8_parts(q_grad, ROWWISE if self.need_d_hidden else TRANSPOSED)[1]
        if not self.need_d_hidden:
            return None
        return be.fp8_gemm(q_grad, ROWWISE, self.q_weight, self.copies["dgrad"], d_hidden_dtype)

    def weight_gradient(self, dtype):
        """d_W over every row of the call, in dtype (W's), once every chunk's gradients ran."""
        be, h, g = self.be, self.states.input, self.states.grad_output
        if self.first_row != self.rows:
            raise ValueError(f"Fp8HeadGemms.weight_gradient: the chunks' gradients covered {self.first_row} of "
                             f"{self.rows} rows")
        q_hidden = be.transposed_rows_value(self.h_rows, h.scale_inv, h.fmt)
        q_grad = be.transposed_rows_value(self.grad_rows, self.grad_scale_inv, g.fmt)
        self.h_rows = self.grad_rows = None
        return weight_gradient(be, q_hidden, q_grad, dtype, layout=self.layout)
