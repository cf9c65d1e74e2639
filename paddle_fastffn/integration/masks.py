"""Attention masks and the attention call on the fast path, for every family whose modeling module
has LLaMA's shape (a module-level scaled_dot_product_attention and is_casual_mask, the model's
_prepare_decoder_attention_mask staticmethod). Each function takes the stock function it stands
in for as `stock`; the family file binds it to its own (llama.py).

- What the model forward would build every step and only the fast forwards read (CAUSAL_MASK,
  IMPLICIT_POSITIONS), passed as implied.
- Packed batches: the examples' boundaries (ops.PackedSegments) travel in attention_mask's place
  to ops.packed_attention (no [seq, seq] mask).
- Two repairs: generate()'s mask on Paddle 3.x, and the causal mask while decoding with a KV
  cache on the flash path.
"""

from __future__ import annotations

import paddle

from .. import ops
from . import state
from .messages import info_once


class _Implied:
    """An argument the model forward (LlamaModel.forward) would otherwise build on every step; the fast forwards it
    reaches read the sentinel for what it stands for (see the family's model forward, e.g. llama.fast_llama_model_forward)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<paddle_fastffn: {self.name}>"


# No attention_mask (and no cache) on the flash path: stock builds a [batch, 1, seq, seq] mask, asks
# is_casual_mask (a device reduction and a blocking read to the host, every step) and drops it for
# is_causal=True. The trace test saw those 18 ops at the head of every training step.
CAUSAL_MASK = _Implied("causal attention, no mask built")
# No position_ids (and no cache): stock builds arange(seq).expand([batch, seq]) and every layer
# expands it again for rotary, whose kernel then reads and range-checks the ids; positions 0..seq-1
# are the token index, which the kernels take from position_ids=None.
IMPLICIT_POSITIONS = _Implied("positions 0..seq-1")


def positions(position_ids):
    return None if position_ids is IMPLICIT_POSITIONS else position_ids


def packed_segments(model, attn_mask_startend_row_indices, attention_mask):
    """The segments of a packed batch (the collator's attn_mask_startend_row_indices), which travel
    in attention_mask's place through the model and its decoder layers (recompute included) to
    scaled_dot_product_attention."""
    if attention_mask is not None:
        raise ValueError("paddle_fastffn: pass either attention_mask or attn_mask_startend_row_indices (a packed "
                         "batch's segments), not both")
    if getattr(model.config, "alibi", False):
        raise ValueError("paddle_fastffn: packed batches (attn_mask_startend_row_indices) do not support alibi")
    return ops.PackedSegments.from_startend_row_indices(attn_mask_startend_row_indices)


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


def scaled_dot_product_attention(stock, query_states, config, key_states, value_states, attention_mask,
                                      output_attentions, alibi=None, sequence_parallel=False,
                                      reshard_layer=None, npu_is_casual=False):
    """The modeling module's scaled_dot_product_attention (`stock`), with the causal mask made explicit where PaddleNLP's
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
    return stock(query_states, config, key_states, value_states, attention_mask,
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


def prepare_decoder_attention_mask(stock, attention_mask, input_shape, past_key_values_length, dtype):
    """The model's _prepare_decoder_attention_mask (`stock`, the class's staticmethod), passing a packed batch's segments through to
    attention (they replace the [batch, 1, seq, seq] mask); other masks as stock. With
    fast_ffn_attention off, attention is PaddleNLP's own: the segments become its dense
    block-causal mask (one info line)."""
    if attention_mask is CAUSAL_MASK:
        return attention_mask
    if isinstance(attention_mask, ops.PackedSegments):
        options = state.current()
        if options is not None and options.attention:
            return attention_mask
        info_once("packed_dense", "fast_ffn_attention is off: packed batches reach PaddleNLP's attention as its "
                                  "dense [batch, 1, seq, seq] block-causal mask")
        attention_mask = paddle.to_tensor(attention_mask.dense_mask())
    return stock.__func__(attention_mask, input_shape, past_key_values_length, dtype)


def is_casual_mask(stock, attention_mask):
    """The modeling module's is_casual_mask (`stock`; the model asks it on the flash path): a packed
    batch's segments are not one causal mask."""
    if attention_mask is CAUSAL_MASK:
        return True
    if isinstance(attention_mask, ops.PackedSegments):
        return False
    return stock(attention_mask)
