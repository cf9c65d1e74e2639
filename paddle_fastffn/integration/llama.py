"""The fast path for PaddleNLP's LLaMA family (paddlenlp.transformers.llama).

Patches are class-level (Liger's pattern): forwards of LlamaRMSNorm, LlamaMLP, LlamaAttention
(its plain fused-QKV path) and LlamaDecoderLayer, and the module's apply_rotary_pos_emb, are
replaced by fused versions that read the same sub-layers and parameters. The decoder layer, its
attention and its MLP run paddle_fastffn/core/decoder.py over this module's layer parts, the code
the GPU harness runs over its own. LoRA's LoRALinear sub-layers keep working (the MLP calls its
sub-layers; the single fused `swiglu_down_proj` kernel path is only taken when down_proj is a plain
Linear), and so do tensor parallel layers (each rank applies SwiGLU to its own shard). What the
fused path does not cover (NPU/XPU fused norms, sequence parallel, AMP O1 dtype mixes) keeps PaddleNLP's
math, with one warning per reason. Two repairs come with it: generate() on Paddle 3.x
(prepare_attention_mask_for_generation) and the causal mask of the flash path while decoding with
a KV cache (fast_scaled_dot_product_attention).

Packed batches (finetune/packing.py): LlamaForCausalLM.forward takes PaddleNLP's
attn_mask_startend_row_indices; the examples' boundaries (ops.PackedSegments) travel in
attention_mask's place through LlamaModel (whose mask preparation and is_casual_mask pass them on),
the decoder layers and recompute, to ops.packed_attention: no [seq, seq] mask is built. A dense 4-D
block-causal mask (stock zero_padding) still works: it is not causal-looking, so it reaches SDPA.

Fused projections. A model built while the fast path is enabled gets PaddleNLP's own fused
qkv_proj and gate_up_fused_proj (config.fuse_attention_qkv / fuse_attention_ffn, set before the
layers read the config: configure; PaddleNLP fuses unfused checkpoints on load). Tensor and
pipeline parallel models keep PaddleNLP's sharded sub-layers. The checkpoint contract stays stock
through the family-neutral fused_projections.py (stock initialisation, save_pretrained and
set_state_dict) and lora.py (adapters on the stock sub-layers), which this file installs once on
LLaMA's classes (install_hooks) with LLaMA's layouts (FUSED_LAYOUTS, fuse_fn, split_fn).

This file is the LLaMA implementation of family.ModelFamily (the contract registry.py relies on):
what it patches (patched_attributes, apply, revert), its layouts and its layer parts. The
family-neutral parts it binds to LLaMA's classes: masks.py (attention masks, packed batches, the
attention call), lm_head.py (the fused LM head + loss), fp8_attach.py, fused_projections.py,
lora.py; messages.py, options.py and state.py (its FamilyState) are shared by every family.
"""

from __future__ import annotations

import math
import os
import sys
from functools import partial

import paddle

from .. import ops
from ..core import decoder as core_decoder
from ..core.residual import ResidualAdd
from ..ops._autograd import pylayer
from ..ops._backend import PaddleBackend
from . import lm_head, masks, state
from .fused_projections import (FusedLayout, init_weights_like_stock, keeps_distributed_layers,
                                mark_fused, remember_stock, save_pretrained_stock, set_state_dict_fusing,
                                stock_config_values)
from .lora import install_lora_hooks
from .messages import info_once as _info_once, warn_once as _warn_once
from . import fp8_attach, lora_forward
from .options import FastFFNOptions
from .patching import own_attribute, restore_attribute

# The ModelFamily contract (family.py): the model types served, the fused layouts, and the functions
# below (modeling_module, example_config, patched_attributes, hooked_attributes, install_hooks, apply,
# revert, decoder_layers, patched_layer_count, configure, mark_fast_built, fuse_fn, split_fn,
# unfused_linear_class).
MODEL_TYPES = ("llama",)
LIBRARY = "paddlenlp"
_PADDLE = PaddleBackend()  # the views core.decoder asks for
# The closing residual add: one gradient tensor for both inputs (Paddle's add_grad copies it twice).
_RESIDUAL_ADD = pylayer(ResidualAdd)
FUSED_LAYOUTS = {
    "qkv": FusedLayout("qkv_proj", ("q_proj", "k_proj", "v_proj"), "fuse_attention_qkv"),
    "ffn": FusedLayout("gate_up_fused_proj", ("gate_proj", "up_proj"), "fuse_attention_ffn"),
}

# This family's patch state (state.FamilyState): the stock attributes it replaced, its install-once
# hooks, the FP8 recipe while FP8 GEMMs run, the options it was applied with. The patched forwards
# read the options from state.current().
_STATE = state.for_family(__name__.rpartition(".")[2])


def _modeling():
    from paddlenlp.transformers.llama import modeling

    return modeling


modeling_module = _modeling  # the ModelFamily member


def _same_dtype(x: paddle.Tensor, weight: paddle.Tensor) -> bool:
    return x.dtype == weight.dtype


def device_keeps_norm(config) -> bool:
    """use_fused_rms_norm on NPU / XPU: PaddleNLP's device kernels stay. On CPU and GPU our fused
    kernel serves the flag, in place of PaddleNLP's fused_ln (an extra package, absent on CPU,
    where stock then fails at the first forward)."""
    from paddlenlp.utils.tools import get_env_device

    return bool(config.use_fused_rms_norm) and get_env_device() not in ("cpu", "gpu")


def fast_rms_norm_forward(self, hidden_states):
    """LlamaRMSNorm.forward through the fused kernel (same numerics); stock for the NPU and XPU
    fused norms the config asks for, and when the input and weight dtypes differ."""
    if self.config.use_fused_rms_norm:
        if device_keeps_norm(self.config):
            _info_once("device_rms_norm", "use_fused_rms_norm on this device: LlamaRMSNorm keeps its device kernel")
            return _STATE.originals["rms_norm"](self, hidden_states)
        _info_once("fused_ln", "use_fused_rms_norm: paddle_fastffn's fused RMSNorm serves it (PaddleNLP's fused_ln "
                               "package is not needed)")
    if not _same_dtype(hidden_states, self.weight):
        _warn_once("norm_dtype", f"RMSNorm input {hidden_states.dtype} and weight {self.weight.dtype} differ "
                                 f"(AMP O1): those norms keep PaddleNLP's math")
        return _STATE.originals["rms_norm"](self, hidden_states)
    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


is_plain_linear = lm_head.is_plain_linear  # the ModelFamily member


class _MLPParts:
    """core.decoder's MLP parts over a PaddleNLP LlamaMLP: its own sub-layers (LoRA, FP8 and tensor
    parallel linears keep their forwards) and the fused ops."""

    def __init__(self, mlp, fp8_ffn=None):
        self.mlp, self.fp8_ffn = mlp, fp8_ffn

    def gate_up(self, x):
        return self.mlp.gate_up_fused_proj(x)

    def swiglu_down(self, gate_up):
        # gate_up is this forward's private intermediate: its memory can hold its gradient.
        return ops.swiglu_down_proj(gate_up, self.mlp.down_proj.weight, reuse_gate_up_memory=True)

    def gate(self, x):
        return self.mlp.gate_proj(x)

    def up(self, x):
        return self.mlp.up_proj(x)

    def swiglu(self, gate_or_gate_up, up=None):
        # Two inputs: gate_proj's and up_proj's outputs are this forward's private intermediates,
        # so their memory can hold their gradients (as gate_up's does on the fused path).
        return ops.swiglu(gate_or_gate_up, up, reuse_input_memory=up is not None)

    def down(self, h):
        return self.mlp.down_proj(h)


def _mlp_variant(mlp, tokens: int, ffn) -> str:
    """Which of decoder_steps.MLP_VARIANTS this MLP runs (with one info line per reason where
    swiglu_recompute cannot apply)."""
    if ffn is not None and ffn.uses_fp8(tokens):
        return "fp8"
    options = state.current()
    recompute = options is not None and options.swiglu_recompute
    if not mlp.fuse_attention_ffn:
        if recompute:
            _info_once("recompute_unfused", "swiglu_recompute needs the fused gate/up projection (a model built "
                                            "while the fast path is enabled, fast_ffn_fuse_projections): this "
                                            "model's MLP keeps gate_proj/up_proj and stores the SwiGLU output")
        return "unfused"
    if recompute and is_plain_linear(mlp.down_proj) and not _fp8_attached(mlp.down_proj):
        return "fused"
    if recompute and _fp8_attached(mlp.down_proj):
        _info_once("recompute_fp8", "fast_ffn_precision=fp8: this MLP's down_proj runs through Fp8Linear (per "
                                    "linear), so the fused SwiGLU output is stored for it")
    elif recompute:
        _info_once("recompute_down_proj", f"swiglu_recompute needs a plain Linear down_proj, this one is "
                                          f"{type(mlp.down_proj).__name__} (LoRA or tensor parallel): "
                                          f"the SwiGLU output is stored")
    return "fused_stored"


def fast_mlp_forward(self, x):
    """SwiGLU MLP, core.decoder.mlp over this layer's sub-layers: gate/up projection(s) -> fused
    SwiGLU -> down projection.

    With fuse_attention_ffn the gate and up projections are one GEMM and the kernel reads the packed
    [gate | up] output; otherwise the two projections run and the two-input kernel fuses silu * up.
    With swiglu_recompute, a fused gate/up projection and a plain down_proj, the SwiGLU output is
    not stored for backward; elsewhere it is (one info line per reason). Under FP8 an MLP with the
    FP8 FFN attached (attach_fp8) runs it: the FFN recomputes SwiGLU in backward by construction."""
    ffn = self.__dict__.get("_fast_ffn_fp8") if _STATE.fp8 is not None else None
    return core_decoder.mlp(_MLPParts(self, ffn), x, _mlp_variant(self, math.prod(x.shape[:-1]), ffn))


def fast_apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    """Drop-in for modeling.apply_rotary_pos_emb: the fused kernel on q and k together."""
    return ops.rotary_embedding(q, k, cos, sin, _positions(position_ids))


def _can_fuse_add_norm(layer) -> bool:
    norm, options = layer.post_attention_layernorm, state.current()
    return (
        options is not None and options.rms_norm and not layer.sequence_parallel
        and type(norm).__name__ == "LlamaRMSNorm" and not device_keeps_norm(norm.config)
    )


class _DecoderLayerParts:
    """core.decoder's layer parts over a PaddleNLP LlamaDecoderLayer: its norms, its self_attn
    (called as the stock layer calls it, under its full_attn recompute) and its mlp. The attention
    sub-layer's extra outputs (weights, cache) are kept for the layer's result."""

    def __init__(self, layer, attention_arguments, npu_is_casual):
        self.layer, self.attention_arguments, self.npu_is_casual = layer, attention_arguments, npu_is_casual
        self.attention_extras = ()

    def input_norm(self, x):
        return self.layer.input_layernorm(x)

    def self_attention(self, x):
        layer = self.layer
        if (layer.enable_recompute and layer.layerwise_recompute and not x.stop_gradient
                and layer.recompute_granularity == "full_attn"):
            # The modeling module's recompute: the FP8 path's while FP8 is on (fp8/recompute.py).
            outputs = _modeling().recompute(layer.self_attn, x, *self.attention_arguments,
                                            use_reentrant=layer.config.recompute_use_reentrant)
        else:
            outputs = layer.self_attn(x, *self.attention_arguments, npu_is_casual=self.npu_is_casual)
        if isinstance(outputs, tuple):
            self.attention_extras = tuple(outputs[1:])
            return outputs[0]
        return outputs

    def post_norm_add(self, a, residual):
        norm = self.layer.post_attention_layernorm
        if _same_dtype(a, norm.weight) and _same_dtype(residual, norm.weight):
            return ops.fused_add_rms_norm(a, residual, norm.weight, norm.variance_epsilon)
        _warn_once("add_norm_dtype", "residual and attention output dtypes differ (AMP O1): the residual add "
                                     "and post-attention norm keep PaddleNLP's math")
        residual = residual + a
        return norm(residual), residual

    def mlp(self, x):
        return self.layer.mlp(x)

    def residual_add(self, residual, y):
        return _RESIDUAL_ADD.apply(residual, y)


def fast_decoder_layer_forward(self, hidden_states, position_ids=None, attention_mask=None,
                               output_attentions=False, past_key_value=None, use_cache=False,
                               alibi=None, npu_is_casual=False):
    """LlamaDecoderLayer.forward as core.decoder.decoder_layer: the attention residual add fused
    into the post-attention RMSNorm (one pass: sum, statistics, normalise); the attention and MLP
    sub-layers called as the stock layer calls them (its layer-wise recompute of attention
    included)."""
    if not _can_fuse_add_norm(self):
        if self.sequence_parallel:
            _warn_once("sequence_parallel", "sequence-parallel decoder layers keep PaddleNLP's residual add "
                                            "and norms (the fused MLP, rotary and attention still apply)")
        return _STATE.originals["decoder_layer"](self, hidden_states, position_ids, attention_mask,
                                           output_attentions, past_key_value, use_cache, alibi,
                                           npu_is_casual)
    parts = _DecoderLayerParts(self, (position_ids, past_key_value, attention_mask, output_attentions, use_cache,
                                      alibi), npu_is_casual)
    result = (core_decoder.decoder_layer(parts, hidden_states),) + parts.attention_extras
    return result[0] if len(result) == 1 else result


class _AttentionParts:
    """core.decoder's attention parts over a PaddleNLP LlamaAttention on its plain fused path: its
    qkv_proj and o_proj (FP8 attachments keep theirs), its rotary tables, ops.qkv_rotary, and the
    modeling module's scaled_dot_product_attention (the fast path's, packed segments included) under
    the attention's core_attn recompute as stock wraps it."""

    variant = "fused"

    def __init__(self, attention, position_ids, attention_mask, npu_is_casual):
        self.layer, self.position_ids, self.attention_mask = attention, position_ids, attention_mask
        self.npu_is_casual = npu_is_casual
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_key_value_heads
        self.head_dim = attention.head_dim

    def qkv(self, x):
        return self.layer.qkv_proj(x)

    def qkv_rotary(self, qkv):
        cos, sin = self.layer.rotary_emb(qkv, seq_len=qkv.shape[1])  # the tables in qkv's dtype, as stock
        return ops.qkv_rotary(qkv, self.num_heads, self.num_kv_heads, cos, sin, _positions(self.position_ids))

    def attention(self, q, k, v):
        layer, config, modeling = self.layer, self.layer.config, _modeling()
        if not config.use_flash_attention:  # stock's eager attention wants every query head's k and v
            k = modeling.repeat_kv(k, layer.num_key_value_groups)
            v = modeling.repeat_kv(v, layer.num_key_value_groups)
        has_gradient = not (q.stop_gradient and k.stop_gradient and v.stop_gradient)
        if (layer.enable_recompute and layer.layerwise_recompute and has_gradient
                and layer.recompute_granularity == "core_attn"):
            return modeling.recompute(modeling.scaled_dot_product_attention, q, config, k, v, self.attention_mask,
                                      False, None, False, reshard_layer=None,
                                      use_reentrant=config.recompute_use_reentrant)
        return modeling.scaled_dot_product_attention(q, config, k, v, self.attention_mask, False, None, False,
                                                     reshard_layer=None, npu_is_casual=self.npu_is_casual)

    def o_proj(self, a):
        return self.layer.o_proj(a)


def _takes_fused_attention(attention, past_key_value, output_attentions, use_cache, alibi) -> bool:
    """Whether stock would take its plain fused-QKV path here (one qkv_proj Linear, no cache,
    attention weights, alibi, sequence / sep parallel, KV-head gathering, fused or long-sequence
    rope): that path is the one the fast attention forward replaces."""
    config, options = attention.config, state.current()
    return (options is not None and options.rotary and attention.fuse_attention_qkv
            and is_plain_linear(attention._sub_layers.get("qkv_proj"))
            and past_key_value is None and not output_attentions and not use_cache and alibi is None
            and not attention.sequence_parallel and attention.reshard_layer is None and attention.kv_indices is None
            and config.rope and not config.use_long_sequence_strategies and not attention.use_fused_rope)


def fast_attention_forward(self, hidden_states, position_ids=None, past_key_value=None, attention_mask=None,
                           output_attentions=False, use_cache=False, alibi=None, npu_is_casual=False):
    """LlamaAttention.forward on the plain fused-QKV path as core.decoder.attention: q, k and v read
    from PaddleNLP's interleaved qkv_proj output by ops.qkv_rotary (no paddle.split copies, and one
    d_qkv written in backward, no concat). Every other path (and fast_ffn_rotary off) is stock's."""
    if not _takes_fused_attention(self, past_key_value, output_attentions, use_cache, alibi):
        return _STATE.originals["attention"](self, hidden_states, position_ids, past_key_value, attention_mask,
                                       output_attentions, use_cache, alibi, npu_is_casual)
    parts = _AttentionParts(self, position_ids, attention_mask, npu_is_casual)
    return core_decoder.attention(_PADDLE, parts, hidden_states)


prepare_attention_mask_for_generation = masks.prepare_attention_mask_for_generation


def fast_scaled_dot_product_attention(*args, **kwargs):
    return masks.scaled_dot_product_attention(_STATE.originals["sdpa"], *args, **kwargs)


def fast_prepare_decoder_attention_mask(attention_mask, input_shape, past_key_values_length, dtype):
    return masks.prepare_decoder_attention_mask(_STATE.originals["prepare_mask"], attention_mask, input_shape,
                                                past_key_values_length, dtype)


def fast_is_casual_mask(attention_mask):
    return masks.is_casual_mask(_STATE.originals["is_casual_mask"], attention_mask)


def _enable_sdpa(config) -> None:
    # PaddleNLP's use_flash_attention path calls F.scaled_dot_product_attention: flash attention
    # on GPU, the fused SDPA on CPU; grouped-query heads natively (no repeat_kv copies).
    remember_stock(config)
    config.use_flash_attention = True


def configure(config, options: FastFFNOptions) -> None:
    """Config changes made before a model is built (the construction hook calls it for every
    decoder layer, before the layer's sub-layers read the config)."""
    remember_stock(config, options.save_fused_checkpoint)
    if options.attention:
        _enable_sdpa(config)
    if not (options.fuse_projections or options.swiglu_recompute):
        return
    if keeps_distributed_layers(config):
        return
    if options.fuse_projections:
        # PaddleNLP 2.8.1 fuses unfused checkpoints on load (and splits fused ones for unfused
        # models): LlamaPretrainedModel._get_fuse_or_split_param_mappings.
        for layout in FUSED_LAYOUTS.values():
            setattr(config, layout.config_flag, True)


def mark_fast_built(layer, config) -> None:
    """After a decoder layer is built: remember which of its projections the fast path fused (the
    stock config had them unfused), for initialisation, saving, loading and LoRA."""
    stock = stock_config_values(config)
    if stock is None:
        return
    head_dim = config.hidden_size // config.num_attention_heads
    owners = {"qkv": getattr(layer, "self_attn", None), "ffn": getattr(layer, "mlp", None)}
    for kind, (fused_name, _parts, flag) in FUSED_LAYOUTS.items():
        owner = owners[kind]
        fused = getattr(owner, fused_name, None) if owner is not None else None
        if fused is None or stock[flag] or not getattr(config, flag, False):
            continue
        if kind == "qkv":
            widths = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
                      config.num_key_value_heads * head_dim)
        else:
            widths = (config.intermediate_size, config.intermediate_size)
        mark_fused(owner, kind, fused, widths, fuse_fn(kind, config))


def fuse_fn(kind: str, config):
    """[stock part weights] -> the fused weight (PaddleNLP's fuse mapping; q/k/v interleaved per KV
    group as LlamaAttention's qkv_proj holds them)."""
    from paddlenlp.transformers.conversion_utils import fuse_param_func

    if kind == "qkv":
        return partial(fuse_param_func(), is_qkv=True, num_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads)
    return fuse_param_func()


def split_fn(kind: str, config):
    """The fused weight -> [stock part weights] (PaddleNLP's split mapping, fuse_fn's inverse)."""
    from paddlenlp.transformers.conversion_utils import split_param_func

    if kind == "qkv":
        return partial(split_param_func(), split_nums=3, is_qkv=True, num_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads)
    return partial(split_param_func(), split_nums=2)


def unfused_linear_class() -> type:
    """What PaddleNLP's LLaMA builds for unfused projections on this device."""
    return _modeling().Linear


def causal_lm_class() -> type:
    return _modeling().LlamaForCausalLM


def fp8_recipe():
    """The Fp8Recipe the FP8 GEMMs run with, None while they do not."""
    return _STATE.fp8


def fp8_checkpoint_layers(model):
    """(recipe, {sub-layer name: Fp8Linear or Fp8FFN}) of what computes in FP8 in `model`, attached
    now where the first forward has not attached it yet (a resume restores the scaling states
    before any forward); (None, {}) while FP8 is off. A checkpoint saves and restores these."""
    return fp8_attach.checkpoint_layers(model, _STATE.fp8, _modeling().LlamaModel, attach_fp8)


def install_hooks(enabled_options) -> None:
    """Install, once, the hooks of the fast path that must outlive revert(): the construction hook
    (config changes and fused-layer records for models built while `enabled_options()` is not
    None), the checkpoint hooks of fused_projections on LlamaPretrainedModel, from_pretrained for
    Hub folders, and the family-neutral LoRA hooks. Each acts only on what the fast path built."""
    if _STATE.hooks:
        return
    modeling = _modeling()
    decoder_init = modeling.LlamaDecoderLayer.__init__

    def init_with_fast_config(self, config, *args, **kwargs):
        options = enabled_options()
        if options is not None:
            configure(config, options)
        decoder_init(self, config, *args, **kwargs)
        if options is not None:
            mark_fast_built(self, config)

    pretrained = modeling.LlamaPretrainedModel
    _STATE.hooks.update(decoder_init=decoder_init, init_weights=pretrained._init_weights,
                  save_pretrained=pretrained.save_pretrained, set_state_dict=pretrained.set_state_dict)
    modeling.LlamaDecoderLayer.__init__ = init_with_fast_config
    pretrained._init_weights = init_weights_like_stock(_STATE.hooks["init_weights"])
    pretrained.save_pretrained = save_pretrained_stock(_STATE.hooks["save_pretrained"], FUSED_LAYOUTS)
    pretrained.set_state_dict = set_state_dict_fusing(_STATE.hooks["set_state_dict"])
    causal_lm = modeling.LlamaForCausalLM
    _STATE.hooks["from_pretrained"] = causal_lm.from_pretrained.__func__
    causal_lm.from_pretrained = classmethod(_from_pretrained_hub_folders(_STATE.hooks["from_pretrained"]))
    install_lora_hooks()


def _from_pretrained_hub_folders(original):
    """LlamaForCausalLM.from_pretrained on a Hugging Face Hub LLaMA folder, while the fast path is
    enabled, through the Hub loader the fine-tune layer offers (state.set_hub_loader:
    paddle_fastffn.finetune.checkpoint, since PaddleNLP 2.8.1 fails on sharded Hub checkpoints and
    on the Hub's tokenizer.model). Everything else, every call while the fast path is off, and
    every call while no loader is offered, is PaddleNLP's own from_pretrained."""
    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, **kwargs):
        load = state.hub_loader()
        if (load is not None and state.current() is not None and cls is _modeling().LlamaForCausalLM
                and not args and isinstance(pretrained_model_name_or_path, (str, os.PathLike))
                and os.path.isdir(pretrained_model_name_or_path)):
            model = load(pretrained_model_name_or_path, kwargs)
            if model is not None:
                return model
        return original(cls, pretrained_model_name_or_path, *args, **kwargs)
    return from_pretrained


# ---------------------------------------------------------------------------------------------
# The fused LM head + cross-entropy (lm_head.py) over LLaMA's classes.

def fused_head_weight(model):
    """lm_head.fused_head_weight for a LlamaForCausalLM."""
    modeling = _modeling()
    return lm_head.fused_head_weight(model, modeling, modeling.LlamaLMHead, modeling.LlamaPretrainingCriterion)


def base_model(causal_lm):
    return causal_lm.llama


def output_class() -> type:
    return _modeling().CausalLMOutputWithCrossAttentions


def fast_causal_lm_forward(self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                           labels=None, use_cache=False, past_key_values=None, output_attentions=None,
                           output_hidden_states=None, return_dict=None, attn_mask_startend_row_indices=None):
    """LlamaForCausalLM.forward: lm_head.causal_lm_forward (the fused loss, packed batches). PaddleNLP
    2.8.1's signature spelled out (its Layer wraps class-level forward patches by signature)."""
    return lm_head.causal_lm_forward(
        sys.modules[__name__], _STATE.originals["causal_lm_forward"], self, input_ids, position_ids, attention_mask,
        inputs_embeds, labels, use_cache, past_key_values, output_attentions, output_hidden_states, return_dict,
        attn_mask_startend_row_indices)


# ---------------------------------------------------------------------------------------------
# FP8 GEMMs (FastFFNOptions.precision == "fp8"). Each decoder layer runs the composition of
# composition.py's LLAMA_DECODER_LAYER_FP8, the one the GPU benchmarks time:
# - the MLP, where gate_up_fused_proj and down_proj are plain Linear layers (the default fused
#   path), is one FP8 FFN (paddle_fastffn.fp8.Fp8FFN, fp8/ffn.py: gate_up GEMM -> SwiGLU fused
#   with quantising h -> down GEMM, SwiGLU recomputed in backward), hung off the LlamaMLP's
#   __dict__; a misaligned one (H or I not a multiple of 16) keeps bf16 with one warning;
# - the other linears (qkv_proj or q/k/v_proj, o_proj, and the MLP's where it is not that pair:
#   LoRA, unfused gate_proj/up_proj, fast_ffn_swiglu off) compute through
#   paddle_fastffn.fp8.Fp8Linear: plain Linear, and PaddleNLP's LoRALinear (adapters in the
#   activation dtype over an FP8 base GEMM), hung off the Linear's __dict__; SwiGLU then runs in
#   16 bits between the MLP's FP8 GEMMs. Tensor-parallel layers keep their stock GEMMs.
# One info line says which path an MLP takes and why. Attaching, detaching and the recipe choice
# are family-neutral (fp8_attach.py); attachment happens at each LlamaModel.forward, so layers LoRA
# placed after construction are covered, and revert detaches every one.
#
# Where FP8 runs: on a Hopper GPU (sm_90) with a CUDA Paddle, cuBLASLt FP8 GEMMs (fp8/cuda.py,
# csrc/paddle/fp8_op.cc); elsewhere emulated (fp32 GEMMs on FP8-rounded values) with fp8_emulate.
# Without it: one warning and the bf16/fp32 path (CPU, other GPUs, an operator build that failed).

_FP8_TARGETS = (("self_attn", ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj")),
                ("mlp", ("gate_up_fused_proj", "gate_proj", "up_proj", "down_proj")))


def resolve_fp8(options: FastFFNOptions):
    """fp8_attach.resolve_fp8 with this patch's info log."""
    return fp8_attach.resolve_fp8(options, _info_once)


def _fp8_attached(linear) -> bool:
    return _STATE.fp8 is not None and fp8_attach.fp8_of(linear) is not None


def _mlp_without_fp8_ffn(mlp) -> str | None:
    """Why this MLP cannot run the FP8 FFN (its linears then run Fp8Linear each, or keep their
    stock GEMMs where tensor parallel), or None where it runs it."""
    from ..fp8.ffn import plain_linear

    options = state.current()
    if options is None or not options.swiglu:
        return "fast_ffn_swiglu is off (PaddleNLP's MLP forward)"
    if not getattr(mlp, "fuse_attention_ffn", False):
        return "MLPs with unfused gate_proj/up_proj (a model built before the fast path was enabled, or LoRA on them)"
    parts = (mlp._sub_layers.get("gate_up_fused_proj"), mlp._sub_layers.get("down_proj"))
    odd = sorted({type(part).__name__ for part in parts if not plain_linear(part)})
    return f"MLPs with {' and '.join(odd)} projections (LoRA or tensor parallel)" if odd else None


def _attach_fp8_ffn(mlp, recipe) -> bool:
    """The FP8 FFN over LlamaMLP's gate_up_fused_proj ([gate | up]) and down_proj where it applies."""
    if mlp is None:
        return False
    why_not = _mlp_without_fp8_ffn(mlp)
    gate_up, down = (None, None) if why_not else (mlp.gate_up_fused_proj, mlp.down_proj)
    return fp8_attach.attach_fp8_ffn(mlp, gate_up, down, recipe, why_not, _info_once)


def attach_fp8(llama_model, recipe) -> int:
    """Give each decoder layer of `llama_model` its FP8 objects (fp8_attach.attach_fp8): the MLP's
    Fp8FFN where it applies, an Fp8Linear for each other target linear; returns how many linears
    compute in FP8 (an FFN counts its two)."""
    return fp8_attach.attach_fp8(getattr(llama_model, "layers", []), recipe, _FP8_TARGETS, _attach_fp8_ffn,
                                 _info_once)


fp8_layers = fp8_attach.fp8_layers


CAUSAL_MASK, IMPLICIT_POSITIONS, _positions = masks.CAUSAL_MASK, masks.IMPLICIT_POSITIONS, masks.positions


def fast_llama_model_forward(self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                             use_cache=None, past_key_values=None, output_attentions=False,
                             output_hidden_states=None, return_dict=False, **kwargs):
    """LlamaModel.forward with what it would build every step passed as implied (CAUSAL_MASK,
    IMPLICIT_POSITIONS) where only the fast forwards read it: no cache and nothing the stock
    forward or a stock kernel reads the tensors for (alibi, fused or long-sequence rope). Under
    FP8 the decoder layers' linears get their Fp8Linear first, and their other LoRA layers the
    fused LoRA forward (lora_forward.py). PaddleNLP 2.8.1's signature spelled
    out: its Layer.__setattr__ wraps a class-level forward patch that lacks output_* / return_dict
    and drops those arguments."""
    if _STATE.fp8 is not None:
        attach_fp8(self, _STATE.fp8)
    lora_forward.attach_lora_forwards(getattr(self, "layers", []))
    config, options = self.config, state.current()
    fresh = (options is not None and not use_cache
             and (past_key_values is None or all(p is None for p in past_key_values)))
    if (fresh and attention_mask is None and options.attention and config.use_flash_attention
            and not config.alibi):
        attention_mask = CAUSAL_MASK
    if (fresh and position_ids is None and options.rotary and not getattr(config, "use_fused_rope", False)
            and not getattr(config, "use_long_sequence_strategies", False)):
        position_ids = IMPLICIT_POSITIONS
    return _STATE.originals["llama_model_forward"](
        self, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
        inputs_embeds=inputs_embeds, use_cache=use_cache, past_key_values=past_key_values,
        output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        return_dict=return_dict, **kwargs)


def _apply_fp8(recipe) -> None:
    fp8_attach.switch_fp8(_STATE, _modeling(), recipe)


def _revert_fp8() -> None:
    fp8_attach.switch_fp8(_STATE, _modeling(), None)


# ---------------------------------------------------------------------------------------------

def apply(options: FastFFNOptions, model=None) -> None:
    """Patch the LLaMA classes (every layer built from now on, and every existing one) and, when
    given, `model`'s instance settings. The class-level patch happens once for given options:
    applying the same options again (the TrainingArguments, then the script's apply_to_model)
    changes no class attribute."""
    if _STATE.applied != options:
        _patch_classes(options)
        _STATE.applied = options
        _STATE.applications += 1
    if model is not None:
        _configure_model(model, options)


def _patch_classes(options: FastFFNOptions) -> None:
    modeling = _modeling()
    if not _STATE.originals:
        _STATE.originals.update(
            rms_norm=modeling.LlamaRMSNorm.forward,
            mlp=modeling.LlamaMLP.forward,
            decoder_layer=modeling.LlamaDecoderLayer.forward,
            rotary=modeling.apply_rotary_pos_emb,
            generation_mask=own_attribute(modeling.LlamaForCausalLM, "prepare_attention_mask_for_generation"),
            sdpa=modeling.scaled_dot_product_attention,
            prepare_mask=own_attribute(modeling.LlamaModel, "_prepare_decoder_attention_mask"),
            is_casual_mask=modeling.is_casual_mask,
        )
    _STATE.originals.setdefault("attention", modeling.LlamaAttention.forward)
    _STATE.originals.setdefault("causal_lm_forward", modeling.LlamaForCausalLM.forward)
    # Always the fast forward: it takes packed batches' segments; the fused loss is its own option.
    modeling.LlamaForCausalLM.forward = fast_causal_lm_forward
    _STATE.originals.setdefault("llama_model_forward", modeling.LlamaModel.forward)
    modeling.LlamaModel.forward = fast_llama_model_forward
    modeling.LlamaModel._prepare_decoder_attention_mask = staticmethod(fast_prepare_decoder_attention_mask)
    modeling.is_casual_mask = fast_is_casual_mask
    modeling.LlamaRMSNorm.forward = fast_rms_norm_forward if options.rms_norm else _STATE.originals["rms_norm"]
    modeling.LlamaMLP.forward = fast_mlp_forward if options.swiglu else _STATE.originals["mlp"]
    modeling.LlamaDecoderLayer.forward = fast_decoder_layer_forward if options.rms_norm else _STATE.originals["decoder_layer"]
    modeling.apply_rotary_pos_emb = fast_apply_rotary_pos_emb if options.rotary else _STATE.originals["rotary"]
    # The plain fused-QKV attention reads q, k, v through the rotary op; other paths stay stock's.
    modeling.LlamaAttention.forward = fast_attention_forward if options.rotary else _STATE.originals["attention"]
    # The attention path: SDPA with the decode-time causal mask, and generate()'s mask on Paddle 3.x
    # (both only where fast_ffn_attention puts the model on PaddleNLP's flash-attention path).
    attention = options.attention
    if attention:
        modeling.LlamaForCausalLM.prepare_attention_mask_for_generation = staticmethod(prepare_attention_mask_for_generation)
    else:
        restore_attribute(modeling.LlamaForCausalLM, "prepare_attention_mask_for_generation", _STATE.originals["generation_mask"])
    modeling.scaled_dot_product_attention = fast_scaled_dot_product_attention if attention else _STATE.originals["sdpa"]
    _apply_fp8(resolve_fp8(options))


def _configure_model(model, options: FastFFNOptions) -> None:
    """`model`'s instance settings: its configs' SDPA switch and stock values (a model built before
    the fast path was enabled keeps its projections, one info line)."""
    configs = [layer.config for layer in model.sublayers(include_self=True)
               if getattr(getattr(layer, "config", None), "model_type", None) in MODEL_TYPES]
    for config in configs:
        remember_stock(config, options.save_fused_checkpoint)
        if options.attention:
            _enable_sdpa(config)
    config = model.config
    unfused = [layout.parts for layout in FUSED_LAYOUTS.values() if not getattr(config, layout.config_flag, False)]
    if options.fuse_projections and unfused and not keeps_distributed_layers(config):
        names = " and ".join("/".join(parts) for parts in unfused)
        stored = ", and the SwiGLU output is stored" if not config.fuse_attention_ffn else ""
        _info_once("built_unfused", f"this model was built before the fast path was enabled: its {names} "
                                    f"projections stay unfused{stored} (enable it first, e.g. use_fast_ffn in "
                                    f"the TrainingArguments, to build fused projections)",
                   covers=("recompute_unfused",))


def revert() -> None:
    """Restore PaddleNLP's own forwards. (The construction and checkpoint hooks stay: they act
    only on layers the fast path built, which keep their stock checkpoint contract.)"""
    _STATE.forget()
    if not _STATE.originals:
        return
    _revert_fp8()
    modeling = _modeling()
    modeling.LlamaRMSNorm.forward = _STATE.originals["rms_norm"]
    modeling.LlamaMLP.forward = _STATE.originals["mlp"]
    modeling.LlamaDecoderLayer.forward = _STATE.originals["decoder_layer"]
    modeling.apply_rotary_pos_emb = _STATE.originals["rotary"]
    modeling.LlamaAttention.forward = _STATE.originals["attention"]
    restore_attribute(modeling.LlamaForCausalLM, "prepare_attention_mask_for_generation", _STATE.originals["generation_mask"])
    modeling.scaled_dot_product_attention = _STATE.originals["sdpa"]
    modeling.LlamaForCausalLM.forward = _STATE.originals["causal_lm_forward"]
    modeling.LlamaModel.forward = _STATE.originals["llama_model_forward"]
    restore_attribute(modeling.LlamaModel, "_prepare_decoder_attention_mask", _STATE.originals["prepare_mask"])
    modeling.is_casual_mask = _STATE.originals["is_casual_mask"]


def patched_layer_count(model) -> int:
    """How many decoder layers of `model` run the fast forward (for tests and the run log)."""
    if state.current() is None:
        return 0
    return len(decoder_layers(model))


def decoder_layers(model) -> list:
    """The LlamaDecoderLayer sub-layers of `model` (any wrapper of a LLaMA model), in order."""
    layer_class = _modeling().LlamaDecoderLayer
    return [layer for layer in model.sublayers(include_self=True) if isinstance(layer, layer_class)]


def patched_attributes() -> tuple:
    """((owner, name), ...) that apply() may replace and revert() restores."""
    modeling = _modeling()
    return ((modeling.LlamaRMSNorm, "forward"), (modeling.LlamaMLP, "forward"),
            (modeling.LlamaDecoderLayer, "forward"), (modeling.LlamaAttention, "forward"),
            (modeling, "apply_rotary_pos_emb"),
            (modeling.LlamaForCausalLM, "prepare_attention_mask_for_generation"),
            (modeling, "scaled_dot_product_attention"), (modeling.LlamaForCausalLM, "forward"),
            (modeling.LlamaModel, "_prepare_decoder_attention_mask"), (modeling, "is_casual_mask"),
            (modeling.LlamaModel, "forward"), (modeling, "recompute"))  # the last two: FP8 only


def hooked_attributes() -> tuple:
    """((owner, name), ...) that install_hooks() wraps once and keeps (LoRAModel's are lora.py's)."""
    modeling = _modeling()
    pretrained = modeling.LlamaPretrainedModel
    return ((modeling.LlamaDecoderLayer, "__init__"), (pretrained, "_init_weights"), (pretrained, "save_pretrained"),
            (pretrained, "set_state_dict"), (modeling.LlamaForCausalLM, "from_pretrained"))


def example_config(**overrides):
    """A two-layer LlamaConfig with grouped-query heads, widths multiples of 16 (FP8's alignment)."""
    from paddlenlp.transformers import LlamaConfig

    values = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6)
    values.update(overrides)
    return LlamaConfig(**values)
