"""Trainer checkpoints of the fast path resume exactly, and across stock and fast runs.

N + M uninterrupted steps against N steps, a checkpoint, and M resumed steps, all through
PaddleNLP's Trainer in this process. Each run builds its model and optimizer inside a fresh
unique-name scope, as a new process would: Paddle keys optimizer state by parameter names, which a
per-process counter hands out (integration/resume.py)."""

import os

import numpy as np
import paddle
import pytest
from paddlenlp.trainer import Trainer, TrainingArguments
from paddlenlp.transformers import LlamaForCausalLM

import paddle_fastffn
from llama_fixtures import tiny_config
from paddle_fastffn import FastFFNTrainingArguments
from paddle_fastffn.integration import resume
from paddle_fastffn.integration.fp8_attach import fp8_layers as fast_fp8_layers
from paddle_fastffn.integration.fused_projections import fast_fused_kinds
from tolerances import FAST_STOCK_TRAINING_LOSS_RTOL

N, M = 2, 2  # steps before the checkpoint, steps after it
SEQ, EXAMPLES = 12, 16


class Batches:
    """Fixed random token sequences (the Trainer's sampler shuffles them by its seed)."""

    def __init__(self, vocab=128):
        rng = np.random.default_rng(5)
        self.rows = [{"input_ids": rng.integers(3, vocab, SEQ), "labels": rng.integers(3, vocab, SEQ)}
                     for _ in range(EXAMPLES)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def collate(rows):
    return {key: paddle.to_tensor(np.stack([row[key] for row in rows]), dtype="int64") for key in rows[0]}


# Every decoder width a multiple of 16 (FP8's GEMM alignment), grouped-query attention.
CONFIG = dict(intermediate_size=192)


def train(output_dir, steps=N + M, fast=True, resume_from=None, lora=False, **overrides):
    """A Trainer run of the tiny LLaMA (with LoRA adapters on every projection where `lora`) for
    `steps` steps, saving every N; returns the Trainer."""
    values = dict(output_dir=str(output_dir), max_steps=steps, save_steps=N, save_strategy="steps",
                  logging_steps=1, per_device_train_batch_size=2, learning_rate=1e-2, warmup_steps=1,
                  lr_scheduler_type="cosine", weight_decay=0.01, seed=7, report_to="none", disable_tqdm=True,
                  device="cpu", dataloader_num_workers=0)
    values.update(overrides)
    with paddle.utils.unique_name.guard():
        if fast:
            args = FastFFNTrainingArguments(use_fast_ffn=True, **values)
        else:
            paddle_fastffn.revert_fast_ffn()
            args = TrainingArguments(**values)
        paddle.seed(11)
        model = LlamaForCausalLM(tiny_config(**CONFIG))
        assert bool(fast_fused_kinds(model)) == (fast and not values.get("unified_checkpoint", False))
        if lora:
            from paddlenlp.peft import LoRAConfig, LoRAModel

            # What scripts/run_finetune.py targets: the fused names where the model has them.
            fused = bool(fast_fused_kinds(model))
            targets = ([".*qkv_proj.*"] if fused else [".*q_proj.*", ".*k_proj.*", ".*v_proj.*"]) + [".*o_proj.*"]
            targets += ([".*gate_up_fused_proj.*"] if fused else [".*gate_proj.*", ".*up_proj.*"]) + [".*down_proj.*"]
            model = LoRAModel(model, LoRAConfig(target_modules=targets, r=4, lora_alpha=8, merge_weights=False))
            model.mark_only_lora_as_trainable()
        trainer = Trainer(model=model, args=args, train_dataset=Batches(), data_collator=collate)
        trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return trainer


def losses(trainer, after=0):
    """{step: logged loss} (PaddleNLP rounds to 8 decimals: every digit of an fp32 loss of ~5);
    a resumed run's history starts with the checkpoint's steps, `after` leaves those out."""
    return {row["step"]: row["loss"] for row in trainer.state.log_history if "loss" in row and row["step"] > after}


def weights(trainer):
    return {name: value.numpy() for name, value in trainer.model.state_dict().items()}


def assert_bit_exact(resumed, full, what):
    full_losses, resumed_losses = losses(full), losses(resumed, after=N)
    assert sorted(resumed_losses) == list(range(N + 1, N + M + 1)), f"{what}: steps {sorted(resumed_losses)}"
    for step, loss in resumed_losses.items():
        assert loss == full_losses[step], f"{what}: step {step} loss {loss!r} != uninterrupted {full_losses[step]!r}"
    full_weights = weights(full)
    for name, value in weights(resumed).items():
        np.testing.assert_array_equal(value, full_weights[name], err_msg=f"{what}: {name}")


def max_relative_loss_difference(resumed, reference):
    ref = losses(reference)
    return max(abs(loss - ref[step]) / abs(ref[step]) for step, loss in losses(resumed, after=N).items())


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fast")
    trainer = train(out)
    return trainer, out / f"checkpoint-{N}"


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stock")
    trainer = train(out, fast=False)
    return trainer, out / f"checkpoint-{N}"


def test_fast_path_resumes_bit_exactly(fast_run, tmp_path):
    full, checkpoint = fast_run
    resumed = train(tmp_path, resume_from=checkpoint)
    assert_bit_exact(resumed, full, "fast -> fast")


def test_fast_checkpoint_optimizer_state_is_what_stock_saves(fast_run, stock_run):
    """Names and shapes of every optimizer entry: the stock model's (the weights are stock too)."""
    fast = paddle.load(str(fast_run[1] / "optimizer.pdopt"))
    stock = paddle.load(str(stock_run[1] / "optimizer.pdopt"))
    fast.pop("LR_Scheduler"), stock.pop("LR_Scheduler")
    assert {k: list(v.shape) for k, v in fast.items()} == {k: list(v.shape) for k, v in stock.items()}
    # Each beta power is the same per part: the fused parameter's, one per stock parameter.
    assert len(fast) == 4 * len(stock_run[0].model.parameters())


def test_fast_checkpoint_resumes_in_stock(fast_run, stock_run, tmp_path):
    resumed = train(tmp_path, fast=False, resume_from=fast_run[1])
    difference = max_relative_loss_difference(resumed, fast_run[0])
    assert difference <= FAST_STOCK_TRAINING_LOSS_RTOL, difference
    assert max_relative_loss_difference(resumed, stock_run[0]) <= FAST_STOCK_TRAINING_LOSS_RTOL


def test_stock_checkpoint_resumes_on_the_fast_path(fast_run, stock_run, tmp_path):
    resumed = train(tmp_path, resume_from=stock_run[1])
    difference = max_relative_loss_difference(resumed, stock_run[0])
    assert difference <= FAST_STOCK_TRAINING_LOSS_RTOL, difference
    assert max_relative_loss_difference(resumed, fast_run[0]) <= FAST_STOCK_TRAINING_LOSS_RTOL


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_emulated_fp8_resumes_bit_exactly_with_its_scaling_state(scaling, tmp_path):
    fp8 = dict(fast_ffn_precision="fp8", fast_ffn_fp8_emulate=True, fast_ffn_fp8_scaling=scaling,
               fast_ffn_fp8_amax_history_len=4)
    full = train(tmp_path / "full", **fp8)
    checkpoint = tmp_path / "full" / f"checkpoint-{N}"
    saved = paddle.load(resume.fp8_state_file(str(checkpoint)), return_numpy=True)
    assert saved["recipe"]["scaling"] == scaling and len(saved["layers"]) == 2 * 3  # per layer: qkv, o, FFN
    resumed = train(tmp_path / "resumed", resume_from=checkpoint, **fp8)
    assert_bit_exact(resumed, full, f"FP8 {scaling}")
    if scaling == "delayed":
        # Another recipe cannot continue these histories: the error names the fields that differ.
        with paddle.utils.unique_name.guard():
            FastFFNTrainingArguments(output_dir=str(tmp_path / "other"), use_fast_ffn=True,
                                     **{**fp8, "fast_ffn_fp8_scaling": "current"})
            other = LlamaForCausalLM(tiny_config(**CONFIG))
        with pytest.raises(ValueError, match=r"another FP8 recipe, \{field: \(saved, now\)\} = \{'scaling': "
                                             r"\('delayed', 'current'\)\}"):
            resume.load_fp8_state(other, str(checkpoint))
        # The test can fail: without the scaling state the resumed run warm-starts its scales again.
        os.remove(resume.fp8_state_file(str(checkpoint)))
        fresh = train(tmp_path / "fresh", resume_from=checkpoint, **fp8)
        assert losses(fresh, after=N) != losses(full, after=N)


@pytest.mark.parametrize("fused_optimizer", [True, False], ids=["fast_adamw", "stock_adamw"])
def test_fp8_trainer_requantises_every_weight_after_every_optimizer_step(fused_optimizer, tmp_path):
    """Explicit FP8 weight freshness under the Trainer (fp8/weight_cache.py): FastAdamW marks the
    weights it updates, the stock AdamW is tracked by the Trainer integration; either way each FP8
    weight is quantised once per step, and the last step's update is seen too: the next use
    re-quantises each weight once, into the current weight's FP8 copy. (Cached copies,
    fast_ffn_fp8_weight_copies "cached"; the default quantises per use and keeps nothing to refresh.)"""
    from paddle_fastffn.fp8.emulated import EMULATED
    from paddle_fastffn.optim import FastAdamW

    steps = 3
    trainer = train(tmp_path, steps=steps, fast_ffn_precision="fp8", fast_ffn_fp8_emulate=True,
                    fast_ffn_fp8_scaling="current", fast_ffn_fused_optimizer=fused_optimizer,
                    fast_ffn_fp8_weight_copies="cached")
    assert isinstance(trainer.optimizer, FastAdamW) is fused_optimizer
    layers = fast_fp8_layers(trainer.model)
    assert layers
    for name, fp8 in layers.items():
        ffn = hasattr(fp8, "gate_up")
        per_step = 2 if ffn else 1
        assert fp8.weight_cache.quantizations == per_step * steps, name
        weights = ((fp8.gate_up.weight, fp8.states.w_gate_up), (fp8.down.weight, fp8.states.w_down)) if ffn else (
            (fp8.linear.weight, fp8.states.weight),)
        for weight, state in weights:
            cached = fp8.weight_cache.get(weight, state)  # what the next forward would use
            assert fp8.weight_cache.get(weight, state) is cached
            fresh = EMULATED.quantize_weight(weight, state)
            np.testing.assert_array_equal(cached.data.astype(paddle.float32).numpy(),
                                          fresh.data.astype(paddle.float32).numpy(), err_msg=name)
        assert fp8.weight_cache.quantizations == per_step * (steps + 1), f"{name}: the last step's update unseen"


def test_lora_checkpoints_resume_both_ways(tmp_path):
    fast, stock = train(tmp_path / "fast", lora=True), train(tmp_path / "stock", fast=False, lora=True)
    assert_bit_exact(train(tmp_path / "fast_fast", lora=True, resume_from=tmp_path / "fast" / f"checkpoint-{N}"),
                     fast, "LoRA fast -> fast")
    to_stock = train(tmp_path / "fast_stock", fast=False, lora=True, resume_from=tmp_path / "fast" / f"checkpoint-{N}")
    assert max_relative_loss_difference(to_stock, fast) <= FAST_STOCK_TRAINING_LOSS_RTOL
    to_fast = train(tmp_path / "stock_fast", lora=True, resume_from=tmp_path / "stock" / f"checkpoint-{N}")
    assert max_relative_loss_difference(to_fast, stock) <= FAST_STOCK_TRAINING_LOSS_RTOL


def test_unified_checkpoint_resumes_both_ways(tmp_path):
    unified = dict(unified_checkpoint=True)
    full = train(tmp_path / "fast", **unified)
    stock_full = train(tmp_path / "stock", fast=False, **unified)
    assert_bit_exact(train(tmp_path / "fast_fast", resume_from=tmp_path / "fast" / f"checkpoint-{N}", **unified),
                     full, "unified fast -> fast")
    to_stock = train(tmp_path / "fast_stock", fast=False, resume_from=tmp_path / "fast" / f"checkpoint-{N}", **unified)
    assert max_relative_loss_difference(to_stock, full) <= FAST_STOCK_TRAINING_LOSS_RTOL
    to_fast = train(tmp_path / "stock_fast", resume_from=tmp_path / "stock" / f"checkpoint-{N}", **unified)
    assert max_relative_loss_difference(to_fast, stock_full) <= FAST_STOCK_TRAINING_LOSS_RTOL


def cubic_step(model, optimizer):
    """One optimizer step on an elementwise loss (Paddle's CPU kernels cannot run a bf16 forward)."""
    sum((p.astype("float32") ** 3).sum() for p in model.parameters()).backward()
    optimizer.step()
    optimizer.clear_grad()


def test_low_memory_optimizer_state_resumes_bit_exactly(tmp_path):
    """fast_ffn_optimizer_moments=int8 through the Trainer's checkpoint (fp32 on the CPU: no masters)."""
    full = train(tmp_path / "full", fast_ffn_optimizer_moments="int8")
    resumed = train(tmp_path / "resumed", resume_from=tmp_path / "full" / f"checkpoint-{N}",
                    fast_ffn_optimizer_moments="int8")
    assert_bit_exact(resumed, full, "int8 moments")


def test_low_memory_state_of_amp_o2_takes_the_stock_layout_and_back(tmp_path):
    """int8 moments and compensated bf16 weights on the fast model (fused projections): its state in
    the stock layout has the keys stock multi_precision AdamW saves (plus the codes and absmax),
    and loads back into a new FastAdamW that continues bit-exactly."""
    from paddle_fastffn.optim import FastAdamW
    from paddle_fastffn.optim.adamw import QUANT_ABSMAX_KEY, QUANT_CODES_KEY

    def model_and_optimizer(model=None):
        if model is None:
            paddle_fastffn.apply_fast_ffn_to_llama()
            paddle.seed(11)
            model = LlamaForCausalLM(tiny_config(**CONFIG)).to(dtype="bfloat16")
        return model, FastAdamW(learning_rate=1e-2, parameters=model.parameters(), multi_precision=True,
                                moments="int8", master_weights="compensated")

    with paddle.utils.unique_name.guard():
        model, optimizer = model_and_optimizer()
        cubic_step(model, optimizer)
        layout = resume.StockOptimizerLayout(model)
        saved = layout.to_stock(optimizer.state_dict())
        paddle.save(saved, str(tmp_path / "optimizer.pdopt"))
        before = {n: p.clone() for n, p in model.named_parameters()}
        cubic_step(model, optimizer)
        continued = {n: p.numpy() for n, p in model.named_parameters()}
    assert any(k.endswith(QUANT_CODES_KEY) for k in saved) and "master_weights" in saved
    stock_keys = {k for k in saved if not k.endswith((QUANT_CODES_KEY, QUANT_ABSMAX_KEY))}
    assert all(k.endswith(("_moment1_0", "_moment2_0", "_pow_acc_0")) for k in stock_keys - {"master_weights"})
    for name, param in model.named_parameters():
        param.set_value(before[name])
    with paddle.utils.unique_name.guard():
        _, restored = model_and_optimizer(model)
        restored.set_state_dict(layout.from_stock(paddle.load(str(tmp_path / "optimizer.pdopt"))))
        cubic_step(model, restored)
    for name, param in model.named_parameters():
        np.testing.assert_array_equal(param.numpy(), continued[name], err_msg=name)


def test_master_weights_and_moments_of_amp_o2_take_the_stock_layout_and_back(tmp_path):
    """bf16 parameters with fp32 master weights (multi_precision, AMP O2's optimizer) on both paths,
    one FastAdamW step each on the same elementwise loss: the fast optimizer's state in the stock
    layout is the stock one, entry by entry (names, master weight names, values), and loads back
    into a new fast optimizer that continues exactly."""
    from paddle_fastffn.optim import FastAdamW

    def model_and_optimizer(fast):
        if fast:
            paddle_fastffn.apply_fast_ffn_to_llama()
        else:
            paddle_fastffn.revert_fast_ffn()
        paddle.seed(11)
        model = LlamaForCausalLM(tiny_config(**CONFIG))
        model.to(dtype="bfloat16")  # Paddle's CPU kernels cannot run a bf16 forward: an elementwise loss
        return model, FastAdamW(learning_rate=1e-2, parameters=model.parameters(), multi_precision=True)

    def entries(state):
        flat = {k: v for k, v in state.items() if k not in ("master_weights", "LR_Scheduler")}
        flat.update({f"master_weights/{k}": v for k, v in state["master_weights"].items()})
        return {k: (getattr(v, "name", None) if k.startswith("master") else None, v.numpy()) for k, v in flat.items()}

    with paddle.utils.unique_name.guard():
        stock_model, stock_optimizer = model_and_optimizer(fast=False)
        cubic_step(stock_model, stock_optimizer)
        expected = entries(stock_optimizer.state_dict())
    with paddle.utils.unique_name.guard():
        model, optimizer = model_and_optimizer(fast=True)
        cubic_step(model, optimizer)
        layout = resume.StockOptimizerLayout(model)
        saved = entries(layout.to_stock(optimizer.state_dict()))
        assert saved.keys() == expected.keys()
        for key, (name, value) in saved.items():
            assert name == expected[key][0], key
            np.testing.assert_array_equal(value, expected[key][1], err_msg=key)
        paddle.save(layout.to_stock(optimizer.state_dict()), str(tmp_path / "optimizer.pdopt"))
        install = layout.from_stock(paddle.load(str(tmp_path / "optimizer.pdopt")))
        assert entries(install).keys() == entries(optimizer.state_dict()).keys()
        before = {n: p.clone() for n, p in model.named_parameters()}
        cubic_step(model, optimizer)
        continued = {n: p.numpy() for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        param.set_value(before[name])
    with paddle.utils.unique_name.guard():  # the resuming process names its accumulators afresh
        restored = FastAdamW(learning_rate=1e-2, parameters=model.parameters(), multi_precision=True)
        restored.set_state_dict(install)
        cubic_step(model, restored)
    for name, param in model.named_parameters():
        np.testing.assert_array_equal(param.numpy(), continued[name], err_msg=name)


def test_optimizer_state_of_another_model_is_named(fast_run):
    """A stock-layout state with entries for parameters the fast model does not have (a checkpoint
    of a deeper model) fails with their names, not with Paddle's assertion at the first step."""
    state = paddle.load(str(fast_run[1] / "optimizer.pdopt"))
    state["linear_99.w_0_moment1_0"] = paddle.zeros([64, 64])
    layout = fast_run[0].optimizer._fast_ffn_stock_layout
    with pytest.raises(ValueError, match=r"1 entries for parameters this model does not have, e.g. "
                                         r"\['linear_99.w_0_moment1_0'\]"):
        layout.from_stock(state)


def test_a_checkpoint_of_the_fused_layout_still_loads(fast_run):
    """Fast checkpoints saved before the stock layout existed hold the fused names and shapes."""
    optimizer = fast_run[0].optimizer
    fused_state = type(optimizer).state_dict(optimizer)  # the class's own, not the stock-layout wrapper
    assert any(list(v.shape) == [64, 128] for k, v in fused_state.items() if k.startswith("linear_0.w_0_moment"))
    assert optimizer._fast_ffn_stock_layout.from_stock(fused_state) is fused_state
