"""Batches built from real SFT length profiles (benchmarks/sft_lengths.py): PaddleNLP's truncation
rule, labels on response tokens only, padding to the longest of each batch."""

import json

import numpy as np
import pytest

from benchmarks import sft_lengths
from benchmarks.sft_lengths import IGNORE_INDEX


def write_profile(tmp_path, pairs, name="tiny"):
    path = tmp_path / f"sft_lengths_{name}.json"
    path.write_text(json.dumps({"name": name, "count": len(pairs), "lengths": pairs,
                                "source": {"repo": "test"}}))
    return path


def test_truncation_follows_paddlenlp(tmp_path):
    # prompt within src_length; prompt cut to src_length; whole cut to max_length.
    profile = sft_lengths.load_profile(write_profile(tmp_path, [[5, 7], [30, 4], [8, 40]]))
    train_len, kept_prompt = profile.train_lengths(src_length=16, max_length=32)
    np.testing.assert_array_equal(kept_prompt, [5, 16, 8])
    np.testing.assert_array_equal(train_len, [5 + 7 - 1, 16 + 4 - 1, 32 - 1])


def test_padded_batches_labels_and_padding(tmp_path):
    pairs = [[5, 7], [30, 4], [8, 40], [3, 2], [9, 9]]
    profile = sft_lengths.load_profile(write_profile(tmp_path, pairs))
    examples = sft_lengths.make_examples(profile, np.arange(5), vocab_size=50, src_length=16, max_length=32)
    batches = sft_lengths.padded_batches(examples, batch_size=2, pad_id=0)
    assert len(batches) == 2  # the fifth example makes an incomplete batch: dropped
    train_len, kept_prompt = profile.train_lengths(src_length=16, max_length=32)
    for b, batch in enumerate(batches):
        rows = [2 * b, 2 * b + 1]
        assert batch["input_ids"].shape == (2, max(train_len[rows]))
        for row, i in enumerate(rows):
            n, prompt = int(train_len[i]), int(kept_prompt[i])
            ids, labels, mask = batch["input_ids"][row], batch["labels"][row], batch["attention_mask"][row]
            assert mask[:n].all() and not mask[n:].any()
            assert (ids[n:] == 0).all() and (ids[:n] >= sft_lengths.FIRST_ORDINARY_ID).all() and (ids < 50).all()
            # labels[i] is the token after input_ids[i]; the prompt's positions and padding are ignored
            assert (labels[: prompt - 1] == IGNORE_INDEX).all() and (labels[n:] == IGNORE_INDEX).all()
            np.testing.assert_array_equal(labels[prompt - 1: n - 1], ids[prompt: n])
            assert labels[n - 1] != IGNORE_INDEX  # the last kept token's label
            assert sft_lengths.labelled_tokens({"labels": labels}) == n + 1 - prompt
    slots = sum(b["input_ids"].size for b in batches)
    assert sft_lengths.padding_waste(batches) == pytest.approx(1 - train_len[:4].sum() / slots)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="profile must be one of"):
        sft_lengths.load_profile("no_such_profile")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        sft_lengths.padded_batches([], 0)
    profile = sft_lengths.load_profile(write_profile(tmp_path, [[5, 7]]))
    with pytest.raises(ValueError, match="src_length must be >= 1 and below max_length"):
        profile.train_lengths(src_length=64, max_length=64)
    with pytest.raises(ValueError, match="vocab_size must exceed"):
        sft_lengths.make_examples(profile, np.arange(1), vocab_size=3)
    with pytest.raises(ValueError, match="'lengths' must be"):
        sft_lengths.load_profile(write_profile(tmp_path, [[5, 0]], name="zero"))


@pytest.mark.skipif(not (sft_lengths.DATA_DIR / sft_lengths.PROFILES["gsm8k"]).is_file(),
                    reason="the shared SFT length data is not on this machine")
def test_gsm8k_waste_matches_the_data_readme():
    # The data README: batches of 4 padded to the longest waste 28.35-29.26% of slots over seeds 0-49.
    profile = sft_lengths.load_profile("gsm8k")
    train_len, kept_prompt = profile.train_lengths()
    assert int(train_len.sum()) == 1475117  # summary.train_len.sum of the file
    examples = sft_lengths.make_examples(profile, sft_lengths.example_order(len(train_len), seed=0), vocab_size=600)
    assert 0.2835 <= sft_lengths.padding_waste(sft_lengths.padded_batches(examples, 4)) <= 0.2926
