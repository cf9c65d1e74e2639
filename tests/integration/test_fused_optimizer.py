"""use_fast_ffn and PaddleNLP's Trainer: the optimizer it builds is FastAdamW (fast_ffn_fused_optimizer,
on by default), with the Trainer's own arguments, and its checkpoints resume in a Trainer running
stock paddle.optimizer.AdamW, and the reverse."""

import numpy as np
import paddle
import pytest
from llama_fixtures import tiny_model
from tolerances import adamw_tolerance

import paddle_fastffn
from paddle_fastffn.optim import FastAdamW

LEARNING_RATE = 1e-2


def _args(out, **overrides):
    from paddlenlp.trainer import PdArgumentParser

    values = dict(output_dir=str(out), use_fast_ffn=True, max_steps=2, save_steps=1, save_strategy="steps",
                  per_device_train_batch_size=4, learning_rate=LEARNING_RATE, weight_decay=0.1, logging_steps=1,
                  report_to="none", device="cpu", disable_tqdm=True, seed=7, max_grad_norm=0.5)
    values.update(overrides)
    return PdArgumentParser((paddle_fastffn.FastFFNTrainingArguments,)).parse_dict(values)[0]


def _rows():
    rng = np.random.default_rng(0)
    return [{"input_ids": ids, "labels": ids} for ids in rng.integers(3, 128, size=(8, 12)).tolist()]


def _optimizer_of(args):
    from paddlenlp.trainer import Trainer

    trainer = Trainer(model=tiny_model(), args=args, train_dataset=_rows())
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    return trainer.optimizer


def test_the_trainer_builds_fast_adamw_with_the_flag_and_stock_adamw_without(tmp_path):
    optimizer = _optimizer_of(_args(tmp_path / "fast"))
    assert type(optimizer) is FastAdamW
    # The Trainer's own arguments reach it: clipping, decay exclusions, masters under O2 (not on CPU).
    assert isinstance(optimizer._grad_clip, paddle.nn.ClipGradByGlobalNorm) and optimizer._grad_clip.clip_norm == 0.5
    assert optimizer._weight_decay == 0.1 and optimizer._apply_decay_param_fun is not None
    paddle_fastffn.revert_fast_ffn()
    assert type(_optimizer_of(_args(tmp_path / "off", fast_ffn_fused_optimizer=False))) is paddle.optimizer.AdamW
    paddle_fastffn.revert_fast_ffn()
    assert type(_optimizer_of(_args(tmp_path / "stock", use_fast_ffn=False))) is paddle.optimizer.AdamW


def _train(out, fused_optimizer, resume_from=None, **overrides):
    """Two steps of the Trainer on the fast path (fused projections either way), with FastAdamW or
    stock AdamW; resume_from: a checkpoint folder to continue from. Returns the final parameters."""
    from paddlenlp.trainer import Trainer

    paddle_fastffn.revert_fast_ffn()
    args = _args(out, fast_ffn_fused_optimizer=fused_optimizer, **overrides)
    # Fresh name counters, as in a new process: the optimizer's checkpoint keys its state by the
    # parameters' and accumulators' generated names.
    with paddle.utils.unique_name.guard():
        model = tiny_model(seed=4)
        trainer = Trainer(model=model, args=args, train_dataset=_rows())
        trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    assert type(trainer.optimizer) is (FastAdamW if fused_optimizer else paddle.optimizer.AdamW)
    return {name: value.numpy() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("first, then", [(True, False), (False, True)], ids=["fast_then_stock", "stock_then_fast"])
def test_optimizer_checkpoints_resume_across_fast_and_stock_adamw(tmp_path, first, then):
    straight = _train(tmp_path / "straight", first)  # step 1 and step 2 with the first optimizer
    resumed = _train(tmp_path / "resumed", then, resume_from=tmp_path / "straight" / "checkpoint-1")
    # Step 2 ran from the same saved parameters, moments, beta powers and LR schedule, with the other
    # optimizer: the kernels differ only in fp32 rounding (tests/tolerances.py: adamw_tolerance).
    # Were the moments or beta powers not restored, step 2 would move each weight by about the
    # learning rate (1e-2), far outside it.
    atol, rtol = adamw_tolerance(2, LEARNING_RATE)
    assert set(straight) == set(resumed)
    for name in straight:
        np.testing.assert_allclose(resumed[name], straight[name], rtol=rtol, atol=atol, err_msg=name)


INT8 = dict(fast_ffn_optimizer_moments="int8")


def test_the_trainer_passes_the_optimizer_state_options(tmp_path):
    from paddle_fastffn.core.optimizer import StateFormat

    optimizer = _optimizer_of(_args(tmp_path, fast_ffn_optimizer_master_weights="compensated", **INT8))
    assert optimizer._state_format == StateFormat("int8", "compensated")


def test_an_8bit_checkpoint_resumes_bit_exactly_and_in_stock_adamw(tmp_path):
    """fast_ffn_optimizer_moments=int8 through the Trainer's save and resume (the stock layout of
    the fused projections included): step 2 resumed with int8 moments is bit-identical to the
    straight run; stock AdamW resumes from the same checkpoint as FastAdamW with fp32 moments does
    (both read the dequantised moments: adamw_tolerance apart)."""
    straight = _train(tmp_path / "straight", True, **INT8)
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    resumed = _train(tmp_path / "resumed", True, resume_from=checkpoint, **INT8)
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)
    stock = _train(tmp_path / "stock", False, resume_from=checkpoint)
    fast = _train(tmp_path / "fast", True, resume_from=checkpoint)
    atol, rtol = adamw_tolerance(2, LEARNING_RATE)
    for name in stock:
        np.testing.assert_allclose(fast[name], stock[name], rtol=rtol, atol=atol, err_msg=name)
