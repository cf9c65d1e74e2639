"""jsonl {"src": ..., "tgt": ...} instruction data -> token ids with the prompt masked out of the
loss, as PaddleNLP's llm/ fine-tune scripts do. PaddleNLP's causal-LM criterion does not shift:
labels[i] is the token that follows input_ids[i], so the pairs are built shifted here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .input_checks import read_jsonl

IGNORE_INDEX = -100


def tokenize_example(tokenizer, example: dict, max_length: int, src_length: int) -> dict:
    """<s> src tgt </s> -> input_ids = all but the last token, labels = the next token at each
    position, IGNORE_INDEX while the next token is still part of the prompt."""
    src = tokenizer.encode(example["src"], add_special_tokens=False)["input_ids"][: src_length - 1]
    tgt = tokenizer.encode(example["tgt"], add_special_tokens=False)["input_ids"]
    src = [tokenizer.bos_token_id] + src
    tgt = (tgt + [tokenizer.eos_token_id])[: max(1, max_length + 1 - len(src))]
    return {"input_ids": (src + tgt)[:-1], "labels": [IGNORE_INDEX] * (len(src) - 1) + tgt}


class TokenizedDataset:
    """A list of tokenized examples (small data: built eagerly, indexable, len())."""

    def __init__(self, tokenizer, path, max_length: int, src_length: int):
        self.rows = read_jsonl(path)
        self.examples = [tokenize_example(tokenizer, e, max_length, src_length) for e in self.rows]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


@dataclass
class PaddingCount:
    """Token slots the model computed on (batch x seq of each batch) vs. real (example) tokens, and
    the labelled tokens among them."""
    slots: int = 0
    real: int = 0
    labelled: int = 0

    def waste(self) -> float:
        """Share of slots holding padding: 1 - real / slots."""
        return 1.0 - self.real / self.slots if self.slots else 0.0

    def as_dict(self) -> dict:
        return {"slot_tokens": self.slots, "real_tokens": self.real, "labelled_tokens": self.labelled,
                "padding_waste": round(self.waste(), 4)}


class TokenCountingCollator:
    """Wraps a collator and counts the non-padding tokens it hands to the model (`tokens`, for
    tokens/s), and in `padding` the slots, real and labelled tokens of what it returns."""

    def __init__(self, collator):
        self.collator = collator
        self.tokens = 0
        self.padding = PaddingCount()

    def __call__(self, features):
        real = int(sum(len(f["input_ids"]) for f in features))
        self.tokens += real
        batch = self.collator(features)
        labels = batch["labels"]
        self.padding.slots += math.prod(labels.shape)
        self.padding.real += real
        self.padding.labelled += int((labels != IGNORE_INDEX).astype("int64").sum())  # paddle or numpy
        return batch

