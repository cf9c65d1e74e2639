"""The packed-SFT benchmark's contenders compute the same loss on the same work
(benchmarks/gpu/bench_packed_sft.py), checked on CPU with a tiny fp32 Hugging Face LLaMA: the
padding-free row (sdpa and FlexAttention, restarting position ids) and the padded micro-batches
with num_items_in_batch give the loss of running every example on its own; and ours' document
mask over PackedSegments' cu_seqlens is PaddleNLP's block-causal mask, on the flattened row the
benchmark trains and on per-row packing (padding segments included). Skipped where torch or
transformers is missing (the CPU CI; the GPU machine runs it). FlexAttention has no backward on
CPU: losses only here, the gradients are tests/gpu/test_packed_sft.py's."""

import importlib.util

import numpy as np
import pytest

from benchmarks import sft_packed_steps
from benchmarks.sft_lengths import make_example, pad_to_longest

# A skip mark, not a module-level importorskip: the suite's collection check wants every test file's
# tests collected (tests/conftest.py), skipped or not.
HAS_TORCH = all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="needs torch and transformers (the GPU machine has them)")
if HAS_TORCH:
    import torch
    import transformers

# fp32 on CPU, the same sums in another order: a few fp32 roundings of a loss of ~7.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def step():
    rng = np.random.default_rng(0)
    examples = [make_example(n, p, rng, 1000) for n, p in ((9, 3), (17, 5), (6, 2), (12, 4), (20, 8))]
    rows = [[0, 1], [2, 3, 4]]
    tensor = lambda d: {k: torch.as_tensor(v) for k, v in d.items() if isinstance(v, np.ndarray)}  # noqa: E731
    return {"examples": [tensor(e) for e in examples],
            # ours' layouts: the flattened row the product's collator gives and the per-row one
            "packed": {flatten: sft_packed_steps.packed_layout(examples, rows, flatten=flatten)
                       for flatten in (True, False)},
            "flat": tensor(sft_packed_steps.flattened_layout(examples)),
            "padded": [tensor(pad_to_longest(examples[i:i + 2])) for i in range(0, len(examples), 2)],
            "labelled": sum(int((e["labels"] != -100).sum()) for e in examples)}


def alone(example):
    """One example as a padded batch of one (no padding)."""
    return {"input_ids": example["input_ids"][None], "labels": example["labels"][None],
            "attention_mask": torch.ones_like(example["input_ids"])[None]}


def tiny_model(attn_implementation):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000, num_hidden_layers=2,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def test_hf_padding_free_and_padded_losses_are_the_per_example_loss(step):
    with torch.no_grad():
        check_padding_free_and_padded_losses(step)


def check_padding_free_and_padded_losses(step):
    from benchmarks.gpu.bench_packed_sft import hf_padded_loss, hf_padding_free_loss

    sdpa = tiny_model("sdpa")
    per_example = sum(hf_padded_loss(sdpa, alone(e), step["labelled"]) for e in step["examples"])
    padded = sum(hf_padded_loss(sdpa, batch, step["labelled"]) for batch in step["padded"])
    free_sdpa = hf_padding_free_loss(sdpa, step["flat"])
    free_flex = hf_padding_free_loss(tiny_model("flex_attention"), step["flat"])
    expected = per_example.item()
    for name, loss in (("padded", padded), ("padding-free sdpa", free_sdpa), ("padding-free flex", free_flex)):
        assert loss.item() == pytest.approx(expected, rel=LOSS_RTOL), name


def test_padded_gradient_accumulation_is_the_per_example_step(step):
    """hf_liger_padded's forward (backward of every micro-batch but the last inside, the last by the
    training step) leaves the gradients of the per-example loss, and returns the step's loss."""
    from benchmarks.gpu.bench_packed_sft import accumulating_forward, hf_padded_loss

    model = tiny_model("sdpa")
    loss = accumulating_forward(model, step["padded"], step["labelled"])()
    loss.backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = sum(hf_padded_loss(model, alone(e), step["labelled"]) for e in step["examples"])
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=LOSS_RTOL)
    for got, (name, p) in zip(accumulated, model.named_parameters()):
        # fp32 sums of the same terms in another order (micro-batch by micro-batch): a few ulps of
        # the largest gradient element
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "rows"])
def test_document_mask_is_the_block_causal_mask_of_the_segments(step, flatten):
    from torch.nn.attention.flex_attention import create_mask

    from benchmarks.gpu.llama_model import document_mask_mod

    packed = step["packed"][flatten]
    rows, seq = packed["input_ids"].shape
    assert rows == (1 if flatten else 2)
    segments = sft_packed_steps.PackedSegments(packed["segment_lengths"], rows, seq)
    mask = create_mask(document_mask_mod(packed["cu_seqlens"], rows, seq, device="cpu"), rows, None, seq,
                       seq, device="cpu")
    np.testing.assert_array_equal(mask.numpy(), segments.dense_mask())
    with pytest.raises(ValueError, match="cu_seqlens"):
        document_mask_mod(packed["cu_seqlens"][:-1], rows, seq, device="cpu")
