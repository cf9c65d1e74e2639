"""Training on the fast path is stock PaddleFormers' training: every trainable parameter's gradient
and the Trainer's per-step losses, for padded rows, full recompute, LoRA and packed rows (cells and
measurement in pf_parity.py), within the PaddleNLP parity matrix's fp32 bounds."""

import pytest

import pf_parity as pp
from tolerances import MODEL_PARITY_FP32_RTOL

EXPECTED_KERNELS = {"fastffn_rms_norm_fwd", "fastffn_rms_norm_bwd", "fastffn_rotary", "fastffn_swiglu_fwd",
                    "fastffn_swiglu_pair_bwd_inplace", "fastffn_cross_entropy", "fastffn_adamw_"}


@pytest.mark.parametrize("cell", pp.CELLS, ids=[c.name for c in pp.CELLS])
def test_fast_path_gradients_and_losses_match_stock_paddleformers(cell):
    r = pp.measure(cell)
    assert r["trainable_fast"] == r["trainable_stock"]
    assert r["grads_fast"] == r["grads_stock"] == r["trainable_stock"], (
        f"missing on the fast path: {sorted(set(r['grads_stock']) - set(r['grads_fast']))}")
    assert r["grad_max_rel"] <= MODEL_PARITY_FP32_RTOL, (r["grad_max_rel_param"], r["grad_max_rel"])
    assert r["loss_rel"] <= MODEL_PARITY_FP32_RTOL, r
    assert len(r["step_losses_fast"]) == len(r["step_losses_stock"]) == pp.STEPS
    assert r["step_loss_rel"] <= MODEL_PARITY_FP32_RTOL, (r["step_losses_fast"], r["step_losses_stock"])
    assert (r["optimizer_stock"], r["optimizer_fast"]) == ("AdamW", "FastAdamW")
    missing = EXPECTED_KERNELS - set(r["kernel_calls_fast"])
    assert not missing, f"compiled ops that never ran on the fast side: {sorted(missing)}"
    assert not r["kernel_calls_stock"], f"the stock side ran our ops: {r['kernel_calls_stock']}"
    # Each forward (one measured step, STEPS Trainer steps) normalises twice per layer and once at
    # the end; full recompute replays each layer's two in backward, so it ran through our forward
    # (under LoRA not the first layer: its input, the frozen embedding's output, needs no gradient,
    # and PaddleFormers recomputes only layers whose input does).
    layers, forwards = pp.PF_AWKWARD["num_hidden_layers"], pp.STEPS + 1
    recomputed = layers - 1 if cell.lora else layers
    replays = 2 * recomputed * forwards if cell.config.get("recompute_granularity") == "full" else 0
    assert r["kernel_calls_fast"]["fastffn_rms_norm_fwd"] == (2 * layers + 1) * forwards + replays


def test_the_measure_finds_a_wrong_gradient(monkeypatch):
    """The parity check's own check: with the two-input SwiGLU's up gradient 1% off (the op
    PaddleFormers' separate gate/up projections run), it fails."""
    from paddle_fastffn.core import swiglu as core_swiglu

    backward = core_swiglu.SwiGLU.backward

    def up_gradient_off(be, saved, d_out):
        d_x, d_y = backward(be, saved, d_out)
        return d_x, d_y * 1.01

    monkeypatch.setattr(core_swiglu.SwiGLU, "backward", staticmethod(up_gradient_off))
    r = pp.measure(pp.CELLS_BY_NAME["plain"])
    assert r["grad_max_rel"] > MODEL_PARITY_FP32_RTOL, r["grad_max_rel"]
