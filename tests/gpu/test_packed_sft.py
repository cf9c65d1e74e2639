"""Ours on packed rows (paddle_fastffn.torch.llama.FastLlama with position ids and cu_seqlens: rotary at restarting
positions, one varlen attention call over cu_seqlens, the fused loss on labelled rows only), flattened to
one row as the benchmark trains them or a row each with padding, computes the loss and gradients of
Hugging Face's LlamaForCausalLM run on every example on its own, in fp32.
(The peers' layouts are checked on CPU in tests/benchmarks_logic/test_packed_sft_contenders.py; the
benchmark records every contender's first bf16 loss and their relative differences.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_checks import close  # noqa: E402
from test_fp8_linear_and_model import _hf_model, _tiny_config, gradient_pairs  # noqa: E402

from benchmarks import sft_packed_steps  # noqa: E402
from benchmarks.sft_lengths import make_example  # noqa: E402


def _tiny_hf(dtype):
    """The fp8 model tests' tiny LLaMA (GQA 4/2), two layers."""
    return _hf_model(_tiny_config(num_hidden_layers=2), dtype)


def _packed_step(flatten=True):
    """Seven examples of awkward lengths in two zero_padding rows of 64: flattened to one row (the
    benchmark's layout), or a row each (the second padded)."""
    rng = np.random.default_rng(3)
    examples = [make_example(n, p, rng, 1000) for n, p in ((13, 4), (29, 7), (21, 2), (5, 3), (17, 9), (9, 1), (11, 6))]
    rows = sft_packed_steps.sequential_rows([len(e["input_ids"]) for e in examples], 64)
    return examples, rows, sft_packed_steps.packed_layout(examples, rows, flatten=flatten)


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "rows"])
def test_fast_llama_on_packed_rows_is_hugging_face_per_example_in_fp32(flatten):
    from paddle_fastffn.torch.llama import FastLlama

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    examples, rows, packed = _packed_step(flatten)
    real = sum(len(e["input_ids"]) for e in examples)
    assert len(rows) == 2
    if flatten:  # one row of the examples, no padding
        assert packed["input_ids"].shape == (1, real)
    else:  # the second row ends in a padding segment
        assert packed["input_ids"].shape[0] == 2 and real < packed["input_ids"].size
    hf = _tiny_hf(torch.float32)
    ours = FastLlama(hf)
    labelled = sum(int((e["labels"] != -100).sum()) for e in examples)
    ref = 0
    for e in examples:  # each example alone; the sum over labelled tokens / the step's labelled tokens
        ids, labels = (torch.as_tensor(e[k], device="cuda")[None] for k in ("input_ids", "labels"))
        ref = ref + hf(input_ids=ids, labels=labels, shift_labels=labels, num_items_in_batch=labelled,
                       use_cache=False).loss
    ref.backward()
    device = {k: torch.as_tensor(packed[k], device="cuda")
              for k in ("input_ids", "labels", "position_ids", "attn_mask_startend_row_indices")}
    # the collator's row indices, read to the host each forward as the Paddle patch reads them
    got = ours(device["input_ids"], device["labels"], device["position_ids"],
               row_ends=device["attn_mask_startend_row_indices"])
    got.backward()
    close(got, ref, torch.float32, "loss")
    for g, r, name in gradient_pairs(ours, hf):
        close(g, r, torch.float32, name, reduced_rows=128)


def test_fast_llama_packed_rejects_cu_seqlens_that_do_not_tile_the_batch():
    from paddle_fastffn.torch.llama import FastLlama

    _, _, packed = _packed_step()
    ours = FastLlama(_tiny_hf(torch.bfloat16))
    device = {k: torch.as_tensor(packed[k], device="cuda") for k in ("input_ids", "labels", "position_ids")}
    with pytest.raises(ValueError, match="cu_seqlens"):
        ours(device["input_ids"], device["labels"], device["position_ids"], packed["cu_seqlens"][:-1])


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_varlen_flash_is_the_reference_forward_and_backward_in_bf16(kv_heads):
    """The packed attention's GPU kernel (torch's flash varlen, GQA native) against varlen_reference
    (per-segment SDPA in fp32) over awkward segment lengths: the output and every input gradient."""
    from paddle_fastffn.torch.llama import PackedBatch, packed_attention, varlen_kernel, varlen_reference

    lengths = [13, 1, 29, 64, 7, 30]
    tokens = sum(lengths)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, tokens, 4, 64, device="cuda", generator=generator).bfloat16().requires_grad_()
    k, v = (torch.randn(1, tokens, kv_heads, 64, device="cuda", generator=generator).bfloat16().requires_grad_()
            for _ in range(2))
    packed = PackedBatch(cu_seqlens, tokens)
    assert varlen_kernel(q).__name__ == "varlen_flash"
    d_out = torch.randn(1, tokens, 4, 64, device="cuda", generator=generator).bfloat16()
    got = packed_attention(q, k, v, packed)
    got_grads = torch.autograd.grad(got, (q, k, v), d_out)
    ref = varlen_reference(*(t.reshape(tokens, t.shape[2], 64) for t in (q, k, v)),
                           torch.as_tensor(packed.bounds, device="cuda"), packed.longest, 64 ** -0.5).reshape(got.shape)
    ref_grads = torch.autograd.grad(ref, (q, k, v), d_out)
    close(got, ref, torch.bfloat16, "out")
    for g, r, name in zip(got_grads, ref_grads, ("d_q", "d_k", "d_v")):
        close(g, r, torch.bfloat16, name, reduced_rows=max(lengths) * (4 // kv_heads))
