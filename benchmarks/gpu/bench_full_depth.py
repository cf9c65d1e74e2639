"""The user's fine-tuning job on one GPU: LLaMA-2-7B (or Llama-3-8B) at full depth, on real SFT lengths
packed as the product's collator packs them, LoRA and full fine-tune, every contender in the same run
(benchmarks/full_depth.py holds the plan, the FLOP counts and the out-of-memory report, tested
without torch):

    python3 -m benchmarks.gpu.bench_full_depth --out full_depth.json [--workloads lora,full]
        [--data gsm8k,oasst1_zh,uniform] [--model llama2_7b|llama3_8b] [--rows-per-step 1]
        [--accumulation 1] [--contenders ours,ours_fp8_delayed,...]

Data (--data):
  gsm8k, oasst1_zh  a step is the examples of the first --rows-per-step rows of 4096 tokens that
      PaddleNLP's zero_padding rule fills from the real length profile (benchmarks/sft_packed_steps.py:
      random ids at the real lengths, labels on the responses). ours* train them as the product's
      collator gives them (collate_packed_rows, flattened to one row, cu_seqlens, restarting
      positions; attention one varlen flash call, paddle_fastffn.torch.llama.packed_attention). The Hugging Face
      peers as their users run them: *_padding_free on one flattened row with restarting positions
      and the collator's cu_seq_lens (DataCollatorWithFlattening, Hugging Face's flash-attention
      padding-free path over the same varlen kernel: hf_varlen_attention), *_padded on micro-batches of
      --padded-batch-size examples padded to their longest (sdpa, gradient accumulation, the step's
      labelled tokens as num_items_in_batch). Every contender trains the same examples, ids and
      labels, so labelled tokens/s compare step times.
  uniform  one row of 4096 random tokens (labels the ids shifted), the Hugging Face peer on sdpa.

Workloads:
lora  LoRA rank 8, alpha 16, on q/k/v/o/gate/up/down, every base weight frozen in bf16.
      ours: FastLlama(lora=) running LLAMA_DECODER_LAYER_UNFUSED, what the Paddle path runs under
      PaddleNLP's LoRAModel (unfuse_for_lora: unfused q/k/v and gate/up, each a LoRALinear, the
      two-input SwiGLU, a LoRA down_proj); ours_fp8_delayed / ours_fp8_current: the same with each
      projection's frozen base GEMM in FP8 (Paddle's attach_fp8 gives each LoRALinear an Fp8Linear;
      the recipe's delayed or current scaling), adapters in bf16. hf_liger_peft*: Hugging Face's
      LlamaForCausalLM patched by Liger, adapters placed by PEFT's get_peft_model (LoraConfig r=8,
      lora_alpha=16, no dropout; adapters kept in bf16, autocast_adapter_dtype=False, as ours are).
full  full fine-tune: ours, ours_fp8_delayed and ours_fp8_current (FastLlama, the fused list and the
      FP8 list) against hf_liger*.
Every contender steps the one-pass master-weight AdamW kernel (paddle_fastffn.torch.llama.FusedMasterAdamW: fp32
masters and moments of the trainable parameters), lr 1e-5, weight decay 0.01, no clipping.

Weights: random, Hugging Face's initialisation (LlamaForCausalLM(config) after torch.manual_seed(0),
the same weights for every contender; ours copies them), so the first step's loss must agree across
contenders (reported).

Whole models with optimizer state do not fit side by side, so the step is timed round-robin over
rebuilt contenders (bench_gpu.round_robin_rebuilt): each round builds, warms up (2 steps), times (5
steps, CUDA events) and frees every contender once, in an order rotated by one per round, 3 rounds;
each figure is the median over rounds of each round's median (spread over rounds). Peak memory:
torch.cuda.max_memory_allocated over one more step after reset_peak_memory_stats (weights, optimizer
state, gradients and activations). A workload whose persistent state (weights, gradients, masters,
moments: full_depth.persistent_state_bytes) exceeds the GPU's memory is not built: its rows say by
how much. A configuration that runs out of memory reports what it asked for against what was free;
where memory needs it, a contender is rebuilt with full recompute per decoder layer (Hugging Face's
gradient checkpointing; FastLlama(layer_recompute=True) for ours in bf16) and the row says so and
why.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import sys
import time
import traceback

import torch

from benchmarks import full_depth as plan
from benchmarks.common import MIN_REPEATS, compare
from benchmarks.gpu.bench_gpu import environment, liger_patched, round_robin_rebuilt
from benchmarks.gpu.bench_step import fused_master_adamw, hf_config, measure_training, new_hf_model


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def random_batch(shape, device="cuda"):
    """Random ids (seeded apart from the weights) and their shifted labels."""
    from paddle_fastffn.torch.llama import shift_labels

    generator = torch.Generator(device=device).manual_seed(1234)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device, generator=generator)
    return ids, shift_labels(ids)


FP8_TOKEN_MULTIPLE = 16


class StepData:
    """One step's work in every layout a contender trains: `uniform` (ids, labels [batch, seq]) or a
    packed SFT step (sft_packed_steps.StepBatches: the product's flattened packed row with its
    cu_seqlens and positions, the flattened row with the collator's flash kwargs, the padded
    micro-batches), with the tokens each step computes and the labelled tokens its loss averages."""

    def __init__(self, name, shape, args, device="cuda"):
        self.name = name
        if name == "uniform":
            self.ids, self.labels = random_batch(shape, device)
            self.tokens = shape["batch"] * shape["seq"]
            self.labelled_tokens = int((self.labels != -100).sum())  # each row's last position has no label
            self.summary = {"layout": f"{shape['batch']} x {shape['seq']} random tokens"}
            return
        from benchmarks.gpu import hf_varlen_attention
        from benchmarks.gpu.bench_packed_sft import on_device
        from benchmarks.sft_packed_steps import build_step, packed_layout

        step = build_step(name, rows_per_step=args.rows_per_step, row_tokens=shape["seq"],
                          padded_batch_size=args.padded_batch_size, vocab_size=shape["vocab"], seed=args.seed,
                          src_length=args.src_length)
        self.summary = step.summary()
        self.packed, self.flat = on_device(step.packed, device), on_device(step.flattened, device)
        self.flat.update(hf_varlen_attention.collator_kwargs(self.flat["position_ids"]))
        self.padded = [on_device(b, device) for b in step.padded]
        # The harness's FP8 weight-gradient GEMM takes tokens in multiples of 16 (the Paddle CUDA op pads
        # only its transposed copies): FP8 rows train the same rows padded as pad_to_multiple_of=16 does,
        # at most 15 padding tokens (a segment of their own, no labels) more work than the bf16 rows.
        self.packed_fp8 = on_device(packed_layout(step.examples, step.rows, pad_to_multiple_of=FP8_TOKEN_MULTIPLE),
                                    device)
        self.tokens, self.labelled_tokens = step.real_tokens, step.labelled_tokens
        self.segment_lengths = list(step.packed["segment_lengths"])

    @property
    def packed_data(self) -> bool:
        return self.name != "uniform"


def seeded_hf_model(config):
    """Hugging Face's LlamaForCausalLM with its own initialisation, the same weights every call."""
    torch.manual_seed(0)
    return new_hf_model(config)


def builders(workload, shape, data: StepData, model_name: str, fp8_lm_head: str = "bf16", accumulation: int = 1):
    """{contender: (build(recompute) -> (model, forward() -> loss), context manager factory)}; the
    model's trainable parameters are what the optimizer steps. accumulation: the forwards the
    training step runs before each optimizer step (the padded peer's forward runs backwards inside
    and scales them by it)."""
    from benchmarks.gpu import hf_varlen_attention
    from benchmarks.gpu.bench_packed_sft import accumulating_forward, hf_padding_free_loss
    from paddle_fastffn.torch.fp8.ffn import Fp8Recipe
    from paddle_fastffn.torch.llama import FastLlama, LoraSettings

    lora = LoraSettings(rank=plan.LORA_RANK, alpha=plan.LORA_ALPHA) if workload == "lora" else None

    def config_with(attn_implementation):
        config = hf_config(shape)
        if model_name == "llama3_8b":
            config.rope_theta = 500000.0
        config._attn_implementation = attn_implementation
        return config

    def ours(scaling=None):
        def build(recompute):
            hf = seeded_hf_model(config_with("sdpa"))
            recipe = None if scaling is None else Fp8Recipe(scaling=scaling, lm_head=fp8_lm_head)
            model = FastLlama(hf, fp8_recipe=recipe, lora=lora, layer_recompute=recompute)
            del hf  # ours holds its own copies
            if data.packed_data:
                p = data.packed if scaling is None else data.packed_fp8
                return model, lambda: model(p["input_ids"], p["labels"], p["position_ids"],
                                            row_ends=p["attn_mask_startend_row_indices"])
            return model, lambda: model(data.ids, data.labels)
        return build, contextlib.nullcontext

    def hf_liger(build_peft, layout):
        if layout == "padding_free":
            hf_varlen_attention.register()

        def build(recompute):
            model = seeded_hf_model(config_with(hf_varlen_attention.NAME if layout == "padding_free" else "sdpa"))
            if recompute:
                model.config.use_cache = False
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if build_peft:
                from peft import LoraConfig, get_peft_model

                peft_config = LoraConfig(r=plan.LORA_RANK, lora_alpha=plan.LORA_ALPHA, lora_dropout=0.0,
                                         target_modules=list(plan.LORA_TARGETS), bias="none", task_type="CAUSAL_LM")
                model = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
            if layout == "padding_free":
                return model, lambda: hf_padding_free_loss(model, data.flat)
            if layout == "padded":
                return model, accumulating_forward(model, data.padded, data.labelled_tokens, accumulation)
            return model, lambda: model(input_ids=data.ids, labels=data.ids).loss
        return build, lambda: liger_patched(fused_linear_cross_entropy=True)

    def with_optimizer(contender, make_optimizer):
        """contender's builder with the optimizer its row steps (the low-memory workload's)."""
        build, context = contender
        return (lambda recompute: (*build(recompute), make_optimizer)), context

    if workload == "full_low_memory":
        layout = "padding_free" if data.packed_data else "uniform"
        return {"ours_int8_compensated": with_optimizer(ours(), int8_compensated_adamw),
                "ours_fp8_delayed_int8_compensated": with_optimizer(ours("delayed"), int8_compensated_adamw),
                "ours_bf16_adamw": with_optimizer(ours(), fused_torch_adamw),
                "hf_liger_bf16_adamw": with_optimizer(hf_liger(False, layout), fused_torch_adamw),
                "hf_liger_adamw8bit": with_optimizer(hf_liger(False, layout), torchao_adamw8bit)}
    table = {"ours": ours(), "ours_fp8_delayed": ours("delayed"), "ours_fp8_current": ours("current")}
    for name in plan.contenders(workload, data.packed_data):
        if name.startswith("hf_liger"):
            layout = next((l for l in ("padding_free", "padded") if name.endswith(l)), "uniform")
            table[name] = hf_liger(name.startswith("hf_liger_peft"), layout)
    return {name: table[name] for name in plan.contenders(workload, data.packed_data)}


def int8_compensated_adamw(params):
    """FastAdamW's low-memory state over the torch binding: 8-bit blockwise moments, bf16 weights
    with a bf16 Kahan compensation instead of an fp32 master (FusedMasterAdamW)."""
    from paddle_fastffn.torch.llama import FusedMasterAdamW

    return FusedMasterAdamW([p for p in params if p.requires_grad], lr=1e-5, weight_decay=0.01, moments="int8",
                            master_weights="compensated")


def fused_torch_adamw(params):
    """torch.optim.AdamW(fused=True) on the bf16 weights themselves: bf16 moments, no master."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-5, weight_decay=0.01, fused=True)


def torchao_adamw8bit(params):
    """torchao's AdamW8bit on the bf16 weights (8-bit blockwise moments, no master)."""
    from torchao.optim import AdamW8bit

    return AdamW8bit([p for p in params if p.requires_grad], lr=1e-5, weight_decay=0.01)


def can_recompute(contender: str) -> bool:
    """Full recompute per layer where it exists: Hugging Face's gradient checkpointing, and ours in
    bf16 (FastLlama refuses it with FP8: the scaling states would see the forward twice)."""
    return "fp8" not in contender


# Optimizer state bytes per trained parameter (masters, moments) of each make_optimizer here, bf16 weights.
# 8-bit moments: a code each and an fp32 absmax per 256-element block (both libraries' block size);
# the few tensors under the 8-bit size threshold (norm weights) are counted as 8-bit too.
_OPTIMIZER_STATE = {"fused_master_adamw": (4, 8), "int8_compensated_adamw": (2, 2 + 8 / 256),
                    "fused_torch_adamw": (0, 4), "torchao_adamw8bit": (0, 2 + 8 / 256)}


def memory_by_category(model, peak_bytes, make_optimizer=None) -> dict:
    """Where a contender's peak memory goes, in bytes: 16/32-bit weights on the GPU, FP8 weights
    (frozen bases held only in FP8; cached FP8 copies of trained weights), gradients of the trained
    parameters, the optimizer's state from its layout (_OPTIMIZER_STATE: masters or compensation,
    moments), and the rest of the peak: activations, workspaces and the allocator's blocks."""
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    masters, moments = _OPTIMIZER_STATE[getattr(make_optimizer, "__name__", "fused_master_adamw")]
    size = lambda p: p.numel() * p.element_size()  # noqa: E731
    fp8_bytes = [m.fp8_weight_bytes() for m in model.modules() if hasattr(m, "fp8_weight_bytes")]
    categories = {
        "weights": sum(size(p) for p in params if p.is_cuda),
        "frozen_weights_fp8": sum(frozen for frozen, _ in fp8_bytes),
        "fp8_weight_copies": sum(cached for _, cached in fp8_bytes),
        "gradients": sum(size(p) for p in trained),
        "optimizer_masters": sum(masters * p.numel() for p in trained if p.dtype != torch.float32),
        "optimizer_moments": sum(moments * p.numel() for p in trained),
    }
    if peak_bytes is not None:
        categories["activations_and_other"] = peak_bytes - sum(categories.values())
    return categories


def run_once(build, context, recompute, steps, warmup, accumulation=1):
    """Build, measure and free one contender: bench_step.measure_training's row (`accumulation`
    micro-batches per optimizer step), or an OOM report."""
    torch.cuda.reset_peak_memory_stats()
    phase = "build"
    try:
        with context():
            model, forward, *optimizer = build(recompute)
            phase = "step"
            make_optimizer = optimizer[0] if optimizer else fused_master_adamw
            row = measure_training(forward, model, make_optimizer, steps=steps, warmup=warmup,
                                   accumulation=accumulation)
            row["optimizer_name"] = make_optimizer.__name__
        row["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        row["memory_by_category"] = memory_by_category(model, row.get("peak_bytes"), make_optimizer)
        return row
    except torch.OutOfMemoryError as error:
        message = str(error)
    # outside the except block: the traceback (and the frames holding the model) are gone
    model = forward = None
    allocated, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    gc.collect()
    torch.cuda.empty_cache()
    return plan.oom_report(message, phase, allocated, peak)


def profile_contenders(names, workload, shape, data, model_name, report, save, log, fp8_lm_head="bf16",
                       accumulation=1) -> None:
    """report["profiles"][contender]: profile_step.profile_training of each named contender, built as
    the timed rows build it (no recompute where the rows use none), on one step's data, `accumulation`
    forward+backward passes per optimizer step."""
    from benchmarks.gpu.profile_step import profile_training

    table = builders(workload, shape, data, model_name, fp8_lm_head, accumulation)
    report["profiles"] = {"workload": workload, "data": data.summary}
    for name in names:
        if name not in table:
            raise SystemExit(f"--profile: {name!r} is not a {workload} contender here ({', '.join(table)})")
        build, context = table[name]
        with context():
            model, forward, *optimizer = build(False)
            report["profiles"][name] = profile_training(forward, model, optimizer[0] if optimizer else fused_master_adamw,
                                                        steps=2, accumulation=accumulation)
        log(f"profiled {name}: " + json.dumps(report["profiles"][name]["gpu_only"]["kernel_ms_by_category"]))
        host = report["profiles"][name].get("host_python")
        if host:
            log(f"  host under cProfile {host['host_ms_per_step_under_cprofile']:.1f} ms a step, "
                f"{host['python_calls_per_step']:.0f} Python calls; most own time: " + "; ".join(
                    f"{row['function']} {row['own_ms_per_step']:.1f} ms x{row['calls_per_step']:.0f}"
                    for row in host["by_own_time"][:12]))
        model = forward = None
        gc.collect()
        torch.cuda.empty_cache()
        save()


def measure_workload(workload, shape, data, model_name, rounds, steps, warmup, save, stop_at, log, not_run=None,
                     fp8_lm_head="bf16", accumulation=1, only=None):
    """round_robin_rebuilt over the workload's contenders on `data` (a StepData), those named in `only`
    if given, but those in not_run ({contender: why}, whose rows say why). A step is `accumulation`
    forward+backward passes over the data, then one optimizer step: its tokens and FLOPs are that
    many times the data's. A workload whose persistent state exceeds the device's memory is not
    built (every row says by how much). Each contender first runs without layer
    recompute; an OOM there is recorded and, where the contender can, it is rebuilt with full
    recompute per layer for this and every later round. A contender that does not fit at all keeps
    its OOM row (not rebuilt in later rounds)."""
    not_run = dict(not_run or {})
    names = plan.contenders(workload, data.packed_data)
    if only is not None:
        names = tuple(name for name in names if name in only)
        if not names:
            return {"error": f"none of --contenders is a {workload} contender on this data", "data": data.summary}
    fit = plan.fits(workload, torch.cuda.get_device_properties(0).total_memory, **shape)
    if not fit["fits"]:
        why = (f"does not fit: persistent state {plan.gib(fit['persistent_state_bytes'])} (weights, gradients, fp32 "
               f"masters and moments) > the device's {plan.gib(fit['device_bytes'])}, short by "
               f"{plan.gib(fit['short_by_bytes'])} before any activation")
        log(f"{workload} {data.name}: {why}")
        return {"contenders": {name: {"does_not_fit": True, **fit, "error": why} for name in names},
                "data": data.summary}
    contenders = {n: b for n, b in builders(workload, shape, data, model_name, fp8_lm_head, accumulation).items()
                  if n in names and n not in not_run}
    decided = {}  # contender -> {"recompute": bool, "oom_without_recompute": row} or {"oom": row}
    progress = []

    def measured(name, build, context):
        def run():
            if time.time() > stop_at:
                raise TimeoutError(f"skipped (time budget, --stop-after-s) at {time.time() - started:.0f} s")
            if "oom" in decided.get(name, {}):
                return {**decided[name]["oom"], "note": "not rebuilt: it ran out of memory in an earlier round"}
            choice = decided.setdefault(name, {"recompute": False})
            row = run_once(build, context, choice["recompute"], steps, warmup, accumulation)
            if row.get("oom") and not choice["recompute"] and can_recompute(name):
                log(f"{workload} {name}: {plan.describe_oom(row)}; rebuilding with full recompute per layer")
                choice.update(recompute=True, oom_without_recompute=row)
                row = run_once(build, context, True, steps, warmup, accumulation)
            row["layer_recompute"] = choice["recompute"]
            if row.get("oom"):  # with recompute, or where there is none: it does not fit
                decided[name] = {"oom": row}
                return row
            if choice["recompute"]:
                row["recompute_because"] = plan.describe_oom(choice["oom_without_recompute"])
            return row
        return run

    def on_round(name, index, row):
        summary = (plan.describe_oom(row) if row.get("oom") else row.get("error") or
                   f"step {row.get('step_ms', 0):.1f} ms (fwd+bwd {row.get('forward_backward_ms', 0):.1f}, optimizer "
                   f"{row.get('optimizer_ms', 0):.1f}; host {row.get('host_issue_ms', 0):.1f}), "
                   f"peak {plan.gib(row.get('peak_bytes'))}")
        log(f"{workload} {data.name} {name} round {index}: {summary}")
        progress.append({"contender": name, "round": index, **{k: v for k, v in row.items() if k != "trace"}})
        save(progress)

    started = time.time()
    runs = {name: measured(name, build, context) for name, (build, context) in contenders.items()}
    results = round_robin_rebuilt(runs, rounds, on_round)
    work = plan.step_work(workload, shape, data.tokens, data.labelled_tokens,
                          data.segment_lengths if data.packed_data else None, accumulation)
    tokens, labelled_tokens = work["tokens"], work["labelled_tokens"]
    flops, executed, nemo = work["model_flops"], work["executed_flops"], work["nemo_model_flops"]
    results.update({name: {"error": why} for name, why in not_run.items() if name in names})
    for row in results.values():
        if isinstance(row.get("step"), dict):
            row.update({k: row["step"][k] for k in ("p50_ms", "p20_ms", "p80_ms", "spread_ms", "repeats")})
            seconds = row["p50_ms"] * 1e-3
            row.update(tokens_per_s=tokens / seconds, labelled_tokens_per_s=labelled_tokens / seconds,
                       model_tflops=flops / seconds / 1e12,
                       executed_tflops=None if executed is None else executed / seconds / 1e12,
                       nemo_model_tflops=None if nemo is None else nemo / seconds / 1e12)
    first = {n: r["first_losses"][0] for n, r in results.items() if r.get("first_losses")}
    return {"contenders": results, "data": data.summary, "comparison": compare_to_peers(results, workload),
            "first_step_losses": first,
            "first_step_loss_max_relative_difference":
                (max(first.values()) - min(first.values())) / abs(min(first.values())) if len(first) > 1 else None,
            "accumulation": accumulation, "model_flops_per_step": flops, "executed_flops_per_step": executed,
            "nemo_model_flops_per_step": nemo}


def compare_to_peers(results: dict, workload: str) -> dict:
    """Each of ours against each peer row: the peer's step time / ours (= the labelled tokens/s
    ratio, the work being equal), the tie rule's verdict, and peak memory of both."""
    out = {}
    for ours in (n for n in results if n.startswith("ours")):
        for peer in (n for n in results if n.startswith(plan.PEER[workload])):
            a, b = results.get(ours, {}), results[peer]
            if "p50_ms" in a and "p50_ms" in b:
                out[f"{ours} vs {peer}"] = {**compare(a, b), "peak_gib": [a["peak_bytes"] / 2**30,
                                                                          b["peak_bytes"] / 2**30]}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="lora,full", help="comma-separated: lora, full")
    parser.add_argument("--data", default=",".join(plan.PACKED_DATA),
                        help=f"comma-separated, each a step's data: {', '.join(plan.DATA)}")
    parser.add_argument("--model", default="llama2_7b", choices=sorted(plan.MODELS))
    parser.add_argument("--rows-per-step", type=int, default=1, help="packed rows of --row-tokens per step")
    parser.add_argument("--padded-batch-size", type=int, default=8, help="examples per padded micro-batch")
    parser.add_argument("--seed", type=int, default=0, help="the examples' order and token ids")
    parser.add_argument("--src-length", type=int, default=1024, help="PaddleNLP's src_length (prompt cut)")
    parser.add_argument("--rounds", type=int, default=MIN_REPEATS, help="round-robin rounds (at least 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contender and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's; fewer "
                                                                 "only to try the script)")
    parser.add_argument("--stop-after-s", type=float, default=None,
                        help="start no contender round after this many seconds (device-time budget)")
    parser.add_argument("--profile", default=None, metavar="CONTENDERS",
                        help="comma-separated contenders: instead of timing, a kernel timeline of each on the first "
                             "--data and --workloads (profile_step.profile_training: by category, top kernels, gaps)")
    parser.add_argument("--fp8-lm-head", default="bf16", choices=("bf16", "fp8"),
                        help="the FP8 contenders' LM head + loss (Fp8Recipe.lm_head): bf16, the default, or its GEMMs "
                             "in FP8 too")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step (the Trainer's gradient_accumulation_steps; PaddleNLP's "
                             "llm/llama/sft_argument.json sets 4): each step is this many forward+backward passes over "
                             "the step's data, then one optimizer step; tokens and FLOPs count every pass")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated: time only these of the workloads' contenders (default: all)")
    parser.add_argument("--allow-missing-peers", action="store_true",
                        help="run without a peer whose packages are missing (its rows say so) instead of stopping")
    args = parser.parse_args()
    try:
        workloads, datasets = plan.workloads_from(args.workloads), plan.data_from(args.data)
        only = None if args.contenders is None else plan.contenders_from(args.contenders, workloads, datasets)
    except ValueError as error:
        parser.error(str(error))
    if args.steps < 3 or args.warmup < 1:
        parser.error("--steps must be at least 3 and --warmup at least 1")
    if args.accumulation < 1:
        parser.error(f"--accumulation: expected micro-batches per optimizer step >= 1, got {args.accumulation}")
    model = plan.MODELS[args.model]
    shape = {**model, "layers": args.layers or model["layers"]}

    missing = {contender: names for contender, names in plan.missing_packages(workloads, importable).items()
               if only is None or contender in only}
    for contender, names in missing.items():
        print(f"MISSING for {contender}: {', '.join(names)} (carry their wheels in .whl: see run_on_gpu.sh)")
    not_run = {contender: f"not run: cannot be imported here (missing {', '.join(names)})"
               for contender, names in missing.items()}
    if "lora" in workloads and "hf_liger_peft" not in not_run and (
            only is None or any(name.startswith("hf_liger_peft") for name in only)):
        try:  # present is not enough: peft must import against this transformers
            import peft
            print(f"peft {peft.__version__} imports")
        except Exception as error:  # noqa: BLE001
            why = f"not run: import peft failed here: {error!r}"[:400]
            not_run.update({name: why for name in ("hf_liger_peft", "hf_liger_peft_padding_free",
                                                   "hf_liger_peft_padded")})
            print(why)
    if not_run and not args.allow_missing_peers:
        print("stopping: a peer cannot be imported (--allow-missing-peers runs without it, its rows saying so)")
        sys.exit(2)

    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.time()
    stop_at = started + args.stop_after_s if args.stop_after_s else float("inf")
    report = {"environment": environment(),
              "command": "python3 -m benchmarks.gpu.bench_full_depth " + " ".join(sys.argv[1:]),
              "model": args.model,
              "fp8_lm_head": args.fp8_lm_head,
              "accumulation": args.accumulation,
              "shape": {**shape, "tokens": shape["batch"] * shape["seq"], "parameters": plan.parameter_count(**shape),
                        "lora_parameters": plan.lora_parameter_count(**shape), "lora_rank": plan.LORA_RANK,
                        "lora_alpha": plan.LORA_ALPHA, "lora_targets": list(plan.LORA_TARGETS)},
              "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
              "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
              "persistent_state_bytes": {w: plan.persistent_state_bytes(w, **shape) for w in workloads},
              "packages": {name: importable(name) for name in ("peft", "accelerate", "liger_kernel")},
              "conventions": {
                  "model_tflops": "6 x GEMM weights incl. LM head x real tokens + causal attention within each "
                                  "example (6 x layers x sum(n^2) x hidden; uniform rows: the row's length), the "
                                  "same model FLOPs for LoRA rows",
                  "executed_tflops": "uniform rows only: LoRA: the GEMM work a LoRA step does (frozen GEMMs forward "
                                     "+ input gradient, attention, adapters 3x); full fine-tune: model_tflops",
                  "nemo_model_tflops": "uniform rows only: NeMo's performance tables' model FLOPs (its llama2/llama3 "
                                       "formula: batch x seq x layers x hidden^2 x (12 + 12 kv_heads/heads + 18 "
                                       "inter/hidden + 12 seq/hidden + 6 vocab/(layers x hidden)), attention counted "
                                       "in full)",
                  "labelled_tokens_per_s": "the step's labelled tokens (equal for every contender) / its median time",
                  "peak_bytes": "torch.cuda.max_memory_allocated over one step after reset_peak_memory_stats: weights, "
                                "optimizer state, gradients, activations",
                  "optimizer": "paddle_fastffn.torch.llama.FusedMasterAdamW for every contender (fp32 masters and moments of the "
                               "trainable parameters), lr 1e-5, weight decay 0.01, no clipping; full_low_memory: each "
                               "contender's own (its rows' optimizer_name)",
                  "accumulation": "a step is --accumulation forward+backward passes over the step's data (the loss "
                                  "divided by their count), then one optimizer step; tokens/s and TFLOP/s count "
                                  "every pass",
                  "timing": f"round-robin over rebuilt contenders, {max(args.rounds, MIN_REPEATS)} rounds of "
                            f"{args.warmup} warm-up + {args.steps} timed steps; median of round medians (spread)"},
              "workloads": {}}
    report["not_run"] = not_run

    def save(progress=None, key=None):
        if progress is not None:
            report["workloads"].setdefault(key, {})["rounds_so_far"] = progress
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)

    def log(line):
        print(f"[{time.time() - started:4.0f}s] {line}", flush=True)

    from benchmarks.gpu import hf_varlen_attention

    if args.profile:
        profile_contenders(args.profile.split(","), workloads[0], shape, StepData(datasets[0], shape, args),
                           args.model, report, save, log, args.fp8_lm_head, args.accumulation)
        return

    for name in datasets:
        data = StepData(name, shape, args)
        log(f"data {name}: {json.dumps(data.summary)[:300]}")
        for workload in workloads:
            key = f"{workload}:{name}"
            try:
                hf_varlen_attention.CALLS.clear()
                result = measure_workload(workload, shape, data, args.model, args.rounds, args.steps, args.warmup,
                                          lambda progress, k=key: save(progress, k), stop_at, log, not_run,
                                          args.fp8_lm_head, args.accumulation, only)
                result["hf_varlen_attention_calls"] = dict(hf_varlen_attention.CALLS)
                report["workloads"][key] = result
            except Exception as error:  # noqa: BLE001
                report["workloads"][key] = {"error": repr(error), "trace": traceback.format_exc()[-2500:]}
                log(f"{key} failed: {error!r}")
            save()
            gc.collect()
            torch.cuda.empty_cache()
        del data
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
