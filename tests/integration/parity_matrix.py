"""The gradient-parity matrix: the fast path against stock PaddleNLP under the switches users combine.

Each cell builds a tiny LLaMA the way a user does (TrainingArguments with `use_fast_ffn` first, then
`from_pretrained` of a stock checkpoint; or stock first and `apply_fast_ffn_to_llama(model)` after),
beside the same checkpoint loaded in stock PaddleNLP, and measures:
- one forward+backward on the same batch: every trainable parameter has a gradient where stock has
  one; the fast model's fused gradients are split into the stock parts they hold by PaddleNLP's own
  split mappings (convert_fuse_and_split) and compared name by name;
- a few optimizer steps of PaddleNLP's Trainer on both: the logged per-step losses.

The model sizes are awkward on purpose (6 query heads over 2 KV heads, head_dim 10, intermediate 92,
vocab 101); FP8 cells use an FP8-aligned variant. `python -m tests.integration.parity_matrix --out F`
writes every cell's measured worst errors as JSON (the figures quoted in notes come from there);
tests/integration/test_parity_matrix.py asserts them against tests/tolerances.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
import paddle

AWKWARD = dict(vocab_size=101, hidden_size=60, intermediate_size=92, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
# FP8 GEMMs need every weight width a multiple of 16 (fp8/linear.py FP8_ALIGNMENT).
FP8_ALIGNED = dict(AWKWARD, vocab_size=128, hidden_size=64, intermediate_size=176, num_attention_heads=4)
EMULATED_FP8 = dict(fast_ffn_precision="fp8", fast_ffn_fp8_emulate=True)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_use_reentrant=False)

SEQ, EXAMPLES, STEPS = 16, 16, 3
INT8_STEPS = 4
LORA_SEED, MODEL_SEED = 11, 5


@dataclass(frozen=True)
class Cell:
    name: str
    model: dict = field(default_factory=lambda: AWKWARD)  # LlamaConfig of the checkpoint
    config: dict = field(default_factory=dict)  # from_pretrained config overrides (recompute_*)
    recompute: bool = False  # TrainingArguments.recompute: the Trainer sets enable_recompute
    fast: dict = field(default_factory=dict)  # fast_ffn_* TrainingArguments fields
    patch_after: bool = False  # stock model first, apply_fast_ffn_to_llama(model) after
    lora: bool = False
    # PaddleNLP zero_padding rows, position ids restarting: "dense_mask" (its 4-D block-causal mask on
    # both sides) or "segments" (the fast side gets the examples' boundaries, as our script hands them)
    packed: str | None = None
    batch_size: int = 4
    grad_accum: int = 1
    # LM head tied to the input embedding, [V, H] used transposed (tie_weights() after loading)
    tied: bool = False
    # Trainer steps logged: step k's loss shows updates 1..k-1 (8-bit cells: two updates that read
    # the moments back from their stored 8-bit state; tolerances.py says why not more)
    steps: int = STEPS
    # False: rows without attention_mask or position_ids (PaddleNLP's llm collator for unpacked SFT;
    # the right padding is ignored through the labels): the fast path implies the causal mask and
    # the positions instead of building them (integration/llama.py CAUSAL_MASK, IMPLICIT_POSITIONS)
    attention_mask: bool = True

    @property
    def fp8(self) -> bool:
        return self.fast.get("fast_ffn_precision") == "fp8"

    @property
    def int8_moments(self) -> bool:
        return int8_moments(self.fast)

    @property
    def fp8_head(self) -> bool:
        return self.fp8 and self.fast.get("fast_ffn_fp8_lm_head") == "fp8"


def int8_moments(fast_arguments: dict) -> bool:
    """Whether these fast_ffn_* arguments ask FastAdamW for 8-bit moments."""
    return fast_arguments.get("fast_ffn_optimizer_moments") == "int8"


CELLS = [
    Cell("default"),
    Cell("recompute_full_nonreentrant", config=FULL_RECOMPUTE, recompute=True),
    Cell("recompute_full_reentrant", config=dict(FULL_RECOMPUTE, recompute_use_reentrant=True), recompute=True),
    Cell("recompute_full_attn", config=dict(FULL_RECOMPUTE, recompute_granularity="full_attn"), recompute=True),
    Cell("recompute_core_attn", config=dict(FULL_RECOMPUTE, recompute_granularity="core_attn"), recompute=True),
    Cell("recompute_no_recompute_layers", config=dict(FULL_RECOMPUTE, no_recompute_layers=[1]), recompute=True),
    Cell("unfused_projections", fast=dict(fast_ffn_fuse_projections=False)),
    Cell("unfused_projections_recompute", config=FULL_RECOMPUTE, recompute=True,
         fast=dict(fast_ffn_fuse_projections=False)),
    Cell("patched_after_build", patch_after=True),
    Cell("patched_after_build_recompute", patch_after=True, config=FULL_RECOMPUTE, recompute=True),
    Cell("lora", lora=True),
    Cell("lora_recompute", lora=True, config=FULL_RECOMPUTE, recompute=True),
    Cell("zero_padding", packed="dense_mask"),
    Cell("zero_padding_recompute", packed="dense_mask", config=FULL_RECOMPUTE, recompute=True),
    Cell("zero_padding_segments", packed="segments"),
    Cell("zero_padding_segments_recompute", packed="segments", config=FULL_RECOMPUTE, recompute=True),
    Cell("grad_accumulation_4", batch_size=1, grad_accum=4),
    Cell("tied_embeddings", tied=True),
    Cell("fused_cross_entropy_off", fast=dict(fast_ffn_fused_cross_entropy=False)),
    Cell("fast_adamw_off", fast=dict(fast_ffn_fused_optimizer=False)),
    # 8-bit blockwise moments on every tensor of at least 4096 elements (here the embedding, the LM
    # head, the fused qkv and gate_up and down_proj; o_proj's 3600 and the norms keep fp32 moments);
    # the first gradient is the default path's, the Trainer's losses move by the moments' quantisation.
    # (master_weights="compensated" replaces the fp32 master of 16-bit weights: this fp32 matrix has
    # none; tests/optim/test_adamw_low_memory.py and tests/integration/test_resume.py cover it in bf16.)
    Cell("optimizer_int8_moments", steps=INT8_STEPS, fast=dict(fast_ffn_optimizer_moments="int8")),
    Cell("optimizer_int8_moments_grad_accumulation_4", batch_size=1, grad_accum=4, steps=INT8_STEPS,
         fast=dict(fast_ffn_optimizer_moments="int8")),
    Cell("swiglu_recompute_off", fast=dict(fast_ffn_swiglu_recompute=False)),
    Cell("no_mask", attention_mask=False),
    Cell("no_mask_recompute_full_reentrant", attention_mask=False, config=dict(FULL_RECOMPUTE, recompute_use_reentrant=True),
         recompute=True),
    Cell("no_mask_recompute_core_attn", attention_mask=False,
         config=dict(FULL_RECOMPUTE, recompute_granularity="core_attn"), recompute=True),
    Cell("no_mask_lora_recompute", attention_mask=False, lora=True, config=FULL_RECOMPUTE, recompute=True),
    Cell("fp8_delayed", model=FP8_ALIGNED, fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="delayed")),
    Cell("fp8_current", model=FP8_ALIGNED, fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="current")),
    Cell("fp8_delayed_recompute", model=FP8_ALIGNED, config=FULL_RECOMPUTE, recompute=True,
         fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="delayed")),
    Cell("fp8_current_lora", model=FP8_ALIGNED, lora=True, fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="current")),
    # The LM head's GEMMs in FP8 too: trained ([H, V] and tied [V, H] layouts) and frozen under LoRA
    # (its input gradient alone).
    Cell("fp8_delayed_fp8_head", model=FP8_ALIGNED,
         fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="delayed", fast_ffn_fp8_lm_head="fp8")),
    Cell("fp8_delayed_fp8_head_tied", model=FP8_ALIGNED, tied=True,
         fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="delayed", fast_ffn_fp8_lm_head="fp8")),
    Cell("fp8_current_lora_fp8_head", model=FP8_ALIGNED, lora=True,
         fast=dict(EMULATED_FP8, fast_ffn_fp8_scaling="current", fast_ffn_fp8_lm_head="fp8")),
]
CELLS_BY_NAME = {cell.name: cell for cell in CELLS}


# --- data ------------------------------------------------------------------------------------------

def _examples(vocab: int):
    """EXAMPLES (prompt, answer) token lists of mixed lengths (3..13 tokens in all)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(EXAMPLES):
        prompt, answer = int(rng.integers(1, 6)), int(rng.integers(2, 8))
        out.append((rng.integers(3, vocab, prompt).tolist(), rng.integers(3, vocab, answer).tolist()))
    return out


def _padded_row(prompt, answer):
    """PaddleNLP's SFT example, right-padded to SEQ: labels on the answer only (shifted by one)."""
    ids = prompt + answer
    labels = [-100] * len(prompt) + answer
    inputs, targets = ids[:-1], labels[1:]
    pad = SEQ - len(inputs)
    return {"input_ids": np.array(inputs + [0] * pad, dtype="int64"),
            "labels": np.array(targets + [-100] * pad, dtype="int64"),
            "attention_mask": np.array([1] * len(inputs) + [0] * pad, dtype="int64")}


def _packed_rows(examples, segments: bool = False):
    """PaddleNLP's zero_padding rows (InTokensMapDataset + its collator): examples concatenated into
    rows of up to SEQ tokens, position ids restarting per example, a [1, SEQ, SEQ] block-causal mask
    that keeps examples apart (padding attends to nothing but itself). segments: the fast side's
    rows as our script's PackedDataset gives them (packing.segments_row: the examples' boundaries,
    no padding, no mask), collated by the product's PackedCollator (collator_for): a batch's rows
    flattened into one row, the layout `use_fast_ffn` trains packed SFT on."""
    from paddle_fastffn.finetune.packing import segments_row

    rows, current = [], []
    for prompt, answer in examples:
        if sum(len(p) + len(a) - 1 for p, a in current) + len(prompt) + len(answer) - 1 > SEQ:
            rows.append(current)
            current = []
        current.append((prompt, answer))
    rows.append(current)
    out = []
    for row in rows:
        members = []
        for prompt, answer in row:
            example = _padded_row(prompt, answer)
            n = int(example["attention_mask"].sum())
            members.append((example["input_ids"][:n].tolist(), example["labels"][:n].tolist()))
        if segments:
            out.append(segments_row(members))
            continue
        ids, labels, positions = [], [], []
        mask = np.zeros((SEQ, SEQ), dtype="bool")
        for member_ids, member_labels in members:
            n, start = len(member_ids), len(ids)
            mask[start:start + n, start:start + n] = np.tril(np.ones((n, n), dtype="bool"))
            ids += member_ids
            labels += member_labels
            positions += list(range(n))
        for i in range(len(ids), SEQ):
            mask[i, i] = True
        pad = SEQ - len(ids)
        out.append({"input_ids": np.array(ids + [0] * pad, dtype="int64"),
                    "labels": np.array(labels + [-100] * pad, dtype="int64"),
                    "position_ids": np.array(positions + list(range(pad)), dtype="int64"),
                    "attention_mask": mask[None]})
    return out


def rows_for(cell: Cell, fast: bool = False) -> list[dict]:
    examples = _examples(cell.model["vocab_size"])
    if cell.packed:
        return _packed_rows(examples, segments=fast and cell.packed == "segments")
    rows = [_padded_row(p, a) for p, a in examples]
    if not cell.attention_mask:
        rows = [{k: v for k, v in row.items() if k != "attention_mask"} for row in rows]
    return rows


def collate(features):
    return {key: paddle.to_tensor(np.stack([f[key] for f in features])) for key in features[0]}


def collator_for(cell: Cell, fast: bool):
    """The fast side of a segments cell: the product's PackedCollator with its defaults (the batch's
    rows flattened into one row, as scripts/run_finetune.py collates packed SFT); else stacking."""
    if fast and cell.packed == "segments":
        from paddle_fastffn.finetune.packing import PackedCollator

        return PackedCollator(pad_token_id=0)
    return collate


# --- models ----------------------------------------------------------------------------------------

_CHECKPOINTS: dict = {}


def stock_checkpoint_dir(model_config: dict) -> str:
    """A stock PaddleNLP checkpoint of the seeded model (saved once per config in this process)."""
    key = json.dumps(model_config, sort_keys=True)
    if key not in _CHECKPOINTS:
        _CHECKPOINTS[key] = save_stock_checkpoint(model_config, tempfile.mkdtemp(prefix="parity_ckpt_"))
    return _CHECKPOINTS[key]


def save_stock_checkpoint(model_config: dict, path: str) -> str:
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    paddle.seed(MODEL_SEED)
    LlamaForCausalLM(LlamaConfig(**model_config)).save_pretrained(path)
    return path


def _training_args(cell: Cell, fast: bool, output_dir: str):
    from paddlenlp.trainer import PdArgumentParser, TrainingArguments

    from paddle_fastffn import FastFFNTrainingArguments

    values = dict(output_dir=output_dir, max_steps=cell.steps, per_device_train_batch_size=cell.batch_size,
                  gradient_accumulation_steps=cell.grad_accum, learning_rate=3e-3, weight_decay=0.01,
                  max_grad_norm=1.0, logging_steps=1, report_to="none", device="cpu", disable_tqdm=True,
                  save_strategy="no", seed=42, lr_scheduler_type="constant", recompute=cell.recompute, dataloader_num_workers=0)
    if fast and not cell.patch_after:
        values.update(use_fast_ffn=True, **cell.fast)
        return PdArgumentParser((FastFFNTrainingArguments,)).parse_dict(values)[0]
    return PdArgumentParser((TrainingArguments,)).parse_dict(values)[0]


def lora_targets(config) -> list[str]:
    """The targets PaddleNLP's llm script picks (get_lora_target_modules): fused names where the
    config fuses its projections."""
    attn = [".*qkv_proj.*"] if config.fuse_attention_qkv else [".*q_proj.*", ".*k_proj.*", ".*v_proj.*"]
    mlp = [".*gate_up_fused_proj.*"] if config.fuse_attention_ffn else [".*gate_proj.*", ".*up_proj.*"]
    return attn + [".*o_proj.*"] + mlp + [".*down_proj.*"]


def build(cell: Cell, fast: bool, output_dir: str):
    """(TrainingArguments, model) in the order a user creates them."""
    from paddlenlp.transformers import LlamaForCausalLM

    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    args = _training_args(cell, fast, output_dir)  # use_fast_ffn enables the fast path here
    model = LlamaForCausalLM.from_pretrained(stock_checkpoint_dir(cell.model), dtype="float32", **cell.config)
    if fast and cell.patch_after:
        fast_kwargs = {k[len("fast_ffn_"):]: v for k, v in cell.fast.items()}
        paddle_fastffn.apply_fast_ffn_to_llama(model, **fast_kwargs)
    if cell.tied:
        tie_embeddings(model, stock_reference=not fast)
    if cell.lora:
        from paddlenlp.peft import LoRAConfig, LoRAModel

        paddle.seed(LORA_SEED)  # the same adapters on both sides (drawn after seeding)
        model = LoRAModel(model, LoRAConfig(target_modules=lora_targets(model.config), r=4, lora_alpha=8,
                                            merge_weights=False))
        model.mark_only_lora_as_trainable()
    return args, model


class TransposedTiedHead(paddle.nn.Layer):
    """The tied head's meaning, hidden @ E^T (PaddleNLP's later LlamaLMHead(transpose_y=True)): the
    stock reference for tied embeddings, since PaddleNLP 2.8.1's own LlamaLMHead multiplies by the
    [V, H] embedding untransposed after tie_weights() and fails on any V != H."""

    def __init__(self, embedding_weight):
        super().__init__()
        self.weight = embedding_weight

    def forward(self, hidden_states, tensor_parallel_output=None):
        return paddle.matmul(hidden_states, self.weight, transpose_y=True)


def tie_embeddings(model, stock_reference: bool) -> None:
    """tie_weights() as a 2.8.1 user calls it (the head's weight becomes the embedding); the stock
    reference computes the tied meaning through TransposedTiedHead."""
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.llama.embed_tokens.weight
    if stock_reference:
        model.lm_head = TransposedTiedHead(model.llama.embed_tokens.weight)


def _enable_recompute_as_the_trainer_does(model) -> None:
    def enable(layer):
        if getattr(layer, "enable_recompute", None) is False:
            layer.enable_recompute = True
    model.apply(enable)


def _stock_named(model, grads: dict) -> dict:
    """Gradients keyed as stock PaddleNLP names them: fused projections split by PaddleNLP's own
    split mappings (its checkpoint conversion), the parts under the stock sub-layer names."""
    base = getattr(model, "model", model)  # LoRAModel wraps the LlamaForCausalLM
    config = copy.deepcopy(base.config)
    if not (config.fuse_attention_qkv or config.fuse_attention_ffn):
        return grads
    prefix = "model." if base is not model else ""
    inner = {k[len(prefix):]: v for k, v in grads.items()}
    config.fuse_attention_qkv = config.fuse_attention_ffn = False
    split, _ = type(base).convert_fuse_and_split(config, inner)
    return {prefix + k: v for k, v in split.items()}


def one_step_gradients(cell: Cell, model, rows, collator=collate) -> tuple[float, dict]:
    model.train()
    if cell.recompute:
        _enable_recompute_as_the_trainer_does(model)
    batch = collator(rows[: cell.batch_size * cell.grad_accum])
    out = model(**batch)
    loss = out[0] if isinstance(out, tuple) else out.loss
    loss.backward()
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()
             if not p.stop_gradient and p.grad is not None}
    trainable = {name: np.zeros(p.shape, "float32") for name, p in model.named_parameters() if not p.stop_gradient}
    model.clear_gradients()
    return float(loss), _stock_named(model, grads), _stock_named(model, trainable).keys()


def innermost_optimizer(optimizer):
    """The optimizer that updates the parameters, inside fleet's HybridParallelOptimizer and
    DygraphShardingOptimizer wrappers."""
    while hasattr(optimizer, "_inner_opt"):
        optimizer = optimizer._inner_opt
    return optimizer


def quantized_moments(optimizer) -> int:
    """How many 8-bit moments (FastAdamW moments="int8") the optimizer holds: 0 for fp32 state."""
    return sum(len(moments) for moments in getattr(innermost_optimizer(optimizer), "_quantized_moments", {}).values())


def trainer_losses(args, model, rows, collator=collate) -> tuple[list[float], str, int]:
    """The Trainer's logged losses, its optimizer's class and how many 8-bit moments it held."""
    from paddlenlp.trainer import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
    trainer.train()
    return ([entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            type(innermost_optimizer(trainer.optimizer)).__name__, quantized_moments(trainer.optimizer))


# --- tensor parallel: the shard math, two ranks simulated in one process ----------------------------

def tensor_parallel_comparisons(ranks: int = 2) -> list:
    """Each rank of PaddleNLP's tensor-parallel LLaMA holds its column shard of gate_up_fused_proj
    ([gate_i | up_i], split by PaddleNLP's own tensor-parallel mappings) and its row shard of
    down_proj; the fused path applies SwiGLU to the rank's own shard (ops.swiglu_down_proj, SwiGLU
    recomputed in backward). Returns (what, actual, expected, rows reduced) for: the ranks' outputs
    summed (the row-parallel all-reduce) against the full FFN's output, d_x summed likewise, and each
    rank's weight gradients against the slices of the full FFN's (stock math: PaddleNLP's LlamaMLP)."""
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    from paddle_fastffn import ops

    hidden, inter, tokens = AWKWARD["hidden_size"], AWKWARD["intermediate_size"], 37
    rng = np.random.default_rng(3)
    x_np = rng.standard_normal((tokens, hidden)).astype("float32")
    gate_np, up_np = (rng.standard_normal((hidden, inter)).astype("float32") * 0.1 for _ in range(2))
    down_np = rng.standard_normal((inter, hidden)).astype("float32") * 0.1
    dy_np = rng.standard_normal((tokens, hidden)).astype("float32")

    def leaf(a):
        t = paddle.to_tensor(a)
        t.stop_gradient = False
        return t

    x, gate, up, down = map(leaf, (x_np, gate_np, up_np, down_np))
    y = paddle.matmul(paddle.nn.functional.silu(x @ gate) * (x @ up), down)
    y.backward(paddle.to_tensor(dy_np))

    fused_full = np.concatenate([gate_np, up_np], axis=-1)  # the single-card fused layout [gate | up]
    shard = inter // ranks
    out, y_sum, dx_sum = [], 0.0, 0.0
    for rank in range(ranks):
        config = LlamaConfig(**dict(AWKWARD, num_hidden_layers=1), fuse_attention_ffn=True,
                             tensor_parallel_degree=ranks, tensor_parallel_rank=rank)
        actions = LlamaForCausalLM._get_tensor_parallel_mappings(config, is_split=True)
        gate_up_rank = actions["layers.0.mlp.gate_up_fused_proj.weight"](fused_full)
        down_rank = actions["layers.0.mlp.down_proj.weight"](down_np)
        cols = slice(rank * shard, (rank + 1) * shard)
        if not np.array_equal(gate_up_rank, np.concatenate([gate_np[:, cols], up_np[:, cols]], -1)):
            raise AssertionError(f"rank {rank}: PaddleNLP's split of gate_up_fused_proj is not [gate_i | up_i]")
        xr, w_gate_up, w_down = leaf(x_np), leaf(gate_up_rank), leaf(down_rank)
        y_rank = ops.swiglu_down_proj(paddle.matmul(xr, w_gate_up), w_down)
        y_rank.backward(paddle.to_tensor(dy_np))  # the all-reduce's backward hands every rank dy
        y_sum, dx_sum = y_sum + y_rank.numpy(), dx_sum + xr.grad.numpy()
        d_gate_up = w_gate_up.grad.numpy()
        out += [(f"rank {rank} d_gate", d_gate_up[:, :shard], gate.grad.numpy()[:, cols], tokens),
                (f"rank {rank} d_up", d_gate_up[:, shard:], up.grad.numpy()[:, cols], tokens),
                (f"rank {rank} d_down", w_down.grad.numpy(), down.grad.numpy()[cols], tokens)]
    return [("all-reduced output", y_sum, y.numpy(), inter), ("all-reduced d_x", dx_sum, x.grad.numpy(), inter)] + out


# --- the measurement -------------------------------------------------------------------------------

def _relative_errors(grads: dict, ref: dict):
    """{name: (max |g - ref| / max |ref|, ||g - ref|| / ||ref||)}."""
    out = {}
    for name, expected in ref.items():
        scale = float(np.abs(expected).max()) or 1.0
        diff = np.asarray(grads[name], dtype=np.float64) - expected
        norm = float(np.linalg.norm(expected)) or 1.0
        out[name] = (float(np.abs(diff).max()) / scale, float(np.linalg.norm(diff)) / norm)
    return out


def measure(cell: Cell) -> dict:
    """Runs `cell` stock and fast; returns what the test asserts and the results file records."""
    from helpers import fp8_heads_made
    from paddle_fastffn.ops import _loader

    import paddle_fastffn

    with tempfile.TemporaryDirectory() as tmp:
        result = {}
        for side in ("stock", "fast"):
            rows = rows_for(cell, fast=side == "fast")
            with paddle.utils.unique_name.guard():
                calls_before = dict(_loader.CALL_COUNTS)
                args, model = build(cell, side == "fast", os.path.join(tmp, side))
                with _counting_causal_mask_checks(side == "fast") as mask_checks, fp8_heads_made() as fp8_heads:
                    collator = collator_for(cell, side == "fast")
                    loss, grads, trainable = one_step_gradients(cell, model, rows, collator)
                    losses, optimizer, quantized = trainer_losses(args, model, rows, collator)
                calls = {k: v - calls_before.get(k, 0) for k, v in _loader.CALL_COUNTS.items()
                         if v - calls_before.get(k, 0)}
                result[side] = dict(loss=loss, grads=grads, trainable=set(trainable), losses=losses,
                                    optimizer=optimizer, quantized_moments=quantized, kernel_calls=calls,
                                    mask_checks=mask_checks[0], fp8_heads=len(fp8_heads))
        paddle_fastffn.revert_fast_ffn()
    stock, fast = result["stock"], result["fast"]
    errors = _relative_errors(fast["grads"], {k: v for k, v in stock["grads"].items() if k in fast["grads"]})
    worst_max = max(errors, key=lambda n: errors[n][0]) if errors else None
    worst_norm = max(errors, key=lambda n: errors[n][1]) if errors else None
    steps = np.array(stock["losses"], dtype=np.float64)
    return dict(
        cell=cell.name,
        trainable_stock=sorted(stock["trainable"]), trainable_fast=sorted(fast["trainable"]),
        grads_stock=sorted(stock["grads"]), grads_fast=sorted(fast["grads"]),
        zero_grads_fast=sorted(n for n, g in fast["grads"].items() if not np.any(g) and np.any(stock["grads"].get(n, 0))),
        loss_rel=abs(fast["loss"] - stock["loss"]) / abs(stock["loss"]),
        grad_max_rel=errors[worst_max][0] if worst_max else 0.0, grad_max_rel_param=worst_max,
        grad_norm_rel=errors[worst_norm][1] if worst_norm else 0.0, grad_norm_rel_param=worst_norm,
        step_losses_stock=stock["losses"], step_losses_fast=fast["losses"],
        step_loss_rel=float(np.max(np.abs(np.array(fast["losses"]) - steps) / np.abs(steps))) if len(steps) else None,
        optimizer_stock=stock["optimizer"], optimizer_fast=fast["optimizer"],
        quantized_moments_stock=stock["quantized_moments"], quantized_moments_fast=fast["quantized_moments"],
        kernel_calls_fast=fast["kernel_calls"], kernel_calls_stock=stock["kernel_calls"],
        causal_mask_checks_fast=fast["mask_checks"],
        fp8_head_calls_fast=fast["fp8_heads"], fp8_head_calls_stock=stock["fp8_heads"],
        fp8=cell.fp8,
    )


@contextlib.contextmanager
def _counting_causal_mask_checks(fast: bool):
    """[count] of the fast side's calls to PaddleNLP's is_casual_mask (a reduction of the built
    [b, 1, s, s] mask and a read to the host): none where the fast path implied the mask."""
    count = [0]
    if not fast:
        yield count
        return
    from paddle_fastffn.integration.registry import family_state

    originals = family_state("llama").originals
    original = originals["is_casual_mask"]

    def counted(mask):
        count[0] += 1
        return original(mask)

    originals["is_casual_mask"] = counted
    try:
        yield count
    finally:
        originals["is_casual_mask"] = original


LAUNCH_MODES = ("dp", "sharding1", "sharding2", "sharding1_int8_moments")
# fast_ffn_* arguments of a launch's fast side only, by mode (parity_launch.py's MODES set both sides'):
# each rank's FastAdamW keeps 8-bit moments of the parameters its sharding stage assigns it.
LAUNCH_FAST_ARGUMENTS = {"sharding1_int8_moments": dict(fast_ffn_optimizer_moments="int8")}


def launch_steps(mode: str) -> int:
    return INT8_STEPS if int8_moments(LAUNCH_FAST_ARGUMENTS.get(mode, {})) else STEPS
# Paddle 3.3.1's group-sharded (stage 2/3) optimizer asserts a GPU, XPU or custom device at setup.
CPU_UNSUPPORTED = "group_sharded_parallel only support gpu, xpu and custom_device"


def launch(mode: str, work_dir: str) -> dict:
    """Runs parity_launch.py on two CPU ranks (paddle.distributed.launch, gloo). Returns
    {"ranks": [each rank's stock and fast runs]} or {"unsupported": why, "log": ...} when Paddle
    refuses the mode on this device, or {"error": ...}."""
    from tests.integration.distributed_launch import run_launch

    save_stock_checkpoint(AWKWARD, os.path.join(work_dir, "checkpoint"))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parity_launch.py")
    run, worker_logs = run_launch([script, mode, work_dir], os.path.join(work_dir, "log"), cwd=work_dir)
    logs = "".join(worker_logs.values())
    if run.returncode != 0:
        if CPU_UNSUPPORTED in logs:
            return {"unsupported": f"Paddle's CPU build refuses it: {CPU_UNSUPPORTED!r}"}
        return {"error": (run.stdout + run.stderr)[-3000:] + logs[-3000:]}
    ranks = []
    for rank in range(2):
        with open(os.path.join(work_dir, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    return {"ranks": ranks}


def launch_loss_rel(result: dict) -> float:
    return max(float(np.max(np.abs(np.array(r["fast"]["losses"]) - r["stock"]["losses"]) / np.abs(r["stock"]["losses"])))
               for r in result["ranks"])


def main(argv=None) -> None:
    import argparse
    import datetime
    import platform

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cells", nargs="*", default=[c.name for c in CELLS])
    parser.add_argument("--launch", nargs="*", default=list(LAUNCH_MODES))
    options = parser.parse_args(argv)
    import paddlenlp

    rows = []
    for name in options.cells:
        r = measure(CELLS_BY_NAME[name])
        rows.append({k: r[k] for k in ("cell", "fp8", "loss_rel", "grad_max_rel", "grad_max_rel_param",
                                        "grad_norm_rel", "grad_norm_rel_param", "step_loss_rel",
                                        "optimizer_stock", "optimizer_fast", "quantized_moments_fast")})
        print(json.dumps(rows[-1]), flush=True)
    tp = tensor_parallel_comparisons()
    rows.append({"cell": "tensor_parallel_2_ranks_simulated", "fp8": False,
                 "grad_max_rel": max(float(np.abs(a - e).max() / np.abs(e).max()) for _, a, e, _ in tp)})
    print(json.dumps(rows[-1]), flush=True)
    for mode in options.launch:
        with tempfile.TemporaryDirectory() as tmp:
            result = launch(mode, tmp)
        row = {"cell": f"launch_{mode}", "fp8": False}
        row.update({"step_loss_rel": launch_loss_rel(result)} if "ranks" in result else result)
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    with open(options.out, "w") as f:
        json.dump({"command": "python -m tests.integration.parity_matrix " + " ".join(sys.argv[1:]),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                   "versions": {"paddle": paddle.__version__, "paddlenlp": paddlenlp.__version__,
                                "python": platform.python_version()},
                   "cells": rows}, f, indent=1)


if __name__ == "__main__":
    main()
