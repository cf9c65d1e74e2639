"""The fast path for PaddleNLP's LLaMA family (paddlenlp.transformers.llama).

Patches are class-level (Liger's pattern): forwards of LlamaRMSNorm, LlamaMLP and
LlamaDecoderLayer, and the module's apply_rotary_pos_emb, are replaced by fused versions that read
the same sub-layers and parameters. LoRA's LoRALinear sub-layers keep working (the MLP calls its
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
layers read the config; PaddleNLP fuses unfused checkpoints on load). Tensor and pipeline parallel
models keep PaddleNLP's sharded sub-layers. The checkpoint contract stays stock, through hooks
installed once (install_hooks) that act only on layers the fast path fused:
- initialisation: a fused weight is drawn as its stock parts, in stock order, and fused, so a
  seed gives the same model as stock PaddleNLP;
- save_pretrained writes the stock unfused layout (q/k/v_proj, gate_proj/up_proj, split by
  PaddleNLP's own split mappings) and the config the model had before the fast path touched it
  (fuse_attention_*, use_flash_attention), unless save_fused_checkpoint is set;
- set_state_dict (the Trainer's resume and best-model reload) fuses stock-layout weights;
- LoRAModel: before adapters are placed, the fused layers it targets are split back into the
  stock sub-layers and fused-name target patterns are aimed at the parts, so the adapters are
  the ones stock PaddleNLP would create (and save under stock names).
"""

from __future__ import annotations

import copy
import math
import os
import re
import warnings
import weakref
from functools import partial

import paddle
from paddle import nn

from .. import ops
from ..core.fp8.weight_cache import weights_changed
from ..ops._fallback import raise_if_strict
from . import fp8_attach
from .options import FastFFNOptions
from .patching import own_attribute, restore_attribute

MODEL_TYPES = ("llama",)

_ORIGINALS: dict = {}
_ACTIVE: FastFFNOptions | None = None
_WARNED: set = set()
_INFORMED: set = set()
_HOOKS: dict = {}
_FP8 = None  # the Fp8Recipe while FP8 GEMMs are active (FastFFNOptions.precision == "fp8" and they can run)
# id(config) -> (weakref to it, {key: value before the fast path changed it}, save_fused_checkpoint)
_STOCK: dict = {}
_PATCHED_CONFIG_KEYS = ("use_flash_attention", "fuse_attention_qkv", "fuse_attention_ffn")
# kind -> (fused sub-layer name, its stock parts in PaddleNLP's order, the config flag)
FUSED_LAYOUTS = {
    "qkv": ("qkv_proj", ("q_proj", "k_proj", "v_proj"), "fuse_attention_qkv"),
    "ffn": ("gate_up_fused_proj", ("gate_proj", "up_proj"), "fuse_attention_ffn"),
}


def _warn_once(key: str, message: str) -> None:
    """Layers the fused path does not cover keep their stock math; say so once per reason (an
    error in strict mode, as a fallback of an op is)."""
    raise_if_strict(f"paddle_fastffn: {message}")
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"paddle_fastffn: {message}", RuntimeWarning, stacklevel=3)


def _info_once(key: str, message: str, covers: tuple = ()) -> None:
    """Where a part of the fast path does not apply by design (LoRA, tensor parallel, a model built
    before enabling), the layer keeps PaddleNLP's sub-layers: one info line, not a fallback
    warning. `covers`: the per-forward reasons this line already explains."""
    if key not in _INFORMED:
        from paddlenlp.utils.log import logger

        logger.info(f"paddle_fastffn: {message}")
    _INFORMED.add(key)
    _INFORMED.update(covers)


def _modeling():
    from paddlenlp.transformers.llama import modeling

    return modeling


def _same_dtype(x: paddle.Tensor, weight: paddle.Tensor) -> bool:
    return x.dtype == weight.dtype


def _device_fused_rms_norm(config) -> bool:
    """use_fused_rms_norm on NPU / XPU: PaddleNLP's device kernels stay. On CPU and GPU our fused
    kernel serves the flag, in place of PaddleNLP's fused_ln (an extra package, absent on CPU,
    where stock then fails at the first forward)."""
    from paddlenlp.utils.tools import get_env_device

    return bool(config.use_fused_rms_norm) and get_env_device() not in ("cpu", "gpu")


def fast_rms_norm_forward(self, hidden_states):
    """LlamaRMSNorm.forward through the fused kernel (same numerics); stock for the NPU and XPU
    fused norms the config asks for, and when the input and weight dtypes differ."""
    if self.config.use_fused_rms_norm:
        if _device_fused_rms_norm(self.config):
            _info_once("device_rms_norm", "use_fused_rms_norm on this device: LlamaRMSNorm keeps its device kernel")
            return _ORIGINALS["rms_norm"](self, hidden_states)
        _info_once("fused_ln", "use_fused_rms_norm: paddle_fastffn's fused RMSNorm serves it (PaddleNLP's fused_ln "
                               "package is not needed)")
    if not _same_dtype(hidden_states, self.weight):
        _warn_once("norm_dtype", f"RMSNorm input {hidden_states.dtype} and weight {self.weight.dtype} differ "
                                 f"(AMP O1): those norms keep PaddleNLP's math")
        return _ORIGINALS["rms_norm"](self, hidden_states)
    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _is_plain_linear(layer) -> bool:
    """A Linear whose math is exactly x @ weight (no LoRA adapters, no tensor-parallel comms)."""
    return type(layer) is nn.Linear and getattr(layer, "bias", None) is None


def fast_mlp_forward(self, x):
    """SwiGLU MLP: gate/up projection(s) -> fused SwiGLU -> down projection.

    With fuse_attention_ffn the gate and up projections are one GEMM and the kernel reads the packed
    [gate | up] output; otherwise the two projections run and the two-input kernel fuses silu * up.
    With swiglu_recompute, a fused gate/up projection and a plain down_proj, the SwiGLU output is
    not stored for backward; elsewhere it is (one info line per reason). Under FP8 an MLP with the
    FP8 FFN attached (attach_fp8) runs it: the FFN recomputes SwiGLU in backward by construction."""
    ffn = self.__dict__.get("_fast_ffn_fp8") if _FP8 is not None else None
    if ffn is not None and ffn.uses_fp8(math.prod(x.shape[:-1])):
        return ffn(x)
    recompute = _ACTIVE is not None and _ACTIVE.swiglu_recompute
    if self.fuse_attention_ffn:
        gate_up = self.gate_up_fused_proj(x)
        if recompute and _is_plain_linear(self.down_proj) and not _fp8_attached(self.down_proj):
            # gate_up is this forward's private intermediate: its memory can hold its gradient.
            return ops.swiglu_down_proj(gate_up, self.down_proj.weight, reuse_gate_up_memory=True)
        if recompute and _fp8_attached(self.down_proj):
            _info_once("recompute_fp8", "fast_ffn_precision=fp8: this MLP's down_proj runs through Fp8Linear (per "
                                        "linear), so the fused SwiGLU output is stored for it")
        elif recompute:
            _info_once("recompute_down_proj", f"swiglu_recompute needs a plain Linear down_proj, this one is "
                                              f"{type(self.down_proj).__name__} (LoRA or tensor parallel): "
                                              f"the SwiGLU output is stored")
        return self.down_proj(ops.swiglu(gate_up))
    if recompute:
        _info_once("recompute_unfused", "swiglu_recompute needs the fused gate/up projection (a model built "
                                        "while the fast path is enabled, fast_ffn_fuse_projections): this "
                                        "model's MLP keeps gate_proj/up_proj and stores the SwiGLU output")
    return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


def fast_apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    """Drop-in for modeling.apply_rotary_pos_emb: the fused kernel on q and k together."""
    return ops.rotary_embedding(q, k, cos, sin, position_ids)


def _can_fuse_add_norm(layer) -> bool:
    norm = layer.post_attention_layernorm
    return (
        _ACTIVE is not None and _ACTIVE.rms_norm and not layer.sequence_parallel
        and type(norm).__name__ == "LlamaRMSNorm" and not _device_fused_rms_norm(norm.config)
    )


def fast_decoder_layer_forward(self, hidden_states, position_ids=None, attention_mask=None,
                               output_attentions=False, past_key_value=None, use_cache=False,
                               alibi=None, npu_is_casual=False):
    """LlamaDecoderLayer.forward with the attention residual add fused into the post-attention
    RMSNorm (one pass: sum, statistics, normalise). Everything else is the stock layer's flow,
    including its layer-wise recompute of attention."""
    if not _can_fuse_add_norm(self):
        if self.sequence_parallel:
            _warn_once("sequence_parallel", "sequence-parallel decoder layers keep PaddleNLP's residual add "
                                            "and norms (the fused MLP, rotary and attention still apply)")
        return _ORIGINALS["decoder_layer"](self, hidden_states, position_ids, attention_mask,
                                           output_attentions, past_key_value, use_cache, alibi,
                                           npu_is_casual)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    attn_args = (hidden_states, position_ids, past_key_value, attention_mask, output_attentions,
                 use_cache, alibi)
    if (self.enable_recompute and self.layerwise_recompute and not hidden_states.stop_gradient
            and self.recompute_granularity == "full_attn"):
        # The modeling module's recompute: the FP8 path's while FP8 is on (fp8/recompute.py).
        outputs = _modeling().recompute(self.self_attn, *attn_args,
                                        use_reentrant=self.config.recompute_use_reentrant)
    else:
        outputs = self.self_attn(*attn_args, npu_is_casual=npu_is_casual)
    attn_output = outputs[0] if isinstance(outputs, tuple) else outputs
    norm = self.post_attention_layernorm
    if _same_dtype(attn_output, norm.weight) and _same_dtype(residual, norm.weight):
        hidden_states, residual = ops.fused_add_rms_norm(attn_output, residual, norm.weight,
                                                         norm.variance_epsilon)
    else:
        _warn_once("add_norm_dtype", "residual and attention output dtypes differ (AMP O1): the residual add "
                                     "and post-attention norm keep PaddleNLP's math")
        residual = residual + attn_output
        hidden_states = norm(residual)
    hidden_states = residual + self.mlp(hidden_states)
    result = (hidden_states,)
    if output_attentions:
        result += (outputs[1],)
    if use_cache:
        result += (outputs[2 if output_attentions else 1],)
    return result[0] if len(result) == 1 else result


def prepare_attention_mask_for_generation(input_ids, pad_token_id, eos_token_id):
    """The 2-D [batch, seq] keep-mask (1 = attend) that LLaMA's generation path expects.

    PaddleNLP 2.8.1's generic GenerationMixin builds an additive float 4-D mask instead; LLaMA's
    _prepare_decoder_attention_mask then hands it to paddle.where as the condition, which Paddle
    3.x rejects ("The `condition` is expected to be a boolean Tensor"), and LLaMA's
    update_model_kwargs_for_generation could not extend a 4-D mask anyway."""
    has_pad = pad_token_id is not None and bool(paddle.any(input_ids == pad_token_id).item())
    if has_pad and pad_token_id != eos_token_id:
        return (input_ids != pad_token_id).astype("int64")
    return paddle.ones_like(input_ids, dtype="int64")


def _bottom_right_causal_mask(q_len: int, kv_len: int, dtype) -> paddle.Tensor:
    """Additive [1, 1, q_len, kv_len] mask: query i (the (kv_len - q_len + i)-th token) sees keys
    0 .. kv_len - q_len + i. is_causal=True aligns the triangle top-left instead, which is only
    right when q_len == kv_len."""
    rows = paddle.arange(q_len, dtype="int64").unsqueeze(1) + (kv_len - q_len)
    allowed = paddle.arange(kv_len, dtype="int64").unsqueeze(0) <= rows
    blocked = paddle.full([q_len, kv_len], paddle.finfo(dtype).min, dtype=dtype)
    return paddle.where(allowed, paddle.zeros([q_len, kv_len], dtype=dtype), blocked).reshape([1, 1, q_len, kv_len])


def fast_scaled_dot_product_attention(query_states, config, key_states, value_states, attention_mask,
                                      output_attentions, alibi=None, sequence_parallel=False,
                                      reshard_layer=None, npu_is_casual=False):
    """modeling.scaled_dot_product_attention, with the causal mask made explicit where PaddleNLP's
    use_flash_attention path drops it (a causal-looking mask becomes None -> is_causal=True) while
    fewer queries than keys are present (decoding with a KV cache): there is_causal=True would let
    the new token see only the first keys. Training (q_len == kv_len) keeps is_causal=True.
    A packed batch's segments (ops.PackedSegments, in the mask's place) run ops.packed_attention:
    each example attends to itself, with no [seq, seq] mask (flash_attn_unpadded on GPU)."""
    if isinstance(attention_mask, ops.PackedSegments):
        return _packed_sdpa(query_states, key_states, value_states, attention_mask, output_attentions, alibi,
                            sequence_parallel, reshard_layer)
    q_len, kv_len = query_states.shape[1], key_states.shape[1]
    if config.use_flash_attention and attention_mask is None and q_len != kv_len:
        attention_mask = _bottom_right_causal_mask(q_len, kv_len, query_states.dtype)
    return _ORIGINALS["sdpa"](query_states, config, key_states, value_states, attention_mask,
                              output_attentions, alibi, sequence_parallel, reshard_layer=reshard_layer,
                              npu_is_casual=npu_is_casual)


def _packed_sdpa(query_states, key_states, value_states, segments, output_attentions, alibi, sequence_parallel,
                 reshard_layer):
    bsz, q_len, num_heads, head_dim = query_states.shape
    unsupported = [name for name, used in (("a KV cache", key_states.shape[1] != q_len),
                                           ("output_attentions", output_attentions), ("alibi", alibi is not None),
                                           ("sequence parallel", sequence_parallel),
                                           ("sep parallel", reshard_layer is not None)) if used]
    if unsupported:
        raise ValueError(f"paddle_fastffn: packed batches (attn_mask_startend_row_indices) do not support "
                         f"{', '.join(unsupported)}; pass a dense 4-D attention_mask instead")
    out = ops.packed_attention(query_states, key_states, value_states, segments)
    return out.reshape([bsz, q_len, num_heads * head_dim])


def fast_prepare_decoder_attention_mask(attention_mask, input_shape, past_key_values_length, dtype):
    """LlamaModel._prepare_decoder_attention_mask, passing a packed batch's segments through to
    attention (they replace the [batch, 1, seq, seq] mask); other masks as stock. With
    fast_ffn_attention off, attention is PaddleNLP's own: the segments become its dense
    block-causal mask (one info line)."""
    if isinstance(attention_mask, ops.PackedSegments):
        if _ACTIVE is not None and _ACTIVE.attention:
            return attention_mask
        _info_once("packed_dense", "fast_ffn_attention is off: packed batches reach PaddleNLP's attention as its "
                                   "dense [batch, 1, seq, seq] block-causal mask")
        attention_mask = paddle.to_tensor(attention_mask.dense_mask())
    return _ORIGINALS["prepare_mask"].__func__(attention_mask, input_shape, past_key_values_length, dtype)


def fast_is_casual_mask(attention_mask):
    """modeling.is_casual_mask (LlamaModel asks it on the flash path): a packed batch's segments
    are not one causal mask."""
    if isinstance(attention_mask, ops.PackedSegments):
        return False
    return _ORIGINALS["is_casual_mask"](attention_mask)


def _enable_sdpa(config) -> None:
    # PaddleNLP's use_flash_attention path calls F.scaled_dot_product_attention: flash attention
    # on GPU, the fused SDPA on CPU; grouped-query heads natively (no repeat_kv copies).
    _remember_stock(config)
    config.use_flash_attention = True


# ---------------------------------------------------------------------------------------------
# The config the model had before the fast path changed it (what a checkpoint must say).

def _remember_stock(config, save_fused: bool | None = None) -> None:
    """Record `config`'s values of the keys the fast path changes, the first time it sees it.
    Kept off the config itself: PretrainedConfig serialises every attribute into config.json."""
    key = id(config)
    entry = _STOCK.get(key)
    if entry is None or entry[0]() is not config:
        values = {name: bool(getattr(config, name, False)) for name in _PATCHED_CONFIG_KEYS}
        entry = [weakref.ref(config, lambda _ref, key=key: _STOCK.pop(key, None)), values, False]
        _STOCK[key] = entry
    if save_fused is not None:
        entry[2] = save_fused


def stock_config_values(config) -> dict | None:
    """{use_flash_attention, fuse_attention_qkv, fuse_attention_ffn} as they were before the fast
    path changed `config`; None for a config it never touched."""
    entry = _STOCK.get(id(config))
    return dict(entry[1]) if entry is not None and entry[0]() is config else None


def _save_fused(config) -> bool:
    if _ACTIVE is not None:
        return _ACTIVE.save_fused_checkpoint
    entry = _STOCK.get(id(config))
    return bool(entry is not None and entry[0]() is config and entry[2])


def _distributed_layers(config) -> str | None:
    """Why this config builds PaddleNLP's sharded layers, or None for plain Linear layers."""
    if (getattr(config, "tensor_parallel_degree", 1) or 1) > 1:
        return f"tensor_parallel_degree={config.tensor_parallel_degree}"
    if (getattr(config, "pipeline_parallel_degree", 1) or 1) > 1:
        return f"pipeline_parallel_degree={config.pipeline_parallel_degree}"
    return None


def _keeps_distributed_layers(config) -> bool:
    """Tensor / pipeline parallel models keep PaddleNLP's sharded sub-layers (one info line)."""
    distributed = _distributed_layers(config)
    if distributed:
        _info_once("distributed_layers", f"{distributed}: the model keeps PaddleNLP's own (sharded) q/k/v and "
                                         f"gate/up projection sub-layers, no fused projections, and stores the "
                                         f"SwiGLU output (recompute needs the fused gate/up projection and a plain "
                                         f"Linear down_proj); the fused SwiGLU, RMSNorm and rotary kernels still apply",
                   covers=("recompute_unfused", "recompute_down_proj"))
    return distributed is not None


def configure(config, options: FastFFNOptions) -> None:
    """Config changes made before a model is built (the construction hook calls it for every
    decoder layer, before the layer's sub-layers read the config)."""
    _remember_stock(config, options.save_fused_checkpoint)
    if options.attention:
        _enable_sdpa(config)
    if not (options.fuse_projections or options.swiglu_recompute):
        return
    if _keeps_distributed_layers(config):
        return
    if options.fuse_projections:
        # PaddleNLP 2.8.1 fuses unfused checkpoints on load (and splits fused ones for unfused
        # models): LlamaPretrainedModel._get_fuse_or_split_param_mappings.
        config.fuse_attention_qkv = True
        config.fuse_attention_ffn = True


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
        owner._fast_ffn_fused = kind
        if kind == "qkv":
            widths = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
                      config.num_key_value_heads * head_dim)
        else:
            widths = (config.intermediate_size, config.intermediate_size)
        fused._fast_ffn_stock_parts = (widths, _fuse_fn(kind, config))


def _fuse_fn(kind: str, config):
    from paddlenlp.transformers.conversion_utils import fuse_param_func

    if kind == "qkv":
        return partial(fuse_param_func(), is_qkv=True, num_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads)
    return fuse_param_func()


def _split_fn(kind: str, config):
    from paddlenlp.transformers.conversion_utils import split_param_func

    if kind == "qkv":
        return partial(split_param_func(), split_nums=3, is_qkv=True, num_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads)
    return partial(split_param_func(), split_nums=2)


def fast_fused_layers(model) -> dict:
    """{sub-layer name: kind} of the attention / MLP layers of `model` whose projections the fast
    path fused ("qkv" or "ffn")."""
    return {name: layer._fast_ffn_fused for name, layer in model.named_sublayers(include_self=True)
            if getattr(layer, "_fast_ffn_fused", None)}


def fast_fused_kinds(model) -> set:
    return set(fast_fused_layers(model).values())


# ---------------------------------------------------------------------------------------------
# Hooks that keep the checkpoint contract stock (installed once; they act only on layers the fast
# path fused, so stock models are untouched).

def _init_weights_like_stock(original):
    def _init_weights(self, layer):
        spec = getattr(layer, "_fast_ffn_stock_parts", None)
        if spec is None or getattr(layer.weight, "is_distributed", False):
            return original(self, layer)
        # Stock draws each part with the same generator in this order; drawing the parts and
        # fusing them gives the weights a stock model built from the same seed has.
        widths, fuse = spec
        std = self.config.initializer_range
        parts = [paddle.tensor.normal(mean=0.0, std=std, shape=[layer.weight.shape[0], width]) for width in widths]
        layer.weight.set_value(fuse(parts))
    return _init_weights


def stock_checkpoint(model, state_dict: dict, config_to_save, save_fused: bool):
    """(state_dict, config) as stock PaddleNLP would save this model: fused projections split by
    PaddleNLP's own split mappings, fuse_attention_* and use_flash_attention as before the fast
    path. With save_fused, the fused weights stay and only use_flash_attention is restored."""
    config_to_save = copy.deepcopy(config_to_save)
    stock = stock_config_values(model.config) or {}
    if "use_flash_attention" in stock:
        config_to_save.use_flash_attention = stock["use_flash_attention"]
    kinds = fast_fused_kinds(model)
    if save_fused or not kinds:
        return state_dict, config_to_save
    state_dict = dict(state_dict)
    fused_suffixes = tuple(f".{FUSED_LAYOUTS[kind][0]}.weight" for kind in kinds)
    for key, value in state_dict.items():
        # Split on the host: the split copies must not double the fused weights on the GPU.
        if key.endswith(fused_suffixes) and isinstance(value, paddle.Tensor) and not value.place.is_cpu_place():
            state_dict[key] = value.cpu()
    for kind in kinds:
        setattr(config_to_save, FUSED_LAYOUTS[kind][2], False)
    state_dict, _ = type(model).convert_fuse_and_split(config_to_save, state_dict)
    return state_dict, config_to_save


def _save_pretrained_stock(original):
    import inspect

    signature = inspect.signature(original)

    def save_pretrained(self, save_dir, *args, **kwargs):
        from paddlenlp.transformers.model_utils import get_parameter_dtype, unwrap_model

        model = unwrap_model(self)
        stock = stock_config_values(model.config)
        if stock is None or _distributed_layers(model.config):
            return original(self, save_dir, *args, **kwargs)
        bound = signature.bind(self, save_dir, *args, **kwargs)
        arguments = dict(bound.arguments)
        extra, positional = dict(arguments.pop("kwargs", {})), arguments.pop("args", ())
        arguments.pop("self")
        state_dict = arguments.get("state_dict")
        if state_dict is None:
            state_dict = model.state_dict()
        # As PaddleNLP's save_pretrained does before it copies the config.
        model.config.dtype = str(get_parameter_dtype(model)).split(".")[1]
        config_to_save = extra.get("config_to_save") or model.config
        arguments["state_dict"], extra["config_to_save"] = stock_checkpoint(
            model, state_dict, config_to_save, _save_fused(model.config))
        if positional:  # arguments past `variant` given by position: keep them positional
            return original(self, *arguments.values(), *positional, **extra)
        return original(self, **arguments, **extra)
    return save_pretrained


def _set_state_dict_fusing(original):
    def set_state_dict(self, state_dict, *args, **kwargs):
        if fast_fused_kinds(self):
            # A stock-layout checkpoint (what save_pretrained writes) into a model whose
            # projections the fast path fused: the Trainer's resume and best-model reload call
            # set_state_dict directly, without from_pretrained's conversion.
            state_dict, _ = type(self).convert_fuse_and_split(self.config, dict(state_dict))
        try:
            return original(self, state_dict, *args, **kwargs)
        finally:  # the FP8 copies of the loaded weights are re-made (fp8/weight_cache.py)
            weights_changed(self.parameters())
    return set_state_dict


def fp8_checkpoint_layers(model):
    """(recipe, {sub-layer name: Fp8Linear or Fp8FFN}) of what computes in FP8 in `model`, attached
    now where the first forward has not attached it yet (a resume restores the scaling states
    before any forward); (None, {}) while FP8 is off. A checkpoint saves and restores these."""
    if _FP8 is None:
        return None, {}
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, _modeling().LlamaModel):
            attach_fp8(layer, _FP8)
    return _FP8, fp8_layers(model)


def install_hooks(enabled_options) -> None:
    """Install, once, the hooks of the fast path that must outlive revert(): the construction hook
    (config changes and fused-layer records for models built while `enabled_options()` is not
    None) and the checkpoint hooks above. Each acts only on what the fast path built."""
    if _HOOKS:
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
    _HOOKS.update(decoder_init=decoder_init, init_weights=pretrained._init_weights,
                  save_pretrained=pretrained.save_pretrained, set_state_dict=pretrained.set_state_dict)
    modeling.LlamaDecoderLayer.__init__ = init_with_fast_config
    pretrained._init_weights = _init_weights_like_stock(_HOOKS["init_weights"])
    pretrained.save_pretrained = _save_pretrained_stock(_HOOKS["save_pretrained"])
    pretrained.set_state_dict = _set_state_dict_fusing(_HOOKS["set_state_dict"])
    causal_lm = modeling.LlamaForCausalLM
    _HOOKS["from_pretrained"] = causal_lm.from_pretrained.__func__
    causal_lm.from_pretrained = classmethod(_from_pretrained_hub_folders(_HOOKS["from_pretrained"]))
    _install_lora_hooks()


def _from_pretrained_hub_folders(original):
    """LlamaForCausalLM.from_pretrained on a Hugging Face Hub LLaMA folder, while the fast path is
    enabled, through paddle_fastffn.finetune.checkpoint (PaddleNLP 2.8.1 fails on sharded Hub
    checkpoints and on the Hub's tokenizer.model; see that module). Everything else, and every
    call while the fast path is off, is PaddleNLP's own from_pretrained."""
    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, **kwargs):
        if (_ACTIVE is not None and cls is _modeling().LlamaForCausalLM and not args
                and isinstance(pretrained_model_name_or_path, (str, os.PathLike))
                and os.path.isdir(pretrained_model_name_or_path)):
            from ..finetune import checkpoint

            if checkpoint.hf_weight_files(pretrained_model_name_or_path):
                kwargs.pop("convert_from_torch", None)  # the conversion happens in memory
                return checkpoint.load_model(pretrained_model_name_or_path, kwargs.pop("dtype", None), **kwargs)
        return original(cls, pretrained_model_name_or_path, *args, **kwargs)
    return from_pretrained


# ---------------------------------------------------------------------------------------------
# LoRA: adapters go on PaddleNLP's stock sub-layers.

def _install_lora_hooks() -> None:
    from paddlenlp.peft import LoRAModel

    lora_init, lora_save = LoRAModel.__init__, LoRAModel.save_pretrained
    _HOOKS.update(lora_init=lora_init, lora_save=lora_save)

    def init_on_stock_layers(self, model, lora_config, *args, **kwargs):
        unfuse_for_lora(model, lora_config)
        lora_init(self, model, lora_config, *args, **kwargs)

    def save_with_stock_config(self, save_directory, merge_tensor_parallel=False, **kwargs):
        base = self.model
        if stock_config_values(getattr(base, "config", None)) is None or not kwargs.get("save_model_config", True):
            return lora_save(self, save_directory, merge_tensor_parallel=merge_tensor_parallel, **kwargs)
        lora_save(self, save_directory, merge_tensor_parallel=merge_tensor_parallel,
                  **{**kwargs, "save_model_config": False})
        if kwargs.get("is_main_process", paddle.distributed.get_rank() == 0):
            _, config = stock_checkpoint(base, {}, base.config, _save_fused(base.config))
            if merge_tensor_parallel:
                config.tensor_parallel_degree = -1
            config.save_pretrained(save_directory)

    LoRAModel.__init__ = init_on_stock_layers
    LoRAModel.save_pretrained = save_with_stock_config


def _part_name(fused_module_name: str, part: str) -> str:
    return fused_module_name.rsplit(".", 1)[0] + "." + part if "." in fused_module_name else part


def unfuse_for_lora(model, lora_config) -> None:
    """Before LoRAModel places adapters: split the fused projections (of the kinds the target
    patterns reach) back into PaddleNLP's stock sub-layers, and aim patterns that name the fused
    layers at their parts, so the adapters, their initialisation and their saved names are the
    ones stock PaddleNLP gives the unfused model. A no-op for models the fast path did not fuse."""
    owners = fast_fused_layers(model)
    if not owners or lora_config.target_modules is None:
        return
    patterns = [lora_config.target_modules] if isinstance(lora_config.target_modules, str) else list(lora_config.target_modules)
    enables = lora_config.enable_lora_list
    if isinstance(lora_config.target_modules, str):
        enables = [enables]
    elif enables is None:
        enables = [None] * len(patterns)
    fused_names = {f"{name}.{FUSED_LAYOUTS[kind][0]}" if name else FUSED_LAYOUTS[kind][0]: kind
                   for name, kind in owners.items()}
    reached = set()
    for fused_name, kind in fused_names.items():
        names = [fused_name] + [_part_name(fused_name, part) for part in FUSED_LAYOUTS[kind][1]]
        if any(re.fullmatch(pattern, name) for pattern in patterns for name in names):
            reached.add(kind)
    if not reached:
        return
    other_names = [name for name, _ in model.named_sublayers() if name not in fused_names]
    new_patterns, new_enables = _retarget(patterns, enables, {n: k for n, k in fused_names.items() if k in reached},
                                          other_names)
    for layer in model.sublayers(include_self=True):
        if getattr(layer, "_fast_ffn_fused", None) in reached:
            _unfuse_layer(layer, model.config)
    stock = stock_config_values(model.config) or {}
    for kind in reached:
        flag = FUSED_LAYOUTS[kind][2]
        setattr(model.config, flag, stock.get(flag, False))
    if isinstance(lora_config.target_modules, str) and len(new_patterns) == 1:
        lora_config.target_modules, lora_config.enable_lora_list = new_patterns[0], new_enables[0]
    else:
        lora_config.target_modules = new_patterns
        lora_config.enable_lora_list = None if all(e is None for e in new_enables) else new_enables
    split = " and ".join(f"{FUSED_LAYOUTS[k][0]} -> {'/'.join(FUSED_LAYOUTS[k][1])}" for k in sorted(reached))
    _info_once("lora", f"LoRA adapts this model's projections: the fused layers are split back into PaddleNLP's "
                       f"sub-layers ({split}), so the adapters sit on the stock layers; the SwiGLU output is "
                       f"stored (recompute needs the fused gate/up projection and a plain down_proj)",
               covers=("recompute_unfused", "recompute_down_proj", "built_unfused"))


def _retarget(patterns, enables, fused_names: dict, other_names: list):
    """LoRA target patterns with the same meaning on the unfused model: a pattern that names a
    fused layer (qkv_proj, gate_up_fused_proj) targets its parts instead (one pattern per part,
    in PaddleNLP's order, so adapters are created in stock order; one pattern for all parts if
    per-part patterns would also match another layer more than once); every other pattern means
    on the unfused layers what it means for stock PaddleNLP."""
    new_patterns, new_enables = [], []
    for pattern, enable in zip(patterns, enables):
        hits = [name for name in fused_names if re.fullmatch(pattern, name)]
        if not hits:
            if pattern not in new_patterns:  # a list naming a part and its fused layer: the part once
                new_patterns.append(pattern)
                new_enables.append(enable)
            continue
        produced = []
        for kind in [k for k in FUSED_LAYOUTS if k in {fused_names[n] for n in hits}]:
            fused, parts, _flag = FUSED_LAYOUTS[kind]
            kind_hits = [n for n in hits if fused_names[n] == kind]
            chosen = [p for i, p in enumerate(parts) if enable is None or (i < len(enable) and enable[i])]
            part_names = [_part_name(n, p) for n in kind_hits for p in parts]
            if fused in pattern:
                candidates = [pattern.replace(fused, part) for part in chosen]
                if any(sum(bool(re.fullmatch(c, n)) for c in candidates) > 1 for n in other_names):
                    candidates = [pattern.replace(fused, "(?:" + "|".join(chosen) + ")")]
            elif enable is None and any(re.fullmatch(pattern, n) for n in part_names):
                candidates = [pattern]  # already means the parts it matches (e.g. ".*proj.*")
            else:
                candidates = ["(?:" + "|".join(re.escape(_part_name(n, p)) for n in kind_hits for p in chosen) + ")"]
            produced += [c for c in candidates if c not in produced]
        produced = [c for c in produced if c not in new_patterns]  # LoRAModel would adapt a layer twice
        new_patterns += produced
        new_enables += [None] * len(produced)
    return new_patterns, new_enables


def _unfuse_layer(owner, config) -> None:
    """Replace owner's fused projection by its stock parts (same values, same dtype, no random
    draws), in the sub-layer order stock PaddleNLP builds."""
    from paddlenlp.transformers.model_utils import dtype_guard

    kind = owner._fast_ffn_fused
    fused_name, parts, flag = FUSED_LAYOUTS[kind]
    fused = getattr(owner, fused_name)
    weight = fused.weight
    pieces = _split_fn(kind, config)(weight.detach())
    new_layers = []
    linear_class = _modeling().Linear  # what PaddleNLP builds for unfused projections on this device
    with dtype_guard(str(weight.dtype).split(".")[-1]):
        for part, piece in zip(parts, pieces):
            # A constant initialiser draws no random numbers: later draws (LoRA's A) stay stock.
            linear = linear_class(piece.shape[0], piece.shape[1], bias_attr=False,
                                  weight_attr=paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)))
            linear.weight.set_value(piece)
            linear.weight.stop_gradient = weight.stop_gradient
            new_layers.append((part, linear))
    items = list(owner._sub_layers.items())
    owner._sub_layers.clear()
    for name, layer in items:
        if name == fused_name:
            owner._sub_layers.update(new_layers)
        else:
            owner._sub_layers[name] = layer
    setattr(owner, flag, False)  # LlamaAttention.fuse_attention_qkv / LlamaMLP.fuse_attention_ffn
    del owner._fast_ffn_fused


# ---------------------------------------------------------------------------------------------
# Fused LM head + cross-entropy (FastFFNOptions.fused_cross_entropy). LlamaForCausalLM.forward with
# labels in training mode computes the hidden states, then ops.linear_cross_entropy on the head's
# weight: PaddleNLP's loss without the [tokens, vocab] logits, which that forward does not return
# (logits=None; the Trainer's compute_loss reads only the loss). Forwards without labels
# (generation) and in eval mode (the Trainer's evaluate/predict, whose prediction_step hands the
# logits to compute_metrics) take the stock forward, as does a head the fused loss cannot read
# (one info line).

def _fused_head_weight(model):
    """(weight, transpose_weight, None) when model's LM head is a plain weight and its criterion
    PaddleNLP's own, else (None, False, why not)."""
    modeling = _modeling()
    config, head = model.config, model.lm_head
    if type(getattr(model, "criterion", None)) is not modeling.LlamaPretrainingCriterion:
        return None, False, f"the criterion is {type(getattr(model, 'criterion', None)).__name__}"
    distributed = _distributed_layers(config)
    if distributed or getattr(model.criterion, "enable_parallel_cross_entropy", False):
        return None, False, f"{distributed or 'tensor parallel'}: the head is sharded over the vocabulary"
    if getattr(config, "sequence_parallel", False) or (getattr(config, "sep_parallel_degree", 1) or 1) > 1:
        return None, False, "sequence parallel gathers the hidden states inside the head"
    if type(head) is not modeling.LlamaLMHead and not _is_plain_linear(head):
        return None, False, f"the LM head is {type(head).__name__}, not LlamaLMHead or a plain Linear"
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


def _packed_segments(model, attn_mask_startend_row_indices, attention_mask):
    """The segments of a packed batch (the collator's attn_mask_startend_row_indices), which travel
    in attention_mask's place through LlamaModel and its decoder layers (recompute included) to
    fast_scaled_dot_product_attention."""
    if attention_mask is not None:
        raise ValueError("paddle_fastffn: pass either attention_mask or attn_mask_startend_row_indices (a packed "
                         "batch's segments), not both")
    if getattr(model.config, "alibi", False):
        raise ValueError("paddle_fastffn: packed batches (attn_mask_startend_row_indices) do not support alibi")
    return ops.PackedSegments.from_startend_row_indices(attn_mask_startend_row_indices)


def fast_causal_lm_forward(self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                           labels=None, use_cache=False, past_key_values=None, output_attentions=None,
                           output_hidden_states=None, return_dict=None, attn_mask_startend_row_indices=None):
    """LlamaForCausalLM.forward with the loss of a training step through ops.linear_cross_entropy
    (logits=None in the result), where fused_cross_entropy is on; everything else is the stock
    forward. attn_mask_startend_row_indices (PaddleNLP's packed-batch key, the causal FlashMask
    form [batch, 1, seq, 1]) marks where each packed example ends: attention keeps the examples
    apart without a dense mask (position_ids should restart at each example, as the packing
    collator gives them)."""
    stock = _ORIGINALS["causal_lm_forward"]
    if attn_mask_startend_row_indices is not None:
        attention_mask = _packed_segments(self, attn_mask_startend_row_indices, attention_mask)
    arguments = (input_ids, position_ids, attention_mask, inputs_embeds, labels, use_cache, past_key_values,
                 output_attentions, output_hidden_states, return_dict)
    if labels is None or not self.training or _ACTIVE is None or not _ACTIVE.fused_cross_entropy:
        return stock(self, *arguments)
    weight, transpose, reason = _fused_head_weight(self)
    if weight is None:
        _info_once(f"fused_ce:{reason}", f"fused_cross_entropy: {reason}; the LM head and loss stay stock")
        return stock(self, *arguments)
    config = self.config
    output_attentions = output_attentions if output_attentions is not None else config.output_attentions
    output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
    return_dict = return_dict if return_dict is not None else config.use_return_dict
    outputs = self.llama(input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, past_key_values=past_key_values,
                         output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                         return_dict=return_dict)
    hidden_states = outputs[0]
    if hidden_states.dtype == weight.dtype:
        loss = ops.linear_cross_entropy(hidden_states, weight, labels, ignore_index=self.criterion.ignore_index,
                                        transpose_weight=transpose)
        logits = None  # never materialised
    else:  # AMP O1 mixes: the stock head (autocast casts its matmul) and criterion
        _info_once("fused_ce_dtype", f"fused_cross_entropy: hidden states {hidden_states.dtype} and LM head weight "
                                     f"{weight.dtype} differ (AMP O1): the LM head and loss stay stock")
        logits = paddle.matmul(hidden_states, weight, transpose_y=True) if transpose else self.lm_head(hidden_states)
        loss = self.criterion(logits, labels)
    if not return_dict:
        return (loss, logits) + tuple(outputs[1:])
    return _modeling().CausalLMOutputWithCrossAttentions(
        loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions)


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
    return _FP8 is not None and fp8_attach.fp8_of(linear) is not None


def _mlp_without_fp8_ffn(mlp) -> str | None:
    """Why this MLP cannot run the FP8 FFN (its linears then run Fp8Linear each, or keep their
    stock GEMMs where tensor parallel), or None where it runs it."""
    from ..fp8.ffn import plain_linear

    if _ACTIVE is None or not _ACTIVE.swiglu:
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


def fast_llama_model_forward(self, input_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                             use_cache=None, past_key_values=None, output_attentions=False,
                             output_hidden_states=None, return_dict=False, **kwargs):
    """LlamaModel.forward, after attaching Fp8Linear to the decoder layers' linears (FP8 only).
    PaddleNLP 2.8.1's signature spelled out: its Layer.__setattr__ wraps a class-level forward
    patch that lacks output_* / return_dict and drops those arguments."""
    if _FP8 is not None:
        attach_fp8(self, _FP8)
    return _ORIGINALS["llama_model_forward"](
        self, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
        inputs_embeds=inputs_embeds, use_cache=use_cache, past_key_values=past_key_values,
        output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        return_dict=return_dict, **kwargs)


def _apply_fp8(recipe) -> None:
    global _FP8
    modeling = _modeling()
    _ORIGINALS.setdefault("llama_model_forward", modeling.LlamaModel.forward)
    _ORIGINALS.setdefault("recompute", modeling.recompute)
    _FP8 = recipe
    if recipe is None:
        _revert_fp8()
        return
    modeling.LlamaModel.forward = fast_llama_model_forward
    # PaddleNLP's layer (and attention) recompute: the replay reuses the forward's FP8 scales.
    from ..fp8.recompute import fp8_recompute

    modeling.recompute = fp8_recompute(_ORIGINALS["recompute"])


def _revert_fp8() -> None:
    global _FP8
    _FP8 = None
    fp8_attach.detach_all_fp8_linears()
    if "llama_model_forward" in _ORIGINALS:
        _modeling().LlamaModel.forward = _ORIGINALS["llama_model_forward"]
        _modeling().recompute = _ORIGINALS["recompute"]


# ---------------------------------------------------------------------------------------------

def apply(options: FastFFNOptions, model=None) -> None:
    """Patch the LLaMA classes (every layer built from now on, and every existing one)."""
    global _ACTIVE
    modeling = _modeling()
    if not _ORIGINALS:
        _ORIGINALS.update(
            rms_norm=modeling.LlamaRMSNorm.forward,
            mlp=modeling.LlamaMLP.forward,
            decoder_layer=modeling.LlamaDecoderLayer.forward,
            rotary=modeling.apply_rotary_pos_emb,
            generation_mask=own_attribute(modeling.LlamaForCausalLM, "prepare_attention_mask_for_generation"),
            sdpa=modeling.scaled_dot_product_attention,
            prepare_mask=own_attribute(modeling.LlamaModel, "_prepare_decoder_attention_mask"),
            is_casual_mask=modeling.is_casual_mask,
        )
    _ACTIVE = options
    _ORIGINALS.setdefault("causal_lm_forward", modeling.LlamaForCausalLM.forward)
    # Always the fast forward: it takes packed batches' segments; the fused loss is its own option.
    modeling.LlamaForCausalLM.forward = fast_causal_lm_forward
    modeling.LlamaModel._prepare_decoder_attention_mask = staticmethod(fast_prepare_decoder_attention_mask)
    modeling.is_casual_mask = fast_is_casual_mask
    modeling.LlamaRMSNorm.forward = fast_rms_norm_forward if options.rms_norm else _ORIGINALS["rms_norm"]
    modeling.LlamaMLP.forward = fast_mlp_forward if options.swiglu else _ORIGINALS["mlp"]
    modeling.LlamaDecoderLayer.forward = fast_decoder_layer_forward if options.rms_norm else _ORIGINALS["decoder_layer"]
    modeling.apply_rotary_pos_emb = fast_apply_rotary_pos_emb if options.rotary else _ORIGINALS["rotary"]
    # The attention path: SDPA with the decode-time causal mask, and generate()'s mask on Paddle 3.x
    # (both only where fast_ffn_attention puts the model on PaddleNLP's flash-attention path).
    attention = options.attention
    if attention:
        modeling.LlamaForCausalLM.prepare_attention_mask_for_generation = staticmethod(prepare_attention_mask_for_generation)
    else:
        restore_attribute(modeling.LlamaForCausalLM, "prepare_attention_mask_for_generation", _ORIGINALS["generation_mask"])
    modeling.scaled_dot_product_attention = fast_scaled_dot_product_attention if attention else _ORIGINALS["sdpa"]
    _apply_fp8(resolve_fp8(options))
    if model is not None:
        configs = [layer.config for layer in model.sublayers(include_self=True)
                   if getattr(getattr(layer, "config", None), "model_type", None) in MODEL_TYPES]
        for config in configs:
            _remember_stock(config, options.save_fused_checkpoint)
            if options.attention:
                _enable_sdpa(config)
        config = model.config
        unfused = [FUSED_LAYOUTS[kind][1] for kind in FUSED_LAYOUTS if not getattr(config, FUSED_LAYOUTS[kind][2], False)]
        if options.fuse_projections and unfused and not _keeps_distributed_layers(config):
            names = " and ".join("/".join(parts) for parts in unfused)
            stored = ", and the SwiGLU output is stored" if not config.fuse_attention_ffn else ""
            _info_once("built_unfused", f"this model was built before the fast path was enabled: its {names} "
                                        f"projections stay unfused{stored} (enable it first, e.g. use_fast_ffn in "
                                        f"the TrainingArguments, to build fused projections)",
                       covers=("recompute_unfused",))


def revert() -> None:
    """Restore PaddleNLP's own forwards. (The construction and checkpoint hooks stay: they act
    only on layers the fast path built, which keep their stock checkpoint contract.)"""
    global _ACTIVE
    _INFORMED.clear()
    fp8_attach.FP8_WARNED.clear()
    if not _ORIGINALS:
        return
    _revert_fp8()
    modeling = _modeling()
    modeling.LlamaRMSNorm.forward = _ORIGINALS["rms_norm"]
    modeling.LlamaMLP.forward = _ORIGINALS["mlp"]
    modeling.LlamaDecoderLayer.forward = _ORIGINALS["decoder_layer"]
    modeling.apply_rotary_pos_emb = _ORIGINALS["rotary"]
    restore_attribute(modeling.LlamaForCausalLM, "prepare_attention_mask_for_generation", _ORIGINALS["generation_mask"])
    modeling.scaled_dot_product_attention = _ORIGINALS["sdpa"]
    modeling.LlamaForCausalLM.forward = _ORIGINALS["causal_lm_forward"]
    restore_attribute(modeling.LlamaModel, "_prepare_decoder_attention_mask", _ORIGINALS["prepare_mask"])
    modeling.is_casual_mask = _ORIGINALS["is_casual_mask"]
    _ACTIVE = None
    _WARNED.clear()


def patched_layer_count(model) -> int:
    """How many decoder layers of `model` run the fast forward (for tests and the run log)."""
    if _ACTIVE is None:
        return 0
    modeling = _modeling()
    return sum(1 for layer in model.sublayers() if isinstance(layer, modeling.LlamaDecoderLayer))
