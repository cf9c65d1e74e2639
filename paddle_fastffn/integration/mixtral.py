"""The fast path for PaddleNLP's Mixtral family (paddlenlp.transformers.mixtral): LLaMA's attention,
norms and rotary around a sparse mixture-of-experts FFN (MixtralSparseMoeBlock: a `gate` router and
experts w1/w3/w2).

On the fast path (class-level patches, as llama.py's):
- MixtralRMSNorm -> ops.rms_norm; the decoder layer runs core.decoder.decoder_layer over llama.py's
  layer parts (the attention residual add fused into the post-attention norm);
- rotary -> llama.py's fused rotary; attention -> PaddleNLP's use_flash_attention path (SDPA) through
  masks.py (packed batches' segments, the decode-time causal mask, implied mask and positions);
- each expert's SwiGLU FFN -> core.decoder.mlp over its w1/w3/w2 (ops.swiglu on the token set the
  router gave it; LoRA and other linears keep their forwards);
- routing as stock computes it (fp32 softmax, top-k, renormalised, cast back), tokens dispatched by
  one stable sort (one host read per layer, not one per expert); experts no token reached are
  skipped, so their parameters get no gradient, as in stock. The MoE forward is also the repair
  that lets Mixtral run on Paddle 3.x: stock indexes routing_weights with paddle.where's
  [n, 1] indices of Paddle 2.x and fails on Paddle 3's 1-D ones;
- the LM head + loss through lm_head.py (ops.linear_cross_entropy, logits=None in training), the
  auxiliary load-balancing loss added as stock adds it (its own load_balancing_loss_func);
- the optimizer through trainer.py (family-neutral);
- FP8 (precision="fp8", through fp8_attach.py as LLaMA's): q/k/v/o_proj and each expert's w1, w3, w2
  through Fp8Linear (LoRA's base GEMM too), SwiGLU in 16 bits between: not the FP8 FFN, whose one
  [gate | up] weight only a per-step copy of w1 and w3 could present. The router keeps 16 bits.
Stock, by design or with one warning: MixtralAttention.forward (separate q/k/v, no fused projection
in PaddleNLP 2.8.1: FUSED_LAYOUTS is empty, so fuse_projections and swiglu_recompute do not apply),
hidden_act other than silu (the experts' MLP), AMP O1 dtype mixes and sequence parallel.
"""

from __future__ import annotations

from types import SimpleNamespace

import paddle
import paddle.nn.functional as F

from .. import ops
from ..core import decoder as core_decoder
from . import fp8_attach, lm_head, lora_forward, masks, state
from .family import TableFamily
from .fused_projections import remember_stock, save_pretrained_stock
from .llama import _DecoderLayerParts, fast_apply_rotary_pos_emb
from .lora import install_lora_hooks
from .messages import info_once, warn_once
from .options import FastFFNOptions

MODEL_TYPES = ("mixtral",)
LIBRARY = "paddlenlp"
FUSED_LAYOUTS: dict = {}  # PaddleNLP 2.8.1 builds no fused q/k/v or w1/w3 sub-layer for Mixtral
_STATE = state.for_family(__name__.rpartition(".")[2])
is_plain_linear = lm_head.is_plain_linear


def _modeling():
    from paddlenlp.transformers.mixtral import modeling

    return modeling


modeling_module = _modeling


def device_keeps_norm(config) -> bool:
    return False  # Mixtral has no device-specific fused norm


def fast_rms_norm_forward(self, hidden_states):
    if hidden_states.dtype != self.weight.dtype:
        warn_once("mixtral_norm_dtype", f"MixtralRMSNorm input {hidden_states.dtype} and weight "
                                        f"{self.weight.dtype} differ (AMP O1): those norms keep PaddleNLP's math")
        return _STATE.originals["rms_norm"](self, hidden_states)
    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _ExpertParts:
    """core.decoder's MLP parts (the unfused variant) over one MixtralMLP expert."""

    def __init__(self, expert):
        self.expert = expert

    def gate(self, x):
        return self.expert.w1(x)

    def up(self, x):
        return self.expert.w3(x)

    def swiglu(self, gate, up):
        return ops.swiglu(gate, up, reuse_input_memory=True)  # both are this forward's own intermediates

    def down(self, h):
        return self.expert.w2(h)


def fast_expert_forward(self, x):
    """MixtralMLP.forward: w2(silu(w1 x) * w3 x) with the fused SwiGLU."""
    if type(self.act_fn).__name__ != "SiLUActivation":  # PaddleNLP's ACT2FN["silu"]
        warn_once("mixtral_act", f"hidden_act={self.act_fn!r} is not silu: the experts keep PaddleNLP's MLP")
        return _STATE.originals["mlp"](self, x)
    if state.current() is not None and state.current().swiglu_recompute:
        info_once("mixtral_recompute", "Mixtral's experts have separate w1/w3 (no fused gate/up projection): the "
                                       "SwiGLU output is stored, swiglu_recompute does not apply")
    return core_decoder.mlp(_ExpertParts(self), x, "unfused")


def route(router_logits, top_k: int, dtype):
    """(routing weights [tokens, top_k], selected experts [tokens, top_k]) as MixtralSparseMoeBlock
    computes them: softmax in fp32 over every expert, the top k, renormalised, cast to `dtype`."""
    with paddle.amp.auto_cast(False):
        weights = F.softmax(router_logits.astype("float32"), axis=1)
    weights, selected = paddle.topk(weights, top_k, axis=-1)
    weights /= weights.sum(axis=-1, keepdim=True)
    return weights.astype(dtype), selected


def fast_moe_forward(self, hidden_states):
    """MixtralSparseMoeBlock.forward: route, then each expert on the tokens it was given (one
    gather and one index_add for all experts; expert order kept, so each token's outputs are summed
    in stock's order). Returns (hidden states, router logits) as stock."""
    batch, seq, hidden = hidden_states.shape
    x = hidden_states.reshape([-1, hidden])
    router_logits = self.gate(x)
    weights, selected = route(router_logits, self.top_k, x.dtype)
    flat = selected.reshape([-1])  # token t's k-th choice at t * top_k + k
    order = paddle.argsort(flat, stable=True)
    counts = paddle.bincount(flat, minlength=self.num_experts).tolist()  # the one host read
    tokens = order // self.top_k
    inputs = paddle.gather(x, tokens)
    outputs, start = [], 0
    for expert, count in zip(self.experts, counts):
        if count:  # an expert no token reached is not run (its parameters get no gradient, as stock)
            outputs.append(expert(inputs[start:start + count]))
        start += count
    expert_out = paddle.concat(outputs) if len(outputs) > 1 else outputs[0]
    expert_out = expert_out * paddle.gather(weights.reshape([-1]), order).unsqueeze(-1)
    out = paddle.zeros_like(x).index_add(tokens, 0, expert_out.astype(x.dtype))
    return out.reshape([batch, seq, hidden]), router_logits


class _LayerParts(_DecoderLayerParts):
    """llama.py's layer parts over a MixtralDecoderLayer: its attention takes no npu_is_casual and
    its MoE block returns the router logits beside the hidden states."""

    router_logits = None

    def self_attention(self, x):
        layer, arguments = self.layer, self.attention_arguments
        if (layer.enable_recompute and layer.layerwise_recompute and not x.stop_gradient
                and layer.recompute_granularity == "full_attn"):
            outputs = _modeling().recompute(layer.self_attn, x, *arguments,
                                            use_reentrant=layer.config.recompute_use_reentrant)
        else:
            outputs = layer.self_attn(x, *arguments)
        self.attention_extras = tuple(outputs[1:]) if isinstance(outputs, tuple) else ()
        return outputs[0] if isinstance(outputs, tuple) else outputs

    def mlp(self, x):
        y, self.router_logits = self.layer.block_sparse_moe(x)
        return y


def fast_decoder_layer_forward(self, hidden_states, position_ids=None, attention_mask=None, output_attentions=False,
                               output_router_logits=False, past_key_value=None, use_cache=False):
    arguments = (position_ids, attention_mask, output_attentions, output_router_logits, past_key_value, use_cache)
    if self.sequence_parallel or type(self.post_attention_layernorm) is not _modeling().MixtralRMSNorm:
        warn_once("mixtral_layer", "sequence parallel or a replaced norm: Mixtral's residual adds and norms keep "
                                   "PaddleNLP's math (the experts, rotary and attention still apply)")
        return _STATE.originals["decoder_layer"](self, hidden_states, *arguments)
    parts = _LayerParts(self, (position_ids, past_key_value, attention_mask, output_attentions, use_cache), False)
    result = (core_decoder.decoder_layer(parts, hidden_states),) + parts.attention_extras
    result += (parts.router_logits,) if output_router_logits else ()
    return result[0] if len(result) == 1 else result


def fast_scaled_dot_product_attention(query_states, config, key_states, value_states, attention_mask,
                                      output_attentions, training=True, sequence_parallel=False):
    def stock(q, config, k, v, mask, output_attentions, _alibi, sequence_parallel, **_llama_only):
        return _STATE.originals["sdpa"](q, config, k, v, mask, output_attentions, training, sequence_parallel)
    return masks.scaled_dot_product_attention(stock, query_states, config, key_states, value_states, attention_mask,
                                              output_attentions, None, sequence_parallel)


def fast_prepare_decoder_attention_mask(attention_mask, input_shape, past_key_values_length, dtype):
    return masks.prepare_decoder_attention_mask(_STATE.originals["prepare_mask"], attention_mask, input_shape,
                                                past_key_values_length, dtype)


def fast_is_casual_mask(attention_mask):
    return masks.is_casual_mask(_STATE.originals["is_casual_mask"], attention_mask)


def fast_model_forward(self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                       use_cache=None, past_key_values=None, output_attentions=False, output_hidden_states=None,
                       output_router_logits=None, return_dict=False, **kwargs):
    """MixtralModel.forward with the causal mask and positions implied where only the fast forwards
    read them (masks.CAUSAL_MASK, IMPLICIT_POSITIONS), as llama.fast_llama_model_forward; the FP8
    objects and the fused LoRA forward (lora_forward.py) attached first."""
    if _STATE.fp8 is not None:
        attach_fp8(self, _STATE.fp8)
    lora_forward.attach_lora_forwards(getattr(self, "layers", []))
    config, options = self.config, state.current()
    fresh = options is not None and not use_cache and (past_key_values is None
                                                       or all(p is None for p in past_key_values))
    if fresh and attention_mask is None and options.attention and config.use_flash_attention:
        attention_mask = masks.CAUSAL_MASK
    if fresh and position_ids is None and options.rotary and not config.use_fused_rope:
        position_ids = masks.IMPLICIT_POSITIONS
    return _STATE.originals["model_forward"](
        self, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
        inputs_embeds=inputs_embeds, use_cache=use_cache, past_key_values=past_key_values,
        output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        output_router_logits=output_router_logits, return_dict=return_dict, **kwargs)


class _Head:
    """lm_head.causal_lm_forward's view of one MixtralForCausalLM call: the base model asked for the
    router logits, its outputs kept for the auxiliary loss."""

    def __init__(self, router):
        self.router, self.outputs = router, None

    def base_model(self, causal_lm):
        def run(*args, **kwargs):
            self.outputs = causal_lm.mixtral(*args, output_router_logits=self.router, **kwargs)
            return self.outputs
        return run

    fused_head_weight = staticmethod(lambda model: fused_head_weight(model))
    fp8_recipe = staticmethod(lambda: _STATE.fp8)
    output_class = staticmethod(lambda: _modeling().MoECausalLMOutputWithPast)


def fast_causal_lm_forward(self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                           labels=None, use_cache=False, past_key_values=None, output_attentions=None,
                           output_hidden_states=None, output_router_logits=None, return_dict=None,
                           attn_mask_startend_row_indices=None):
    """MixtralForCausalLM.forward: the training loss through lm_head.causal_lm_forward (fused LM head +
    cross-entropy, packed batches), plus router_aux_loss_coef * the load-balancing loss as stock adds
    it. PaddleNLP 2.8.1's signature spelled out (its Layer wraps class-level forward patches by it)."""
    router = output_router_logits if output_router_logits is not None else self.config.output_router_logits
    if router and attention_mask is not None and attention_mask.ndim == 2 and not paddle.is_floating_point(attention_mask):
        # Stock's load-balancing loss multiplies the 2-D keep-mask into float32 tensors: an integer
        # mask (what collators give) fails Paddle 3.x's type promotion. The mask means the same as float.
        attention_mask = attention_mask.astype("float32")
    head = _Head(router)

    def stock(model, *arguments):  # lm_head's argument order lacks output_router_logits
        return _STATE.originals["causal_lm_forward"](model, *arguments[:-1], router, arguments[-1])
    result = lm_head.causal_lm_forward(head, stock, self, input_ids, position_ids, attention_mask, inputs_embeds,
                                       labels, use_cache, past_key_values, output_attentions, output_hidden_states,
                                       return_dict, attn_mask_startend_row_indices)
    if head.outputs is None:  # the stock forward ran (it adds the auxiliary loss itself)
        return result
    outputs, as_dict = head.outputs, not isinstance(result, tuple)
    loss, logits = (result.loss, result.logits) if as_dict else result[:2]  # logits: None unless AMP O1 mixes
    aux_loss = None
    if router:
        aux_loss = _modeling().load_balancing_loss_func(outputs.router_logits if as_dict else outputs[-1],
                                                        self.num_experts, self.num_experts_per_tok, attention_mask)
        loss = loss + self.router_aux_loss_coef * aux_loss
    if not as_dict:
        return (loss,) + ((aux_loss,) if router else ()) + (logits,) + tuple(outputs[1:])
    return _modeling().MoECausalLMOutputWithPast(
        loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions, router_logits=outputs.router_logits)


def fused_head_weight(model):
    from paddlenlp.utils.tools import get_env_device

    modeling = _modeling()
    return lm_head.fused_head_weight(model, SimpleNamespace(get_env_device=get_env_device), modeling.MixtralLMHead,
                                     modeling.MixtralPretrainingCriterion)


# --- FP8 GEMMs (precision="fp8"; the module docstring says what runs in FP8) -------------------------

def attach_fp8(mixtral_model, recipe) -> int:
    """fp8_attach.attach_fp8 over the decoder layers: an Fp8Linear for q/k/v/o_proj and every expert's
    w1/w3/w2; returns how many linears compute in FP8. The router (block_sparse_moe.gate) is no
    target: its softmax and top-k pick each token's experts, where FP8 rounding would flip choices.
    An expert no token reached is not run (fast_moe_forward), so its scaling states record nothing."""
    targets = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),) + tuple(
        (f"block_sparse_moe.experts.{i}", ("w1", "w3", "w2")) for i in range(mixtral_model.config.num_local_experts))
    why_not = "Mixtral's experts (w1 and w3 separate parameters, no fused gate/up weight)"
    return fp8_attach.attach_fp8(
        getattr(mixtral_model, "layers", []), recipe, targets, info_once=info_once, mlp_name="block_sparse_moe",
        attach_ffn=lambda moe, r: fp8_attach.attach_fp8_ffn(moe, None, None, r, why_not, info_once))


# --- the ModelFamily contract (family.py) ----------------------------------------------------------

def _patches(options: FastFFNOptions) -> dict:
    """{(owner, name): (key in _STATE.originals, fast version or None for stock)}."""
    m = _modeling()
    return {(m.MixtralRMSNorm, "forward"): ("rms_norm", options.rms_norm and fast_rms_norm_forward),
            (m.MixtralMLP, "forward"): ("mlp", options.swiglu and fast_expert_forward),
            (m.MixtralSparseMoeBlock, "forward"): ("moe", fast_moe_forward),  # Paddle 3.x needs it
            (m.MixtralDecoderLayer, "forward"): ("decoder_layer", options.rms_norm and fast_decoder_layer_forward),
            (m, "apply_rotary_pos_emb"): ("rotary", options.rotary and fast_apply_rotary_pos_emb),
            (m, "scaled_dot_product_attention"): ("sdpa", options.attention and fast_scaled_dot_product_attention),
            (m, "is_casual_mask"): ("is_casual_mask", fast_is_casual_mask),
            (m.MixtralModel, "_prepare_decoder_attention_mask"):
                ("prepare_mask", staticmethod(fast_prepare_decoder_attention_mask)),
            (m.MixtralModel, "forward"): ("model_forward", fast_model_forward),
            (m.MixtralForCausalLM, "forward"): ("causal_lm_forward", fast_causal_lm_forward)}


_TABLE = TableFamily(_STATE, _modeling, _patches, label="Mixtral", decoder_layer="MixtralDecoderLayer",
                     base_model="MixtralModel", causal_lm="MixtralForCausalLM", attach_fp8=attach_fp8,
                     info_once=info_once)
_TABLE.bind(globals())  # patched_attributes, revert, fuse_fn, split_fn, decoder_layers, fp8_recipe, ...


def apply(options: FastFFNOptions, model=None) -> None:
    _TABLE.patch(options)
    if model is not None:
        for layer in model.sublayers(include_self=True):
            if getattr(getattr(layer, "config", None), "model_type", None) in MODEL_TYPES:
                configure(layer.config, options)


def configure(config, options: FastFFNOptions) -> None:
    """Before a decoder layer is built (and for a model patched after): PaddleNLP's use_flash_attention
    path (SDPA) where fast_ffn_attention is on; save_pretrained restores the stock value."""
    remember_stock(config, options.save_fused_checkpoint)
    if options.attention:
        config.use_flash_attention = True


def mark_fast_built(layer, config) -> None:
    """Nothing to record: the fast path fuses no Mixtral projection."""


def hooked_attributes() -> tuple:
    m = _modeling()
    return ((m.MixtralDecoderLayer, "__init__"), (m.MixtralPretrainedModel, "save_pretrained"))


def install_hooks(enabled_options) -> None:
    """Once: configure() before each decoder layer reads its config while the fast path is enabled,
    save_pretrained writing the stock config, and the family-neutral LoRA hooks."""
    if _STATE.hooks:
        return
    m = _modeling()
    decoder_init = m.MixtralDecoderLayer.__init__

    def init_with_fast_config(self, config, *args, **kwargs):
        options = enabled_options()
        if options is not None:
            configure(config, options)
        decoder_init(self, config, *args, **kwargs)

    _STATE.hooks.update(decoder_init=decoder_init, save_pretrained=m.MixtralPretrainedModel.save_pretrained)
    m.MixtralDecoderLayer.__init__ = init_with_fast_config
    m.MixtralPretrainedModel.save_pretrained = save_pretrained_stock(_STATE.hooks["save_pretrained"], FUSED_LAYOUTS)
    install_lora_hooks()


def example_config(**overrides):
    """A two-layer MixtralConfig: 4 experts, top-2, grouped-query heads, widths multiples of 16."""
    from paddlenlp.transformers import MixtralConfig

    values = dict(architectures=["MixtralForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    values.update(overrides)
    return MixtralConfig(**values)

