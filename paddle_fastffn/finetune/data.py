"""jsonl {"src": ..., "tgt": ...} instruction data -> token ids with the prompt masked out of the
loss, as PaddleNLP's llm/ fine-tune scripts do. PaddleNLP's causal-LM criterion does not shift:
labels[i] is the token that follows input_ids[i], so the pairs are built shifted here."""

from __future__ import annotations

import json
from pathlib import Path

IGNORE_INDEX = -100


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("src"), str) or not isinstance(row.get("tgt"), str):
                raise ValueError(f"{path}:{line_no}: each line must be a JSON object with string fields "
                                 f"'src' and 'tgt'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


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


class TokenCountingCollator:
    """Wraps a collator and counts the non-padding tokens it hands to the model (for tokens/s)."""

    def __init__(self, collator):
        self.collator = collator
        self.tokens = 0

    def __call__(self, features):
        self.tokens += int(sum(len(f["input_ids"]) for f in features))
        return self.collator(features)

