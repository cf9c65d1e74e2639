"""The fast path for PaddleFormers' LLaMA family (paddleformers.transformers.llama, PaddleFormers 1.2).

Its LLaMA is built from PaddleFormers' shared layers (nn.norm.RMSNorm, nn.mlp.MLP, nn.linear.Linear,
nn.lm_head.LMHead, nn.criterion.CriterionLayer), so a class-level patch of those would reach every
family. Everything here is patched on LLaMA's own classes or in LLaMA's modeling module only:
- LlamaDecoderLayer.forward: core.decoder.decoder_layer over this file's layer parts: the norms
  through ops.rms_norm, the attention residual add fused into the post-attention norm
  (ops.fused_add_rms_norm), the MLP as core.decoder.mlp over its gate_proj/up_proj/down_proj
  sub-layers with the two-input fused SwiGLU (llama._MLPParts: LoRA and other linears keep their
  forwards). The layer object is the one PaddleFormers' pipeline model builds too
  (LlamaForCausalLMPipe._decoder_layer_cls), and its full recompute re-enters this forward;
- LLamaAttention.forward: q/k/v projections kept [batch, seq, heads, head_dim] (no transposes to
  PaddleFormers' [batch, heads, seq, head_dim]); rotary through ops.rotary_embedding on the cos/sin
  LlamaModel computed once and passed down ([batch, seq, head_dim], any positions: read as one
  table row per token); attention through SDPA (GQA native; the dense mask where PaddleFormers built
  one), packed batches (attn_mask_startend_row_indices) through ops.packed_attention, which reads
  the segments' boundaries and builds no [seq, seq] mask;
- the module global GeneralNorm: norms LLaMA builds while the fast path is on are FastRMSNorm (the
  same parameter; LlamaModel's final norm included);
- LlamaForCausalLM.forward: the training loss as ops.linear_cross_entropy over the LM head's
  weight (PaddleFormers' sft loss, a mean over labelled tokens; the [tokens, vocab] logits never
  built) where PaddleFormers' criterion allows (fused_head_weight says where not);
- FastAdamW through integration/trainer.py (PaddleFormers' Trainer keeps PaddleNLP's hooks).
Stock, with one line each: decoding with a KV cache (generation), attention dropout in training,
sequence parallel, AMP O1 dtype mixes, a loss_mask, non-sft criteria (DPO, KTO, MTP), a tensor-
parallel head. By design: no fused projections (FUSED_LAYOUTS is empty): PaddleFormers' LLaMA
checkpoints are Hugging Face's q/k/v and gate/up keys (its load converter maps each one), and
LoRA targets them by those names; so swiglu_recompute, which needs the fused gate/up output, does
not apply either. Each LoRALinear of the decoder layers adds its adapter through the fused LoRA
forward (lora_forward.py), attached at each LlamaModel.forward.
FP8 (precision="fp8", through fp8_attach.py as PaddleNLP's families): q/k/v/o_proj and
gate/up/down_proj through Fp8Linear each (LoRA's frozen base GEMM too, held only in FP8 under
fp8_frozen_weights), attached at each LlamaModel.forward; SwiGLU runs in 16 bits between the MLP's
FP8 GEMMs. Not the FP8 FFN: it reads one [gate | up] weight, which separate gate_proj and up_proj
could present only as a per-step copy. Its full recompute replays with the forward's FP8 scales
(the modeling module's `recompute`, fp8/recompute.py). The LM head + loss runs in FP8 under
fp8_lm_head="fp8" (lm_head.fp8_head_recipe, as on PaddleNLP), else in 16 bits.
"""

from __future__ import annotations

from types import SimpleNamespace

import paddle
import paddle.nn.functional as F

from .. import ops
from ..core import decoder as core_decoder
from ..core.residual import ResidualAdd
from ..ops._autograd import pylayer
from ..ops._backend import PaddleBackend
from . import fp8_attach, lm_head, lora_forward, state
from .family import TableFamily
from .llama import _MLPParts
from .messages import info_once, warn_once
from .options import FastFFNOptions

MODEL_TYPES = ("llama",)
LIBRARY = "paddleformers"
FUSED_LAYOUTS: dict = {}
_STATE = state.for_family(__name__.rpartition(".")[2])
_PADDLE = PaddleBackend()
_RESIDUAL_ADD = pylayer(ResidualAdd)


def _modeling():
    from paddleformers.transformers.llama import modeling

    return modeling


modeling_module = _modeling


def _rms_norm_class():
    from paddleformers.nn.norm import RMSNorm

    return RMSNorm


def _options() -> FastFFNOptions | None:
    return state.current()


def device_keeps_norm(config) -> bool:
    return False  # PaddleFormers' RMSNorm has one fused kernel (fused_rms_norm_ext), which ours serves


def is_plain_linear(layer) -> bool:
    return type(layer) is paddle.nn.Linear and getattr(layer, "bias", None) is None


# --- norms ---------------------------------------------------------------------------------------

def _fast_norm_applies(norm, x) -> bool:
    """ops.rms_norm computes `norm` exactly: PaddleFormers' RMSNorm (or ours) with input and weight of
    one dtype (an AMP O1 mix keeps PaddleFormers' casts, with one warning)."""
    options = _options()
    if options is None or not options.rms_norm or not isinstance(norm, _rms_norm_class()):
        return False
    if x.dtype != norm.weight.dtype:
        warn_once("pf_norm_dtype", f"RMSNorm input {x.dtype} and weight {norm.weight.dtype} differ (AMP O1): those "
                                   f"norms keep PaddleFormers' math")
        return False
    return True


def rms_norm(norm, x):
    """`norm`(x) through the fused kernel where it applies, else the layer's own forward."""
    if _fast_norm_applies(norm, x):
        return ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    return norm(x)


def _fast_rms_norm_class():
    """FastRMSNorm, the RMSNorm LLaMA builds while the fast path is on (made once: it subclasses
    PaddleFormers' class, imported on first use). Its forward is ops.rms_norm while the fast path
    is enabled and PaddleFormers' own after revert_fast_ffn()."""
    if "fast_rms_norm_class" not in _STATE.hooks:
        stock = _rms_norm_class()

        class FastRMSNorm(stock):
            def forward(self, hidden_states):
                if _fast_norm_applies(self, hidden_states):
                    return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)
                return stock.forward(self, hidden_states)

        _STATE.hooks["fast_rms_norm_class"] = FastRMSNorm
    return _STATE.hooks["fast_rms_norm_class"]


def _fast_general_norm_of(modeling):
    """The FastNorm over the modeling module's stock GeneralNorm (made once)."""
    if "fast_general_norm" not in _STATE.hooks:
        stock = _STATE.originals.get("general_norm", modeling.GeneralNorm)
        _STATE.hooks["fast_general_norm"] = _fast_general_norm(stock)
    return _STATE.hooks["fast_general_norm"]


def _fast_general_norm(stock_norm):
    """A stand-in for the modeling module's GeneralNorm (nn.norm.Norm) whose create() builds a
    FastRMSNorm where Norm would build its RMSNorm: LLaMA's norms only, the registry untouched."""

    class FastNorm(stock_norm):
        @classmethod
        def create(cls, config, *args, **kwargs):
            norm = stock_norm.create(config, *args, **kwargs)
            if type(norm) is _rms_norm_class():
                norm.__class__ = _fast_rms_norm_class()
            return norm

    return FastNorm


# --- MLP -----------------------------------------------------------------------------------------

def _mlp(mlp, x):
    """LLaMA's MLP (nn.mlp.MLP: gate_proj, up_proj, down_proj) with the fused two-input SwiGLU, or its
    own forward where that is not its math (fast_ffn_swiglu off, fused up_gate, an activation other
    than silu)."""
    options = _options()
    if options is None or not options.swiglu:
        return mlp(x)
    if getattr(mlp, "fuse_up_gate", False) or getattr(mlp, "act_type", "silu") != "silu":
        info_once("pf_mlp", f"MLP with fuse_up_gate={getattr(mlp, 'fuse_up_gate', None)} and "
                            f"hidden_act={getattr(mlp, 'act_type', None)!r}: PaddleFormers' MLP forward")
        return mlp(x)
    if options.swiglu_recompute:
        info_once("pf_swiglu_recompute", "swiglu_recompute needs a fused gate/up projection, which PaddleFormers' "
                                         "LLaMA does not have (its checkpoints and LoRA name gate_proj and "
                                         "up_proj): the SwiGLU output is stored")
    return core_decoder.mlp(_MLPParts(mlp), x, "unfused")


# --- attention -----------------------------------------------------------------------------------

_SEGMENTS: dict = {"indices": None, "segments": None}


def packed_segments(indices) -> ops.PackedSegments:
    """The examples of a packed batch from its attn_mask_startend_row_indices: read to the host once
    per batch (every layer and a recompute's replay get the same tensor and reuse the result)."""
    if _SEGMENTS["indices"] is not indices:
        _SEGMENTS.update(indices=indices, segments=ops.PackedSegments.from_startend_row_indices(indices))
    return _SEGMENTS["segments"]


def _attention_stock_reason(attention, past_key_values, use_cache) -> str | None:
    config = attention.config
    if past_key_values is not None or use_cache:
        return "decoding with a KV cache (generation)"
    if config.sequence_parallel:
        return "sequence parallel"
    if attention.training and attention.attention_dropout:
        return f"attention dropout {attention.attention_dropout} in training"
    return None


class _AttentionParts:
    """core.decoder's attention parts (the unfused variant) over a PaddleFormers LLamaAttention: its
    q/k/v/o projections, rotary on [batch, seq, heads, head_dim] views with the cos/sin the model
    passed down, and attention in that layout."""

    variant = "unfused"

    def __init__(self, layer, position_embeddings, attention_mask, indices):
        self.layer, self.attention_mask, self.indices = layer, attention_mask, indices
        self.cos, self.sin = position_embeddings
        self.num_heads, self.num_kv_heads, self.head_dim = layer.num_heads, layer.num_key_value_heads, layer.head_dim

    def q(self, x):
        return self.layer.q_proj(x)

    def k(self, x):
        return self.layer.k_proj(x)

    def v(self, x):
        return self.layer.v_proj(x)

    def rotary(self, q, k):
        b, s, d = self.cos.shape
        if not _options().rotary:
            q_t, k_t = _modeling().apply_rotary_pos_emb(q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 1, 3]),
                                                        self.cos, self.sin)
            return q_t.transpose([0, 2, 1, 3]), k_t.transpose([0, 2, 1, 3])
        # cos/sin hold one row per token (positions already applied): the batch read as one row of
        # b * s tokens against a table of b * s rows is the same rotation, without position ids.
        q_rot, k_rot = ops.rotary_embedding(q.reshape([1, b * s, q.shape[2], d]), k.reshape([1, b * s, k.shape[2], d]),
                                            self.cos.reshape([b * s, d]), self.sin.reshape([b * s, d]))
        return q_rot.reshape(q.shape), k_rot.reshape(k.shape)

    def attention(self, q, k, v):
        b, s, h, d = q.shape
        layer, options = self.layer, _options()
        if not options.attention:
            interface = _modeling().ALL_ATTENTION_FUNCTIONS[layer.config._attn_implementation]
            out, _ = interface(layer, query=q.transpose([0, 2, 1, 3]), key=k.transpose([0, 2, 1, 3]),
                               value=v.transpose([0, 2, 1, 3]), attention_mask=self.attention_mask,
                               attn_mask_startend_row_indices=self.indices, dropout=0.0, scaling=layer.scaling)
            return out
        if self.indices is not None:
            out = ops.packed_attention(q, k, v, packed_segments(self.indices))
        else:
            mask = self.attention_mask
            out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal=mask is None, training=layer.training,
                                                 enable_gqa=True)
        return out.reshape([b, s, h * d])

    def o_proj(self, a):
        return self.layer.o_proj(a)


def _causal_row_indices(indices):
    """PaddleFormers' causal FlashMask form ([b, 1, s, 1] or [b, s, 1] / [b, s]), or None for the other
    forms (start and end rows per column: [..., 2] or [..., 4]), which ops.packed_attention does not read."""
    if indices is None or indices.shape[-1] != 1 and indices.ndim != 2:
        return None
    return indices


def fast_attention_forward(self, hidden_states, past_key_values=None, attention_mask=None,
                           attn_mask_startend_row_indices=None, position_embeddings=None, use_cache=False):
    """LLamaAttention.forward as core.decoder.attention (module docstring); returns (output, None) as
    stock's SDPA path does (no attention weights)."""
    reason = _attention_stock_reason(self, past_key_values, use_cache)
    if attn_mask_startend_row_indices is not None and _causal_row_indices(attn_mask_startend_row_indices) is None:
        reason = f"attn_mask_startend_row_indices of shape {list(attn_mask_startend_row_indices.shape)} (not causal)"
    if reason is not None:
        info_once(f"pf_attention:{reason}", f"{reason}: LLaMA's attention keeps PaddleFormers' forward")
        return _STATE.originals["attention"](self, hidden_states, past_key_values, attention_mask,
                                             attn_mask_startend_row_indices, position_embeddings, use_cache)
    parts = _AttentionParts(self, position_embeddings, attention_mask, attn_mask_startend_row_indices)
    return core_decoder.attention(_PADDLE, parts, hidden_states), None


# --- the decoder layer ---------------------------------------------------------------------------

class _LayerParts:
    """core.decoder's layer parts over a PaddleFormers LlamaDecoderLayer."""

    def __init__(self, layer, attention_arguments: dict):
        self.layer, self.attention_arguments = layer, attention_arguments

    def input_norm(self, x):
        return rms_norm(self.layer.input_layernorm, x)

    def self_attention(self, x):
        out, _weights = self.layer.self_attn(hidden_states=x, **self.attention_arguments)
        return out

    def post_norm_add(self, a, residual):
        norm = self.layer.post_attention_layernorm
        if _fast_norm_applies(norm, a) and residual.dtype == norm.weight.dtype:
            return ops.fused_add_rms_norm(a, residual, norm.weight, norm.variance_epsilon)
        residual = residual + a
        return norm(residual), residual

    def mlp(self, x):
        return _mlp(self.layer.mlp, x)

    def residual_add(self, residual, y):
        return _RESIDUAL_ADD.apply(residual, y)


def fast_decoder_layer_forward(self, hidden_states, attention_mask=None, attn_mask_startend_row_indices=None,
                               position_ids=None, position_embeddings=None, past_key_values=None, use_cache=False):
    """LlamaDecoderLayer.forward as core.decoder.decoder_layer; returns the hidden states (a tensor,
    as stock's single output)."""
    if self.config.sequence_parallel:
        warn_once("pf_sequence_parallel", "sequence-parallel decoder layers keep PaddleFormers' forward")
        return _STATE.originals["decoder_layer"](self, hidden_states, attention_mask, attn_mask_startend_row_indices,
                                                 position_ids, position_embeddings, past_key_values, use_cache)
    arguments = dict(attention_mask=attention_mask, attn_mask_startend_row_indices=attn_mask_startend_row_indices,
                     position_embeddings=position_embeddings, past_key_values=past_key_values, use_cache=use_cache)
    return core_decoder.decoder_layer(_LayerParts(self, arguments), hidden_states)


# --- the LM head + loss --------------------------------------------------------------------------

def fused_head_weight(model):
    """(weight [vocab, hidden], True, None) where the fused LM head + loss computes `model`'s training
    loss exactly (PaddleFormers' LMHead without bias, its sft criterion, one card), else (None,
    False, why not)."""
    from paddleformers.nn.criterion.interface import CriterionLayer
    from paddleformers.nn.lm_head import LMHead

    config, head, criterion = model.config, model.lm_head, getattr(model, "criterion", None)
    if type(criterion) is not CriterionLayer or criterion.loss_type != "sft":
        return None, False, f"the criterion is {getattr(criterion, 'loss_type', type(criterion).__name__)!r}, not sft"
    if config.tensor_model_parallel_size > 1 or criterion.enable_parallel_cross_entropy:
        return None, False, "tensor parallel: the head is sharded over the vocabulary"
    if config.sequence_parallel:
        return None, False, "sequence parallel gathers the hidden states inside the head"
    if type(head) is not LMHead or head.bias is not None:
        return None, False, f"the LM head is {type(head).__name__}{' with a bias' if head.bias is not None else ''}"
    return head.weight, True, None


def _fused_loss_stock_reason(model, labels, loss_mask) -> str | None:
    options = _options()
    if labels is None or not model.training or options is None or not options.fused_cross_entropy:
        return ""  # not a training loss on the fast path: stock, nothing to say
    if loss_mask is not None:
        return "a loss_mask weights the tokens"
    return fused_head_weight(model)[2]


# lm_head.fp8_head_recipe's view of this family: its FP8 recipe (None while FP8 is off).
_FP8_HEAD = SimpleNamespace(fp8_recipe=lambda: _STATE.fp8)


def fast_causal_lm_forward(self, input_ids, position_ids=None, attention_mask=None, attn_mask_startend_row_indices=None,
                           inputs_embeds=None, labels=None, loss_mask=None, use_cache=False, past_key_values=None,
                           output_hidden_states=False, return_dict=False, **kwargs):
    """LlamaForCausalLM.forward with a training step's loss through ops.linear_cross_entropy (logits
    None in the result); everything else is PaddleFormers' forward."""
    reason = _fused_loss_stock_reason(self, labels, loss_mask)
    if reason is not None:
        if reason:
            info_once(f"pf_fused_ce:{reason}", f"fused_cross_entropy: {reason}; the LM head and loss stay stock")
            lm_head.warn_fp8_head_not_run(_FP8_HEAD, reason)
        return _STATE.originals["causal_lm_forward"](
            self, input_ids, position_ids=position_ids, attention_mask=attention_mask,
            attn_mask_startend_row_indices=attn_mask_startend_row_indices, inputs_embeds=inputs_embeds,
            labels=labels, loss_mask=loss_mask, use_cache=use_cache, past_key_values=past_key_values,
            output_hidden_states=output_hidden_states, return_dict=return_dict, **kwargs)
    if kwargs.get("attn_mask_start_row_indices") is not None and attn_mask_startend_row_indices is None:
        attn_mask_startend_row_indices = kwargs.pop("attn_mask_start_row_indices")
    if attention_mask is not None and attention_mask.dtype != paddle.bool:
        attention_mask = paddle.cast(attention_mask, paddle.bool)
    if attn_mask_startend_row_indices is not None:
        attention_mask = None  # as stock: the row indices win
    outputs = self.model(input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         attn_mask_startend_row_indices=attn_mask_startend_row_indices, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, past_key_values=past_key_values,
                         output_hidden_states=output_hidden_states, return_dict=True)
    hidden_states = outputs[0]
    if hidden_states.dtype != self.lm_head.weight.dtype:
        info_once("pf_fused_ce_dtype", f"fused_cross_entropy: hidden states {hidden_states.dtype} and LM head "
                                       f"weight {self.lm_head.weight.dtype} differ (AMP O1): stock head and loss")
        lm_head.warn_fp8_head_not_run(_FP8_HEAD, f"hidden states {hidden_states.dtype} and LM head weight "
                                                 f"{self.lm_head.weight.dtype} differ (AMP O1)")
        logits = self.lm_head(hidden_states)
        loss, _ = self.criterion(logits, labels)
    else:
        loss = ops.linear_cross_entropy(hidden_states, self.lm_head.weight, labels,
                                        ignore_index=self.criterion.ignored_index, transpose_weight=True,
                                        fp8_recipe=lm_head.fp8_head_recipe(_FP8_HEAD, hidden_states,
                                                                           self.lm_head.weight, True))
        logits = None  # never materialised
    if not return_dict:
        return (loss, logits) + tuple(outputs[1:])
    from paddleformers.transformers.model_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


# --- FP8 GEMMs (precision="fp8"; the module docstring says what runs in FP8) -------------------------

# "up_gate_proj": PaddleFormers' MLP with fuse_up_gate (LLaMA does not build it; its stock forward
# then runs, over an Fp8Linear like the others).
_FP8_TARGETS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                ("mlp", ("gate_proj", "up_proj", "up_gate_proj", "down_proj")))
_NO_FP8_FFN = "PaddleFormers' LLaMA MLPs (gate_proj and up_proj separate parameters, no fused gate/up weight)"


def attach_fp8(llama_model, recipe) -> int:
    """fp8_attach.attach_fp8 over the decoder layers of a PaddleFormers LlamaModel: an Fp8Linear for
    each target projection; returns how many linears compute in FP8."""
    return fp8_attach.attach_fp8(
        getattr(llama_model, "layers", []), recipe, _FP8_TARGETS, info_once=info_once,
        attach_ffn=lambda mlp, r: fp8_attach.attach_fp8_ffn(mlp, None, None, r, _NO_FP8_FFN, info_once))


def fast_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, attn_mask_startend_row_indices=None, use_cache=None,
                       output_hidden_states=None, return_dict=False):
    """LlamaModel.forward with the decoder layers' FP8 objects and the fused LoRA forward
    (lora_forward.py) attached first (layers LoRA replaced after construction included); the rest is
    PaddleFormers' forward."""
    if _STATE.fp8 is not None:
        attach_fp8(self, _STATE.fp8)
    lora_forward.attach_lora_forwards(getattr(self, "layers", []))
    return _STATE.originals["model_forward"](
        self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds,
        attn_mask_startend_row_indices=attn_mask_startend_row_indices, use_cache=use_cache,
        output_hidden_states=output_hidden_states, return_dict=return_dict)


# --- the ModelFamily contract (family.py) ----------------------------------------------------------

def _patches(options: FastFFNOptions) -> dict:
    """{(owner, name): (key in _STATE.originals, fast version or None for stock)}."""
    m = _modeling()
    layer = options.rms_norm or options.swiglu
    attention = options.rotary or options.attention
    return {(m.LlamaDecoderLayer, "forward"): ("decoder_layer", layer and fast_decoder_layer_forward),
            (m.LLamaAttention, "forward"): ("attention", attention and fast_attention_forward),
            (m, "GeneralNorm"): ("general_norm", options.rms_norm and _fast_general_norm_of(m)),
            (m.LlamaForCausalLM, "forward"): ("causal_lm_forward", options.fused_cross_entropy and fast_causal_lm_forward),
            (m.LlamaModel, "forward"): ("model_forward", fast_model_forward)}


_TABLE = TableFamily(_STATE, _modeling, _patches, label="PaddleFormers' LLaMA", decoder_layer="LlamaDecoderLayer",
                     base_model="LlamaModel", causal_lm="LlamaForCausalLM", attach_fp8=attach_fp8,
                     info_once=info_once)
_TABLE.bind(globals())  # patched_attributes, revert, fuse_fn, split_fn, decoder_layers, fp8_recipe, ...


def apply(options: FastFFNOptions, model=None) -> None:
    """Patch LLaMA's classes and modeling module for `options` (FP8 GEMMs included); `model` needs
    no instance setting (nothing is configured per model)."""
    _TABLE.patch(options)


def configure(config, options: FastFFNOptions) -> None:
    """Nothing to set on the config: the fast forwards read PaddleFormers' own settings."""


def mark_fast_built(layer, config) -> None:
    """Nothing to record: the fast path fuses no PaddleFormers LLaMA projection."""


def hooked_attributes() -> tuple:
    return ()


def install_hooks(enabled_options) -> None:
    """Nothing to hook at construction or checkpointing: no fused projections, and the norms come
    from the patched GeneralNorm."""


def example_config(**overrides):
    """A two-layer PaddleFormers LlamaConfig with grouped-query heads; fuse_rms_norm off, so that the
    stock model it builds runs on CPU (PaddleFormers' fused norm has no CPU kernel)."""
    from paddleformers.transformers import LlamaConfig

    values = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, fuse_rms_norm=False, tie_word_embeddings=False)
    values.update(overrides)
    return LlamaConfig(**values)
