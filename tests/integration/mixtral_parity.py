"""Mixtral's parity rows: the fast path against stock PaddleNLP Mixtral, one forward + backward on the
same batch (loss, auxiliary loss included, and every trainable parameter's gradient), and the
Trainer's first steps. The measurement reuses parity_matrix.py's (data rows, recompute as the
Trainer sets it, relative errors); the model is family.example_config's tiny Mixtral (hidden 64,
4 experts, top-2, 2 layers). The fp8_* rows run the fast side in emulated FP8 (attention and
every expert's linears through Fp8Linear, the router in 16 bits) against stock in fp32.

Stock PaddleNLP 2.8.1's MixtralSparseMoeBlock indexes the routing weights with paddle.where's
[n, 1] index tensors of Paddle 2.x; Paddle 3.x returns 1-D ones and the stock block fails on a
broadcast. The stock reference therefore runs PaddleNLP's code unchanged under Paddle 2.x's
single-argument paddle.where (paddle_2x_where); the fast path needs no such help."""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import paddle

import parity_matrix as pm

SEED, LORA_SEED = 5, 11
EMULATED_FP8 = dict(precision="fp8", fp8_emulate=True)
LORA_TARGETS = [".*q_proj.*", ".*k_proj.*", ".*v_proj.*", ".*o_proj.*", ".*w1.*", ".*w2.*", ".*w3.*"]


@dataclass(frozen=True)
class Row:
    name: str
    model: dict = field(default_factory=dict)  # example_config overrides
    config: dict = field(default_factory=dict)  # from_pretrained overrides (recompute_*)
    recompute: bool = False
    lora: bool = False
    router: str | None = None  # "uneven": a preference order over experts; "idle": the last expert never chosen
    packed: str | None = None  # parity_matrix's packed rows: "dense_mask" both sides, "segments" on the fast side
    fast: dict = field(default_factory=dict)  # FastFFNOptions overrides


ROWS = [
    Row("plain"),
    Row("recompute_full", config=pm.FULL_RECOMPUTE, recompute=True),
    Row("recompute_full_attn", config=dict(pm.FULL_RECOMPUTE, recompute_granularity="full_attn"), recompute=True),
    Row("recompute_core_attn", config=dict(pm.FULL_RECOMPUTE, recompute_granularity="core_attn"), recompute=True),
    Row("lora", lora=True),
    Row("lora_recompute", lora=True, config=pm.FULL_RECOMPUTE, recompute=True),
    Row("top2_uneven_loads", router="uneven"),
    Row("expert_without_tokens", router="idle"),
    Row("expert_without_tokens_recompute", router="idle", config=pm.FULL_RECOMPUTE, recompute=True),
    Row("three_experts", model=dict(num_local_experts=3)),
    Row("packed_dense_mask", packed="dense_mask"),
    # The auxiliary loss counts every token of a row, padding included: the fast side's packed rows
    # have no padding, so this row compares the language-model loss alone.
    Row("packed_segments", packed="segments", model=dict(output_router_logits=False)),
    Row("fp8_delayed", fast=EMULATED_FP8),
    Row("fp8_top2_uneven_loads", router="uneven", fast=EMULATED_FP8),
    Row("fp8_expert_without_tokens", router="idle", fast=EMULATED_FP8),
    Row("fp8_expert_without_tokens_recompute", router="idle", config=pm.FULL_RECOMPUTE, recompute=True,
        fast=EMULATED_FP8),
    Row("fp8_lora", lora=True, fast=EMULATED_FP8),
]
ROWS_BY_NAME = {row.name: row for row in ROWS}


@contextlib.contextmanager
def paddle_2x_where():
    """paddle.where(condition) as Paddle 2.x returns it: a tuple of [n, 1] index tensors."""
    where = paddle.where

    def where_2x(condition, x=None, y=None, name=None):
        if x is None and y is None:
            return tuple(t.reshape([-1, 1]) for t in paddle.nonzero(condition, as_tuple=True))
        return where(condition, x, y, name)

    paddle.where = where_2x
    try:
        yield
    finally:
        paddle.where = where


def model_config(row: Row):
    from paddle_fastffn.integration import mixtral

    return mixtral.example_config(**dict(dict(vocab_size=101), **row.model))


def save_checkpoint(row: Row, path: str) -> str:
    """The seeded stock checkpoint, with the router crafted for the row."""
    from paddlenlp.transformers import MixtralForCausalLM

    import paddle_fastffn

    paddle_fastffn.revert_fast_ffn()
    paddle.seed(SEED)
    model = MixtralForCausalLM(model_config(row))
    if row.router:
        craft_router(model, row.router)
    model.save_pretrained(path)
    return path


def craft_router(model, kind: str) -> None:
    """Routers with a clear preference: logits O(1) apart, so stock and fast pick the same experts.
    "idle": the embedding's dimension 0 is large for every token, and the last expert's gate reads it
    negatively: it never makes the top 2. "uneven": a fixed preference 0 > 1 > 2 > ... through it."""
    config = model.config
    rng = np.random.default_rng(7)
    embedding = rng.standard_normal((config.vocab_size, config.hidden_size)).astype("float32")
    embedding[:, 0] = 3.0
    model.mixtral.embed_tokens.weight.set_value(embedding)
    experts = config.num_local_experts
    for layer in model.mixtral.layers:
        gate = rng.standard_normal((config.hidden_size, experts)).astype("float32") * 0.3
        if kind == "idle":
            gate[:, -1] = 0.0
            gate[0, -1] = -20.0
        else:
            gate[0] = np.linspace(0.6, -0.6, experts)
        layer.block_sparse_moe.gate.weight.set_value(gate)


def expert_loads(router_logits, top_k: int) -> list:
    """Tokens per expert of each layer, from the router logits stock returns."""
    return [np.bincount(paddle.topk(logits, top_k, axis=-1)[1].numpy().ravel(), minlength=logits.shape[-1]).tolist()
            for logits in router_logits]


def build(row: Row, fast: bool, checkpoint: str):
    from paddlenlp.transformers import MixtralForCausalLM

    import paddle_fastffn
    from paddle_fastffn.integration import FastFFNOptions, enable

    paddle_fastffn.revert_fast_ffn()
    if fast:
        enable(FastFFNOptions(**row.fast))  # as use_fast_ffn in the TrainingArguments does
    model = MixtralForCausalLM.from_pretrained(checkpoint, dtype="float32", **row.config)
    if row.lora:
        from paddlenlp.peft import LoRAConfig, LoRAModel

        paddle.seed(LORA_SEED)
        model = LoRAModel(model, LoRAConfig(target_modules=LORA_TARGETS, r=4, lora_alpha=8, merge_weights=False))
        model.mark_only_lora_as_trainable()
    return model


def one_step(row: Row, model, batch) -> dict:
    model.train()
    if row.recompute:
        pm._enable_recompute_as_the_trainer_does(model)
    out = model(**batch, return_dict=True)
    out.loss.backward()
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters()
             if not p.stop_gradient and p.grad is not None}
    trainable = sorted(name for name, p in model.named_parameters() if not p.stop_gradient)
    model.clear_gradients()
    aux = out.aux_loss
    from paddle_fastffn.integration.fp8_attach import fp8_layers

    # Each FP8 linear: whether its input's scaling state recorded an amax (an expert no token reached must not).
    fp8 = {name: fp8.states.input.seeded for name, fp8 in fp8_layers(model).items()}
    return dict(loss=float(out.loss), aux_loss=None if aux is None else float(aux), grads=grads, trainable=trainable,
                router_logits=out.router_logits, fp8=fp8)


def measure(row: Row) -> dict:
    """Stock and fast on the row's batch: losses, gradients, expert loads, the ops the fast side ran."""
    from paddle_fastffn.ops import _loader

    import paddle_fastffn

    cell = pm.Cell(row.name, model=dict(vocab_size=101), packed=row.packed)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(row, os.path.join(tmp, "checkpoint"))
        for side in ("stock", "fast"):
            fast = side == "fast"
            batch = pm.collator_for(cell, fast)(pm.rows_for(cell, fast=fast)[:4])
            if not fast and "attention_mask" in batch and batch["attention_mask"].ndim == 2:
                # Stock's load-balancing loss needs a float 2-D mask on Paddle 3.x; the fast side takes the
                # collator's int64 one.
                batch["attention_mask"] = batch["attention_mask"].astype("float32")
            with paddle.utils.unique_name.guard(), (contextlib.nullcontext() if fast else paddle_2x_where()):
                calls_before = dict(_loader.CALL_COUNTS)
                model = build(row, fast, checkpoint)
                result[side] = one_step(row, model, batch)
                result[side]["kernel_calls"] = {k for k, v in _loader.CALL_COUNTS.items() if v - calls_before.get(k, 0)}
        paddle_fastffn.revert_fast_ffn()
    stock, fast = result["stock"], result["fast"]
    errors = pm._relative_errors(fast["grads"], {k: v for k, v in stock["grads"].items() if k in fast["grads"]})
    worst = max(errors, key=lambda n: errors[n][0]) if errors else None
    worst_norm = max(errors, key=lambda n: errors[n][1]) if errors else None
    top_k = model_config(row).num_experts_per_tok
    return dict(row=row.name, loss_stock=stock["loss"], loss_fast=fast["loss"],
                loss_rel=abs(fast["loss"] - stock["loss"]) / abs(stock["loss"]),
                aux_stock=stock["aux_loss"], aux_fast=fast["aux_loss"],
                trainable_stock=stock["trainable"], trainable_fast=fast["trainable"],
                grads_stock=sorted(stock["grads"]), grads_fast=sorted(fast["grads"]),
                grad_max_rel=errors[worst][0] if worst else 0.0, grad_max_rel_param=worst,
                grad_norm_rel=errors[worst_norm][1] if worst_norm else 0.0, grad_norm_rel_param=worst_norm,
                fp8_fast=fast["fp8"], fp8_stock=stock["fp8"],
                loads=expert_loads(stock["router_logits"], top_k) if stock["router_logits"] else None,
                kernel_calls_fast=sorted(fast["kernel_calls"]), kernel_calls_stock=sorted(stock["kernel_calls"]))
