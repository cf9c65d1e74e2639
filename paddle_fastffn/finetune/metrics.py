"""Evaluation metrics of scripts/run_finetune.py: PaddleNLP's llm script's token accuracy.

PaddleNLP 2.8's llm/finetune_generation.py evaluates with compute_metrics from llm/utils.py: the
argmax of the logits (taken in CausalLMTrainer.prediction_step, so the [tokens, vocab] logits are
never gathered) against the labels, over the positions whose label is not -100 (PaddleNLP's
criterion does not shift: label i is the token after input i). `metric_for_best_model: "accuracy"`
reads it as eval_accuracy.
"""

from __future__ import annotations

import numpy as np

from .data import IGNORE_INDEX


def argmax_logits(logits, labels):
    """Trainer(preprocess_logits_for_metrics=...): keep the predicted token ids per evaluation
    batch instead of the logits."""
    if isinstance(logits, (list, tuple)):
        logits = logits[0]
    return logits.argmax(axis=-1)


def token_accuracy(eval_preds) -> dict:
    """{"accuracy": share of the labelled tokens predicted exactly} (llm/utils.py's compute_metrics,
    its sklearn accuracy_score as the mean of the matches)."""
    predictions = np.asarray(eval_preds.predictions).reshape(-1)
    labels = np.asarray(eval_preds.label_ids).reshape(-1)
    if predictions.shape != labels.shape:
        raise ValueError(f"token_accuracy: {predictions.size} predicted tokens for {labels.size} labels "
                         f"(pass preprocess_logits_for_metrics=argmax_logits)")
    scored = labels != IGNORE_INDEX
    return {"accuracy": float(np.mean(predictions[scored] == labels[scored])) if scored.any() else 0.0}
