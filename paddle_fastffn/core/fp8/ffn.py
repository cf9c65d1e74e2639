"""The FP8 FFN (LLaMA's SwiGLU MLP, y = swiglu(x @ W_gu) @ W_d, SwiGLU fused with the
quantisation of its output and recomputed in backward), written once over an FP8 backend
(backend.py). The Paddle emulation, the Paddle CUDA ops and the torch harness all run this class;
its C calls, on the CUDA backends, are integration/composition.py's fp8_ffn_calls
(tests/integration/test_composition.py traces the Paddle one, tests/gpu/test_fp8_ffn_composition.py
the harness's). paddle_fastffn/fp8/ffn.py documents the data flow and the GEMM table.

  forward   q(x), q(x)^T          states.x (its step ends with the forward)
            q(W_gu), q(W_d)       both copies, once per weight version (WeightCache), or the
                                  forward's copies per use (linear.weight_for_forward)
            gate_up               x.dtype = gemm(q(x), q(W_gu)), fast accumulation
            q(h) [, q(gate_up)]   one swiglu_fwd_fp8 pass (states.h, states.gate_up: their scales
                                  together); h only in fp32
            y                     x.dtype = gemm(q(h), q(W_d)), fast accumulation
            kept                  q(x)^T, gate_up's FP8 copy (or the 16-bit gate_up), h's scale,
                                  the weights' dgrad copies (per use: the weights)
  backward  q(dy), q(dy)^T        states.dy
            d_h                   x.dtype = gemm(q(dy), q(W_d))
            q(d_gate_up) (+^T), q(h)^T   one swiglu_bwd_fp8 pass from the kept gate_up and d_h;
                                  h recomputed and quantised with the forward's scale
            dW_d, dx, dW_gu       gemm(q(h)^T, q(dy)^T), gemm(q(d_gate_up), q(W_gu)),
                                  gemm(q(x)^T, q(d_gate_up)^T) (weight gradients in the
                                  framework's layout: linear.weight_gradient)

`record` (an option: a dict or None) receives the intermediates of each forward and backward
(the harness's tests check every stage with it).
"""

from __future__ import annotations

from ..autograd import FusedOp, Saved
from .linear import ROWWISE, TRANSPOSED, WEIGHT_COPIES, weight_for_dgrad, weight_for_forward, weight_gradient
from .recipe import FAST_ACCUM_FORWARD
from .scaling import quantize_with


class Fp8FFNOp(FusedOp):
    inputs = ("x", "w_gate_up", "w_down")
    options = ("states", "weight_cache", "record")

    @staticmethod
    def forward(be, saved: Saved, x, w_gate_up, w_down, states, weight_cache, record):
        x2d = be.contiguous(be.rows(x))
        cols = be.transpose_cols(be.shape(x2d)[0])
        copies = WEIGHT_COPIES[be.weight_layout]
        qx = states.x.quantize(x2d, end_step=False, backend=be, rowwise=True, transpose=True, transpose_cols=cols)
        q_gu, gu_kept = weight_for_forward(be, w_gate_up, states.w_gate_up, weight_cache)
        q_d, d_kept = weight_for_forward(be, w_down, states.w_down, weight_cache)
        x_dtype = be.dtype(x)
        gate_up = be.fp8_gemm(qx, ROWWISE, q_gu, copies["forward"], x_dtype, fast_accum=FAST_ACCUM_FORWARD)
        h, gu = states.h, states.gate_up
        # One pass quantises h and (saved_gate_up "fp8") gate_up's copy; their scales together.
        qh, q_saved = quantize_with(
            be, [h] if gu is None else [h, gu],
            lambda: be.swiglu_fwd_fp8(gate_up, h.scale_used, h.kernel_amax, None if gu is None else gu.scale_used,
                                      None if gu is None else gu.kernel_amax, h.fmt, quantize=False),
            lambda: be.swiglu_fwd_fp8(gate_up, h.scale_used, h.kernel_amax, None if gu is None else gu.scale_used,
                                      None if gu is None else gu.kernel_amax, h.fmt, quantize=True),
            end_step=False)
        y = be.fp8_gemm(qh, ROWWISE, q_d, copies["forward"], x_dtype, fast_accum=FAST_ACCUM_FORWARD)
        h_scale = be.clone(h.scale_used)  # the backward re-quantises the recomputed h with it
        for state in (states.x, h, gu):
            if state is not None:
                state.end_step(be)
        kept_gate_up = (gate_up, None) if gu is None else be.fp8_parts(q_saved, ROWWISE)
        saved.save(*be.fp8_parts(qx, TRANSPOSED), *kept_gate_up, h_scale, *gu_kept, *d_kept)
        saved.states, saved.record, saved.transpose_cols = states, record, cols
        saved.per_use = weight_cache is None
        saved.dtypes = (x_dtype, be.dtype(w_gate_up), be.dtype(w_down))
        saved.x_shape = be.shape(x)
        if record is not None:
            record.update(q_x=qx, w_gate_up=q_gu, w_down=q_d, gate_up=gate_up, q_h=qh, h_scale=h_scale, y=y,
                          saved_gate_up=kept_gate_up[0], saved_gate_up_scale_inv=kept_gate_up[1])
        return be.reshape(y, saved.x_shape)

    @staticmethod
    def backward(be, saved: Saved, grad_output):
        x_t, x_scale_inv, gate_up, gate_up_scale_inv, h_scale, *kept = saved.tensors
        states, record, cols = saved.states, saved.record, saved.transpose_cols
        x_dtype, gu_dtype, d_dtype = saved.dtypes
        need_dx, need_dgu, need_dd = saved.needs
        copies = WEIGHT_COPIES[be.weight_layout]
        dy2d = be.contiguous(be.cast(be.rows(grad_output), x_dtype))
        qdy = states.dy.quantize(dy2d, end_step=False, backend=be, rowwise=True, transpose=True, transpose_cols=cols)
        q_d = weight_for_dgrad(be, kept[2:], states.w_down, saved.per_use)
        d_h = be.fp8_gemm(qdy, ROWWISE, q_d, copies["dgrad"], x_dtype)
        dgu, h_fmt = states.d_gate_up, states.h.fmt if need_dd else ""
        q_dgu, q_h = quantize_with(
            be, [dgu],
            lambda: be.swiglu_bwd_fp8(gate_up, gate_up_scale_inv, d_h, dgu.scale, dgu.amax_history, dgu.fmt,
                                      quantize=False),
            lambda: be.swiglu_bwd_fp8(gate_up, gate_up_scale_inv, d_h, dgu.scale, dgu.amax_history, dgu.fmt,
                                      quantize=True, h_scale=h_scale, h_fmt=h_fmt, transpose_cols=cols),
            end_step=False)
        if record is not None:
            record.update(q_dy=qdy, d_h=d_h, q_d_gate_up=q_dgu, q_h_t=q_h)
        d_h = None  # [T, I]: released before the remaining GEMMs allocate their outputs
        dx = d_w_gu = d_w_d = None
        if need_dd:
            d_w_d = weight_gradient(be, q_h, qdy, d_dtype)
        qdy = q_h = None
        if need_dx:
            q_gu = weight_for_dgrad(be, kept[:2], states.w_gate_up, saved.per_use)
            dx = be.reshape(be.fp8_gemm(q_dgu, ROWWISE, q_gu, copies["dgrad"], x_dtype), saved.x_shape)
        if need_dgu:
            q_x = be.fp8_join(x_t, x_scale_inv, states.x.fmt, TRANSPOSED)
            d_w_gu = weight_gradient(be, q_x, q_dgu, gu_dtype)
        states.dy.end_step(be)
        states.d_gate_up.end_step(be)
        if record is not None:
            record.update(d_x=dx, d_w_gate_up=d_w_gu, d_w_down=d_w_d)
        return dx, d_w_gu, d_w_d
