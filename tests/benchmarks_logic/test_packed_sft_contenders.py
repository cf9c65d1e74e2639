"""The packed-SFT benchmark's contenders compute the same loss on the same work
(benchmarks/gpu/bench_packed_sft.py), checked on CPU with a tiny fp32 Hugging Face LLaMA: the
padding-free row (sdpa with Hugging Face's packed mask, and Hugging Face's flash padding-free path
over the varlen kernel's contract, hf_varlen_attention, with the collator's cu_seq_lens or from
the position ids) and the padded micro-batches with num_items_in_batch give the loss of running
every example on its own; and ours' packed attention over PackedSegments' cu_seqlens
(paddle_fastffn.torch.llama.packed_attention, the varlen reference on CPU) is attention under PaddleNLP's
block-causal mask, on the flattened row the benchmark trains and on per-row packing (padding
segments included). Skipped where torch or transformers is missing (the GPU machine and the torch
CI environment run it); the bf16 kernel's gradients are tests/gpu/test_packed_sft.py's."""

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
    from benchmarks.gpu import hf_varlen_attention

    free_sdpa = hf_padding_free_loss(sdpa, step["flat"])
    hf_varlen_attention.register()
    varlen = tiny_model(hf_varlen_attention.NAME)
    hf_varlen_attention.CALLS.clear()
    free_varlen = hf_padding_free_loss(varlen, step["flat"])
    assert hf_varlen_attention.CALLS == {"position_ids": 2}  # one call per layer, lengths from the positions
    with_kwargs = {**step["flat"], **hf_varlen_attention.collator_kwargs(step["flat"]["position_ids"])}
    free_varlen_kwargs = hf_padding_free_loss(varlen, with_kwargs)
    assert hf_varlen_attention.CALLS["collator_kwargs"] == 2
    expected = per_example.item()
    for name, loss in (("padded", padded), ("padding-free sdpa", free_sdpa), ("padding-free varlen", free_varlen),
                       ("padding-free varlen, collator kwargs", free_varlen_kwargs)):
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
def test_packed_attention_is_attention_under_the_block_causal_mask(step, flatten):
    from paddle_fastffn.torch.llama import PackedBatch, packed_attention

    packed = step["packed"][flatten]
    rows, seq = packed["input_ids"].shape
    assert rows == (1 if flatten else 2)
    segments = sft_packed_steps.PackedSegments(packed["segment_lengths"], rows, seq)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(rows, seq, 4, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(rows, seq, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    got = packed_attention(q, k, v, PackedBatch(packed["cu_seqlens"], rows * seq))
    mask = torch.as_tensor(segments.dense_mask())  # [rows, 1, seq, seq], True where a query may attend
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedBatch(packed["cu_seqlens"][:-1], rows * seq)
