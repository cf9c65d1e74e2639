"""The packed-SFT benchmark's step batches (benchmarks/sft_packed_steps.py): the same examples, ids
and labels in every layout, PaddleNLP's zero_padding rule, the packing collation (flattened by
default, per row on request) and PackedSegments taken from the product's files, position ids
restarting per example. numpy only (runs on the CPU CI and the GPU machine);
the checks against the imported product modules skip where Paddle is missing (the GPU machine)."""

import json

import numpy as np
import pytest

from benchmarks import sft_lengths, sft_packed_steps
from benchmarks.sft_lengths import IGNORE_INDEX


@pytest.fixture
def tiny_profile(tmp_path, monkeypatch):
    """A profile of 60 awkward lengths (prompts longer than src_length, responses past max_length)."""
    rng = np.random.default_rng(7)
    pairs = [[int(p), int(r)] for p, r in zip(rng.integers(2, 40, 60), rng.integers(1, 50, 60))]
    pairs[3] = [90, 10]    # prompt cut to src_length
    pairs[11] = [20, 200]  # whole cut to max_length
    (tmp_path / "sft_lengths_tiny.json").write_text(json.dumps({"name": "tiny", "count": len(pairs),
                                                                "lengths": pairs, "source": {"repo": "test"}}))
    monkeypatch.setattr(sft_lengths, "DATA_DIR", tmp_path)
    monkeypatch.setitem(sft_lengths.PROFILES, "tiny", "sft_lengths_tiny.json")
    return sft_lengths.load_profile("tiny")


def build(**kwargs):
    settings = dict(rows_per_step=3, row_tokens=64, padded_batch_size=4, vocab_size=50, seed=1, src_length=32)
    settings.update(kwargs)
    return sft_packed_steps.build_step("tiny", **settings)


def test_every_layout_holds_the_same_examples(tiny_profile):
    step = build()
    ids = np.concatenate([e["input_ids"] for e in step.examples])
    labels = np.concatenate([e["labels"] for e in step.examples])
    # flattened: the examples concatenated, nothing else
    np.testing.assert_array_equal(step.flattened["input_ids"][0], ids)
    np.testing.assert_array_equal(step.flattened["labels"][0], labels)
    # packed (the product's collation, flattened): the padding-free peer's row, token for token
    for key in ("input_ids", "labels", "position_ids"):
        np.testing.assert_array_equal(step.packed[key], step.flattened[key], err_msg=key)
    # packed per row: each row's real tokens are its examples', the rest padding without labels
    rows = sft_packed_steps.packed_layout(step.examples, step.rows, flatten=False)
    assert rows["input_ids"].shape[0] == len(step.rows) == 3
    packed_ids, packed_labels = [], []
    for r, row in enumerate(step.rows):
        n = sum(len(step.examples[i]["input_ids"]) for i in row)
        packed_ids.append(rows["input_ids"][r, :n])
        packed_labels.append(rows["labels"][r, :n])
        assert (rows["labels"][r, n:] == IGNORE_INDEX).all()
    np.testing.assert_array_equal(np.concatenate(packed_ids), ids)
    np.testing.assert_array_equal(np.concatenate(packed_labels), labels)
    # padded: micro-batches of the examples in order, padding without labels
    padded_ids = [b["input_ids"][j, :b["attention_mask"][j].sum()] for b in step.padded for j in range(len(b["input_ids"]))]
    np.testing.assert_array_equal(np.concatenate(padded_ids), ids)
    assert all((b["labels"][b["attention_mask"] == 0] == IGNORE_INDEX).all() for b in step.padded)
    # the same labelled tokens everywhere
    counts = {sft_lengths.labelled_tokens(step.flattened), sft_lengths.labelled_tokens(step.packed),
              sft_lengths.labelled_tokens(rows), sum(sft_lengths.labelled_tokens(b) for b in step.padded)}
    assert counts == {step.labelled_tokens} and step.labelled_tokens > 0
    assert [len(b["input_ids"]) for b in step.padded] == [4] * (len(step.examples) // 4) + (
        [len(step.examples) % 4] if len(step.examples) % 4 else [])


def test_rows_follow_zero_padding_and_truncation(tiny_profile):
    step = build()
    train_len, kept_prompt = tiny_profile.train_lengths(32, 64)
    order = sft_lengths.example_order(len(train_len), 1)
    lengths = [int(n) for n in train_len[order]]
    expected = sft_packed_steps.sequential_rows(lengths, 64)[:3]
    assert step.rows == expected
    for i, example in enumerate(step.examples):
        source = order[i]
        assert len(example["input_ids"]) == train_len[source]
        # labels only on the response: the kept prompt's positions but its last are ignored
        assert (example["labels"][: kept_prompt[source] - 1] == IGNORE_INDEX).all()
        assert (example["labels"][kept_prompt[source] - 1:] != IGNORE_INDEX).all()
    assert max(len(e["input_ids"]) for e in step.examples) <= 63


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "rows"])
def test_position_ids_restart_and_segments_match_rows(tiny_profile, flatten):
    step = build()
    packed = step.packed if flatten else sft_packed_steps.packed_layout(step.examples, step.rows, flatten=False)
    seq = packed["input_ids"].shape[1]
    # flattened: the rows one after another in a single row, with no padding
    layout_rows = [[i for row in step.rows for i in row]] if flatten else step.rows
    assert packed["input_ids"].shape[0] == len(layout_rows)
    expected_lengths = []
    for r, row in enumerate(layout_rows):
        start = 0
        for i in row:
            n = len(step.examples[i]["input_ids"])
            np.testing.assert_array_equal(packed["position_ids"][r, start:start + n], np.arange(n))
            expected_lengths.append(n)
            start += n
        if start < seq:  # the padding is a segment of its own, with its own positions
            np.testing.assert_array_equal(packed["position_ids"][r, start:], np.arange(seq - start))
            expected_lengths.append(seq - start)
    assert flatten == (len(expected_lengths) == len(step.examples))  # rows: some row ends in padding
    assert packed["segment_lengths"] == expected_lengths
    np.testing.assert_array_equal(packed["cu_seqlens"], np.concatenate([[0], np.cumsum(expected_lengths)]))
    assert packed["cu_seqlens"].dtype == np.int32
    starts = np.concatenate([np.arange(len(e["input_ids"])) for e in step.examples])
    np.testing.assert_array_equal(step.flattened["position_ids"][0], starts)


def test_summary_counts_slots_and_padding(tiny_profile):
    step = build(padded_batch_size=5)
    summary = step.summary()
    assert summary["token_slots"]["flattened"] == summary["real_tokens"] == step.real_tokens
    assert summary["token_slots"]["packed"] == step.packed["input_ids"].size == step.real_tokens
    assert summary["padding_share"]["flattened"] == summary["padding_share"]["packed"] == 0.0
    assert summary["packed_shape"] == [1, step.real_tokens]
    assert summary["padding_share"]["padded"] > 0.0
    assert summary["examples"] == len(step.examples) and summary["packed_rows"] == 3


def test_bad_arguments_name_themselves(tiny_profile):
    with pytest.raises(ValueError, match="rows_per_step"):
        build(rows_per_step=0)
    with pytest.raises(ValueError, match="padded_batch_size"):
        build(padded_batch_size=0)
    with pytest.raises(ValueError, match="fills only"):
        build(rows_per_step=10_000)


def test_load_pure_names_what_is_missing(tmp_path):
    source = tmp_path / "module.py"
    source.write_text("import paddle\nLIMIT = 3\n\ndef double(x):\n    return 2 * np.asarray(x) + LIMIT\n")
    pure = sft_packed_steps.load_pure(source, ("LIMIT", "double"))
    assert pure["double"](1) == 5
    with pytest.raises(ImportError, match="missing_fn"):
        sft_packed_steps.load_pure(source, ("double", "missing_fn"))


def test_pure_parts_are_the_product_modules_code():
    """The rule, the collation and PackedSegments taken from the files behave as the imported
    product modules."""
    pytest.importorskip("paddle")
    from paddle_fastffn.finetune import packing
    from paddle_fastffn.ops.varlen_attention import PackedSegments

    lengths = [int(n) for n in np.random.default_rng(3).integers(1, 900, 400)]
    assert sft_packed_steps.sequential_rows(lengths, 1024) == packing.sequential_rows(lengths, 1024)
    rows = [[5, 7], [12], [3, 3, 3]]
    ours, theirs = (cls.from_row_lengths(rows, 12) for cls in (sft_packed_steps.PackedSegments, PackedSegments))
    assert ours.lengths == theirs.lengths
    np.testing.assert_array_equal(ours.cu_seqlens(), theirs.cu_seqlens())
    np.testing.assert_array_equal(ours.startend_row_indices(), theirs.startend_row_indices())
    # The benchmark's packed layout is what PackedCollator hands the fast path, in either layout.
    rng = np.random.default_rng(5)
    examples = [sft_lengths.make_example(n, p, rng, 50) for n, p in ((9, 3), (17, 5), (6, 2), (12, 4))]
    packed_rows = [[0, 1], [2, 3]]
    dataset = packing.PackedDataset([(e["input_ids"], e["labels"]) for e in examples], 30)
    assert dataset.rows == packed_rows
    for flatten in (True, False):
        layout = sft_packed_steps.packed_layout(examples, packed_rows, flatten=flatten)
        batch = packing.PackedCollator(0, return_tensors="np", flatten=flatten)([dataset[0], dataset[1]])
        for key in ("input_ids", "labels", "position_ids"):
            np.testing.assert_array_equal(layout[key], batch[key], err_msg=f"flatten={flatten}: {key}")
        segments = PackedSegments(layout["segment_lengths"], *layout["input_ids"].shape)
        np.testing.assert_array_equal(segments.startend_row_indices(), batch["attn_mask_startend_row_indices"])
