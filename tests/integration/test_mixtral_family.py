"""Mixtral, the second model family (integration/mixtral.py), against stock PaddleNLP Mixtral: the
loss (auxiliary load-balancing loss included) and every trainable parameter's gradient of one
training step within the central fp32 tolerance, under recompute, LoRA, crafted routers (uneven
expert loads, an expert that receives no token), packed batches; emulated FP8 against stock fp32
within the LLaMA FP8 rows' budgets (tolerances.py), its scaling states resumed bit-exactly; the
Trainer's steps (FastAdamW) likewise. Rows and measurement: mixtral_parity.py."""

import os
import warnings

import numpy as np
import paddle
import pytest

import mixtral_parity as mp
import parity_matrix as pm
from tolerances import FP8_TRAINING_LOSS_RTOL, MODEL_PARITY_FP32_RTOL, fp8_model_grad_norm_rtol

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
    fp8 = row.fast.get("precision") == "fp8"
    loss_rtol = FP8_TRAINING_LOSS_RTOL if fp8 else MODEL_PARITY_FP32_RTOL
    assert r["loss_rel"] <= loss_rtol, r
    if fp8:  # the LLaMA FP8 rows' budgets (test_parity_matrix), for this model's depth
        budget = fp8_model_grad_norm_rtol(mp.model_config(row).num_hidden_layers)
        assert r["grad_norm_rel"] <= budget, (r["grad_norm_rel_param"], r["grad_norm_rel"], budget)
        # FP8 did run: its roundings are far above fp32's (1e-5), 5% a GEMM norm-wise.
        assert r["grad_norm_rel"] > 100 * MODEL_PARITY_FP32_RTOL, r["grad_norm_rel"]
        _assert_fp8_covers_attention_and_experts(row, r)
    else:
        assert r["grad_max_rel"] <= MODEL_PARITY_FP32_RTOL, (r["grad_max_rel_param"], r["grad_max_rel"])
        assert not r["fp8_fast"]
    assert not r["fp8_stock"]
    if r["aux_stock"] is not None:
        assert abs(r["aux_fast"] - r["aux_stock"]) <= loss_rtol * abs(r["aux_stock"]), r
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
    assert not fp8_warnings, fp8_warnings


def _assert_fp8_covers_attention_and_experts(row, r):
    """q/k/v/o_proj and every expert's w1/w3/w2 through Fp8Linear, the router not; an expert no
    token reached has scaling states that recorded nothing, every other one has."""
    config = mp.model_config(row)
    prefix = "model.mixtral" if row.lora else "mixtral"
    expected = {f"{prefix}.layers.{i}.self_attn.{p}" for i in range(config.num_hidden_layers)
                for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    expected |= {f"{prefix}.layers.{i}.block_sparse_moe.experts.{e}.{w}" for i in range(config.num_hidden_layers)
                 for e in range(config.num_local_experts) for w in ("w1", "w3", "w2")}
    assert set(r["fp8_fast"]) == expected, set(r["fp8_fast"]) ^ expected
    idle = f"experts.{config.num_local_experts - 1}." if row.router == "idle" else None
    unseeded = sorted(name for name, seeded in r["fp8_fast"].items() if not seeded)
    assert unseeded == sorted(n for n in expected if idle and idle in n), unseeded


@pytest.mark.parametrize("fast_options", [{}, pm.EMULATED_FP8], ids=["fp32", "fp8_emulated"])
def test_mixtral_trainer_steps_match_stock(fast_options, tmp_path):
    """PaddleNLP's Trainer on both sides (use_fast_ffn in the TrainingArguments: FastAdamW, the fused
    loss), rows without a mask (stock's load-balancing loss cannot take an integer mask on Paddle 3.x);
    emulated FP8 (delayed scaling) against stock fp32 within the LLaMA FP8 cells' per-step budget."""
    cell = pm.Cell("mixtral_trainer", model=dict(vocab_size=101), attention_mask=False, fast=fast_options)
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
    (stock, stock_optimizer, _), (fast, fast_optimizer, _) = losses["stock"], losses["fast"]
    assert (stock_optimizer, fast_optimizer) == ("AdamW", "FastAdamW")
    assert len(stock) == len(fast) == cell.steps
    np.testing.assert_allclose(fast, stock, rtol=FP8_TRAINING_LOSS_RTOL if cell.fp8 else MODEL_PARITY_FP32_RTOL)
    if cell.fp8:  # FP8 did run: its roundings move the losses far more than fp32's reordering does
        assert np.max(np.abs(np.array(fast) - stock) / np.abs(stock)) > 10 * MODEL_PARITY_FP32_RTOL, (fast, stock)


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


def test_mixtral_fp8_report_and_revert():
    """Under emulated FP8 the report has no FP8 note (the family's recipe is set), PaddleNLP's
    recompute runs FP8's phases, and revert detaches every Fp8Linear and restores recompute."""
    from paddlenlp.transformers import MixtralForCausalLM

    import paddle_fastffn
    from paddle_fastffn.integration import FastFFNOptions, enable, mixtral
    from paddle_fastffn.integration.fp8_attach import fp8_layers
    from paddle_fastffn.integration.report import fast_path_report

    stock_recompute = mixtral.modeling_module().recompute
    enable(FastFFNOptions(precision="fp8", fp8_emulate=True))
    try:
        model = MixtralForCausalLM(mixtral.example_config())
        report = fast_path_report(model)
        assert not any("fp8" in note.lower() for note in report["notes"]), report
        assert mixtral.fp8_recipe() is not None and mixtral.modeling_module().recompute.fp8_phases
        assert len(mixtral.fp8_checkpoint_layers(model)[1]) == 2 * (4 + 3 * 4)
    finally:
        paddle_fastffn.revert_fast_ffn()
    assert mixtral.fp8_recipe() is None and mixtral.modeling_module().recompute is stock_recompute
    assert not fp8_layers(model) and mixtral.fp8_checkpoint_layers(model) == (None, {})


def _fp8_trainer(tmp_path, name, checkpoint, resume_from=None, steps=4):
    """A Trainer run of the FP8 (emulated, delayed scaling) Mixtral with uneven expert loads, saving every 2 steps."""
    from paddlenlp.trainer import PdArgumentParser, Trainer

    from paddle_fastffn import FastFFNTrainingArguments

    cell = pm.Cell("mixtral_fp8_resume", model=dict(vocab_size=101), attention_mask=False)
    values = dict(output_dir=str(tmp_path / name), max_steps=steps, save_steps=2, save_strategy="steps",
                  per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1, report_to="none", device="cpu",
                  disable_tqdm=True, seed=42, dataloader_num_workers=0, use_fast_ffn=True, fast_ffn_precision="fp8",
                  fast_ffn_fp8_emulate=True, fast_ffn_fp8_scaling="delayed", fast_ffn_fp8_amax_history_len=4)
    with paddle.utils.unique_name.guard():
        args = PdArgumentParser((FastFFNTrainingArguments,)).parse_dict(values)[0]
        trainer = Trainer(model=_built_after_enable(checkpoint), args=args, train_dataset=pm.rows_for(cell),
                          data_collator=pm.collate)
        trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return trainer


def _step_losses(trainer, after=0):
    return {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row and row["step"] > after}


def test_mixtral_fp8_scaling_state_resumes_bit_exactly(tmp_path):
    """The FP8 scaling states of every attention projection and expert linear go into the Trainer
    checkpoint (fp8_checkpoint_layers, resume.py) and come back: 2 + 2 resumed steps are the 4
    uninterrupted ones, bit for bit; without the saved states they are not (the test can fail)."""
    import paddle_fastffn
    from paddle_fastffn.integration import resume

    weights = mp.save_checkpoint(mp.Row("fp8_resume", router="uneven"), str(tmp_path / "weights"))
    try:
        full = _fp8_trainer(tmp_path, "full", weights)
        checkpoint = tmp_path / "full" / "checkpoint-2"
        saved = paddle.load(resume.fp8_state_file(str(checkpoint)), return_numpy=True)
        config = mp.model_config(mp.Row("fp8_resume"))
        assert saved["recipe"]["scaling"] == "delayed"
        assert len(saved["layers"]) == config.num_hidden_layers * (4 + 3 * config.num_local_experts)
        assert not any(".gate" in name for name in saved["layers"]), "the router stays in 16 bits"
        resumed = _fp8_trainer(tmp_path, "resumed", weights, resume_from=checkpoint)
        assert sorted(_step_losses(resumed, after=2)) == [3, 4]
        for step, loss in _step_losses(resumed, after=2).items():
            assert loss == _step_losses(full)[step], (step, loss, _step_losses(full)[step])
        full_weights = full.model.state_dict()
        for name, value in resumed.model.state_dict().items():
            np.testing.assert_array_equal(value.numpy(), full_weights[name].numpy(), err_msg=name)
        os.remove(resume.fp8_state_file(str(checkpoint)))
        fresh = _fp8_trainer(tmp_path, "fresh", weights, resume_from=checkpoint)
        assert _step_losses(fresh, after=2) != _step_losses(full, after=2)
    finally:
        paddle_fastffn.revert_fast_ffn()
