"""Hugging Face's padding-free flash-attention path, with torch's built-in flash-attention varlen kernel
where Hugging Face users install the flash-attn package (which cannot be installed on the GPU machine).

A Hugging Face user trains padding-free with attn_implementation="flash_attention_2" and
DataCollatorWithFlattening: one row of concatenated examples, position ids restarting per example,
and (return_flash_attn_kwargs=True) the examples' cu_seq_lens_q/k and max_length_q/k handed to every
attention call. Hugging Face's flash path then transposes q/k/v to [batch, seq, heads, d], flattens
them to [tokens, heads, d] (contiguous copies) and calls flash_attn_varlen_func over those
cumulative lengths; without the collator's kwargs it derives them from the position ids in each layer
(prepare_fa_kwargs_from_position_ids). `varlen_attention_forward` is that path, registered under
NAME in Hugging Face's attention and mask interfaces (its mask function is the flash one: no
materialised mask), calling the same kernel our packed attention calls (paddle_fastffn.torch.llama.varlen_flash on
the GPU in fp16/bf16; its reference, paddle_fastffn.torch.llama.varlen_reference, for fp32 and CPU tests).
CALLS counts which source of the lengths each call used, so a run records that the collator's
kwargs reached the attention. Against a real flash_attention_2 run this path is a little lighter, not
heavier: Hugging Face's per-layer `_is_packed_sequence` check is not made when the kwargs are there.
"""

from __future__ import annotations

from collections import Counter

import torch

NAME = "torch_varlen"  # no "flash" in it: Hugging Face would try to import a flash-attn package for such a name
CALLS: Counter = Counter()


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                             **kwargs):
    """Hugging Face's attention-interface signature: query [b, h, s, d], key/value [b, hk, s, d] ->
    ([b, s, h, d], None); causal within each example."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    from paddle_fastffn.torch.llama import varlen_kernel

    if attention_mask is not None:
        raise ValueError(f"{NAME}: padding-free rows only (no attention_mask); got a mask of shape "
                         f"{tuple(attention_mask.shape)}")
    if dropout:
        raise ValueError(f"{NAME}: dropout must be 0, got {dropout}")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(f"{NAME}: causal attention only")
    b, h, s, d = query.shape
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is not None and longest is not None:
        CALLS["collator_kwargs"] += 1
    else:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError(f"{NAME}: needs cu_seq_lens_q/max_length_q or position_ids")
        (cu, _), (longest, _) = prepare_fa_kwargs_from_position_ids(position_ids)
        CALLS["position_ids"] += 1
    q, k, v = (t.transpose(1, 2).contiguous().view(-1, t.shape[1], d) for t in (query, key, value))
    out = varlen_kernel(q)(q, k, v, cu.to(torch.int32), int(longest), scaling if scaling is not None else d ** -0.5)
    return out.view(b, s, h, d), None


def register():
    """Makes NAME an attn_implementation of Hugging Face models (attention and mask interfaces)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def collator_kwargs(position_ids: torch.Tensor) -> dict:
    """What DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds to a batch: the examples'
    cumulative lengths (int32, on the batch's device) and the longest, from restarting position ids
    [1, tokens]."""
    ids = position_ids.reshape(-1)
    starts = torch.nonzero(ids == 0).reshape(-1).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([ids.numel()], dtype=torch.int32, device=ids.device)])
    longest = int(torch.diff(cu).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
