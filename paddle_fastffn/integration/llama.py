"""The fast path for PaddleNLP's LLaMA family (paddlenlp.transformers.llama).

Patches are class-level (Liger's pattern): forwards of LlamaRMSNorm, LlamaMLP and
LlamaDecoderLayer, and the module's apply_rotary_pos_emb, are replaced by fused versions that read
the same sub-layers and parameters. So parameter names, shapes and checkpoints stay PaddleNLP's,
LoRA's LoRALinear sub-layers keep working (the MLP calls its sub-layers; the single fused
`swiglu_down_proj` kernel path is only taken when down_proj is a plain Linear), and so do tensor
parallel layers (each rank applies SwiGLU to its own [gate_i | up_i] shard). What the fused path
does not cover (fused_ln, sequence parallel, AMP O1 dtype mixes) keeps PaddleNLP's math, with one
warning per reason. Two repairs come with it: generate() on Paddle 3.x
(prepare_attention_mask_for_generation) and the causal mask of the flash path while decoding with
a KV cache (fast_scaled_dot_product_attention).
"""

from __future__ import annotations

import warnings

import paddle
from paddle import nn

from .. import ops
from ..ops._fallback import raise_if_strict
from .options import FastFFNOptions

MODEL_TYPES = ("llama",)

_ORIGINALS: dict = {}
_ACTIVE: FastFFNOptions | None = None
_WARNED: set = set()


def _warn_once(key: str, message: str) -> None:
    """Layers the fused path does not cover keep their stock math; say so once per reason (an
    error in strict mode, as a fallback of an op is)."""
    raise_if_strict(f"paddle_fastffn: {message}")
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"paddle_fastffn: {message}", RuntimeWarning, stacklevel=3)


def _modeling():
    from paddlenlp.transformers.llama import modeling

    return modeling


def _same_dtype(x: paddle.Tensor, weight: paddle.Tensor) -> bool:
    return x.dtype == weight.dtype


def fast_rms_norm_forward(self, hidden_states):
    """LlamaRMSNorm.forward through the fused kernel (same numerics); stock for the fused_ln,
    NPU and XPU paths the config asks for, and when the input and weight dtypes differ."""
    if self.config.use_fused_rms_norm:
        _warn_once("fused_ln", "use_fused_rms_norm is set: LlamaRMSNorm keeps PaddleNLP's fused_ln path")
        return _ORIGINALS["rms_norm"](self, hidden_states)
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
    With swiglu_recompute and a plain down_proj, the SwiGLU output is not stored for backward."""
    recompute = _ACTIVE is not None and _ACTIVE.swiglu_recompute
    if self.fuse_attention_ffn:
        gate_up = self.gate_up_fused_proj(x)
        if recompute and _is_plain_linear(self.down_proj):
            # gate_up is this forward's private intermediate: its memory can hold its gradient.
            return ops.swiglu_down_proj(gate_up, self.down_proj.weight, reuse_gate_up_memory=True)
        if recompute:
            _warn_once("recompute_down_proj", "swiglu_recompute needs a plain Linear down_proj (not LoRA or "
                                              "tensor parallel): the SwiGLU output is stored")
        return self.down_proj(ops.swiglu(gate_up))
    if recompute:
        _warn_once("recompute_unfused", "swiglu_recompute needs fused gate/up projections "
                                        "(fast_ffn_fuse_projections): the SwiGLU output is stored")
    return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


def fast_apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    """Drop-in for modeling.apply_rotary_pos_emb: the fused kernel on q and k together."""
    return ops.rotary_embedding(q, k, cos, sin, position_ids)


def _can_fuse_add_norm(layer) -> bool:
    norm = layer.post_attention_layernorm
    return (
        _ACTIVE is not None and _ACTIVE.rms_norm and not layer.sequence_parallel
        and type(norm).__name__ == "LlamaRMSNorm" and not norm.config.use_fused_rms_norm
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
        from paddle.distributed.fleet.utils import recompute

        outputs = recompute(self.self_attn, *attn_args, use_reentrant=self.config.recompute_use_reentrant)
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
    the new token see only the first keys. Training (q_len == kv_len) keeps is_causal=True."""
    q_len, kv_len = query_states.shape[1], key_states.shape[1]
    if config.use_flash_attention and attention_mask is None and q_len != kv_len:
        attention_mask = _bottom_right_causal_mask(q_len, kv_len, query_states.dtype)
    return _ORIGINALS["sdpa"](query_states, config, key_states, value_states, attention_mask,
                              output_attentions, alibi, sequence_parallel, reshard_layer=reshard_layer,
                              npu_is_casual=npu_is_casual)


def _enable_sdpa(config) -> None:
    # PaddleNLP's use_flash_attention path calls F.scaled_dot_product_attention: flash attention
    # on GPU, the fused SDPA on CPU; grouped-query heads natively (no repeat_kv copies).
    config.use_flash_attention = True


def configure(config, options: FastFFNOptions) -> None:
    """Config changes made before a model is built (used by from_pretrained / from_config hooks)."""
    if options.attention:
        _enable_sdpa(config)
    if options.fuse_projections:
        # PaddleNLP 2.8.1 converts unfused checkpoints on load (and fused ones back for stock
        # models): LlamaPretrainedModel._get_fuse_or_split_param_mappings.
        if getattr(config, "tensor_parallel_degree", 1) <= 1 or config.num_key_value_heads % config.tensor_parallel_degree == 0:
            config.fuse_attention_qkv = True
        config.fuse_attention_ffn = True


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
            generation_mask=modeling.LlamaForCausalLM.prepare_attention_mask_for_generation,
            sdpa=modeling.scaled_dot_product_attention,
        )
    _ACTIVE = options
    modeling.LlamaRMSNorm.forward = fast_rms_norm_forward if options.rms_norm else _ORIGINALS["rms_norm"]
    modeling.LlamaMLP.forward = fast_mlp_forward if options.swiglu else _ORIGINALS["mlp"]
    modeling.LlamaDecoderLayer.forward = fast_decoder_layer_forward if options.rms_norm else _ORIGINALS["decoder_layer"]
    modeling.apply_rotary_pos_emb = fast_apply_rotary_pos_emb if options.rotary else _ORIGINALS["rotary"]
    modeling.LlamaForCausalLM.prepare_attention_mask_for_generation = staticmethod(prepare_attention_mask_for_generation)
    modeling.scaled_dot_product_attention = fast_scaled_dot_product_attention
    if model is not None:
        if options.attention:
            for layer in model.sublayers(include_self=True):
                if hasattr(layer, "config") and getattr(layer.config, "model_type", None) in MODEL_TYPES:
                    _enable_sdpa(layer.config)
        if options.fuse_projections and not (model.config.fuse_attention_ffn and model.config.fuse_attention_qkv):
            warnings.warn("paddle_fastffn: fuse_projections only applies when the model is built (from_pretrained "
                          "/ from_config after the flag is set); this model keeps its unfused projections.",
                          RuntimeWarning, stacklevel=3)


def revert() -> None:
    """Restore PaddleNLP's own forwards."""
    global _ACTIVE
    if not _ORIGINALS:
        return
    modeling = _modeling()
    modeling.LlamaRMSNorm.forward = _ORIGINALS["rms_norm"]
    modeling.LlamaMLP.forward = _ORIGINALS["mlp"]
    modeling.LlamaDecoderLayer.forward = _ORIGINALS["decoder_layer"]
    modeling.apply_rotary_pos_emb = _ORIGINALS["rotary"]
    modeling.LlamaForCausalLM.prepare_attention_mask_for_generation = staticmethod(_ORIGINALS["generation_mask"])
    modeling.scaled_dot_product_attention = _ORIGINALS["sdpa"]
    _ACTIVE = None
    _WARNED.clear()


def patched_layer_count(model) -> int:
    """How many decoder layers of `model` run the fast forward (for tests and the run log)."""
    if _ACTIVE is None:
        return 0
    modeling = _modeling()
    return sum(1 for layer in model.sublayers() if isinstance(layer, modeling.LlamaDecoderLayer))
