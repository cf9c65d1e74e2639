"""scripts/run_finetune.py's arguments: the complete argument set of PaddleNLP's 2.8 llm fine-tune
script (llm/finetune_generation.py and its argument.py: same names, defaults and meaning), so its
shipped JSONs (llm/llama/sft_argument.json, lora_argument.json) run unchanged apart from paths,
plus our own keys (`dtype`, `lora_alpha`, `sample_prompts`, `from_hf_hub`) and the fast path's
(FastFFNTrainingArguments: `use_fast_ffn`, `fast_ffn_*`).

Each field says how run_finetune.py treats it (`support` in its metadata):
- IMPLEMENTED: run_finetune.py does what PaddleNLP's script does with it;
- MODEL_CONFIG: set on the model config before the model is built, as PaddleNLP's script does;
- NO_EFFECT: PaddleNLP's script does not use it either (kept so its JSONs parse);
- only_with(key): PaddleNLP's script reads it only with `key`, which this script does not support;
- Unsupported(what to use instead): a value other than the default stops the run with an error
  naming the key (quantisation, prefix tuning, AI Studio, ...).

    python -m paddle_fastffn.finetune.llm_arguments    # the table of keys, for the README
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import List, Optional

from ..integration.training_args import FastFFNTrainingArguments

IMPLEMENTED = "implemented"
MODEL_CONFIG = "model config"
NO_EFFECT = "no effect (as in PaddleNLP's script)"
OURS = "ours (not in PaddleNLP's script)"


def only_with(key: str) -> str:
    """A key PaddleNLP's script reads only together with `key` (which this script does not support)."""
    return f"read only with `{key}`"


@dataclass(frozen=True)
class Unsupported:
    instead: str

    def __str__(self):
        return f"error unless default: {self.instead}"


# help text -> support: a field's metadata goes to argparse's add_argument as it is (PdArgumentParser),
# so it carries only the help; each help text is unique.
_SUPPORT_BY_HELP: dict = {}


def arg(default, help: str, support=IMPLEMENTED):
    assert help not in _SUPPORT_BY_HELP, f"help text used twice: {help!r}"
    _SUPPORT_BY_HELP[help] = support
    return field(default=default, metadata={"help": help})


QUANTISATION = Unsupported("quantisation runs in PaddleNLP's llm script (`python -m paddle_fastffn "
                           "finetune_generation.py ...`); fine-tune here in bf16/fp16/fp32")
AISTUDIO = Unsupported("no model hub is reachable here: download the model and give its folder as "
                       "model_name_or_path")


@dataclass
class ModelArgument:
    model_name_or_path: str = arg(None, "A PaddleNLP checkpoint folder or model name, or a Hugging Face Hub LLaMA "
                                        "folder (safetensors or .bin, sharded or not).")
    tokenizer_name_or_path: Optional[str] = arg(None, "Tokenizer folder or name when it is not model_name_or_path's.")
    dtype: Optional[str] = arg(None, "Parameter dtype (float32, bfloat16, float16). Default: PaddleNLP's rule, "
                                     "bfloat16/float16 under fp16_opt_level O2 with bf16/fp16, else float32.", OURS)
    from_hf_hub: bool = arg(False, "Unused here (no hub access); kept for PaddleNLP parity.", OURS)
    use_flash_attention: bool = arg(False, "Attention through the flash / SDPA kernel.", MODEL_CONFIG)
    use_fused_rms_norm: bool = arg(False, "Fused RMSNorm (on the fast path: our kernel; stock: the fused_ln "
                                          "package).", MODEL_CONFIG)
    fuse_attention_qkv: bool = arg(False, "One q/k/v projection GEMM.", MODEL_CONFIG)
    fuse_attention_ffn: bool = arg(False, "One gate/up projection GEMM.", MODEL_CONFIG)
    recompute_granularity: str = arg("full", "What recompute recomputes: full, full_attn or core_attn.", MODEL_CONFIG)
    virtual_pp_degree: int = arg(1, "Virtual pipeline stages (pipeline parallel).", MODEL_CONFIG)
    hidden_dropout_prob: float = arg(0.1, "Hidden dropout of models that have it (LLaMA has none).", MODEL_CONFIG)
    attention_probs_dropout_prob: float = arg(0.1, "Attention dropout of models that have it (LLaMA has none).",
                                              MODEL_CONFIG)
    continue_training: bool = arg(False, "Pre-training flag of PaddleNLP's run_pretrain.py.", NO_EFFECT)
    sequence_parallel: bool = arg(False, "Sequence parallel (with tensor parallel).", MODEL_CONFIG)
    fuse_sequence_parallel_allreduce: bool = arg(False, "Fuse sequence parallel's all-reduce.", MODEL_CONFIG)
    use_fused_rope: Optional[bool] = arg(False, "Paddle's fused rotary kernel (GPU).", MODEL_CONFIG)
    no_recompute_layers: Optional[List[int]] = arg(None, "Decoder layers that recompute skips.", MODEL_CONFIG)
    pp_recompute_interval: int = arg(1, "Recompute every n-th layer under pipeline parallel.", MODEL_CONFIG)
    recompute_use_reentrant: bool = arg(False, "Reentrant (PyLayer) recompute instead of the saved-tensor hooks.",
                                        MODEL_CONFIG)
    weight_quantize_algo: str = arg(None, "Weight quantisation (nf4, fp4, weight_only_int4/8).", QUANTISATION)
    weight_blocksize: int = arg(64, "Block size of nf4/fp4 weight quantisation.", only_with("weight_quantize_algo"))
    weight_double_quant: bool = arg(False, "Quantise the nf4/fp4 scales too.", QUANTISATION)
    weight_double_quant_block_size: int = arg(256, "Block size of the double quantisation.", only_with("weight_quantize_algo"))
    lora: bool = arg(False, "Train LoRA adapters instead of all weights.")
    lora_path: str = arg(None, "Start from the LoRA adapters saved in this folder.")
    lora_rank: int = arg(8, "LoRA rank.")
    lora_alpha: Optional[int] = arg(None, "LoRA alpha. Default: PaddleNLP's script's rule, 2 x lora_rank (4 with "
                                          "rslora).", OURS)
    use_quick_lora: bool = arg(False, "PaddleNLP's quick LoRA kernel (only with lora_dropout 0).")
    rslora: bool = arg(False, "Rank-stabilised LoRA scaling (alpha / sqrt(r)).")
    lora_plus_scale: float = arg(1.0, "LoRA+: learning-rate scale of the B matrices.")
    pissa: bool = arg(False, "PiSSA: adapters initialised from the weights' principal singular vectors.")
    vera: bool = arg(False, "VeRA adapters.", Unsupported("PaddleNLP's 2.8 llm script does not build VeRA either; "
                                                          "use lora"))
    prefix_tuning: bool = arg(False, "Prefix tuning.", Unsupported("use lora (LoRA adapters on the fast path)"))
    prefix_path: str = arg(None, "Prefix-tuning weights to start from.", only_with("prefix_tuning"))
    num_prefix_tokens: int = arg(128, "Prefix tokens of prefix tuning.", only_with("prefix_tuning"))
    from_aistudio: bool = arg(False, "Load the model from AI Studio.", AISTUDIO)
    save_to_aistudio: bool = arg(False, "Upload the model to AI Studio.", Unsupported(
        "no model hub is reachable here: upload output_dir yourself"))
    aistudio_repo_id: str = arg(None, "AI Studio repository.", only_with("save_to_aistudio"))
    aistudio_repo_private: bool = arg(True, "AI Studio repository is private.", only_with("save_to_aistudio"))
    aistudio_repo_license: str = arg("Apache License 2.0", "AI Studio repository licence.", only_with("save_to_aistudio"))
    aistudio_token: str = arg(None, "AI Studio token.", only_with("save_to_aistudio"))
    neftune: bool = arg(False, "NEFTune: uniform noise on the input embeddings while training.")
    neftune_noise_alpha: float = arg(5.0, "NEFTune noise scale (alpha / sqrt(tokens x hidden)).")


@dataclass
class DataArgument:
    dataset_name_or_path: str = arg(None, "Folder with train.json and dev.json ({\"src\", \"tgt\"} per line).")
    task_name: str = arg(None, "Sub-task of a PaddleNLP built-in dataset.", Unsupported(
        "built-in datasets need a download: give a folder with train.json / dev.json"))
    zero_padding: bool = arg(False, "Pack examples into rows of max_length (PaddleNLP's InTokens rule: positions "
                                    "restarting per example, attention within each; the fast path takes the "
                                    "examples' boundaries, stock the block-causal mask).")
    greedy_zero_padding: bool = arg(False, "Pack greedily (PaddleNLP 3.x's key): within each run of 500 examples, "
                                           "each into the open row with the most room.")
    pad_to_multiple_of: int = arg(None, "Pad each batch to a multiple of this length.")
    src_length: int = arg(1024, "Maximum prompt tokens (cut from the left).")
    max_length: int = arg(2048, "Maximum prompt + answer tokens; the row length of zero_padding.")
    eval_with_do_generation: bool = arg(False, "Evaluate by generating answers (ROUGE-1/2/L, BLEU-4) instead of token "
                                               "accuracy (off with a chat template, as in PaddleNLP's script).")
    save_generation_output: bool = arg(False, "Write the generated answers to output_dir/generated_output.json "
                                              "(with eval_with_do_generation).")
    lazy: bool = arg(False, "Stream the data (an IterDataset).", Unsupported("lazy false (the data is read "
                                                                             "into memory)"))
    chat_template: str = arg(None, "The chat template for multi-turn data: a chat_template.json file or its folder, "
                                   "\"none\" for no template; default: the model folder's chat_template.json if any.")
    task_name_or_path: str = arg(None, "Deprecated name of dataset_name_or_path.")
    intokens: bool = arg(None, "Deprecated name of zero_padding.")
    sample_prompts: int = arg(3, "Dev prompts to answer greedily after training.", OURS)

    def __post_init__(self):
        # PaddleNLP's deprecated spellings keep their meaning.
        if self.task_name_or_path is not None:
            self.dataset_name_or_path = self.task_name_or_path
        if self.intokens is not None:
            self.zero_padding = self.intokens


@dataclass
class QuantArgument:
    quant_type: str = arg("a8w8", "Quantisation type.", only_with("do_ptq"))
    do_qat: bool = arg(False, "Quantisation-aware training.", QUANTISATION)
    do_ptq: bool = arg(False, "Post-training quantisation.", QUANTISATION)
    ptq_step: int = arg(32, "PTQ steps.", only_with("do_ptq"))
    weight_quant_method: str = arg("abs_max_channel_wise", "Weight quantisation method.", only_with("do_ptq"))
    shift: bool = arg(False, "Shift before quantising.", QUANTISATION)
    shift_all_linears: bool = arg(False, "Shift all linears.", only_with("shift"))
    shift_sampler: str = arg("ema", "Shift sampler.", only_with("shift"))
    shift_step: int = arg(32, "Shift steps.", only_with("shift"))
    smooth: bool = arg(False, "Smooth before quantising.", QUANTISATION)
    smooth_all_linears: bool = arg(False, "Smooth all linears.", only_with("smooth"))
    smooth_sampler: str = arg("none", "Smooth sampler.", only_with("smooth"))
    smooth_step: int = arg(32, "Smooth steps.", only_with("smooth"))
    smooth_piecewise_search: bool = arg(False, "Piecewise search for smoothing.", only_with("smooth"))
    smooth_k_piece: int = arg(3, "Pieces of the K search.", only_with("smooth"))
    smooth_search_piece: bool = arg(False, "Search the number of pieces.", only_with("smooth"))
    do_gptq: bool = arg(False, "GPTQ.", QUANTISATION)
    gptq_step: int = arg(8, "GPTQ steps.", only_with("do_gptq"))
    do_awq: bool = arg(False, "AWQ search.", QUANTISATION)
    auto_clip: bool = arg(False, "AWQ's auto clip.", QUANTISATION)
    awq_step: int = arg(8, "AWQ steps.", only_with("do_awq"))
    autoclip_step: int = arg(8, "Auto clip steps.", only_with("auto_clip"))


@dataclass
class GenerateArgument:
    top_k: int = arg(1, "Top-k of generation (with eval_with_do_generation).")
    top_p: float = arg(1.0, "Top-p of generation (with eval_with_do_generation).")


@dataclass
class FinetuneTrainingArguments(FastFFNTrainingArguments):
    """PaddleNLP's TrainingArguments, the fast path's flags, and the llm script's own additions."""
    benchmark: bool = arg(False, "Log the effective tokens per second.", "tokens/s is always logged here (and written "
                                                                         "to run_summary.json); the model is saved either way")
    autotuner_benchmark: bool = arg(False, "PaddleNLP's autotuner benchmark mode.", Unsupported(
        "PaddleNLP's llm script (`python -m paddle_fastffn finetune_generation.py ...`)"))
    decay_steps: int = arg(0, "Declared by PaddleNLP's script, which does not use it.", NO_EFFECT)


ARGUMENT_CLASSES = (GenerateArgument, QuantArgument, ModelArgument, DataArgument, FinetuneTrainingArguments)
# Fields of PaddleNLP's TrainingArguments that run_finetune.py cannot honour (not dataclass fields of
# ours, so checked by name).
TRAINING_UNSUPPORTED = {
    "pipeline_parallel_degree": (1, Unsupported(
        "PaddleNLP's Pipe model is built by its llm script: `python -m paddle_fastffn -m paddle.distributed.launch "
        "... finetune_generation.py ...` (tensor parallel and sharding run here)")),
}


def _support(f) -> object:
    return _SUPPORT_BY_HELP.get(f.metadata.get("help"), IMPLEMENTED)


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def unsupported_settings(*argument_objects) -> list[str]:
    """One message per key set away from its default that run_finetune.py does not implement."""
    problems = []
    for obj in argument_objects:
        for f in fields(obj):
            support = _support(f)
            if isinstance(support, Unsupported) and getattr(obj, f.name) != _default(f):
                problems.append(f"{f.name}={getattr(obj, f.name)!r} is not supported by scripts/run_finetune.py: "
                                f"{support.instead}")
        for name, (default, support) in TRAINING_UNSUPPORTED.items():
            if hasattr(obj, name) and getattr(obj, name) not in (default, None, 0, -1):
                problems.append(f"{name}={getattr(obj, name)!r} is not supported by scripts/run_finetune.py: "
                                f"{support.instead}")
    return problems


def check_supported(*argument_objects) -> None:
    problems = unsupported_settings(*argument_objects)
    if problems:
        raise ValueError("\n".join(problems))


def model_dtype(model_args: ModelArgument, training_args) -> str:
    """PaddleNLP's script's rule (fp16_opt_level O2 loads the model in the AMP dtype), unless `dtype`
    names one."""
    if model_args.dtype:
        return model_args.dtype
    if training_args.fp16_opt_level == "O2":
        if training_args.fp16:
            return "float16"
        if training_args.bf16:
            return "bfloat16"
        raise ValueError("fp16_opt_level='O2' loads the model in the AMP dtype: set fp16 or bf16 to true "
                         "(or dtype)")
    return "float32"


def model_config_overrides(model_args: ModelArgument, data_args: DataArgument, training_args) -> dict:
    """What PaddleNLP's script sets on the model config before building the model, as
    from_pretrained keyword arguments: the keys the model's config has (PaddleNLP's script also sets
    GPT's dropout keys on every config, where LLaMA's ignores them; as from_pretrained arguments an
    unknown key would reach the model's constructor)."""
    from paddlenlp.transformers import AutoConfig

    overrides = {f.name: getattr(model_args, f.name) for f in fields(model_args) if _support(f) == MODEL_CONFIG}
    overrides.update(use_recompute=training_args.recompute, seq_length=data_args.max_length,
                     tensor_parallel_degree=training_args.tensor_parallel_degree,
                     tensor_parallel_rank=training_args.tensor_parallel_rank,
                     sep_parallel_degree=training_args.sep_parallel_degree)
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    return {key: value for key, value in overrides.items() if hasattr(config, key)}


def lora_alpha(model_args: ModelArgument) -> int:
    """PaddleNLP's script: 2 x rank, 4 with rslora; `lora_alpha` when given."""
    if model_args.lora_alpha is not None:
        return model_args.lora_alpha
    return 4 if model_args.rslora else 2 * model_args.lora_rank


def support_table() -> str:
    """Markdown: every key of PaddleNLP's llm script and ours, its default and how run_finetune.py
    treats it."""
    rows = ["| key | default | run_finetune.py |", "|---|---|---|"]
    for cls in ARGUMENT_CLASSES:
        own = [f for f in fields(cls) if cls is not FinetuneTrainingArguments
               or f.name in {"benchmark", "autotuner_benchmark", "decay_steps"}]
        for f in own:
            rows.append(f"| `{f.name}` | `{_default(f)!r}` | {_support(f)} |")
    for name, (default, support) in TRAINING_UNSUPPORTED.items():
        rows.append(f"| `{name}` | `{default!r}` | {support} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(support_table())
