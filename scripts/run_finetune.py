"""Fine-tune a LLaMA-style model with PaddleNLP, optionally on paddle_fastffn's fused path.

    python scripts/run_finetune.py configs/demo_tiny_fast.json [--flag value ...]

The PaddleNLP 2.8 llm/ flow: its complete argument set (paddle_fastffn/finetune/llm_arguments.py: the
keys of llm/finetune_generation.py and its argument.py, same names, defaults and meaning; keys this
script does not implement stop it with an error that says what to use) parsed from a JSON file with
command-line overrides (PdArgumentParser), jsonl {"src", "tgt"} train/dev files, SFT or LoRA,
evaluation and saving. `use_fast_ffn: true` patches every LLaMA decoder layer when the model
is built. Logs loss, tokens/s and peak memory, and writes them to <output_dir>/run_summary.json.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path

with warnings.catch_warnings():
    # `import paddle` imports paddle.utils.cpp_extension, which warns "No ccache found" (about
    # rebuilding custom ops; ours are cached by a hash of their sources), and paddlenlp's imports
    # bring setuptools' "Setuptools is replacing distutils": two warnings on every run that ask
    # nothing of the user. Only these two messages are filtered, and only during these imports.
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    warnings.filterwarnings("ignore", message="Setuptools is replacing distutils", category=UserWarning)
    import paddle
    from paddlenlp.data import DataCollatorForSeq2Seq
    from paddlenlp.trainer import Trainer, TrainerCallback, get_last_checkpoint, set_seed
    from paddlenlp.utils.log import logger

from paddle_fastffn.finetune import llm_flow
from paddle_fastffn.finetune.argument_errors import command_line_names, unknown_argument_error
from paddle_fastffn.finetune.chat import ConversationDataset, select_chat_template
from paddle_fastffn.finetune.checkpoint import load_model_and_tokenizer, load_tokenizer
from paddle_fastffn.finetune.data import TokenCountingCollator, TokenizedDataset
from paddle_fastffn.finetune.input_checks import ArgumentParser, InputError, check_inputs, read_json_config
from paddle_fastffn.finetune.llm_arguments import (ARGUMENT_CLASSES, check_supported, model_config_overrides,
                                                   model_dtype)
from paddle_fastffn.finetune.metrics import argmax_logits, token_accuracy
from paddle_fastffn.finetune.packing import PackedCollator, PackedDataset, is_packed_row
from paddle_fastffn.finetune.visualdl_compat import repair_visualdl_hparams
from paddle_fastffn.integration.fp8_attach import fp8_fallback_reason
from paddle_fastffn.integration.registry import apply_to_model, family_for, family_state
from paddle_fastffn.integration.resume import check_checkpoint_folder


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


def flatten_packed_batches(training_args, config, neftune) -> bool:
    """Whether the fast path's packed training batches flatten into one row (PackedCollator's
    default, no padding work; attention is per segment, so training is the same), or stay a row
    each where the layout changes what stock computes:
    - fast_ffn_attention off: the segments become PaddleNLP's dense mask, [tokens, tokens] for a
      flattened batch against a [seq, seq] per row;
    - NEFTune: its noise scale is alpha / sqrt(batch x sequence) of the tensor it sees, so one row
      of the batch's real tokens would get other noise than stock's rows;
    - dynamic NTK rope (rope_scaling_type="dynamic_ntk", or use_long_sequence_strategies, whose
      strategies include it and which stock's attention serves): the rotary table is rescaled when the
      row is longer than max_position_embeddings, which a flattened row can be where no packed row is."""
    if not training_args.use_fast_ffn or not training_args.fast_ffn_attention or neftune is not None:
        return False  # stock's dense-mask rows; the dense mask; NEFTune
    return (getattr(config, "rope_scaling_type", None) != "dynamic_ntk"
            and not getattr(config, "use_long_sequence_strategies", False))


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


def parse_arguments(argv=None):
    """(generate, quant, model, data, training) arguments, as PaddleNLP's llm script parses them. A
    mistake (an unknown key, a value of the wrong type, an option that cannot take effect here)
    raises InputError, one line naming the argument and where it came from."""
    argv = list(sys.argv[1:] if argv is None else argv)
    json_path = argv.pop(0) if argv and argv[0].endswith(".json") else None
    json_values = read_json_config(json_path) if json_path else None
    asks_for_help = "-h" in argv or "--help" in argv  # argparse prints the usage and exits
    error = None if asks_for_help else unknown_argument_error(ARGUMENT_CLASSES, json_values, argv, json_path)
    if error:
        raise InputError(str(error))
    parser = ArgumentParser(ARGUMENT_CLASSES, json_path, command_line_names(argv))
    # JSON first, command line after it: the command line wins (PaddleNLP's convention).
    args = (parser.read_json(json_path) if json_path else []) + argv
    try:
        return parser.common_parse(args, False)
    except InputError:
        raise
    except ValueError as error:  # the argument classes' own checks (__post_init__): one line each
        raise InputError(str(error).strip().replace("\n", " ")) from None


def end_of_run_line(summary: dict) -> str:
    """The run in one line: steps, losses, throughput, and an FP8 fallback if there was one."""
    parts = [f"use_fast_ffn={summary['use_fast_ffn']}"]
    if "global_steps" in summary:
        parts.append(f"{summary['global_steps']} steps, train_loss {summary['train_loss']:.4f}, "
                     f"{summary['tokens_per_second']} tokens/s, {summary['step_time_ms']} ms/step")
    if summary.get("eval_loss") is not None:
        parts.append(f"eval_loss {summary['eval_loss']:.4f}")
    if summary.get("fp8_fallback"):
        parts.append(f"FP8 NOT USED: {summary['fp8_fallback']}")
    return "paddle_fastffn: run summary: " + "; ".join(parts)


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
    # PaddleNLP's logger starts at DEBUG (a 150-line dump of the arguments); PADDLE_FASTFFN_LOG_LEVEL=DEBUG keeps it.
    logger.set_level(os.environ.get("PADDLE_FASTFFN_LOG_LEVEL", "INFO").upper())
    gen_args, quant_args, model_args, data_args, training_args = parse_arguments(argv)
    try:
        check_supported(gen_args, quant_args, model_args, data_args, training_args)
        model_dtype(model_args, training_args)
    except ValueError as error:
        raise InputError(str(error).replace("\n", "; ")) from None
    check_inputs(model_args, data_args, training_args)  # before anything loads, downloads or writes
    paddle.set_device(training_args.device)
    set_seed(training_args.seed)
    logger.info(f"paddle_fastffn: use_fast_ffn={training_args.use_fast_ffn} "
                f"options={training_args.fast_ffn_options().as_dict() if training_args.use_fast_ffn else {}}")

    # The model config as PaddleNLP's llm script sets it (its switches, recompute, tensor parallel:
    # the config tells PaddleNLP to build, and load into, each rank's shards).
    dtype = model_dtype(model_args, training_args)
    model, tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, dtype,
                                                **model_config_overrides(model_args, data_args, training_args))
    if model_args.tokenizer_name_or_path:
        tokenizer = load_tokenizer(model_args.tokenizer_name_or_path)
    select_chat_template(tokenizer, model_args.model_name_or_path, data_args.chat_template)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.unk_token
    if training_args.use_fast_ffn:
        family_for(model.config.model_type)  # a clear error for a model with no LLaMA-style layers
        layers = apply_to_model(model, training_args.fast_ffn_options())
        logger.info(f"paddle_fastffn: {layers} decoder layers on the fast path")

    config = model.config  # the base model's (before a LoRA wrapper)
    neftune = llm_flow.add_neftune(model, model_args.neftune_noise_alpha) if (
        training_args.do_train and model_args.neftune) else None
    if model_args.lora:
        model = llm_flow.build_lora_model(model, model_args, training_args, dtype, lora_target_modules(model.config))

    data_dir = Path(data_args.dataset_name_or_path)
    # As PaddleNLP's script: a tokenizer with a chat template (the model folder's chat_template.json,
    # or the chat_template key) tokenizes conversations through it.
    dataset_class = TokenizedDataset if tokenizer.chat_template is None else ConversationDataset
    train_set = dataset_class(tokenizer, data_dir / "train.json", data_args.max_length, data_args.src_length)
    dev_set = dataset_class(tokenizer, data_dir / "dev.json", data_args.max_length, data_args.src_length)
    train_rows, dev_rows = train_set, dev_set
    generate = data_args.eval_with_do_generation and tokenizer.chat_template is None  # as PaddleNLP's script
    if generate:  # prompts to answer, the answers as labels (never packed)
        dev_rows = [llm_flow.prompt_and_answer_ids(tokenizer, row, data_args.max_length, data_args.src_length)
                    for row in dev_set.rows]
    packing = data_args.zero_padding or data_args.greedy_zero_padding
    if packing:
        # Rows of up to max_length (PaddleNLP's zero_padding rule, or the greedy one). The fast path
        # takes each batch's example boundaries (no [seq, seq] mask), its rows flattened to one row
        # by PackedCollator (no padding to the batch's longest row); stock PaddleNLP the dense 4-D
        # block-causal mask of its InTokens datasets, a row each.
        form = "segments" if training_args.use_fast_ffn else "dense_mask"
        train_rows = PackedDataset(train_set.examples, data_args.max_length, greedy=data_args.greedy_zero_padding,
                                   form=form)
        if not generate:
            dev_rows = PackedDataset(dev_set.examples, data_args.max_length, greedy=data_args.greedy_zero_padding,
                                     form=form)
    # No max_length: with padding=True the tokenizer ignores it (and warns on every run that it does).
    collate = DataCollatorForSeq2Seq(tokenizer=tokenizer, padding=True,
                                     label_pad_token_id=-100, return_tensors="pd",
                                     pad_to_multiple_of=data_args.pad_to_multiple_of)
    eval_collate = collate
    if packing:  # packed rows; with eval_with_do_generation the evaluation's prompts stay plain
        plain = collate
        packed = PackedCollator(tokenizer.pad_token_id, data_args.pad_to_multiple_of,
                                flatten=None if flatten_packed_batches(training_args, config, neftune) else False)
        per_row = PackedCollator(tokenizer.pad_token_id, data_args.pad_to_multiple_of, flatten=False)
        collate = lambda rows: packed(rows) if is_packed_row(rows[0]) else plain(rows)  # noqa: E731
        # Evaluation a row each: llm_flow.with_eval_collator says why.
        eval_collate = lambda rows: per_row(rows) if is_packed_row(rows[0]) else plain(rows)  # noqa: E731
    collator = TokenCountingCollator(collate)
    throughput = ThroughputCallback(collator)
    if "visualdl" in training_args.report_to:
        repair_visualdl_hparams()
    common = dict(model=model, args=training_args, train_dataset=train_rows, eval_dataset=dev_rows,
                  tokenizer=tokenizer, data_collator=collator, callbacks=[throughput])
    if generate:
        output_file = (Path(training_args.output_dir) / "generated_output.json"
                       if data_args.save_generation_output else None)
        trainer = llm_flow.generation_trainer_class()(
            **common, gen_args=gen_args, max_length=data_args.max_length,
            compute_metrics=llm_flow.generation_metrics(tokenizer, output_file))
    else:
        trainer = llm_flow.with_eval_collator(Trainer)(**common, eval_data_collator=eval_collate,
                                                       compute_metrics=token_accuracy,
                                                       preprocess_logits_for_metrics=argmax_logits)

    summary = {"use_fast_ffn": training_args.use_fast_ffn, "device": training_args.device,
               "model": model_args.model_name_or_path, "lora": model_args.lora}
    if training_args.do_train:
        started = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args, model))
        seconds = time.perf_counter() - started
        if neftune is not None:
            neftune.remove()
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
    for row in dev_set.rows[: data_args.sample_prompts]:
        prompt = row["src"]
        if not isinstance(prompt, str) or tokenizer.chat_template is not None:
            break  # the greedy samples are plain single-turn prompts
        samples.append({"prompt": prompt, "answer": greedy_answer(model, tokenizer, prompt), "expected": row["tgt"]})
        logger.info(f"sample: {prompt!r} -> {samples[-1]['answer']!r}")
    summary["samples"] = samples
    summary["fp8_fallback"] = fp8_fallback_reason() if training_args.use_fast_ffn else None
    # How often the class-level patch was applied in this run (once: the TrainingArguments enable
    # it, and apply_to_model then only sets the model's own settings).
    summary["patch_applications"] = (family_state(config.model_type).applications
                                     if training_args.use_fast_ffn else 0)
    logger.info(end_of_run_line(summary))
    if training_args.should_save:
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(Path(training_args.output_dir) / "run_summary.json", "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


if __name__ == "__main__":
    try:
        main()
    except InputError as input_error:  # the user's mistake: one line, no traceback
        print(f"run_finetune.py: error: {input_error}", file=sys.stderr)
        sys.exit(2)
