"""Real SFT length profiles (/work/shared/data/sft_lengths_*.json) turned into training batches of
random token ids with those lengths, so a benchmark's shapes match real LLaMA-2 fine-tuning.

Framework-neutral (numpy only): the CPU benchmarks feed the arrays to Paddle, the GPU harness
(benchmarks/gpu, torch, no Paddle) can feed them to torch.

Each example's length is what PaddleNLP's fine-tune script trains on (no chat template, its
defaults src_length=1024, max_length=2048): the prompt is cut from the left to src_length, the
response cut so the whole fits max_length, and the sequence shifted by one, so

    train_len = min(min(prompt, src_length) + response, max_length) - 1

and the labels are the kept response tokens (train_len + 1 - kept prompt of them; the prompt's
positions carry IGNORE_INDEX), as paddle_fastffn.finetune.data builds them for the demo.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IGNORE_INDEX = -100
FIRST_ORDINARY_ID = 3  # LLaMA: <unk>=0, <s>=1, </s>=2; random ids stay clear of them
DATA_DIR = Path(os.environ.get("FASTFFN_SFT_LENGTHS_DIR", "/work/shared/data"))
PROFILES = {"gsm8k": "sft_lengths_gsm8k_train.json", "oasst1_zh": "sft_lengths_oasst1_zh.json"}


@dataclass(frozen=True)
class LengthProfile:
    """Untruncated [prompt, response] token counts of one dataset, in the source file's order."""
    name: str
    prompt: np.ndarray    # int64 [examples], includes <s>
    response: np.ndarray  # int64 [examples], includes </s>
    source: dict

    def train_lengths(self, src_length: int = 1024, max_length: int = 2048) -> tuple[np.ndarray, np.ndarray]:
        """(train_len, kept prompt) per example under PaddleNLP's truncation rule."""
        if src_length < 1 or max_length <= src_length:
            raise ValueError(f"src_length must be >= 1 and below max_length, got src_length={src_length}, "
                             f"max_length={max_length}")
        kept_prompt = np.minimum(self.prompt, src_length)
        train_len = np.minimum(kept_prompt + self.response, max_length) - 1
        return train_len, kept_prompt


def load_profile(name_or_path: str | Path) -> LengthProfile:
    """A profile by short name (one of PROFILES, read from $FASTFFN_SFT_LENGTHS_DIR, default
    /work/shared/data) or by the path of an sft_lengths_*.json file."""
    path = Path(name_or_path)
    if not path.suffix:
        if str(name_or_path) not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)} or a path to an sft_lengths_*.json "
                             f"file, got {name_or_path!r}")
        path = DATA_DIR / PROFILES[str(name_or_path)]
    data = json.loads(path.read_text())
    pairs = np.asarray(data["lengths"], dtype=np.int64)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or len(pairs) != data["count"] or (pairs < 1).any():
        raise ValueError(f"{path}: 'lengths' must be {data.get('count')} [prompt_tokens, response_tokens] "
                         f"pairs of positive counts, got shape {pairs.shape}")
    name = str(name_or_path) if not Path(name_or_path).suffix else data.get("name", path.stem)
    return LengthProfile(name=name, prompt=pairs[:, 0], response=pairs[:, 1], source=data["source"])


def example_order(count: int, seed: int, limit: int | None = None) -> np.ndarray:
    """Shuffled example indices (numpy default_rng(seed), as the data README's waste figures),
    the first `limit` of them when given."""
    order = np.random.default_rng(seed).permutation(count)
    return order if limit is None else order[:limit]


def make_example(train_len: int, kept_prompt: int, rng: np.random.Generator, vocab_size: int) -> dict:
    """One shifted example of random ids: input_ids [train_len], labels [train_len] with the
    prompt's positions ignored (labels[i] is the token after input_ids[i], PaddleNLP's convention)."""
    sequence = rng.integers(FIRST_ORDINARY_ID, vocab_size, size=train_len + 1, dtype=np.int64)
    labels = sequence[1:].copy()
    labels[: kept_prompt - 1] = IGNORE_INDEX
    return {"input_ids": sequence[:-1], "labels": labels}


def make_examples(profile: LengthProfile, indices: np.ndarray, vocab_size: int, seed: int = 0,
                  src_length: int = 1024, max_length: int = 2048) -> list[dict]:
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab_size must exceed {FIRST_ORDINARY_ID} (the special ids), got {vocab_size}")
    train_len, kept_prompt = profile.train_lengths(src_length, max_length)
    rng = np.random.default_rng(seed)
    return [make_example(int(train_len[i]), int(kept_prompt[i]), rng, vocab_size) for i in indices]


def pad_to_longest(examples: list[dict], pad_id: int = 0) -> dict:
    """One batch padded on the right to its longest example: input_ids, labels (IGNORE_INDEX on
    padding), attention_mask (1 on real tokens), int64 numpy arrays [batch, longest]."""
    longest = max(len(e["input_ids"]) for e in examples)
    batch = {"input_ids": np.full((len(examples), longest), pad_id, dtype=np.int64),
             "labels": np.full((len(examples), longest), IGNORE_INDEX, dtype=np.int64),
             "attention_mask": np.zeros((len(examples), longest), dtype=np.int64)}
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        batch["input_ids"][row, :n] = example["input_ids"]
        batch["labels"][row, :n] = example["labels"]
        batch["attention_mask"][row, :n] = 1
    return batch


def padded_batches(examples: list[dict], batch_size: int, pad_id: int = 0) -> list[dict]:
    """Consecutive batches of batch_size, each padded to its longest; an incomplete last batch is
    dropped (as the data README's batch4_pad_to_longest waste figure does)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    whole = len(examples) // batch_size * batch_size
    return [pad_to_longest(examples[i:i + batch_size], pad_id) for i in range(0, whole, batch_size)]


def labelled_tokens(batch: dict) -> int:
    """Tokens that carry a label: what effective tokens/s counts (numpy or framework arrays)."""
    return int((np.asarray(batch["labels"]) != IGNORE_INDEX).sum())


def padding_waste(batches: list[dict]) -> float:
    """Share of token slots holding padding (1 - real tokens / slots)."""
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    slots = sum(b["input_ids"].size for b in batches)
    return 1.0 - real / slots
