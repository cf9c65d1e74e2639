"""One SFT training step's examples in the three layouts the packed-SFT GPU benchmark compares
(benchmarks/gpu/bench_packed_sft.py), built from a real length profile (benchmarks/sft_lengths.py).
numpy only: no torch, no Paddle (the GPU machine has no Paddle; the CPU tests have no torch).

How work is equalised: a step is a fixed set of examples, those of the first `rows_per_step` rows
that PaddleNLP's zero_padding rule (paddle_fastffn.finetune.packing.sequential_rows) fills with the
profile's examples in shuffled order. Every contender trains exactly these examples, with the same
token ids and the same labels (PaddleNLP's shifted labels: labels[i] is the token after
input_ids[i], IGNORE_INDEX on the prompt), so each step carries the same labelled tokens and the
loss is the mean over them for everyone. The layouts:

- packed (ours, Paddle's zero_padding): the rows as the product's collator gives them to the fast
  path (packing.collate_packed_rows, PackedCollator's default): the step's rows flattened to one
  row [1, tokens] in the rule's order, no padding, position ids restarting per example, the
  collator's attn_mask_startend_row_indices (and, for tests, the cu_seqlens PackedSegments derives
  from them); the same token work as the padding-free peer.
  packed_layout(flatten=False) gives the per-row layout (each row right-padded to the longest, the
  padding a segment of its own with its own positions, as flash_attn_unpadded sees it);
- flattened (Hugging Face padding-free, DataCollatorWithFlattening): all the step's examples
  concatenated in one row [1, tokens], no padding, position ids restarting per example (Hugging
  Face finds the examples' boundaries from them). DataCollatorWithFlattening's own labels are
  unshifted with -100 at each example's first token, which would drop each example's last label;
  the benchmark hands the same shifted labels as `shift_labels` instead, so the work matches;
- padded (Hugging Face's default collator): micro-batches of `padded_batch_size` examples in the
  same order, each right-padded to its longest (sft_lengths.pad_to_longest), trained with gradient
  accumulation over the step (loss summed over labelled tokens / the step's labelled tokens, as
  Hugging Face's num_items_in_batch does).

paddle_fastffn's packing.py and varlen_attention.py import Paddle at the top (for their collator
and attention), but their packing rule, row builder and collation (segments_row,
collate_packed_rows) and PackedSegments are plain Python and numpy: they are taken from the files'
own source (load_pure), so the benchmark runs the product's code.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks import sft_lengths
from paddle_fastffn.core.packed_attention import cu_seqlens_of, segment_lengths_from_row_ends

REPO = Path(__file__).resolve().parents[1]
ROW_TOKENS = 4096


def load_pure(path: Path, names: tuple[str, ...], given: dict | None = None) -> dict:
    """The top-level functions, classes and constant assignments called `names` in the Python file
    at `path`, executed with numpy as np and the names in `given` (what those parts take from the
    file's imports, which are skipped with the rest of the file). For pure parts of modules whose
    other parts need a framework this machine lacks."""
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    wanted = set(names)
    kept = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted:
            kept.append(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in wanted for t in node.targets):
            kept.append(node)
    found = {n.name if not isinstance(n, ast.Assign) else n.targets[0].id for n in kept}
    if found != wanted:
        raise ImportError(f"{path}: {sorted(wanted - found)} not found at the top level of the file")
    namespace = {**(given or {}), "np": np, "__name__": f"pure_{Path(path).stem}"}
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in names}


_FINETUNE = REPO / "paddle_fastffn" / "finetune"
# packing.py takes IGNORE_INDEX from data.py (-100, as sft_lengths').
_PACKING = load_pure(_FINETUNE / "packing.py",
                     ("GREEDY_WINDOW", "_check_lengths", "sequential_rows", "greedy_rows", "segments_row",
                      "_check_flatten", "collate_packed_rows"),
                     given=load_pure(_FINETUNE / "data.py", ("IGNORE_INDEX",)))
_SEGMENTS = load_pure(REPO / "paddle_fastffn" / "ops" / "varlen_attention.py", ("OP", "PackedSegments"),
                      given={"cu_seqlens_of": cu_seqlens_of,
                             "segment_lengths_from_row_ends": segment_lengths_from_row_ends})
sequential_rows, segments_row, collate_packed_rows = (
    _PACKING[name] for name in ("sequential_rows", "segments_row", "collate_packed_rows"))
PackedSegments = _SEGMENTS["PackedSegments"]


@dataclass
class StepBatches:
    """One step's examples and the three layouts of them (numpy int64 arrays unless noted)."""
    profile: str
    examples: list[dict]
    rows: list[list[int]]          # example indices (into `examples`) of each packed row
    packed: dict                   # input_ids, labels, position_ids [1, tokens]; cu_seqlens int32; segment_lengths
    flattened: dict                # input_ids, labels, position_ids [1, tokens]
    padded: list[dict]             # micro-batches: input_ids, labels, attention_mask [n, longest]
    settings: dict = field(default_factory=dict)

    @property
    def labelled_tokens(self) -> int:
        return sum(int((e["labels"] != sft_lengths.IGNORE_INDEX).sum()) for e in self.examples)

    @property
    def real_tokens(self) -> int:
        return sum(len(e["input_ids"]) for e in self.examples)

    def summary(self) -> dict:
        """What a results file records about the step's work: the same examples and labelled tokens
        for every layout, and the token slots (and padding share) each layout computes."""
        slots = {"packed": int(self.packed["input_ids"].size), "flattened": int(self.flattened["input_ids"].size),
                 "padded": sum(int(b["input_ids"].size) for b in self.padded)}
        return {"profile": self.profile, "examples": len(self.examples), "labelled_tokens": self.labelled_tokens,
                "real_tokens": self.real_tokens, "packed_rows": len(self.rows),
                "packed_shape": list(self.packed["input_ids"].shape),
                "padded_micro_batches": [list(b["input_ids"].shape) for b in self.padded],
                "token_slots": slots,
                "padding_share": {k: 1.0 - self.real_tokens / v for k, v in slots.items()}, **self.settings}


def step_examples(profile: sft_lengths.LengthProfile, rows_per_step: int, row_tokens: int, vocab_size: int,
                  seed: int = 0, src_length: int = 1024) -> tuple[list[dict], list[list[int]]]:
    """The examples of the first `rows_per_step` rows that zero_padding fills from the profile in
    shuffled order (example_order(seed)), truncated by PaddleNLP's rule with max_length = row_tokens
    (zero_padding packs rows of max_length), and those rows as indices into the returned list."""
    if not isinstance(rows_per_step, int) or rows_per_step < 1:
        raise ValueError(f"rows_per_step must be a positive int, got {rows_per_step!r}")
    train_len, _ = profile.train_lengths(src_length, row_tokens)
    order = sft_lengths.example_order(len(train_len), seed)
    rows, taken = [], 0
    # Pack a prefix of the shuffled order large enough to fill the rows (each row holds >= 1 example).
    while len(rows) <= rows_per_step and taken < len(order):
        taken = min(len(order), max(2 * taken, rows_per_step * 64))
        rows = sequential_rows([int(n) for n in train_len[order[:taken]]], row_tokens)
    if len(rows) < rows_per_step:
        raise ValueError(f"profile {profile.name!r} fills only {len(rows)} rows of {row_tokens} tokens, "
                         f"rows_per_step={rows_per_step} asked")
    # A row is complete once the next one has started (more than rows_per_step rows were packed).
    rows = rows[:rows_per_step]
    # sequential rows hold consecutive positions of the order, 0 .. k-1: indices into `examples` too
    chosen = [i for row in rows for i in row]
    examples = sft_lengths.make_examples(profile, order[chosen], vocab_size, seed, src_length, row_tokens)
    return examples, rows


def packed_layout(examples: list[dict], rows: list[list[int]], pad_id: int = 0, flatten: bool = True,
                  pad_to_multiple_of: int | None = None) -> dict:
    """The product's collation of the packed rows (PackedDataset's segments rows through
    packing.collate_packed_rows): flattened to one row [1, tokens] by default, as PackedCollator
    gives the fast path; flatten=False: a row each, right-padded to the longest (the padding its
    own segment, positions 0..); pad_to_multiple_of rounds the tokens up as PackedCollator's does (the
    padding a segment of its own). With the segments' cu_seqlens and lengths (PackedSegments)."""
    out, row_lengths = collate_packed_rows(
        [segments_row([(examples[i]["input_ids"], examples[i]["labels"]) for i in row]) for row in rows],
        pad_id, pad_to_multiple_of, flatten=flatten, ignore_index=sft_lengths.IGNORE_INDEX)
    segments = PackedSegments.from_row_lengths(row_lengths, out["input_ids"].shape[1])
    out["attn_mask_startend_row_indices"] = segments.startend_row_indices()  # as PackedCollator adds it
    out["cu_seqlens"] = segments.cu_seqlens()
    out["segment_lengths"] = list(segments.lengths)
    return out


def flattened_layout(examples: list[dict]) -> dict:
    """DataCollatorWithFlattening's row: every example concatenated, position ids restarting."""
    return {"input_ids": np.concatenate([e["input_ids"] for e in examples])[None],
            "labels": np.concatenate([e["labels"] for e in examples])[None],
            "position_ids": np.concatenate([np.arange(len(e["input_ids"])) for e in examples])[None]}


def build_step(profile_name: str, rows_per_step: int = 4, row_tokens: int = ROW_TOKENS, padded_batch_size: int = 4,
               vocab_size: int = 32000, seed: int = 0, src_length: int = 1024) -> StepBatches:
    if not isinstance(padded_batch_size, int) or padded_batch_size < 1:
        raise ValueError(f"padded_batch_size must be a positive int, got {padded_batch_size!r}")
    profile = sft_lengths.load_profile(profile_name)
    examples, rows = step_examples(profile, rows_per_step, row_tokens, vocab_size, seed, src_length)
    # Every example in some micro-batch (the last one may be smaller): the same work as the others.
    padded = [sft_lengths.pad_to_longest(examples[i:i + padded_batch_size])
              for i in range(0, len(examples), padded_batch_size)]
    settings = {"rows_per_step": rows_per_step, "row_tokens": row_tokens, "padded_batch_size": padded_batch_size,
                "src_length": src_length, "max_length": row_tokens, "seed": seed, "vocab_size": vocab_size,
                "profile_source": profile.source}
    return StepBatches(profile.name, examples, rows, packed_layout(examples, rows), flattened_layout(examples),
                       padded, settings)
