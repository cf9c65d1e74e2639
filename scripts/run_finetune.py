"""Fine-tune a LLaMA-style model with PaddleNLP, optionally on paddle_fastffn's fused path.

    python scripts/run_finetune.py configs/demo_tiny_fast.json [--flag value ...]

The PaddleNLP 2.8 llm/ flow: model, data and training-argument dataclasses parsed from a JSON
file with command-line overrides (PdArgumentParser), jsonl {"src", "tgt"} train/dev files, SFT or
LoRA, evaluation and saving. `use_fast_ffn: true` patches every LLaMA decoder layer when the model
is built. Logs loss, tokens/s and peak memory, and writes them to <output_dir>/run_summary.json.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import paddle
from paddlenlp.data import DataCollatorForSeq2Seq
from paddlenlp.trainer import PdArgumentParser, Trainer, TrainerCallback, get_last_checkpoint, set_seed
from paddlenlp.utils.log import logger

from paddle_fastffn import FastFFNTrainingArguments
from paddle_fastffn.finetune.arguments import unknown_argument_error
from paddle_fastffn.finetune.checkpoint import load_model_and_tokenizer
from paddle_fastffn.finetune.data import TokenCountingCollator, TokenizedDataset
from paddle_fastffn.finetune.metrics import argmax_logits, token_accuracy
from paddle_fastffn.finetune.packing import PackedCollator, PackedDataset
from paddle_fastffn.finetune.visualdl_compat import repair_visualdl_hparams
from paddle_fastffn.integration.resume import check_checkpoint_folder
from paddle_fastffn.integration.registry import apply_to_model, family_for


@dataclass
class ModelArgument:
    model_name_or_path: str = field(metadata={"help": "A PaddleNLP checkpoint directory or model name, or a Hugging Face Hub LLaMA folder (safetensors or .bin, sharded or not)."})
    dtype: str = field(default="float32", metadata={"help": "Parameter dtype: float32, bfloat16 or float16."})
    lora: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights."})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    from_hf_hub: bool = field(default=False, metadata={"help": "Unused here (no hub access); kept for PaddleNLP parity."})


@dataclass
class DataArgument:
    dataset_name_or_path: str = field(metadata={"help": "Directory with train.json and dev.json (jsonl src/tgt)."})
    max_length: int = field(default=256, metadata={"help": "Maximum tokens of prompt + answer."})
    src_length: int = field(default=128, metadata={"help": "Maximum prompt tokens."})
    sample_prompts: int = field(default=3, metadata={"help": "Dev prompts to answer greedily after training."})
    zero_padding: bool = field(default=False, metadata={"help": "Pack examples into rows of max_length (PaddleNLP's rule: in order, a new row when the next does not fit); position ids restart and attention stays within each example."})
    greedy_zero_padding: bool = field(default=False, metadata={"help": "Pack greedily: within each run of 500 examples, each goes into the open row with the most room (implies zero_padding)."})


def lora_target_modules(config) -> list[str]:
    """PaddleNLP's names for q/k/v/o/gate/up/down, fused ones where the config fuses them."""
    attn = [".*qkv_proj.*"] if config.fuse_attention_qkv else [".*q_proj.*", ".*k_proj.*", ".*v_proj.*"]
    mlp = [".*gate_up_fused_proj.*"] if config.fuse_attention_ffn else [".*gate_proj.*", ".*up_proj.*"]
    return attn + [".*o_proj.*"] + mlp + [".*down_proj.*"]


class ThroughputCallback(TrainerCallback):
    """Adds tokens/s and peak memory to the Trainer's logs."""

    def __init__(self, counter: TokenCountingCollator):
        self.counter = counter
        self.start = None
        self.history = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.start, self.counter.tokens = time.perf_counter(), 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.start is None or "loss" not in logs:
            return
        elapsed = time.perf_counter() - self.start
        logs["tokens_per_second"] = round(self.counter.tokens / max(elapsed, 1e-9), 1)
        logs["peak_memory_mb"] = round(peak_memory_mb(), 1)
        self.history.append({"step": state.global_step, **logs})


def peak_memory_mb() -> float:
    if paddle.is_compiled_with_cuda() and "gpu" in paddle.device.get_device():
        return paddle.device.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB (process RSS)


def greedy_answer(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy decoding with full forward passes: independent of PaddleNLP 2.8.1's generate(),
    which fails on Paddle 3.x (a float mask reaches paddle.where in _prepare_decoder_attention_mask)."""
    ids = [tokenizer.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False)["input_ids"]
    start = len(ids)
    model.eval()
    with paddle.no_grad():
        for _ in range(max_new_tokens):
            out = model(paddle.to_tensor([ids]))
            logits = out[0] if isinstance(out, tuple) else out.logits
            next_id = int(paddle.argmax(logits[0, -1]))
            if next_id == tokenizer.eos_token_id:
                break
            ids.append(next_id)
    return tokenizer.decode(ids[start:], skip_special_tokens=True)


ARGUMENT_CLASSES = (ModelArgument, DataArgument, FastFFNTrainingArguments)


def parse_arguments(argv=None):
    parser = PdArgumentParser(ARGUMENT_CLASSES)
    argv = list(sys.argv[1:] if argv is None else argv)
    json_path = argv.pop(0) if argv and argv[0].endswith(".json") else None
    error = unknown_argument_error(ARGUMENT_CLASSES, json.loads(Path(json_path).read_text()) if json_path else None,
                                   argv, json_path)
    if error:
        raise error
    if json_path:
        # JSON first, command line after it: the command line wins (PaddleNLP's convention).
        return parser.common_parse(parser.read_json(json_path) + argv, False)
    return parser.parse_args_into_dataclasses(argv)


def checkpoint_to_resume(training_args, model) -> str | None:
    """resume_from_checkpoint, else (PaddleNLP's llm script) the last checkpoint-<step> in output_dir
    unless overwrite_output_dir; checked to be a Trainer checkpoint of `model`."""
    checkpoint = training_args.resume_from_checkpoint
    if checkpoint is None and training_args.do_train and not training_args.overwrite_output_dir \
            and os.path.isdir(training_args.output_dir):
        checkpoint = get_last_checkpoint(training_args.output_dir)
        if checkpoint is not None:
            logger.info(f"Checkpoint detected, resuming training at {checkpoint} (--overwrite_output_dir trains "
                        f"from scratch)")
    if checkpoint is not None:
        check_checkpoint_folder(checkpoint, model)
    return checkpoint


def main(argv=None):
    model_args, data_args, training_args = parse_arguments(argv)
    paddle.set_device(training_args.device)
    set_seed(training_args.seed)
    logger.info(f"paddle_fastffn: use_fast_ffn={training_args.use_fast_ffn} "
                f"options={training_args.fast_ffn_options().as_dict() if training_args.use_fast_ffn else {}}")

    # Tensor parallel: the config tells PaddleNLP to build (and load into) each rank's shards.
    model, tokenizer = load_model_and_tokenizer(
        model_args.model_name_or_path, model_args.dtype,
        tensor_parallel_degree=training_args.tensor_parallel_degree,
        tensor_parallel_rank=training_args.tensor_parallel_rank)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.unk_token
    if training_args.use_fast_ffn:
        family_for(model.config.model_type)  # a clear error for a model with no LLaMA-style layers
        layers = apply_to_model(model, training_args.fast_ffn_options())
        logger.info(f"paddle_fastffn: {layers} decoder layers on the fast path")

    if model_args.lora:
        from paddlenlp.peft import LoRAConfig, LoRAModel

        lora_config = LoRAConfig(target_modules=lora_target_modules(model.config), r=model_args.lora_rank,
                                 lora_alpha=model_args.lora_alpha, merge_weights=False,
                                 dtype=model_args.dtype)
        set_seed(training_args.seed)  # the adapters depend on the seed, not on what loading the model drew
        model = LoRAModel(model, lora_config)
        model.mark_only_lora_as_trainable()
        model.print_trainable_parameters()

    data_dir = Path(data_args.dataset_name_or_path)
    train_set = TokenizedDataset(tokenizer, data_dir / "train.json", data_args.max_length, data_args.src_length)
    dev_set = TokenizedDataset(tokenizer, data_dir / "dev.json", data_args.max_length, data_args.src_length)
    dev_rows = dev_set.rows  # the jsonl rows, for the sample prompts
    packing = data_args.zero_padding or data_args.greedy_zero_padding
    if packing:
        # The fast path takes each batch's example boundaries (no [seq, seq] mask); stock PaddleNLP
        # the dense 4-D block-causal mask of its InTokens datasets.
        form = "segments" if training_args.use_fast_ffn else "dense_mask"
        train_set, dev_set = (PackedDataset(data.examples, data_args.max_length,
                                            greedy=data_args.greedy_zero_padding, form=form)
                              for data in (train_set, dev_set))
        collator = TokenCountingCollator(PackedCollator(tokenizer.pad_token_id))
    else:
        collator = TokenCountingCollator(DataCollatorForSeq2Seq(
            tokenizer=tokenizer, padding=True, max_length=data_args.max_length, label_pad_token_id=-100,
            return_tensors="pd"))
    throughput = ThroughputCallback(collator)
    if "visualdl" in training_args.report_to:
        repair_visualdl_hparams()
    trainer = Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=dev_set,
                      tokenizer=tokenizer, data_collator=collator, callbacks=[throughput],
                      compute_metrics=token_accuracy, preprocess_logits_for_metrics=argmax_logits)

    summary = {"use_fast_ffn": training_args.use_fast_ffn, "device": training_args.device,
               "model": model_args.model_name_or_path, "lora": model_args.lora}
    if training_args.do_train:
        started = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args, model))
        seconds = time.perf_counter() - started
        trainer.save_model()
        summary.update(optimizer=type(trainer.optimizer).__name__,
                       train_runtime_s=round(seconds, 2), global_steps=result.global_step,
                       train_loss=result.training_loss, tokens=collator.tokens,
                       tokens_per_second=round(collator.tokens / seconds, 1),
                       step_time_ms=round(1e3 * seconds / max(result.global_step, 1), 2),
                       peak_memory_mb=round(peak_memory_mb(), 1), log_history=throughput.history,
                       packing=("greedy_zero_padding" if data_args.greedy_zero_padding else
                                "zero_padding" if packing else None),
                       padding=collator.padding.as_dict())
    if training_args.do_eval:
        metrics = trainer.evaluate()
        summary.update(eval_loss=metrics.get("eval_loss"), eval_accuracy=metrics.get("eval_accuracy"))
        logger.info(f"eval_loss {summary['eval_loss']}")
    samples = []
    for row in dev_rows[: data_args.sample_prompts]:
        prompt = row["src"]
        samples.append({"prompt": prompt, "answer": greedy_answer(model, tokenizer, prompt), "expected": row["tgt"]})
        logger.info(f"sample: {prompt!r} -> {samples[-1]['answer']!r}")
    summary["samples"] = samples
    if training_args.should_save:
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(Path(training_args.output_dir) / "run_summary.json", "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


if __name__ == "__main__":
    main()
