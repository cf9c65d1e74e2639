"""Sequence packing (zero_padding / greedy_zero_padding) and the fast path's packed batches.

The packing rules against PaddleNLP 2.8.1's InTokensMapDataset and the shared data set's waste
figures; a packed batch against the same examples run one by one (per-example losses, the loss
and every gradient), stock (PaddleNLP's dense 4-D mask) and fast (segments, no mask, the batch's
rows flattened to one row or a row each); the flattened collation itself and its padding count;
and the fast packed batch (flattened, per row) against stock PaddleNLP's dense form and its own
zero_padding pipeline (InTokensMapDataset + DataCollatorForSeq2Seq, same examples, same weights)."""

import json
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from llama_fixtures import tiny_model
from paddlenlp.data import DataCollatorForSeq2Seq
from paddlenlp.datasets import InTokensMapDataset
from paddlenlp.transformers.llama import modeling as paddlenlp_modeling
from tolerances import assert_close

import paddle_fastffn
from paddle_fastffn import ops
from paddle_fastffn.finetune.data import TokenCountingCollator
from paddle_fastffn.finetune.packing import (PackedCollator, PackedDataset, greedy_rows, packed_batches,
                                             sequential_rows)

IGNORE = -100
DATA = Path("/work/shared/data")


def make_examples(lengths, prompts, seed=0, vocab=128):
    """(input_ids, labels) pairs: random ids, the first `prompt` labels ignored (a prompt)."""
    rng = np.random.default_rng(seed)
    examples = []
    for n, prompt in zip(lengths, prompts):
        ids = rng.integers(3, vocab, size=n).tolist()
        labels = rng.integers(3, vocab, size=n).tolist()
        labels[:prompt] = [IGNORE] * prompt
        examples.append((ids, labels))
    return examples


# Seven examples of 1 to 29 tokens into rows of 40: rows of 2-3 examples, a one-token example, an
# example with a single label, one whose labels are all ignored.
LENGTHS = [17, 9, 29, 1, 12, 23, 6]
PROMPTS = [5, 0, 28, 0, 12, 7, 2]
MAX_LENGTH = 40


def test_sequential_rows_are_paddlenlp_intokens_rows():
    examples = make_examples([7, 30, 3, 12, 40, 1, 25, 14, 2], [0] * 9)
    records = [{"input_ids": ids, "labels": labels, "position_ids": list(range(len(ids)))}
               for ids, labels in examples]
    stock = InTokensMapDataset(records, tokenizer=None, max_length=40)
    ours = PackedDataset(examples, 40, form="dense_mask")
    assert len(ours) == len(stock) == 5
    for index in range(len(stock)):
        for key in ("input_ids", "labels", "position_ids", "attention_mask"):
            np.testing.assert_array_equal(np.asarray(ours[index][key]), np.asarray(stock[index][key]), err_msg=key)
    segments = PackedDataset(examples, 40)
    assert [segments[i]["seq_lens"] for i in range(len(segments))] == [[7, 30, 3], [12], [40], [1, 25, 14], [2]]
    assert segments[0]["position_ids"] == list(range(7)) + list(range(30)) + list(range(3))


def test_greedy_rule_puts_each_example_in_the_row_with_most_room():
    # max_length 10: 7 opens a row (3 left); 2 joins it (1 left); 6 fits nowhere and opens a row
    # (4 left); 4 joins that one, the roomiest (0 left); 1 fits only in the first (0 left).
    assert greedy_rows([7, 2, 6, 4, 1], 10) == [[0, 1, 4], [2, 3]]
    # The most room wins over the first fit: 1 goes to the row with 5 left, not the one with 2.
    assert greedy_rows([8, 5, 1], 10) == [[0], [1, 2]]
    # Rows close at the end of each window of examples.
    assert greedy_rows([3, 3, 3, 3], 10, window=2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="example 1 has 11 tokens"):
        greedy_rows([3, 11], 10)
    with pytest.raises(ValueError, match="max_length"):
        sequential_rows([3], 0)


@pytest.mark.parametrize("name", ["gsm8k_train", "oasst1_zh"])
def test_waste_matches_the_shared_data_figures(name):
    """PaddleNLP-truncated lengths in shuffled orders (the data README's procedure, seeds 0..4),
    rows counted as 2048 slots: the waste of each rule falls in the README's range over 50 seeds."""
    data = json.loads((DATA / f"sft_lengths_{name}.json").read_text())
    train_len = [min(min(p, 1024) + r, 2048) - 1 for p, r in data["lengths"]]
    figures = data["summary"]["padding_waste"]
    for rule, key in ((sequential_rows, "pack2048_sequential_paddlenlp_zero_padding"),
                      (greedy_rows, "pack2048_greedy_paddlenlp_greedy_zero_padding")):
        for seed in range(5):
            order = np.random.default_rng(seed).permutation(len(train_len))
            rows = rule([train_len[i] for i in order], 2048)
            waste = 1 - sum(train_len) / (2048 * len(rows))
            assert figures[key]["waste_min"] - 5e-4 <= waste <= figures[key]["waste_max"] + 5e-4, (rule, seed, waste)


def losses_and_grads(model, batch):
    """(training loss, {param: grad}) of one batch dict."""
    model.train()
    for p in model.parameters():
        p.clear_gradient()
    out = model(**batch)
    loss = out[0] if isinstance(out, tuple) else out.loss
    loss.backward()
    return float(loss), {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def per_example_losses(model, batch, row_lengths):
    """Eval-mode logits of a packed batch -> each example's mean loss over its labelled tokens
    (None where it has none), in packing order."""
    model.eval()
    with paddle.no_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = model(**inputs)
    model.train()
    logits = (out[0] if isinstance(out, tuple) else out.logits).astype("float32")
    token_loss = F.cross_entropy(logits, batch["labels"].unsqueeze(-1), reduction="none",
                                 ignore_index=IGNORE).squeeze(-1).numpy()
    labels = batch["labels"].numpy()
    result = []
    for row, lengths in enumerate(row_lengths):
        start = 0
        for n in lengths:
            kept = labels[row, start:start + n] != IGNORE
            result.append(float(token_loss[row, start:start + n][kept].mean()) if kept.any() else None)
            start += n
    return result


def one_by_one(model, examples):
    """Each example alone (batch 1, no mask): its loss, labelled-token count and gradients, and
    the packed batch's expectation: the token-weighted mean of losses and gradients."""
    losses, counts, grads = [], [], []
    for ids, labels in examples:
        n = sum(label != IGNORE for label in labels)
        if n == 0:
            losses.append(None)
            continue
        loss, g = losses_and_grads(model, {"input_ids": paddle.to_tensor([ids]), "labels": paddle.to_tensor([labels])})
        losses.append(loss)
        counts.append(n)
        grads.append(g)
    total = sum(counts)
    mean_loss = sum(c * l for c, l in zip(counts, [l for l in losses if l is not None])) / total
    mean_grads = {name: sum(c * g[name] for c, g in zip(counts, grads)) / total for name in grads[0]}
    return losses, mean_loss, mean_grads


def check_packed_against_one_by_one(model, examples, form, batch_size, flatten=None):
    batches, count = packed_batches(examples, MAX_LENGTH, batch_size=batch_size, form=form, flatten=flatten)
    assert len(batches) == 1, "the test wants every example in one batch"
    batch = batches[0]
    dataset = PackedDataset(examples, MAX_LENGTH)
    row_lengths = [dataset[i]["seq_lens"] for i in range(len(dataset))]
    if form == "segments" and flatten is not False:  # the collator's default: the rows in one row
        row_lengths = [[n for row in row_lengths for n in row]]
    assert list(batch["input_ids"].shape)[0] == len(row_lengths)
    order = [i for row in dataset.rows for i in row]
    alone, mean_loss, mean_grads = one_by_one(model, examples)
    packed = per_example_losses(model, batch, row_lengths)
    for position, index in enumerate(order):
        if alone[index] is None:
            assert packed[position] is None
        else:
            assert_close(packed[position], alone[index], paddle.float32, f"{form}: example {index}'s loss")
    loss, grads = losses_and_grads(model, batch)
    assert_close(loss, mean_loss, paddle.float32, f"{form}: packed loss")
    assert grads.keys() == mean_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, mean_grads[name], paddle.float32, f"{form}: d {name}", reduced_rows=sum(LENGTHS))
    assert count.real == sum(LENGTHS) and count.slots == batch["input_ids"].size
    return loss, grads


@pytest.fixture(scope="module")
def examples():
    return make_examples(LENGTHS, PROMPTS)


def test_stock_packed_batch_gives_the_examples_losses_and_gradients(examples):
    """PaddleNLP's dense 4-D block-causal mask (InTokens rows) on stock LLaMA, two packed rows."""
    check_packed_against_one_by_one(tiny_model(), examples, "dense_mask", batch_size=8)


@pytest.mark.parametrize("flatten", [None, False], ids=["flattened", "rows"])
@pytest.mark.parametrize("fused_loss", [True, False], ids=["fused_loss", "stock_loss"])
def test_fast_packed_batch_gives_the_examples_losses_and_gradients(examples, fused_loss, flatten, kernel_calls):
    paddle_fastffn.apply_fast_ffn_to_llama(fused_cross_entropy=fused_loss)
    model = tiny_model()
    paddle_fastffn.apply_fast_ffn_to_llama(model, fused_cross_entropy=fused_loss)
    check_packed_against_one_by_one(model, examples, "segments", batch_size=8, flatten=flatten)
    calls = kernel_calls()
    assert calls["fastffn_rotary"] > 0 and (calls["fastffn_cross_entropy"] > 0) == fused_loss


def test_flattened_collator_gives_one_row_of_the_examples(examples):
    """PackedCollator's default for segments rows: one row of every example in packing order, no
    padding, positions restarting, each example a segment of its own; pad_to_multiple_of adds one
    padding segment at the end; flatten=False keeps a row each, padded to the longest."""
    dataset = PackedDataset(examples, MAX_LENGTH)
    rows = [dataset[i] for i in range(len(dataset))]
    assert [row["seq_lens"] for row in rows] == [[17, 9], [29, 1], [12, 23], [6]]
    order = [i for row in dataset.rows for i in row]
    lengths = [len(examples[i][0]) for i in order]
    total = sum(lengths)
    batch = PackedCollator(0, return_tensors="np")(rows)
    assert batch.keys() == {"input_ids", "labels", "position_ids", "attn_mask_startend_row_indices"}
    np.testing.assert_array_equal(batch["input_ids"], [[t for i in order for t in examples[i][0]]])
    np.testing.assert_array_equal(batch["labels"], [[t for i in order for t in examples[i][1]]])
    np.testing.assert_array_equal(batch["position_ids"], [np.concatenate([np.arange(n) for n in lengths])])
    ends = np.cumsum(lengths)
    expected_ends = np.repeat(ends, lengths).astype(np.int32)
    assert batch["attn_mask_startend_row_indices"].dtype == np.int32
    np.testing.assert_array_equal(batch["attn_mask_startend_row_indices"], expected_ends.reshape(1, 1, total, 1))

    padded = PackedCollator(5, pad_to_multiple_of=16, return_tensors="np")(rows)
    seq = -(-total // 16) * 16
    assert seq > total and padded["input_ids"].shape == (1, seq)
    np.testing.assert_array_equal(padded["input_ids"][0, :total], batch["input_ids"][0])
    assert (padded["input_ids"][0, total:] == 5).all() and (padded["labels"][0, total:] == IGNORE).all()
    np.testing.assert_array_equal(padded["position_ids"][0, total:], np.arange(seq - total))
    np.testing.assert_array_equal(padded["attn_mask_startend_row_indices"].reshape(-1),
                                  np.concatenate([expected_ends, np.full(seq - total, seq, np.int32)]))

    per_row = PackedCollator(0, return_tensors="np", flatten=False)(rows)
    longest = max(len(row["input_ids"]) for row in rows)
    assert per_row["input_ids"].shape == (4, longest) and longest < total


def test_flatten_argument_errors(examples):
    dense = PackedDataset(examples, MAX_LENGTH, form="dense_mask")
    PackedCollator(0, return_tensors="np")([dense[0], dense[1]])  # the dense form's default: a row each
    with pytest.raises(ValueError, match="`flatten=True` needs the segments form"):
        PackedCollator(0, flatten=True)([dense[0], dense[1]])
    with pytest.raises(ValueError, match="`flatten=True` needs the segments form"):
        packed_batches(examples, MAX_LENGTH, batch_size=2, form="dense_mask", flatten=True)
    with pytest.raises(ValueError, match="`flatten` must be True, False or None"):
        PackedCollator(0, flatten="rows")


def test_token_counting_reports_no_padding_for_a_flattened_batch(examples):
    dataset = PackedDataset(examples, MAX_LENGTH)
    rows = [dataset[i] for i in range(len(dataset))]
    labelled = sum(label != IGNORE for _, labels in examples for label in labels)
    flat, per_row = (TokenCountingCollator(PackedCollator(0, flatten=flatten)) for flatten in (None, False))
    flat(rows)
    per_row(rows)
    assert (flat.padding.slots, flat.padding.real, flat.padding.labelled) == (sum(LENGTHS), sum(LENGTHS), labelled)
    assert flat.padding.waste() == 0.0 and flat.tokens == sum(LENGTHS)
    # a row each: the shorter row is padded to the longer
    assert per_row.padding.real == sum(LENGTHS) < per_row.padding.slots and per_row.padding.waste() > 0


def test_flattened_training_equals_per_row_and_stock(examples, kernel_calls):
    """One training batch of the same packed rows three ways: stock PaddleNLP on the dense_mask
    form, and the fast path (its defaults, fused projections included) on the segments form
    flattened (the default) and a row each: the same loss and every parameter's gradient (fp32:
    summation order only; stock's gradients in the fused layout by PaddleNLP's own mappings)."""
    from test_default_fast_path import fuse_like

    dense_batch = packed_batches(examples, MAX_LENGTH, batch_size=8, form="dense_mask")[0][0]
    rows = len(PackedDataset(examples, MAX_LENGTH))
    assert dense_batch["input_ids"].shape[0] == rows > 1
    stock_loss, stock_grads = losses_and_grads(tiny_model(), dense_batch)
    paddle_fastffn.apply_fast_ffn_to_llama()
    model = tiny_model()  # the same seed: the stock model's weights, fused (test_default_fast_path)
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    stock_grads = fuse_like(model, stock_grads)
    results = {}
    for flatten in (None, False):
        batch = packed_batches(examples, MAX_LENGTH, batch_size=8, flatten=flatten)[0][0]
        assert batch["input_ids"].shape[0] == (1 if flatten is None else rows)
        results["flattened" if flatten is None else "rows"] = losses_and_grads(model, batch)
    assert stock_grads
    for name, (loss, grads) in results.items():
        assert_close(loss, stock_loss, paddle.float32, f"{name}: loss against stock")
        assert grads.keys() == stock_grads.keys(), name
        for param, grad in stock_grads.items():
            assert_close(grads[param], grad, paddle.float32, f"{name}: d {param} against stock",
                         reduced_rows=sum(LENGTHS))
    flat_loss, flat_grads = results["flattened"]
    assert_close(flat_loss, results["rows"][0], paddle.float32, "loss: flattened against rows")
    for param, grad in results["rows"][1].items():
        assert_close(flat_grads[param], grad, paddle.float32, f"d {param}: flattened against rows",
                     reduced_rows=sum(LENGTHS))
    calls = kernel_calls()
    assert calls["fastffn_rotary"] > 0 and calls["fastffn_cross_entropy"] > 0  # the fast path ran


def test_fast_packed_dense_mask_reaches_attention(examples):
    """The fast path (use_flash_attention forced on) with PaddleNLP's dense 4-D mask: the mask is
    not causal-looking, so it reaches SDPA and keeps the examples apart too."""
    paddle_fastffn.apply_fast_ffn_to_llama()
    model = tiny_model()
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    assert model.config.use_flash_attention
    check_packed_against_one_by_one(model, examples, "dense_mask", batch_size=8)


def test_fast_packed_segments_with_attention_off_take_paddlenlp_attention(examples, info_lines):
    """fast_ffn_attention off: no attention function is patched, so the segments reach PaddleNLP's own
    attention as its dense block-causal mask."""
    paddle_fastffn.apply_fast_ffn_to_llama(attention=False)
    model = tiny_model()
    check_packed_against_one_by_one(model, examples, "segments", batch_size=8)
    assert any("packed batches reach PaddleNLP's attention" in line for line in info_lines)


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    """A real LlamaTokenizer (PaddleNLP's padding rules: left, 3-D masks padded at the front) from
    a small sentencepiece model."""
    import sentencepiece as spm
    from paddlenlp.transformers import LlamaTokenizer

    out = tmp_path_factory.mktemp("spm")
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(f"example {i} packs into rows of tokens" for i in range(50)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out / "spm"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, minloglevel=2, num_threads=1)
    tokenizer = LlamaTokenizer(vocab_file=str(out / "spm.model"))
    tokenizer.pad_token = tokenizer.unk_token
    return tokenizer


def test_fast_packed_equals_paddlenlp_zero_padding(examples, llama_tokenizer):
    """PaddleNLP's own zero_padding pipeline (llm/finetune_generation.py with zero_padding: records
    with position_ids, InTokensMapDataset, DataCollatorForSeq2Seq) on stock LLaMA, and the fast path
    on the packing collator's segments: same loss and gradients."""
    records = [{"input_ids": ids, "labels": labels, "position_ids": list(range(len(ids)))} for ids, labels in examples]
    stock_rows = InTokensMapDataset(records, tokenizer=llama_tokenizer, max_length=MAX_LENGTH)
    collator = DataCollatorForSeq2Seq(tokenizer=llama_tokenizer, padding=True, return_tensors="pd")
    stock_batch = collator([stock_rows[i] for i in range(len(stock_rows))])
    assert list(stock_batch["attention_mask"].shape)[:2] == [len(stock_rows), 1]
    stock_loss, stock_grads = losses_and_grads(tiny_model(), stock_batch)

    model = tiny_model()  # built stock, then patched: the same weights under the same names
    paddle_fastffn.apply_fast_ffn_to_llama(model)
    fast_rows = PackedDataset(examples, MAX_LENGTH)
    fast_batch = PackedCollator(llama_tokenizer.pad_token_id)([fast_rows[i] for i in range(len(fast_rows))])
    assert "attention_mask" not in fast_batch
    fast_loss, fast_grads = losses_and_grads(model, fast_batch)
    assert_close(fast_loss, stock_loss, paddle.float32, "loss")
    assert fast_grads.keys() == stock_grads.keys()
    for name, grad in stock_grads.items():
        assert_close(fast_grads[name], grad, paddle.float32, f"d {name}", reduced_rows=sum(LENGTHS))


@pytest.mark.parametrize("granularity", ["full", "core_attn"])
def test_fast_packed_batch_under_recompute(examples, granularity):
    """PaddleNLP's default non-reentrant recompute replays the layers (or the core attention) in
    backward: the segments travel as an argument, so the replay keeps the examples apart too."""
    paddle_fastffn.apply_fast_ffn_to_llama()
    batch = packed_batches(examples, MAX_LENGTH, batch_size=8)[0][0]
    plain_loss, plain_grads = losses_and_grads(tiny_model(), batch)
    model = tiny_model(recompute=True, recompute_granularity=granularity, recompute_use_reentrant=False)
    model.recompute_enable()  # what PaddleNLP's Trainer does with `recompute: true`
    calls = []
    original = paddlenlp_modeling.recompute
    paddlenlp_modeling.recompute = lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs)
    try:
        loss, grads = losses_and_grads(model, batch)
    finally:
        paddlenlp_modeling.recompute = original
    # Each layer recomputed (full: the modeling's recompute wraps each decoder layer, core_attn:
    # each attention), with the segments as an argument.
    assert len(calls) == 2 and all(any(isinstance(arg, ops.PackedSegments) for arg in args) for args in calls)
    assert_close(loss, plain_loss, paddle.float32, "loss under recompute")
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, plain_grads[name], paddle.float32, f"d {name} under recompute", reduced_rows=sum(LENGTHS))


def test_run_finetune_zero_padding_stock_and_fast(tmp_path_factory, tmp_path):
    """scripts/run_finetune.py with zero_padding: stock (PaddleNLP's dense 4-D mask), fast
    (segments, each batch's rows flattened to one) and fast with fast_ffn_attention off (segments
    a row each, as they become PaddleNLP's dense mask) train the same per-step losses; greedy_zero_padding packs at least as tightly; each
    summary reports the padding waste, lower than the padded run's."""
    from test_run_finetune import demo as build_demo, losses, run

    demo = build_demo.__wrapped__(tmp_path_factory)
    # Evaluation in batches of 2 rows (the demo dev set packs into 3: a short last batch): PaddleNLP
    # weights each batch's loss by its rows, so eval_loss matches stock only if evaluation collates a
    # row each (llm_flow.with_eval_collator; with a flattened evaluation this assertion fails).
    rows = ("--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--max_length", "128")
    stock = run(demo, tmp_path / "stock", *rows, "--zero_padding", "true", "--use_fast_ffn", "false", steps=4)
    fast = run(demo, tmp_path / "fast", *rows, "--zero_padding", "true", steps=4)
    greedy = run(demo, tmp_path / "greedy", *rows, "--greedy_zero_padding", "true", steps=4)
    # fast_ffn_attention off: PaddleNLP's attention on the segments' dense mask, so a row each
    attention_off = run(demo, tmp_path / "attention_off", *rows, "--zero_padding", "true",
                        "--fast_ffn_attention", "false", steps=4)
    padded = run(demo, tmp_path / "padded", steps=4)
    assert (stock["packing"], fast["packing"], greedy["packing"], padded["packing"]) == (
        "zero_padding", "zero_padding", "greedy_zero_padding", None)
    # fp32 on CPU both ways; see test_checkpoints_and_convergence for the tolerance's reasoning.
    np.testing.assert_allclose(losses(fast), losses(stock), rtol=1e-4)
    np.testing.assert_allclose([fast["eval_loss"], attention_off["eval_loss"]], stock["eval_loss"], rtol=1e-4)
    # The same tokens; the fast batches are flattened (PackedCollator's default), so no padding
    # slots, while stock pads each batch's rows to its longest.
    same = ("real_tokens", "labelled_tokens")
    assert {k: fast["padding"][k] for k in same} == {k: stock["padding"][k] for k in same}
    assert fast["padding"]["slot_tokens"] == fast["padding"]["real_tokens"] < stock["padding"]["slot_tokens"]
    np.testing.assert_allclose(losses(attention_off), losses(stock), rtol=1e-4)
    assert attention_off["padding"] == stock["padding"]
    for summary in (stock, fast, greedy, padded):
        count = summary["padding"]
        assert 0 < count["labelled_tokens"] <= count["real_tokens"] <= count["slot_tokens"]
        assert count["padding_waste"] == pytest.approx(1 - count["real_tokens"] / count["slot_tokens"], abs=1e-4)
    assert fast["padding"]["padding_waste"] < padded["padding"]["padding_waste"]


def test_training_flattens_and_evaluation_collates_a_row_each(examples):
    """llm_flow.with_eval_collator on PaddleNLP's Trainer, as scripts/run_finetune.py builds it for
    packed SFT: the training dataloader gives one flattened row, the evaluation and prediction
    dataloaders a row each (PaddleNLP weights each evaluation batch's loss by its rows), and the
    Trainer keeps its training collator afterwards."""
    from paddlenlp.trainer import Trainer, TrainingArguments

    from paddle_fastffn.finetune.llm_flow import with_eval_collator

    dataset = PackedDataset(examples, MAX_LENGTH)
    rows = len(dataset)
    assert rows > 1
    flattened, per_row = PackedCollator(0), PackedCollator(0, flatten=False)
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             report_to="none", device="cpu")
    trainer = with_eval_collator(Trainer)(model=tiny_model(), args=args, train_dataset=dataset, eval_dataset=dataset,
                                          data_collator=flattened, eval_data_collator=per_row)
    assert next(iter(trainer.get_train_dataloader()))["input_ids"].shape[0] == 1
    assert next(iter(trainer.get_eval_dataloader()))["input_ids"].shape[0] == rows
    assert next(iter(trainer.get_test_dataloader(dataset)))["input_ids"].shape[0] == rows
    assert trainer.data_collator is flattened
