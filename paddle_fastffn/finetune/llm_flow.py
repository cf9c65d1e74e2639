"""The steps of PaddleNLP's 2.8 llm fine-tune flow that scripts/run_finetune.py takes from the
keys of paddle_fastffn.finetune.arguments, with PaddleNLP's own classes and their meaning: LoRA
(rslora, LoRA+, PiSSA, quick LoRA, adapters from lora_path), NEFTune, zero_padding."""

from __future__ import annotations

import math

import paddle

from .arguments import lora_alpha


def build_lora_model(model, model_args, training_args, dtype: str, target_modules: list[str]):
    """LoRAModel over `model` as PaddleNLP's script builds it (alpha 2 x rank, 4 with rslora, unless
    lora_alpha), or with the adapters saved in lora_path."""
    from paddlenlp.peft import LoRAConfig, LoRAModel

    if model_args.lora_path is not None:
        model = LoRAModel.from_pretrained(model=model, lora_path=model_args.lora_path)
    else:
        config = LoRAConfig(target_modules=target_modules, r=model_args.lora_rank, lora_alpha=lora_alpha(model_args),
                            rslora=model_args.rslora, lora_plus_scale=model_args.lora_plus_scale,
                            pissa=model_args.pissa, merge_weights=False,
                            tensor_parallel_degree=training_args.tensor_parallel_degree, dtype=dtype,
                            base_model_name_or_path=model_args.model_name_or_path,
                            use_quick_lora=model_args.use_quick_lora)
        model = LoRAModel(model, config)  # marks only the adapters trainable
    model.print_trainable_parameters()
    return model


def add_neftune(model, noise_alpha: float):
    """NEFTune: uniform noise in [-s, s] added to the input embeddings in training mode, with
    PaddleNLP's scale s = alpha / sqrt(batch x sequence) (the paper divides by sqrt(sequence x
    hidden)). Returns the hook's handle (remove() after training, as PaddleNLP's script does)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None:
        raise ValueError(f"neftune=true needs a model with input embeddings; {type(model).__name__} has none")

    def add_noise(layer, inputs, output):
        if not layer.training:
            return output
        scale = noise_alpha / math.sqrt(output.shape[0] * output.shape[1])
        return output + paddle.uniform(shape=output.shape, dtype=output.dtype, min=-scale, max=scale)

    return embeddings.register_forward_post_hook(add_noise)


def zero_padding_dataset(examples, tokenizer, max_length: int):
    """zero_padding: examples packed in order into rows of at most max_length tokens by PaddleNLP's
    InTokensMapDataset (what its llm script uses): one [1, L, L] block-causal mask per row."""
    from paddlenlp.datasets import InTokensMapDataset

    return InTokensMapDataset(examples, tokenizer=tokenizer, max_length=max_length)


def predicted_tokens(logits, labels):
    """preprocess_logits_for_metrics: the argmax token per position, so evaluation gathers [batch,
    seq] ids instead of [batch, seq, vocab] logits (what PaddleNLP's CausalLMTrainer does)."""
    if isinstance(logits, (list, tuple)):
        logits = logits[0]
    return logits.argmax(axis=-1)


def token_accuracy(eval_preds) -> dict:
    """compute_metrics of PaddleNLP's llm script: the share of labelled tokens (labels != -100)
    whose argmax prediction is the label (PaddleNLP's LLaMA labels are already shifted)."""
    import numpy as np

    predictions = np.asarray(eval_preds.predictions).reshape(-1)
    labels = np.asarray(eval_preds.label_ids).reshape(-1)
    labelled = labels != -100
    return {"accuracy": float((predictions[labelled] == labels[labelled]).mean()) if labelled.any() else 0.0}
