"""Sequence packing for SFT: PaddleNLP's `zero_padding` (and `greedy_zero_padding`) semantics.

Tokenized examples ({"input_ids", "labels"}, labels already shifted, -100 outside the loss) are
packed into rows of up to `max_length` tokens. Inside a row, position ids restart at 0 for each
example and attention never crosses examples; labels stay per example, so the loss (PaddleNLP's
mean over labelled tokens) is the one of running the examples unpacked.

Two packing rules:
- sequential (`zero_padding`): PaddleNLP 2.8.1's InTokensMapDataset: examples in order, each added
  to the current row until the next does not fit, which then starts a new row;
- greedy (`greedy_zero_padding`, which PaddleNLP 2.8.1 does not ship): within each run of
  GREEDY_WINDOW (500) examples, each example goes into the open row with the most room, and opens a
  new row when none has room; the run's rows are closed at its end.

Two forms of a packed row:
- "dense_mask", what stock PaddleNLP consumes: each row built by PaddleNLP's own
  InTokens._pad_batch_records (block-diagonal causal mask, position ids concatenated), collated to
  `attention_mask` bool [batch, 1, seq, seq] (padding attends nowhere), rows right-padded to the
  batch's longest with pad_token_id, label -100;
- "segments", what the fast path consumes: `attn_mask_startend_row_indices` int32
  [batch, 1, seq, 1] (PaddleNLP's causal FlashMask form; padding is one more segment) and no
  [seq, seq] mask; paddle_fastffn's LlamaForCausalLM.forward hands it to packed attention.

A batch of segments rows is collated by default to ONE flattened row [1, the rows' real tokens]
(padding-free, as Hugging Face's DataCollatorWithFlattening): the fast path's attention is per
segment, so concatenating the rows is the same training (positions restart per example,
attention never crosses examples, the loss is the mean over labelled tokens) without the padding
each row would carry to the batch's longest through every GEMM. `PackedCollator(flatten=False)`
keeps one row per packed row (right-padded to the longest); `pad_to_multiple_of` pads either
layout's rows at the end (one more segment). The dense form cannot be flattened: its mask would be
[tokens, tokens] for the whole batch.

`packed_batches(examples, max_length, ...)` builds either form from a list of examples (for
benchmarks and tests); `PackedDataset` + `PackedCollator` are the Trainer's dataset and collator.
"""

from __future__ import annotations

import numpy as np
import paddle

from .data import IGNORE_INDEX, TokenCountingCollator

GREEDY_WINDOW = 500
FORMS = ("segments", "dense_mask")


def _check_lengths(lengths, max_length: int) -> None:
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"packing: `max_length` must be a positive int, got {max_length!r}")
    for index, n in enumerate(lengths):
        if n < 1 or n > max_length:
            raise ValueError(f"packing: example {index} has {n} tokens; each example must have 1 to max_length "
                             f"({max_length}) tokens (truncate it when tokenizing)")


def sequential_rows(lengths, max_length: int) -> list[list[int]]:
    """Example indices per row, PaddleNLP's InTokensMapDataset rule (zero_padding)."""
    _check_lengths(lengths, max_length)
    rows, row, used = [], [], 0
    for index, n in enumerate(lengths):
        if row and used + n > max_length:
            rows.append(row)
            row, used = [], 0
        row.append(index)
        used += n
    if row:
        rows.append(row)
    return rows


def greedy_rows(lengths, max_length: int, window: int = GREEDY_WINDOW) -> list[list[int]]:
    """Example indices per row, greedy_zero_padding: within each run of `window` examples, each
    example goes into the open row with the most room (the earliest such row on a tie), or opens a
    new row when none has room for it; rows keep their examples in arrival order and are emitted in
    the order they were opened."""
    _check_lengths(lengths, max_length)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"packing: `window` must be a positive int, got {window!r}")
    rows = []
    for first in range(0, len(lengths), window):
        open_rows, room = [], []
        for index in range(first, min(first + window, len(lengths))):
            n = lengths[index]
            best = int(np.argmax(room)) if room else -1
            if best < 0 or room[best] < n:
                open_rows.append([index])
                room.append(max_length - n)
            else:
                open_rows[best].append(index)
                room[best] -= n
        rows.extend(open_rows)
    return rows


def _check_example(example, index: int) -> tuple[list, list]:
    try:
        input_ids, labels = example["input_ids"], example["labels"]
    except (TypeError, KeyError):
        raise ValueError(f"packing: example {index} must be a dict with 'input_ids' and 'labels' "
                         f"(or an (input_ids, labels) pair)") from None
    if len(input_ids) != len(labels):
        raise ValueError(f"packing: example {index} has {len(input_ids)} input_ids and {len(labels)} labels; "
                         f"they must match (labels already shifted, {IGNORE_INDEX} outside the loss)")
    return list(input_ids), list(labels)


def segments_row(members) -> dict:
    """One packed row of the segments form from its examples' (input_ids, labels): the examples
    concatenated, position ids restarting per example, and their lengths (`seq_lens`). Plain Python:
    the GPU benchmark loads it by source (benchmarks/sft_packed_steps.py)."""
    return {"input_ids": [t for ids, _ in members for t in ids],
            "labels": [t for _, labels in members for t in labels],
            "position_ids": [p for ids, _ in members for p in range(len(ids))],
            "seq_lens": [len(ids) for ids, _ in members]}


class PackedDataset:
    """Packed rows of tokenized examples: len() rows, each one dict in `form` (see the module doc).
    greedy: the greedy_zero_padding rule instead of zero_padding's sequential one. Rows are built
    when read (a dense row mask is seq^2 bytes, so InTokensMapDataset's eager masks would hold
    gigabytes for a real dataset)."""

    def __init__(self, examples, max_length: int, greedy: bool = False, form: str = "segments"):
        if form not in FORMS:
            raise ValueError(f"packing: `form` must be one of {FORMS}, got {form!r}")
        self.examples = [_check_example(e if isinstance(e, dict) else {"input_ids": e[0], "labels": e[1]}, i)
                         for i, e in enumerate(examples)]
        lengths = [len(ids) for ids, _ in self.examples]
        self.rows = (greedy_rows if greedy else sequential_rows)(lengths, max_length)
        self.max_length, self.form = max_length, form

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        members = [self.examples[i] for i in self.rows[index]]
        if self.form == "dense_mask":
            from paddlenlp.datasets.intokens_dataset import InTokens

            # PaddleNLP's own row builder; position ids restart per example as its llm/data.py
            # gives them for LLaMA (LlamaTokenizer lists position_ids among its model inputs).
            return InTokens._pad_batch_records([{"input_ids": ids, "labels": labels,
                                                 "position_ids": list(range(len(ids)))}
                                                for ids, labels in members])
        return segments_row(members)

    def real_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.examples)


def is_packed_row(row: dict) -> bool:
    """A PackedDataset row (either form), as opposed to one plain tokenized example."""
    return "seq_lens" in row or np.ndim(row.get("attention_mask", ())) >= 2


def _check_flatten(flatten) -> None:
    if flatten not in (None, True, False):
        raise ValueError(f"packing: `flatten` must be True, False or None (the form's default), got {flatten!r}")


def collate_packed_rows(rows, pad_token_id: int, pad_to_multiple_of: int | None = None, flatten: bool | None = None,
                        ignore_index: int = IGNORE_INDEX):
    """PackedDataset rows of one form -> (numpy batch, row_lengths). numpy only, no Paddle: the GPU
    benchmark (no Paddle there) loads it by source and trains the layout the product collates.

    Segments rows (`seq_lens`): flatten None or True concatenates the rows into one row
    [1, their tokens]; flatten False keeps a row each, right-padded to the longest. row_lengths: per
    batch row, its examples' lengths (PackedSegments.from_row_lengths adds the padding segment).
    Dense rows (`attention_mask`): a row each with the mask [batch, 1, seq, seq]; row_lengths None;
    flatten must not be True. pad_to_multiple_of rounds seq up; padding has pad_token_id, label
    ignore_index and, in the segments form, positions of its own from 0."""
    _check_flatten(flatten)
    dense = "attention_mask" in rows[0]
    if dense and flatten:
        raise ValueError("packing: `flatten=True` needs the segments form; the dense_mask form (stock PaddleNLP's) "
                         "keeps one row per packed row, as its [seq, seq] mask would span the whole batch "
                         "(pass flatten=None or False)")
    if not dense and flatten is not False:
        # One row of every example, in order: the per-row layout below with a single row.
        rows = [{key: np.concatenate([np.asarray(row[key]).reshape(-1) for row in rows])
                 for key in ("input_ids", "labels", "position_ids", "seq_lens")}]
    seq = max(len(row["input_ids"]) for row in rows)
    if pad_to_multiple_of:
        seq = -(-seq // pad_to_multiple_of) * pad_to_multiple_of
    batch = len(rows)
    input_ids = np.full((batch, seq), pad_token_id, dtype=np.int64)
    labels = np.full((batch, seq), ignore_index, dtype=np.int64)
    position_ids = np.zeros((batch, seq), dtype=np.int64)
    mask = np.zeros((batch, 1, seq, seq), dtype=bool) if dense else None
    row_lengths = None if dense else []
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[r, :n], labels[r, :n] = row["input_ids"], row["labels"]
        position_ids[r, :n] = np.asarray(row["position_ids"]).reshape(-1)
        if dense:
            mask[r, 0, :n, :n] = np.asarray(row["attention_mask"]).reshape(n, n)
        else:
            row_lengths.append([int(length) for length in row["seq_lens"]])
            position_ids[r, n:] = np.arange(seq - n)  # the padding segment's own positions
    out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    if dense:
        out["attention_mask"] = mask
    return out, row_lengths


class PackedCollator:
    """Collates PackedDataset rows of one form into paddle tensors (collate_packed_rows; numpy
    arrays with return_tensors="np"). flatten (None: the form's default): segments rows become one
    flattened row [1, tokens] unless flatten=False; dense_mask rows stay a row each and reject
    flatten=True. Keep a row each (flatten=False) where the batch's shape changes what the model
    computes: NEFTune's noise scale, dynamic NTK rope past max_position_embeddings, and evaluation
    (PaddleNLP weights each batch's loss by its rows); scripts/run_finetune.py's
    flatten_packed_batches and llm_flow.with_eval_collator."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, return_tensors: str = "pd",
                 flatten: bool | None = None):
        if return_tensors not in ("pd", "np"):
            raise ValueError(f"packing: `return_tensors` must be 'pd' or 'np', got {return_tensors!r}")
        _check_flatten(flatten)
        self.pad_token_id, self.pad_to_multiple_of = int(pad_token_id), pad_to_multiple_of
        self.return_tensors, self.flatten = return_tensors, flatten

    def __call__(self, rows):
        out, row_lengths = collate_packed_rows(rows, self.pad_token_id, self.pad_to_multiple_of, self.flatten)
        if row_lengths is not None:
            from ..ops.varlen_attention import PackedSegments

            out["attn_mask_startend_row_indices"] = PackedSegments.from_row_lengths(
                row_lengths, out["input_ids"].shape[1]).startend_row_indices()
        if self.return_tensors == "pd":
            out = {key: paddle.to_tensor(value) for key, value in out.items()}
        return out


def packed_batches(examples, max_length: int, batch_size: int = 1, greedy: bool = False,
                   form: str = "segments", pad_token_id: int = 0, flatten: bool | None = None):
    """Packed batches of `examples` ((input_ids, labels) pairs or {"input_ids", "labels"} dicts,
    labels shifted, -100 outside the loss), ready for LlamaForCausalLM(**batch): form "segments"
    for the fast path (paddle_fastffn applied), "dense_mask" for stock PaddleNLP; `batch_size` packed
    rows a batch, flattened to one row as PackedCollator(flatten) does. Returns
    (list of batch dicts of paddle tensors, the PaddingCount of those batches)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"packing: `batch_size` must be a positive int, got {batch_size!r}")
    dataset = PackedDataset(examples, max_length, greedy=greedy, form=form)
    collator = TokenCountingCollator(PackedCollator(pad_token_id, flatten=flatten))
    batches = [collator([dataset[i] for i in range(first, min(first + batch_size, len(dataset)))])
               for first in range(0, len(dataset), batch_size)]
    return batches, collator.padding
