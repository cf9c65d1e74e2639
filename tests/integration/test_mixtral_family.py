"""Mixtral, the second model family (integration/mixtral.py), against stock PaddleNLP Mixtral: the
loss (auxiliary load-balancing loss included) and every trainable parameter's gradient of one
training step within the central fp32 tolerance, under recompute, LoRA, crafted routers (uneven
expert loads, an expert that receives no token), packed batches and FP8's fallback; the Trainer's
steps (FastAdamW) likewise. Rows and measurement: mixtral_parity.py."""

import os
import warnings

import numpy as np
import paddle
import pytest

import mixtral_parity as mp
import parity_matrix as pm
from tolerances import MODEL_PARITY_FP32_RTOL

FAST_KERNELS = {"fastffn_rms_norm_fwd", "fastffn_rms_norm_bwd", "fastffn_rotary", "fastffn_swiglu_fwd",
                "fastffn_swiglu_pair_bwd_inplace", "fastffn_cross_entropy"}


@pytest.mark.parametrize("row", mp.ROWS, ids=[row.name for row in mp.ROWS])
def test_mixtral_fast_path_matches_stock(row):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = mp.measure(row)
    # Every trainable parameter has a gradient where stock has one, and none where stock has none
    # (an expert no token reached has none on either side).
    assert r["trainable_fast"] == r["trainable_stock"]
    assert r["grads_fast"] == r["grads_stock"], set(r["grads_fast"]) ^ set(r["grads_stock"])
    assert r["loss_rel"] <= MODEL_PARITY_FP32_RTOL, r
    assert r["grad_max_rel"] <= MODEL_PARITY_FP32_RTOL, (r["grad_max_rel_param"], r["grad_max_rel"])
    if r["aux_stock"] is not None:
        assert abs(r["aux_fast"] - r["aux_stock"]) <= MODEL_PARITY_FP32_RTOL * abs(r["aux_stock"]), r
    assert FAST_KERNELS <= set(r["kernel_calls_fast"]), sorted(FAST_KERNELS - set(r["kernel_calls_fast"]))
    assert not r["kernel_calls_stock"]
    experts = mp.model_config(row).num_local_experts
    if r["loads"] is not None:
        assert all(sum(layer) == 2 * 4 * pm.SEQ for layer in r["loads"])  # top-2 of every token
    if row.router == "idle":
        assert all(layer[-1] == 0 and min(layer[:-1]) > 0 for layer in r["loads"]), r["loads"]
        idle = {n for n in r["trainable_stock"] if f"experts.{experts - 1}." in n}
        assert idle and not idle & set(r["grads_stock"]), "the idle expert must get no gradient on either side"
    if row.router == "uneven":
        assert all(min(layer) > 0 and max(layer) >= 4 * min(layer) for layer in r["loads"]), r["loads"]
    fp8_warnings = [str(w.message) for w in caught if "fast_ffn_precision=fp8" in str(w.message)]
    assert len(fp8_warnings) == (1 if row.fast.get("precision") == "fp8" else 0), fp8_warnings


def test_mixtral_trainer_steps_match_stock(tmp_path):
    """PaddleNLP's Trainer on both sides (use_fast_ffn in the TrainingArguments: FastAdamW, the fused
    loss), rows without a mask (stock's load-balancing loss cannot take an integer mask on Paddle 3.x)."""
    cell = pm.Cell("mixtral_trainer", model=dict(vocab_size=101), attention_mask=False)
    row = mp.Row("trainer")
    checkpoint = mp.save_checkpoint(row, str(tmp_path / "checkpoint"))
    losses = {}
    for side in ("stock", "fast"):
        fast = side == "fast"
        with paddle.utils.unique_name.guard(), (mp.contextlib.nullcontext() if fast else mp.paddle_2x_where()):
            args = pm._training_args(cell, fast, str(tmp_path / side))
            model = mp.build(row, False, checkpoint) if not fast else _built_after_enable(checkpoint)
            losses[side] = pm.trainer_losses(args, model, pm.rows_for(cell), pm.collate)
    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    (stock, stock_optimizer), (fast, fast_optimizer) = losses["stock"], losses["fast"]
    assert (stock_optimizer, fast_optimizer) == ("AdamW", "FastAdamW")
    assert len(stock) == len(fast) == pm.STEPS
    np.testing.assert_allclose(fast, stock, rtol=MODEL_PARITY_FP32_RTOL)


def _built_after_enable(checkpoint):
    """The fast model as a user builds it after FastFFNTrainingArguments(use_fast_ffn=True) enabled the
    fast path (build() would enable it again with default options)."""
    from paddlenlp.transformers import MixtralForCausalLM

    return MixtralForCausalLM.from_pretrained(checkpoint, dtype="float32")


def test_mixtral_save_pretrained_keeps_the_stock_config(tmp_path):
    """The fast path turns on use_flash_attention (SDPA) in the configs it builds; the checkpoint keeps
    the stock value."""
    from paddlenlp.transformers import MixtralConfig, MixtralForCausalLM

    import paddle_fastffn
    from paddle_fastffn.integration import FastFFNOptions, enable

    checkpoint = mp.save_checkpoint(mp.Row("save"), str(tmp_path / "stock"))
    enable(FastFFNOptions())
    try:
        model = MixtralForCausalLM.from_pretrained(checkpoint, dtype="float32")
        assert model.config.use_flash_attention
        model.save_pretrained(str(tmp_path / "fast"))
    finally:
        paddle_fastffn.revert_fast_ffn()
    assert MixtralConfig.from_pretrained(str(tmp_path / "fast")).use_flash_attention is False
    assert os.path.exists(tmp_path / "fast" / "model_state.pdparams")


def test_mixtral_fast_path_report():
    from paddlenlp.transformers import MixtralForCausalLM

    from paddle_fastffn.integration import FastFFNOptions, enable, mixtral
    from paddle_fastffn.integration.report import fast_path_report

    enable(FastFFNOptions())
    report = fast_path_report(MixtralForCausalLM(mixtral.example_config()))
    assert (report["decoder_layers"], report["fast_path_layers"]) == (2, 2)
    assert set(report["off"]) == {"fuse_projections", "swiglu_recompute"}, report["off"]
    assert "no fused projection" in report["off"]["fuse_projections"]
