from paddle_fastffn.finetune.data import IGNORE_INDEX, tokenize_example


class CharTokenizer:
    bos_token_id, eos_token_id = 1, 2

    def encode(self, text, add_special_tokens=False):
        return {"input_ids": [10 + ord(c) % 50 for c in text]}


def test_labels_are_the_next_tokens_with_the_prompt_masked():
    example = tokenize_example(CharTokenizer(), {"src": "ab", "tgt": "cd"}, max_length=16, src_length=8)
    a, b, c, d = (10 + ord(ch) % 50 for ch in "abcd")
    assert example["input_ids"] == [1, a, b, c, d]  # <s> a b c d (the final </s> is only a label)
    assert example["labels"] == [IGNORE_INDEX, IGNORE_INDEX, c, d, 2]


def test_truncation_keeps_input_and_labels_aligned():
    example = tokenize_example(CharTokenizer(), {"src": "abcdef", "tgt": "ghijkl"}, max_length=6, src_length=4)
    assert len(example["input_ids"]) == len(example["labels"]) == 6
    assert example["labels"][:3] == [IGNORE_INDEX] * 3
