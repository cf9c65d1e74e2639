"""The steps of PaddleNLP's 2.8 llm fine-tune flow that scripts/run_finetune.py takes from the
keys of paddle_fastffn.finetune.llm_arguments, with PaddleNLP's own classes and their meaning: LoRA
(rslora, LoRA+, PiSSA, quick LoRA, adapters from lora_path), NEFTune."""

from __future__ import annotations

import math

import paddle

from .llm_arguments import lora_alpha


def build_lora_model(model, model_args, training_args, dtype: str, target_modules: list[str]):
    """LoRAModel over `model` as PaddleNLP's script builds it (alpha 2 x rank, 4 with rslora, unless
    lora_alpha), or with the adapters saved in lora_path. Unlike PaddleNLP's script, the adapters
    are drawn right after seeding (training_args.seed), so two runs draw the same ones."""
    from paddlenlp.peft import LoRAConfig, LoRAModel

    from paddlenlp.trainer import set_seed

    set_seed(training_args.seed)  # the adapters depend on the seed, not on what loading the model drew
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


def prompt_and_answer_ids(tokenizer, row: dict, max_length: int, src_length: int) -> dict:
    """An evaluation example for eval_with_do_generation, as PaddleNLP's llm script builds it: the
    prompt's encoding (special tokens added, cut from the left to src_length), the answer (cut to
    what max_length leaves, </s> added when it is not cut) as labels."""
    prompt = tokenizer(row["src"], max_length=src_length, truncation=True, truncation_side="left",
                       add_special_tokens=True)  # with position_ids: LLaMA's generate() needs them
    room = max_length - len(prompt["input_ids"])
    answer = tokenizer(row["tgt"], max_length=room, truncation=True, truncation_side="right",
                       add_special_tokens=False)["input_ids"]
    if len(answer) < room:
        answer = answer + [tokenizer.eos_token_id]
    return {**prompt, "labels": answer}


def with_eval_collator(trainer_class):
    """`trainer_class` whose evaluation and prediction dataloaders collate with the keyword
    `eval_data_collator` (training keeps `data_collator`). For packed SFT: training batches flatten
    into one row, but PaddleNLP's evaluation_loop weights each batch's loss by its batch size
    (find_batch_size: rows) and trims the distributed sampler's repeated rows by count, so a
    flattened evaluation batch would change eval_loss against stock; evaluation collates a row each."""

    class EvalCollatorTrainer(trainer_class):
        def __init__(self, *args, eval_data_collator=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.eval_data_collator = eval_data_collator

        def _with_eval_collator(self, make_dataloader):
            if self.eval_data_collator is None:
                return make_dataloader()
            # The dataloaders take collate_fn=self.data_collator when built: swap it for the build.
            training, self.data_collator = self.data_collator, self.eval_data_collator
            try:
                return make_dataloader()
            finally:
                self.data_collator = training

        def get_eval_dataloader(self, eval_dataset=None):
            return self._with_eval_collator(lambda: super(EvalCollatorTrainer, self).get_eval_dataloader(eval_dataset))

        def get_test_dataloader(self, test_dataset):
            return self._with_eval_collator(lambda: super(EvalCollatorTrainer, self).get_test_dataloader(test_dataset))

    return EvalCollatorTrainer


def generation_trainer_class():
    """PaddleNLP's Trainer whose evaluation generates each prompt's answer (eval_with_do_generation:
    model.generate with the generate arguments top_k / top_p, sampling; top_k 1 is greedy), as the
    llm script's CausalLMTrainer does; the predictions are the generated ids, padded with -100."""
    from paddlenlp.trainer import Trainer

    class GenerationEvalTrainer(Trainer):
        def __init__(self, *args, gen_args, max_length: int, **kwargs):
            super().__init__(*args, **kwargs)
            self.gen_args, self.max_length = gen_args, max_length

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            if prediction_loss_only:
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            model.eval()
            tokenizer = self.tokenizer
            with paddle.no_grad():
                generated = model.generate(
                    input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                    position_ids=inputs.get("position_ids"),
                    max_length=max(self.max_length - inputs["input_ids"].shape[-1], 1), decode_strategy="sampling",
                    top_k=self.gen_args.top_k, top_p=self.gen_args.top_p, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_cache=True)[0]
            rows = [row[row != tokenizer.pad_token_id].tolist() for row in generated]
            width = max(len(row) for row in rows)
            predictions = paddle.to_tensor([row + [-100] * (width - len(row)) for row in rows])
            return None, predictions, inputs.get("labels")

    return GenerationEvalTrainer


def generation_metrics(tokenizer, output_file=None):
    """compute_metrics for eval_with_do_generation: ROUGE-1/2/L and BLEU-4 of the generated answers
    against the references (PaddleNLP's metrics), the pairs written to `output_file` when given
    (save_generation_output)."""
    import json

    from paddlenlp.metrics import BLEU, Rouge1, Rouge2, RougeL

    def compute(eval_preds) -> dict:
        decode = lambda rows: tokenizer.batch_decode([row[row != -100].tolist() for row in rows],  # noqa: E731
                                                     skip_special_tokens=True, clean_up_tokenization_spaces=False)
        predictions, references = decode(eval_preds.predictions), decode(eval_preds.label_ids)
        if output_file is not None:
            with open(output_file, "w", encoding="utf-8") as f:
                for prediction, reference in zip(predictions, references):
                    f.write(json.dumps({"output": prediction, "tgt": reference}, ensure_ascii=False) + "\n")
        rouge_l, bleu = RougeL(), BLEU(n_size=4)
        for prediction, reference in zip(predictions, references):
            rouge_l.add_inst(prediction, [reference])
            bleu.add_inst(prediction, [reference])
        return {"rouge1": Rouge1().score(predictions, references), "rouge2": Rouge2().score(predictions, references),
                "rougel": rouge_l.score(), "bleu4": bleu.score()}

    return compute
