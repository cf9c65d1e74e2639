"""Training on the fast path is stock PaddleFormers' training: every trainable parameter's gradient
and the Trainer's per-step losses, for padded rows, full recompute, LoRA and packed rows (cells and
measurement in pf_parity.py), within the PaddleNLP parity matrix's fp32 bounds; and emulated FP8
(delayed and current scaling, recompute, LoRA over FP8-held bases, packed rows) within the budget of
that matrix's FP8 rows, against the fast path in fp32."""

import numpy as np
import pytest

import pf_parity as pp
from tolerances import FP8_TRAINING_LOSS_RTOL, MODEL_PARITY_FP32_RTOL, fp8_model_grad_norm_rtol

EXPECTED_KERNELS = {"fastffn_rms_norm_fwd", "fastffn_rms_norm_bwd", "fastffn_rotary", "fastffn_swiglu_fwd",
                    "fastffn_swiglu_pair_bwd_inplace", "fastffn_cross_entropy", "fastffn_adamw_"}


def _assert_within(r: dict, grad_rtol: float, grad_measure: str, loss_rtol: float) -> None:
    """Every trainable parameter has a gradient on both sides, each within grad_rtol (grad_measure:
    "grad_max_rel" or the norm-wise "grad_norm_rel"), and the first and every Trainer step's loss
    within loss_rtol of the reference."""
    assert r["trainable_fast"] == r["trainable_ref"]
    assert r["grads_fast"] == r["grads_ref"] == r["trainable_ref"], (
        f"missing on the fast side: {sorted(set(r['grads_ref']) - set(r['grads_fast']))}")
    assert r[grad_measure] <= grad_rtol, (r[f"{grad_measure}_param"], r[grad_measure], grad_rtol)
    assert r["loss_rel"] <= loss_rtol, r["loss_rel"]
    assert len(r["step_losses_fast"]) == len(r["step_losses_ref"]) == pp.STEPS
    assert r["step_loss_rel"] <= loss_rtol, (r["step_losses_fast"], r["step_losses_ref"])


@pytest.mark.parametrize("cell", pp.CELLS, ids=[c.name for c in pp.CELLS])
def test_fast_path_gradients_and_losses_match_stock_paddleformers(cell):
    r = pp.measure(cell)
    _assert_within(r, MODEL_PARITY_FP32_RTOL, "grad_max_rel", MODEL_PARITY_FP32_RTOL)
    assert (r["optimizer_ref"], r["optimizer_fast"]) == ("AdamW", "FastAdamW")
    missing = EXPECTED_KERNELS - set(r["kernel_calls_fast"])
    assert not missing, f"compiled ops that never ran on the fast side: {sorted(missing)}"
    assert not r["kernel_calls_ref"], f"the stock side ran our ops: {r['kernel_calls_ref']}"
    assert not r["fp8_linears_fast"], r["fp8_linears_fast"]
    # Each forward (one measured step, STEPS Trainer steps) normalises twice per layer and once at
    # the end; full recompute replays each layer's two in backward, so it ran through our forward
    # (under LoRA not the first layer: its input, the frozen embedding's output, needs no gradient,
    # and PaddleFormers recomputes only layers whose input does).
    layers, forwards = pp.PF_AWKWARD["num_hidden_layers"], pp.STEPS + 1
    recomputed = layers - 1 if cell.lora else layers
    replays = 2 * recomputed * forwards if cell.config.get("recompute_granularity") == "full" else 0
    assert r["kernel_calls_fast"]["fastffn_rms_norm_fwd"] == (2 * layers + 1) * forwards + replays


FP8_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("cell", pp.FP8_CELLS, ids=[c.name for c in pp.FP8_CELLS])
def test_emulated_fp8_gradients_and_losses_within_the_fp8_budget_of_the_fast_path(cell):
    r = pp.measure(cell)
    # The PaddleNLP matrix's FP8 rows' budget: norm-wise per parameter, and the losses.
    layers = cell.model["num_hidden_layers"]
    _assert_within(r, fp8_model_grad_norm_rtol(layers), "grad_norm_rel", FP8_TRAINING_LOSS_RTOL)
    # FP8 ran: every decoder projection through its Fp8Linear, and its rounding shows in the
    # gradients (the fp32 cells differ by 1e-6 at most; e4m3/e5m2 rounding by percents).
    prefix = "model.model.layers" if cell.lora else "model.layers"
    assert r["fp8_linears_fast"] == sorted(f"{prefix}.{i}.{p}" for i in range(layers) for p in FP8_PROJECTIONS)
    assert not r["fp8_linears_ref"]
    assert r["grad_norm_rel"] > 1e-3, r["grad_norm_rel"]
    assert (r["optimizer_ref"], r["optimizer_fast"]) == ("FastAdamW", "FastAdamW")
    if cell.lora:
        # LoRA's frozen bases are held only in FP8, each quantised once over all the steps (a
        # frozen weight never changes), recompute's replays included.
        assert sorted(r["frozen_fp8_fast"]) == r["fp8_linears_fast"]
        assert set(r["frozen_fp8_fast"].values()) == {1}, r["frozen_fp8_fast"]
    else:
        assert not r["frozen_fp8_fast"]


def test_fp8_delayed_scaling_under_paddleformers_recompute_is_training_without_it(monkeypatch):
    """PaddleFormers' full recompute replays each layer in backward; its FP8 quantisations take the
    forward's scales and record nothing (fp8/recompute.py, installed as the modeling module's
    `recompute`), so the FP8 run with recompute is the FP8 run without it, to fp32 rounding. Without
    the wrapper the amax histories roll twice per step and the losses move (the check can fail)."""
    with_recompute = pp.CELLS_BY_NAME["fp8_delayed_recompute"]
    plain = pp.measure(pp.CELLS_BY_NAME["fp8_delayed"])["step_losses_fast"]
    replayed = pp.measure(with_recompute)["step_losses_fast"]
    np.testing.assert_allclose(replayed, plain, rtol=MODEL_PARITY_FP32_RTOL)

    from paddle_fastffn.fp8 import recompute as fp8_recompute_module

    monkeypatch.setattr(fp8_recompute_module, "fp8_recompute", lambda recompute_fn: recompute_fn)
    unwrapped = pp.measure(with_recompute)["step_losses_fast"]
    assert not np.allclose(unwrapped, plain, rtol=MODEL_PARITY_FP32_RTOL), (unwrapped, plain)


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
