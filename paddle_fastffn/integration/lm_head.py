"""The fused LM head + cross-entropy for every family whose causal LM has LLaMA's shape (a base
model, an lm_head and PaddleNLP's pretraining criterion): the family file binds causal_lm_forward
and fused_head_weight to its own classes (llama.py).

The causal LM forward with labels in training mode computes the hidden states, then
ops.linear_cross_entropy on the head's weight: PaddleNLP's loss without the [tokens, vocab]
logits, which that forward does not return (logits=None; the Trainer's compute_loss reads only the
loss). Forwards without labels (generation) and in eval mode (the Trainer's evaluate/predict, whose
prediction_step hands the logits to compute_metrics) take the stock forward, as does a head the
fused loss cannot read (one info line).
"""

from __future__ import annotations

import paddle
from paddle import nn

from .. import ops
from ..ops.linear_cross_entropy import fp8_head_unsupported
from . import masks, state
from .fused_projections import distributed_layers
from .messages import info_once, warn_once


def is_plain_linear(layer) -> bool:
    """A Linear whose math is exactly x @ weight (no LoRA adapters, no tensor-parallel comms)."""
    return type(layer) is nn.Linear and getattr(layer, "bias", None) is None


def fused_head_weight(model, modeling, head_class, criterion_class):
    """(weight, transpose_weight, None) when model's LM head is a plain weight (a `head_class` or a
    plain Linear) and its criterion PaddleNLP's own (`criterion_class`), else (None, False, why not).
    `modeling`: the family's modeling module (its get_env_device)."""
    config, head = model.config, model.lm_head
    if type(getattr(model, "criterion", None)) is not criterion_class:
        return None, False, f"the criterion is {type(getattr(model, 'criterion', None)).__name__}"
    distributed = distributed_layers(config)
    if distributed or getattr(model.criterion, "enable_parallel_cross_entropy", False):
        return None, False, f"{distributed or 'tensor parallel'}: the head is sharded over the vocabulary"
    if getattr(config, "sequence_parallel", False) or (getattr(config, "sep_parallel_degree", 1) or 1) > 1:
        return None, False, "sequence parallel gathers the hidden states inside the head"
    if type(head) is not head_class and not is_plain_linear(head):
        return None, False, f"the LM head is {type(head).__name__}, not {head_class.__name__} or a plain Linear"
    if modeling.get_env_device() not in ("cpu", "gpu"):
        return None, False, f"the head runs {modeling.get_env_device()}'s own matmul"
    weight = head.weight
    if getattr(weight, "is_distributed", False):
        return None, False, "the head's weight is distributed"
    embedding = getattr(model.get_input_embeddings(), "weight", None)
    # Tied: PaddleNLP's later LlamaLMHead(transpose_y=True), or 2.8.1's tie_weights(), which sets
    # the head's weight to the [V, H] embedding; 2.8.1's own head then fails on its matmul (it
    # applies [H, V] weights only), so the fused loss gives it the tied meaning, hidden @ E^T.
    # (A square tied weight, V == H, keeps what 2.8.1's head computes, hidden @ E.)
    transpose = bool(getattr(head, "transpose_y", False)) or (weight is embedding and weight.shape[0] != weight.shape[1])
    if list(weight.shape) != ([config.vocab_size, config.hidden_size] if transpose else [config.hidden_size, config.vocab_size]):
        return None, False, f"the head's weight {list(weight.shape)} is not [hidden, vocab] or a tied [vocab, hidden]"
    return weight, transpose, None


def fp8_head_asked(family):
    """The family's Fp8Recipe where it asks for the FP8 LM head (fast_ffn_precision=fp8 running, with
    fp8_lm_head=fp8), else None."""
    recipe = family.fp8_recipe()
    return recipe if recipe is not None and recipe.lm_head == "fp8" else None


def fp8_head_recipe(family, hidden_states, weight, transpose: bool):
    """fp8_head_asked's recipe where this head can run in FP8 (ops.linear_cross_entropy's
    fp8_head_unsupported), else None; one the FP8 head cannot take stays in its own dtype with one
    warning (an error under PADDLE_FASTFFN_STRICT=1)."""
    recipe = fp8_head_asked(family)
    if recipe is None:
        return None
    why_not = fp8_head_unsupported(hidden_states.dtype, weight, transpose)
    if why_not is None:
        return recipe
    warn_once(f"fp8_head:{why_not}", f"fast_ffn_fp8_lm_head=fp8: {why_not}; the LM head stays in {hidden_states.dtype}")
    return None


def warn_fp8_head_not_run(family, why: str) -> None:
    """Where the fused loss leaves the head to stock (`why`) while the family asks for the FP8 head:
    one warning (an error under PADDLE_FASTFFN_STRICT=1), as fp8_head_recipe gives."""
    if fp8_head_asked(family) is not None:
        warn_once(f"fp8_head:{why}", f"fast_ffn_fp8_lm_head=fp8: {why}; the LM head and loss stay stock")


def causal_lm_forward(family, stock, self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                      labels=None, use_cache=False, past_key_values=None, output_attentions=None,
                      output_hidden_states=None, return_dict=None, attn_mask_startend_row_indices=None):
    """The causal LM's forward (`stock`: the family's, e.g. LlamaForCausalLM.forward) with the loss of a training step through ops.linear_cross_entropy
    (logits=None in the result), where fused_cross_entropy is on; everything else is the stock
    forward. attn_mask_startend_row_indices (PaddleNLP's packed-batch key, the causal FlashMask
    form [batch, 1, seq, 1]) marks where each packed example ends: attention keeps the examples
    apart without a dense mask (position_ids should restart at each example, as the packing
    collator gives them). `family`: its base_model(causal_lm), fused_head_weight and output_class."""
    if attn_mask_startend_row_indices is not None:
        attention_mask = masks.packed_segments(self, attn_mask_startend_row_indices, attention_mask)
    arguments = (input_ids, position_ids, attention_mask, inputs_embeds, labels, use_cache, past_key_values,
                 output_attentions, output_hidden_states, return_dict)
    options = state.current()
    if labels is None or not self.training or options is None or not options.fused_cross_entropy:
        return stock(self, *arguments)
    weight, transpose, reason = family.fused_head_weight(self)
    if weight is None:
        info_once(f"fused_ce:{reason}", f"fused_cross_entropy: {reason}; the LM head and loss stay stock")
        warn_fp8_head_not_run(family, reason)
        return stock(self, *arguments)
    config = self.config
    output_attentions = output_attentions if output_attentions is not None else config.output_attentions
    output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
    return_dict = return_dict if return_dict is not None else config.use_return_dict
    outputs = family.base_model(self)(input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                      inputs_embeds=inputs_embeds, use_cache=use_cache,
                                      past_key_values=past_key_values, output_attentions=output_attentions,
                                      output_hidden_states=output_hidden_states, return_dict=return_dict)
    hidden_states = outputs[0]
    if hidden_states.dtype == weight.dtype:
        loss = ops.linear_cross_entropy(hidden_states, weight, labels, ignore_index=self.criterion.ignore_index,
                                        transpose_weight=transpose,
                                        fp8_recipe=fp8_head_recipe(family, hidden_states, weight, transpose))
        logits = None  # never materialised
    else:  # AMP O1 mixes: the stock head (autocast casts its matmul) and criterion
        info_once("fused_ce_dtype", f"fused_cross_entropy: hidden states {hidden_states.dtype} and LM head weight "
                                    f"{weight.dtype} differ (AMP O1): the LM head and loss stay stock")
        warn_fp8_head_not_run(family, f"hidden states {hidden_states.dtype} and LM head weight {weight.dtype} "
                                      "differ (AMP O1)")
        logits = paddle.matmul(hidden_states, weight, transpose_y=True) if transpose else self.lm_head(hidden_states)
        loss = self.criterion(logits, labels)
    if not return_dict:
        return (loss, logits) + tuple(outputs[1:])
    return family.output_class()(
        loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions)
