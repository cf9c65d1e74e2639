"""Stock PaddleFormers against the fast path on a tiny LLaMA: one forward+backward (every trainable
parameter's gradient) and a few steps of PaddleFormers' Trainer (the logged losses), for the cells
users combine (padded SFT rows, full recompute, LoRA, packed rows), and emulated FP8 against the
fast path in fp32 (CPU's 16-bit stand-in). The rows and the error measure are the PaddleNLP parity
matrix's (tests/integration/parity_matrix.py); the model sizes are its awkward ones (6 query heads
over 2 KV heads, head_dim 10, intermediate 92, vocab 101), FP8 rows its FP8-aligned variant."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import paddle

from parity_matrix import (AWKWARD, EMULATED_FP8, FP8_ALIGNED, LORA_SEED, MODEL_SEED, SEQ, STEPS, _examples,
                           _padded_row, _relative_errors)

PF_AWKWARD = dict(AWKWARD, fuse_rms_norm=False)  # stock PaddleFormers' fused norm has no CPU kernel
PF_FP8_ALIGNED = dict(FP8_ALIGNED, fuse_rms_norm=False)
# Weights drawn as PaddleNLP's LlamaPretrainedModel._init_weights draws them (normal, std
# initializer_range = 0.02) for the FP8 cells, whose budget the PaddleNLP matrix's FP8 rows measured
# on such a model. PaddleFormers' constructor leaves Paddle's Xavier-uniform default (rms 0.12-0.14
# at these widths): q and k 6x larger sharpen the attention softmax, whose backward then amplifies
# FP8's q/k errors (measured 0.24 norm-wise in k_proj's gradient against 0.12 with this init).
LLAMA_INIT = "normal(0, initializer_range)"
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
LORA_TARGETS = [f".*{name}.*" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]


@dataclass(frozen=True)
class Cell:
    name: str
    config: dict = field(default_factory=dict)  # from_pretrained config overrides (recompute)
    lora: bool = False
    packed: bool = False
    batch_size: int = 4
    model: dict = field(default_factory=lambda: PF_AWKWARD)  # the checkpoint's LlamaConfig
    init: str | None = None  # None: PaddleFormers' constructor's weights; LLAMA_INIT
    fast: dict = field(default_factory=dict)  # fast_ffn_* TrainingArguments fields of the measured side

    @property
    def fp8(self) -> bool:
        return self.fast.get("fast_ffn_precision") == "fp8"

    @property
    def reference(self) -> dict | None:
        """The reference side's fast_ffn_* fields: None for stock PaddleFormers; for FP8 cells the
        fast path in fp32 (the measured side's options without FP8), so that the difference
        measured is FP8's alone."""
        if not self.fp8:
            return None
        return {k: v for k, v in self.fast.items() if k not in EMULATED_FP8 and not k.startswith("fast_ffn_fp8_")}


CELLS = [Cell("plain"), Cell("recompute_full", config=RECOMPUTE), Cell("lora", lora=True),
         Cell("lora_recompute", lora=True, config=RECOMPUTE), Cell("packing", packed=True),
         Cell("packing_recompute", packed=True, config=RECOMPUTE)]
FP8_CELLS = [
    Cell("fp8_delayed", model=PF_FP8_ALIGNED, init=LLAMA_INIT, fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="delayed")),
    Cell("fp8_current", model=PF_FP8_ALIGNED, init=LLAMA_INIT, fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="current")),
    Cell("fp8_delayed_recompute", model=PF_FP8_ALIGNED, init=LLAMA_INIT, config=RECOMPUTE,
         fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="delayed")),
    Cell("fp8_current_lora", model=PF_FP8_ALIGNED, init=LLAMA_INIT, lora=True, fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="current")),
    Cell("fp8_delayed_lora_recompute", model=PF_FP8_ALIGNED, init=LLAMA_INIT, lora=True, config=RECOMPUTE,
         fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="delayed")),
    Cell("fp8_current_packing", model=PF_FP8_ALIGNED, init=LLAMA_INIT, packed=True,
         fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="current")),
]
CELLS_BY_NAME = {cell.name: cell for cell in CELLS + FP8_CELLS}


def packed_rows(examples) -> list[dict]:
    """PaddleFormers' packed rows: examples concatenated into rows of up to SEQ tokens, position ids
    restarting, attn_mask_startend_row_indices (the causal FlashMask form, [1, SEQ, 1] a row) marking
    where each example ends; a row's padding is one more example of its own."""
    from paddle_fastffn.ops import PackedSegments

    rows, current = [], []
    for prompt, answer in examples:
        example = _padded_row(prompt, answer)
        n = int(example["attention_mask"].sum())
        if sum(len(ids) for ids, _ in current) + n > SEQ:
            rows.append(current)
            current = []
        current.append((example["input_ids"][:n].tolist(), example["labels"][:n].tolist()))
    rows.append(current)
    out = []
    for members in rows:
        ids = sum((m[0] for m in members), [])
        labels = sum((m[1] for m in members), [])
        lengths = [len(m[0]) for m in members]
        pad = SEQ - len(ids)
        segments = PackedSegments.from_row_lengths([lengths], SEQ)
        out.append({"input_ids": np.array(ids + [0] * pad, dtype="int64"),
                    "labels": np.array(labels + [-100] * pad, dtype="int64"),
                    "position_ids": np.array(sum((list(range(n)) for n in lengths), []) + list(range(pad)), "int64"),
                    "attn_mask_startend_row_indices": segments.startend_row_indices()[0]})
    return out


def rows_for(cell: Cell) -> list[dict]:
    examples = _examples(cell.model["vocab_size"])
    return packed_rows(examples) if cell.packed else [_padded_row(p, a) for p, a in examples]


def collate(features):
    return {key: paddle.to_tensor(np.stack([f[key] for f in features])) for key in features[0]}


def save_stock_checkpoint(path: str, model: dict = PF_AWKWARD, init: str | None = None, **overrides) -> str:
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    paddle.seed(MODEL_SEED)
    llama = LlamaForCausalLM(LlamaConfig(**dict(model, **overrides)))
    if init == LLAMA_INIT:
        for name, param in llama.named_parameters():
            if not name.endswith("norm.weight"):  # norms keep their ones
                param.set_value(paddle.normal(0.0, llama.config.initializer_range, param.shape).astype(param.dtype))
    elif init is not None:
        raise ValueError(f"init must be None or {LLAMA_INIT!r}, got {init!r}")
    llama.save_pretrained(path)
    return path


def training_args(cell: Cell, fast: dict | None, output_dir: str, **overrides):
    """PaddleFormers' TrainingArguments (fast None: stock) or FastFFNTrainingArguments with
    use_fast_ffn and the `fast` fast_ffn_* fields, parsed by its PdArgumentParser as a user's script
    parses them."""
    from paddleformers.trainer import PdArgumentParser, TrainingArguments

    from paddle_fastffn import FastFFNTrainingArguments

    values = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=cell.batch_size,
                  learning_rate=3e-3, weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, report_to="none",
                  device="cpu", disable_tqdm=True, save_strategy="no", seed=42, lr_scheduler_type="constant",
                  dataloader_num_workers=0, amp_master_grad=False)
    values.update(overrides)
    if fast is not None:
        return PdArgumentParser((FastFFNTrainingArguments,)).parse_dict(dict(values, use_fast_ffn=True, **fast))[0]
    return PdArgumentParser((TrainingArguments,)).parse_dict(values)[0]


def build(cell: Cell, fast: dict | None, checkpoint: str, output_dir: str):
    """(TrainingArguments, model) in the order a user creates them: the arguments first (use_fast_ffn
    enables the fast path), then from_pretrained of a stock checkpoint, then LoRA."""
    from paddleformers.transformers import LlamaForCausalLM

    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    args = training_args(cell, fast, output_dir)
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype="float32", **cell.config)
    if cell.lora:
        from paddleformers.peft import LoRAConfig, LoRAModel

        paddle.seed(LORA_SEED)
        model = LoRAModel(model, LoRAConfig(target_modules=LORA_TARGETS, r=4, lora_alpha=8, merge_weights=False))
        model.mark_only_lora_as_trainable()
    return args, model


def one_step_gradients(model, rows, batch_size: int):
    model.train()
    out = model(**collate(rows[:batch_size]))
    loss = out[0] if isinstance(out, tuple) else out.loss
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if not p.stop_gradient and p.grad is not None}
    trainable = sorted(n for n, p in model.named_parameters() if not p.stop_gradient)
    model.clear_gradients()
    return float(loss), grads, trainable


def loss_recorder():
    """A TrainerCallback keeping each logged training loss (PaddleFormers' Trainer empties
    state.log_history at every log)."""
    from paddleformers.trainer import TrainerCallback

    class LossRecorder(TrainerCallback):
        def __init__(self):
            self.losses = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    return LossRecorder()


def trainer_losses(args, model, rows) -> tuple[list, str]:
    from paddleformers.trainer import Trainer

    recorder = loss_recorder()
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[recorder])
    trainer.train()
    return recorder.losses, type(trainer.optimizer).__name__


def fp8_linears(model) -> dict:
    """{sub-layer name: Fp8Linear} attached to `model` (empty while FP8 is off)."""
    from paddle_fastffn.integration import fp8_attach

    return fp8_attach.fp8_layers(model)


def measure(cell: Cell) -> dict:
    """Runs `cell`'s reference side (stock PaddleFormers, or the fast path in fp32 for FP8 cells) and
    its fast side; returns what the tests assert, "ref" naming the reference side's figures."""
    from paddle_fastffn.ops import _loader

    import paddle_fastffn

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_stock_checkpoint(os.path.join(tmp, "checkpoint"), cell.model, cell.init)
        for side, fast in (("ref", cell.reference), ("fast", cell.fast)):
            rows = rows_for(cell)
            with paddle.utils.unique_name.guard():
                before = dict(_loader.CALL_COUNTS)
                args, model = build(cell, fast, checkpoint, os.path.join(tmp, side))
                loss, grads, trainable = one_step_gradients(model, rows, cell.batch_size)
                losses, optimizer = trainer_losses(args, model, rows)
                calls = {k: v - before.get(k, 0) for k, v in _loader.CALL_COUNTS.items() if v - before.get(k, 0)}
                fp8 = fp8_linears(model)
            result[side] = dict(loss=loss, grads=grads, trainable=trainable, losses=losses, optimizer=optimizer,
                                calls=calls, fp8_linears=sorted(fp8),
                                frozen_fp8={n: f.frozen_quantizations for n, f in fp8.items() if f.holds_frozen_weight()})
        paddle_fastffn.revert_fast_ffn()
    ref, fast = result["ref"], result["fast"]
    errors = _relative_errors(fast["grads"], {k: v for k, v in ref["grads"].items() if k in fast["grads"]})
    worst = max(errors, key=lambda n: errors[n][0])
    worst_norm = max(errors, key=lambda n: errors[n][1])
    steps = np.array(ref["losses"])
    return dict(cell=cell.name, trainable_ref=ref["trainable"], trainable_fast=fast["trainable"],
                grads_ref=sorted(ref["grads"]), grads_fast=sorted(fast["grads"]),
                loss_rel=abs(fast["loss"] - ref["loss"]) / abs(ref["loss"]),
                grad_max_rel=errors[worst][0], grad_max_rel_param=worst,
                grad_norm_rel=errors[worst_norm][1], grad_norm_rel_param=worst_norm,
                step_losses_ref=ref["losses"], step_losses_fast=fast["losses"],
                step_loss_rel=float(np.max(np.abs(np.array(fast["losses"]) - steps) / np.abs(steps))),
                optimizer_ref=ref["optimizer"], optimizer_fast=fast["optimizer"],
                kernel_calls_fast=fast["calls"], kernel_calls_ref=ref["calls"],
                fp8_linears_ref=ref["fp8_linears"], fp8_linears_fast=fast["fp8_linears"],
                frozen_fp8_fast=fast["frozen_fp8"])
