"""The gradient-parity matrix: training on the fast path is stock PaddleNLP's training under every
switch users combine (cells and measurement in parity_matrix.py; distributed ranks in
parity_launch.py). It was written after PaddleNLP's own default, non-reentrant recompute left every
layer's mlp.down_proj.weight without a gradient on the default fast path, which tests that built the
model before enabling the fast path never ran."""

import numpy as np
import paddle
import pytest

import parity_matrix as pm
from paddle_fastffn.core import swiglu as core_swiglu
from tolerances import (FP8_TRAINING_LOSS_RTOL, INT8_MOMENTS_TRAINING_LOSS_RTOL, MODEL_PARITY_FP32_RTOL, assert_close,
                        fp8_model_grad_norm_rtol)


def _expected_kernels(cell: pm.Cell) -> set:
    """The compiled ops the fast side must have run (the default path, not a fallback)."""
    kernels = {"fastffn_rms_norm_fwd", "fastffn_rms_norm_bwd", "fastffn_rotary"}
    if not cell.fp8:
        kernels.add("fastffn_swiglu_fwd")
        unfused = cell.lora or cell.patch_after or not cell.fast.get("fast_ffn_fuse_projections", True)
        if unfused:  # gate_proj and up_proj: the two-input SwiGLU, its gradients written over its inputs
            kernels.add("fastffn_swiglu_pair_bwd_inplace")
        elif cell.fast.get("fast_ffn_swiglu_recompute", True):
            # The default MLP: fused gate_up + swiglu_down_proj, SwiGLU recomputed in place in backward.
            kernels.add("fastffn_swiglu_bwd_inplace")
        else:
            kernels.add("fastffn_swiglu_bwd")
    if cell.fast.get("fast_ffn_fused_cross_entropy", True):
        kernels.add("fastffn_cross_entropy")
    if cell.fast.get("fast_ffn_fused_optimizer", True):
        kernels.add("fastffn_adamw_")
    return kernels


@pytest.mark.parametrize("cell", pm.CELLS, ids=[c.name for c in pm.CELLS])
def test_fast_path_gradients_and_losses_match_stock(cell):
    r = pm.measure(cell)
    # Every trainable parameter has a gradient where stock has one, and none where stock has none.
    assert r["trainable_fast"] == r["trainable_stock"]
    assert r["grads_fast"] == r["grads_stock"], (
        f"missing on the fast path: {sorted(set(r['grads_stock']) - set(r['grads_fast']))}; "
        f"extra: {sorted(set(r['grads_fast']) - set(r['grads_stock']))}")
    assert r["grads_stock"] == r["trainable_stock"]
    assert not r["zero_grads_fast"], f"all-zero gradients on the fast path only: {r['zero_grads_fast']}"
    assert len(r["step_losses_fast"]) == len(r["step_losses_stock"]) == cell.steps
    if cell.fp8:
        # Emulated FP8 against stock fp32 (CPU Paddle has no bf16 matmul, so fp32 is the 16-bit stand-in).
        budget = fp8_model_grad_norm_rtol(cell.model["num_hidden_layers"])
        assert r["grad_norm_rel"] <= budget, (r["grad_norm_rel_param"], r["grad_norm_rel"], budget)
        assert r["loss_rel"] <= FP8_TRAINING_LOSS_RTOL and r["step_loss_rel"] <= FP8_TRAINING_LOSS_RTOL, r
    else:
        assert r["grad_max_rel"] <= MODEL_PARITY_FP32_RTOL, (r["grad_max_rel_param"], r["grad_max_rel"])
        assert r["loss_rel"] <= MODEL_PARITY_FP32_RTOL, r
        # Quantised moments change the trajectory from the second update on, but the losses stay
        # within the map's rounding of stock's.
        assert r["step_loss_rel"] <= (INT8_MOMENTS_TRAINING_LOSS_RTOL if cell.int8_moments
                                      else MODEL_PARITY_FP32_RTOL), r
    # The 8-bit state is what the fast side's optimizer held (first and second moment of each large
    # tensor), and only where asked for.
    assert r["quantized_moments_stock"] == 0
    assert (r["quantized_moments_fast"] > 0) == cell.int8_moments, r["quantized_moments_fast"]
    assert r["optimizer_stock"] == "AdamW"
    assert r["optimizer_fast"] == ("FastAdamW" if cell.fast.get("fast_ffn_fused_optimizer", True) else "AdamW")
    # The LM head's GEMMs ran in FP8 (one per forward with labels) where the cell asks, never elsewhere.
    assert r["fp8_head_calls_stock"] == 0
    assert (r["fp8_head_calls_fast"] > 0) == cell.fp8_head, r["fp8_head_calls_fast"]
    missing = _expected_kernels(cell) - set(r["kernel_calls_fast"])
    assert not missing, f"compiled ops that never ran on the fast side: {sorted(missing)}"
    assert not r["kernel_calls_stock"], f"the stock side ran our ops: {r['kernel_calls_stock']}"
    # Without a mask the fast path implies the causal one (no [b, 1, s, s] mask built and read to the
    # host), and packed segments are no mask at all; a collator's dense mask is checked as stock does.
    if cell.attention_mask and cell.packed != "segments":
        assert r["causal_mask_checks_fast"] > 0, r["causal_mask_checks_fast"]
    else:
        assert r["causal_mask_checks_fast"] == 0, r["causal_mask_checks_fast"]


def test_the_matrix_finds_a_missing_gradient(monkeypatch):
    """The matrix's own check: with a down_proj gradient dropped, as recompute once did (issue 19:
    the weight's need was read off its detached replay copy), it fails."""
    backward = core_swiglu.SwiGLUDownProj.backward

    def backward_without_the_weights_need(be, saved, d_out):
        saved.needs = (saved.needs[0], False)
        return backward(be, saved, d_out)

    monkeypatch.setattr(core_swiglu.SwiGLUDownProj, "backward", staticmethod(backward_without_the_weights_need))
    r = pm.measure(pm.CELLS_BY_NAME["recompute_full_nonreentrant"])
    assert set(r["grads_stock"]) - set(r["grads_fast"]) == {
        f"llama.layers.{i}.mlp.down_proj.weight" for i in range(pm.AWKWARD["num_hidden_layers"])}


def test_the_matrix_finds_8bit_moments_lost_between_steps(monkeypatch):
    """The 8-bit cells' loss budget is tight enough to see a state that does not survive a step:
    with every moment's absmax zeroed after each step (the codes then dequantise to zero), the cell
    fails."""
    from paddle_fastffn.optim import adamw

    step = adamw.FastAdamW.step

    def step_then_drop_the_moments(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        for moments in self._quantized_moments.values():
            for moment in moments.values():
                moment.absmax.zero_()
        return out

    monkeypatch.setattr(adamw.FastAdamW, "step", step_then_drop_the_moments)
    r = pm.measure(pm.CELLS_BY_NAME["optimizer_int8_moments"])
    assert r["step_loss_rel"] > INT8_MOMENTS_TRAINING_LOSS_RTOL, r["step_loss_rel"]


# --- data parallel and sharding: two CPU ranks under paddle.distributed.launch (gloo) ---------------

@pytest.mark.parametrize("mode", pm.LAUNCH_MODES)
def test_distributed_training_matches_the_stock_launch(tmp_path, mode):
    result = pm.launch(mode, str(tmp_path))
    if "unsupported" in result:
        pytest.skip(f"{mode}: {result['unsupported']}")
    assert "error" not in result, result.get("error")
    int8_moments = pm.int8_moments(pm.LAUNCH_FAST_ARGUMENTS.get(mode, {}))
    for rank in result["ranks"]:
        stock, fast = rank["stock"], rank["fast"]
        assert stock["world_size"] == fast["world_size"] == 2
        assert fast["fused"] and not stock["fused"]
        assert fast["optimizer"] == "FastAdamW" and stock["optimizer"] == "AdamW"
        assert len(fast["losses"]) == len(stock["losses"]) == pm.launch_steps(mode)
        # each rank's optimizer holds its share of the 8-bit state, and only where asked for
        assert stock["quantized_moments"] == 0 and (fast["quantized_moments"] > 0) == int8_moments, rank
    assert pm.launch_loss_rel(result) <= (INT8_MOMENTS_TRAINING_LOSS_RTOL if int8_moments else MODEL_PARITY_FP32_RTOL)


# --- tensor parallel: the shard math, two ranks simulated in one process ----------------------------

def test_tensor_parallel_fused_gate_up_shards_compose_to_the_full_ffn():
    """Tensor parallel cannot run on CPU (gloo has no calc-stream all_reduce): the shard math instead,
    two ranks simulated in one process (parity_matrix.tensor_parallel_comparisons)."""
    comparisons = pm.tensor_parallel_comparisons()
    assert len(comparisons) == 2 + 3 * 2  # output and d_x all-reduced; each rank's three weight grads
    for what, actual, expected, reduced_rows in comparisons:
        assert_close(actual, expected, paddle.float32, what, reduced_rows)
