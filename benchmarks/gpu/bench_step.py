"""A whole fine-tune step on the H200, every contender in the same run:

    python3 -m benchmarks.gpu.bench_step --out step.json [--sections loss,step] [--configs ...]

1. loss: the LM head GEMM + cross-entropy, forward and backward, at 8192 tokens x hidden 4096 and
   vocabularies 32000 / 128256: Hugging Face's path (bf16 logits, fp32 upcast, cross_entropy),
   the same under torch.compile, Liger's fused linear cross-entropy and ours
   (ops.linear_cross_entropy, the Paddle op's chunked composition). Time and peak memory.
2. step: embedding, 8 decoder layers, final norm, LM head + loss, and AdamW, 8192 tokens per step,
   at LLaMA-2-7B width (vocab 32000, 4 x 2048) and Llama-3-8B width (GQA 32/8, vocab 128256,
   2 x 4096). Ours (paddle_fastffn.torch.llama.FastLlama: the Paddle fast path's composition, bf16, and with FP8
   linears under both recipes) against Hugging Face's LlamaForCausalLM (sdpa) eager, patched by
   Liger (rope, RMSNorm, SwiGLU and its fused linear cross-entropy) and under torch.compile. All of
   these keep bf16 weights with fp32 masters and step the same optimizer, the one-pass
   master-weight AdamW kernel (paddle_fastffn.torch.llama.FusedMasterAdamW, framework-neutral; what
   paddle_fastffn.optim.FastAdamW runs in Paddle): Hugging Face has no stock one-pass master-weight
   AdamW for bf16 weights, and a different optimizer would make the step compare optimizers.
   Beside them, HF + Liger as Hugging Face's Trainer runs bf16 (hf_liger_amp: fp32 weights and
   gradients, the forward under torch.autocast, torch's fused AdamW on the fp32 parameters).
   Forward+backward and the optimizer are timed apart (CUDA events inside each step) and reported
   apart; tokens/s, model TFLOP/s (bf16-equivalent FLOPs for FP8) and peak memory.

Contenders cannot be held side by side (each holds a model and its optimizer state; at Llama-3-8B
width two do not fit), so the step is timed round-robin over whole contenders: each round builds,
warms up, times and frees every contender once, in an order rotated by one per round
(bench_gpu.round_robin_rebuilt), at least 3 rounds; each figure is the median over the rounds of
each round's median step, with its spread (benchmarks/common.py: TIE_RULE).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.common import MIN_REPEATS, percentiles
from paddle_fastffn.core.fp8.recipe import Fp8Recipe
from paddle_fastffn.torch import ops
from benchmarks.gpu.bench_gpu import (DT, _liger_version, decoder_flops, environment, leaf,
                                      liger_patched, peak_bytes, round_robin, round_robin_rebuilt)

STEP_CONFIGS = {
    "llama2_7b_8layers": dict(batch=4, seq=2048, hidden=4096, inter=11008, heads=32, kv_heads=32, layers=8,
                              vocab=32000),
    "llama3_8b_8layers": dict(batch=2, seq=4096, hidden=4096, inter=14336, heads=32, kv_heads=8, layers=8,
                              vocab=128256, rope_theta=500000.0),
}


def step_flops(batch, seq, hidden, vocab, layers, **shape):
    """Model FLOPs of one training step: the decoder layers' fwd+bwd (3x forward, causal attention
    at half) and the LM head's three GEMMs; the optimizer and the loss's elementwise work are not
    counted."""
    tokens = batch * seq
    return layers * decoder_flops(batch=batch, seq=seq, hidden=hidden, **shape) + 3 * 2 * tokens * hidden * vocab


# --- loss -----------------------------------------------------------------------------------------

def hf_loss(hidden, weight, labels):
    """What LlamaForCausalLM's loss does with unshifted inputs: bf16 logits, fp32 upcast."""
    return F.cross_entropy(F.linear(hidden, weight).float(), labels)


FP8_HEAD_RECIPE = Fp8Recipe(lm_head="fp8")  # the loss section's ours_fp8


def loss_contenders(vocab, tokens, width, liger, device="cuda"):
    """The loss section's contenders at one vocabulary: ({impl: (fn(hidden, weight) -> loss, inputs)},
    hidden, w_vh, w_hv), each fn in its users' weight layout."""
    torch.manual_seed(0)
    hidden = leaf((tokens, width), device=device)
    w_vh = (torch.randn(vocab, width, device=device) * 0.02).to(DT).requires_grad_()  # HF / Liger layout
    w_hv = w_vh.detach().t().contiguous().requires_grad_()  # PaddleNLP's LM head layout [H, V]
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[::17] = -100  # some ignored positions, as padding and prompts give
    compiled_hf_loss = torch.compile(hf_loss)
    impls = {"hf_eager": (lambda h, w: hf_loss(h, w, labels), [hidden, w_vh]),
             "hf_torch_compile": (lambda h, w: compiled_hf_loss(h, w, labels), [hidden, w_vh]),
             "ours": (lambda h, w: ops.linear_cross_entropy(h, w, labels), [hidden, w_hv]),
             # the same op with its three GEMMs in FP8 (Fp8Recipe.lm_head "fp8"): the default chunks
             # (1 GiB counted in fp32; at vocab 128256 2080 rows), and 4096-row chunks (twice the
             # transient logits); d_W one GEMM over every chunk's rows either way
             "ours_fp8": (lambda h, w: ops.linear_cross_entropy(h, w, labels, fp8_recipe=FP8_HEAD_RECIPE),
                          [hidden, w_hv]),
             "ours_fp8_chunk4096": (lambda h, w: ops.linear_cross_entropy(h, w, labels, chunk_tokens=4096,
                                                                          fp8_recipe=FP8_HEAD_RECIPE),
                                    [hidden, w_hv])}
    if liger:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger_loss = LigerFusedLinearCrossEntropyLoss()
        impls["liger_flce"] = (lambda h, w: liger_loss(w, h, labels), [hidden, w_vh])
    return impls, hidden, w_vh, w_hv


def loss_section(vocabs=(32000, 128256), tokens=8192, width=4096, liger=True):
    rows = []
    for vocab in vocabs:
        impls, hidden, w_vh, w_hv = loss_contenders(vocab, tokens, width, liger)
        runs, values = {}, {}
        for name, (fn, inputs) in impls.items():
            def run(fn=fn, inputs=inputs):
                for t in inputs:
                    t.grad = None
                fn(*inputs).backward()
            try:
                run()  # compiles (torch.compile, Triton) outside the timing
                with torch.no_grad():
                    values[name] = float(fn(*inputs).item())
                runs[name] = (run, peak_bytes(run))
            except Exception as error:  # noqa: BLE001
                rows.append({"vocab": vocab, "impl": name, "error": repr(error), "trace": traceback.format_exc()[-1500:]})
        timings = round_robin({n: r[0] for n, r in runs.items()}, reps=15)
        for name, (_, peak) in runs.items():
            # peak_bytes: above the inputs and the previous iteration's gradients (freed at the start)
            rows.append({"vocab": vocab, "tokens": tokens, "hidden": width, "impl": name, **timings[name],
                         "loss": values[name], "peak_bytes": peak})
        rows.append({"vocab": vocab, "tokens": tokens, "impl": "reference_sizes",
                     "logits_bf16_bytes": tokens * vocab * 2, "logits_fp32_bytes": tokens * vocab * 4,
                     "gradient_bytes": hidden.numel() * 2 + w_vh.numel() * 2})
        del hidden, w_vh, w_hv, impls, runs
        gc.collect()
        torch.cuda.empty_cache()
        print(f"loss V={vocab} done", flush=True)
    return rows


# --- whole step -----------------------------------------------------------------------------------

def hf_config(shape):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         num_hidden_layers=shape["layers"], vocab_size=shape["vocab"], rms_norm_eps=1e-5,
                         max_position_embeddings=max(4096, shape["seq"]), tie_word_embeddings=False,
                         rope_theta=shape.get("rope_theta", 10000.0))
    config._attn_implementation = "sdpa"
    return config


def new_hf_model(config, device="cuda"):
    from transformers.models.llama import modeling_llama

    with torch.device(device):
        model = modeling_llama.LlamaForCausalLM(config)
    return model.to(DT).train()


def training_step(forward, model, optimizer, accumulation=1):
    """One training step as every contender runs it: `accumulation` micro-batches of forward() ->
    loss and its backward, each loss divided by their count (PaddleNLP's Trainer under
    gradient_accumulation_steps; the micro-batches here are alike, so Hugging Face's count of the
    step's labelled tokens gives the same), then the optimizer's step, zero_grad, and for FP8
    models the weight cache invalidated (the weights changed). Returns the last loss."""
    invalidate = getattr(model, "invalidate_fp8_weights", lambda: None)

    def step():
        loss = accumulated_backward(forward, accumulation)
        optimizer.step()
        optimizer.zero_grad()
        invalidate()
        return loss
    return step


def accumulated_backward(forward, accumulation):
    """forward() and backward `accumulation` times into the same gradients; the last (unscaled) loss."""
    if accumulation < 1:
        raise ValueError(f"accumulation: expected micro-batches per optimizer step >= 1, got {accumulation}")
    for _ in range(accumulation):
        loss = forward()
        (loss / accumulation if accumulation > 1 else loss).backward()
    return loss


def measure_training(forward, model, make_optimizer, steps=8, warmup=3, accumulation=1):
    """forward() -> loss; make_optimizer(params) -> the optimizer stepped after every `accumulation`
    forward+backward passes (training_step). Returns one round's row: the medians over `steps` timed
    steps of the whole step, its forward+backward part (every micro-batch) and its optimizer part (ms,
    CUDA events inside each step), the warm-up losses and memory."""
    optimizer = make_optimizer(model.parameters())
    invalidate = getattr(model, "invalidate_fp8_weights", lambda: None)
    step = training_step(forward, model, optimizer, accumulation)

    losses = []
    started = time.time()
    for _ in range(warmup):  # the first step compiles (torch.compile) and allocates the masters' state
        losses.append(float(step().item()))
    warmup_s = time.time() - started

    def timed_step():
        """(whole step, forward+backward, host) in ms: CUDA events around the parts of one step, and
        the host's time to issue the step (from the start event to the end event's record, with no
        wait in between). A host time near the step's says the GPU waited for the host."""
        start, after_backward, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        issued = time.perf_counter()
        accumulated_backward(forward, accumulation)
        after_backward.record()
        optimizer.step()
        optimizer.zero_grad()
        invalidate()
        end.record()
        issued = (time.perf_counter() - issued) * 1e3
        end.synchronize()
        return start.elapsed_time(end), start.elapsed_time(after_backward), issued

    timed = [timed_step() for _ in range(steps)]
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"step_ms": percentiles([total for total, _, _ in timed])["p50_ms"],
            "forward_backward_ms": percentiles([fb for _, fb, _ in timed])["p50_ms"],
            "optimizer_ms": percentiles([total - fb for total, fb, _ in timed])["p50_ms"],
            "host_issue_ms": percentiles([host for _, _, host in timed])["p50_ms"],
            "steps_per_round": steps, "accumulation": accumulation, "first_losses": losses, "warmup_s": warmup_s,
            "peak_bytes": peak, "resident_bytes": resident, "peak_above_resident_bytes": peak - resident}


def fused_master_adamw(params):
    """AdamW on fp32 masters of the bf16 parameters in one pass per parameter: our framework-neutral
    kernel, the Paddle path's FastAdamW (paddle_fastffn.torch.llama.FusedMasterAdamW), stepped by every contender
    that keeps bf16 weights."""
    from paddle_fastffn.torch.llama import FusedMasterAdamW

    return FusedMasterAdamW(params, lr=1e-5, weight_decay=0.01)


def fused_torch_adamw(params):
    """torch.optim.AdamW(fused=True) on fp32 parameters (no master copies)."""
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)


def step_contenders(config, base, ids, labels, liger):
    """The step section's contenders for one configuration, on ids' device: {contender: build() ->
    (model, forward() -> loss, make_optimizer)}; the hf_liger ones are built and run inside
    liger_patched(fused_linear_cross_entropy=True)."""
    from paddle_fastffn.torch.llama import FastLlama

    device = ids.device

    def ours(fp8_kind=None, lm_head="bf16", weight_copies="per_use"):
        recipe = None if fp8_kind is None else Fp8Recipe(scaling=fp8_kind, lm_head=lm_head, weight_copies=weight_copies)
        model = FastLlama(base, fp8_recipe=recipe)
        return model, lambda: model(ids, labels), fused_master_adamw

    def hf_eager():
        model = copy.deepcopy(base)
        return model, lambda: model(input_ids=ids, labels=ids).loss, fused_master_adamw

    def hf_compile():
        model = copy.deepcopy(base)
        compiled = torch.compile(model)
        return model, lambda: compiled(input_ids=ids, labels=ids).loss, fused_master_adamw

    def hf_liger():  # built and run inside liger_patched (step_section)
        model = new_hf_model(config, device)
        model.load_state_dict(base.state_dict())
        return model, lambda: model(input_ids=ids, labels=ids).loss, fused_master_adamw

    def hf_liger_amp():
        """Hugging Face Trainer's bf16 mode: fp32 weights and gradients, the forward under
        torch.autocast, torch's fused AdamW straight on the fp32 parameters (one pass, no
        master copies); Liger patched as in hf_liger."""
        model = new_hf_model(config, device).float()
        model.load_state_dict(base.state_dict())

        def forward():
            with torch.autocast(device.type, dtype=DT):
                return model(input_ids=ids, labels=ids).loss
        return model, forward, fused_torch_adamw

    # ours_fp8_delayed_fp8_head: the LM head's GEMMs in FP8 too (Fp8Recipe.lm_head "fp8"); its _cached twin holds
    # both FP8 copies of each trained weight (weight_copies "cached": one cast pass a weight version where per use
    # casts the forward's copy in forward and the dgrad's in backward); the _tuned twins run with the GEMM
    # provider's tuning on (GEMM_TUNING below).
    cached = lambda: ours("delayed", lm_head="fp8", weight_copies="cached")  # noqa: E731
    contenders = {"ours": ours, "ours_fp8_current": lambda: ours("current"),
                  "ours_fp8_delayed": lambda: ours("delayed"),
                  "ours_fp8_delayed_tuned": lambda: ours("delayed"),
                  "ours_fp8_delayed_fp8_head": lambda: ours("delayed", lm_head="fp8"),
                  "ours_fp8_delayed_fp8_head_cached": cached,
                  "ours_fp8_delayed_fp8_head_cached_tuned": cached,
                  "hf_eager": hf_eager}
    if liger:
        contenders["hf_liger"] = hf_liger
        contenders["hf_liger_amp"] = hf_liger_amp
    contenders["hf_torch_compile"] = hf_compile
    return contenders


# Contenders run with the GEMM provider's tuning on (fastffn_gemm_set_tuning): that many candidates timed
# per new problem (--gemm-tuning sets it). Everyone else runs the heuristic's first choice (tuning 0, the default).
GEMM_TUNING = {"ours_fp8_delayed_tuned": 8, "ours_fp8_delayed_fp8_head_cached_tuned": 8}


@contextlib.contextmanager
def gemm_tuning(candidates, row):
    """The GEMM provider's tuning for one contender's round, restored after; the problems it tuned in
    this round (the first: later rounds reuse the process's cached choices) go into row."""
    from paddle_fastffn.torch.fp8 import c_api as fp8_c_api

    kernels = fp8_c_api.kernels()
    before, saved = len(kernels.gemm_tuning_records()), kernels.gemm_tuning
    kernels.gemm_tuning = candidates
    try:
        yield
    finally:
        kernels.gemm_tuning = saved
        tuned = kernels.gemm_tuning_records()[before:]
        if tuned:
            row["gemm_tuning"] = tuned


def tuning_for(contender, row):
    """The GEMM tuning a contender's round runs under (GEMM_TUNING), or nothing."""
    return gemm_tuning(GEMM_TUNING[contender], row) if contender in GEMM_TUNING else contextlib.nullcontext()


def step_section(configs, liger, skip_compile_after_s=None, started=None, report=None, save=lambda: None,
                 rounds=3, only=None):
    """report (a dict) receives each configuration's results as they come; save() after each
    contender's round, so a run cut short keeps what it measured."""
    from paddle_fastffn.torch.llama import shift_labels

    started = started or time.time()
    report = {} if report is None else report
    for name in configs:
        shape = STEP_CONFIGS[name]
        config = hf_config(shape)
        torch.manual_seed(0)
        base = new_hf_model(config)
        ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device="cuda")
        labels = shift_labels(ids)
        tokens = shape["batch"] * shape["seq"]
        flops = step_flops(**shape)
        contenders = step_contenders(config, base, ids, labels, liger)
        if only:
            unknown = set(only) - set(contenders)
            if unknown:
                raise SystemExit(f"--contenders: unknown {sorted(unknown)}; known: {sorted(contenders)}")
            contenders = {name: build for name, build in contenders.items() if name in only}

        def measured(contender, build):
            def run():
                if (contender == "hf_torch_compile" and skip_compile_after_s
                        and time.time() - started > skip_compile_after_s):
                    raise TimeoutError(f"skipped (time budget): {time.time() - started:.0f} s into the run")
                patch = (liger_patched(fused_linear_cross_entropy=True) if contender.startswith("hf_liger")
                         else contextlib.nullcontext())
                tuning = {}
                try:
                    with patch, tuning_for(contender, tuning):
                        model, forward, make_optimizer = build()
                        row = measure_training(forward, model, make_optimizer)
                    row.update(tuning)
                finally:
                    if contender == "hf_torch_compile":
                        torch._dynamo.reset()  # frees the compiled graphs and the model they hold
                # The docstring's first paragraph (its first line alone can end mid-sentence).
                row["optimizer_used"] = " ".join(make_optimizer.__doc__.split("\n\n")[0].split())
                return row
            return run

        def progress(contender, index, row):
            """Prints each contender's round and saves it (the configuration's summary replaces
            these rows when its last round is done): a run cut short keeps its rounds."""
            print(f"step {name} {contender} round {index}: {row.get('step_ms', row.get('error'))} ms "
                  f"(fwd+bwd {row.get('forward_backward_ms')}, optimizer {row.get('optimizer_ms')}), "
                  f"peak {row.get('peak_bytes', 0) / 2**30:.2f} GiB at {time.time() - started:.0f}s", flush=True)
            report.setdefault(name, {}).setdefault("rounds_so_far", []).append(
                {"contender": contender, "round": index, **row})
            save()

        results = report[name] = round_robin_rebuilt(
            {contender: measured(contender, build) for contender, build in contenders.items()}, rounds, progress)
        for row in results.values():
            if "step" in row:
                # p50_ms / spread_ms: the whole step's, what common.compare reads
                row.update({k: row["step"][k] for k in ("p50_ms", "p20_ms", "p80_ms", "spread_ms", "repeats")})
                row["tokens_per_s"] = tokens / (row["p50_ms"] * 1e-3)
                row["model_tflops"] = flops / (row["p50_ms"] * 1e-3) / 1e12
        results["shape"] = {**shape, "tokens": tokens, "model_flops_per_step": flops,
                            "optimizer_settings": "each row's 'optimizer_used' field (lr 1e-5, no clipping, weight decay 0.01)",
                            "flops_convention": "3x forward; causal attention at half; LM head included; "
                                                "FP8 rows count the same bf16-equivalent FLOPs",
                            "timing": f"round-robin over whole contenders, {max(rounds, MIN_REPEATS)} rounds, "
                                      "median of round medians"}
        save()
        base = contenders = None  # the next configuration's model needs the memory
        gc.collect()
        torch.cuda.empty_cache()
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="loss,step")
    parser.add_argument("--configs", nargs="+", default=list(STEP_CONFIGS))
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds of the step (at least 3)")
    parser.add_argument("--contenders", nargs="+", default=None,
                        help="the step section's contenders to run (default: all)")
    parser.add_argument("--gemm-tuning", type=int, default=None,
                        help=f"candidates the _tuned contenders time per GEMM problem (default {GEMM_TUNING})")
    parser.add_argument("--skip-compile-after-s", type=float, default=None,
                        help="skip torch.compile contenders once the run is this old (device-time budget)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.time()
    liger = _liger_version() is not None
    report = {"environment": environment(),
              "command": "python3 -m benchmarks.gpu.bench_step " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if v is not None),
              "note": "Ours: the csrc/kernels CUDA sources through ctypes in the Paddle fast path's composition; "
                      "torch's cuBLAS, SDPA, embedding and fused AdamW stand in for Paddle's."}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    if args.gemm_tuning is not None:
        GEMM_TUNING.update(dict.fromkeys(GEMM_TUNING, args.gemm_tuning))
    sections = args.sections.split(",")
    if "loss" in sections:
        report["loss"] = loss_section(liger=liger)
        save()
    if "step" in sections:
        report["step"] = {}
        step_section(args.configs, liger, args.skip_compile_after_s, started, report["step"], save, args.rounds,
                     args.contenders)
        save()
    print(f"wrote {args.out} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
