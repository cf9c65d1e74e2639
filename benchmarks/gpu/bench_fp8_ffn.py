"""FP8 FFN forward+backward on the H200, everything in one run and interleaved: ours FP8 with
current and with delayed scaling (paddle_fastffn/torch/fp8/ffn.py, the C entry points the Paddle GPU path
calls), ours bf16 (ops.fused_ffn), the six FP8 GEMMs of our composition alone on pre-quantised
operands (the floor of the FP8 design), torchao float8 tensorwise and rowwise under torch.compile,
the same FFN in bf16 under torch.compile, and eager bf16. Time (CUDA events, median of interleaved
repeats) and the activation memory each keeps for backward.

Every FP8 step re-quantises the weights (an optimizer step per iteration: the conservative case),
as torchao does. Ours FP8 keeps gate_up's FP8 copy for backward (Fp8Recipe.saved_gate_up "fp8", the
default); the `_gate_up_activation` rows keep the 16-bit gate_up instead. The `_accumulate4` rows
time gradient accumulation as configs/llama2_7b_sft_*.json runs it: 4 micro-batches of 8192 tokens
per optimizer step, every contender in the same loop (4 calls after one L2 flush, one
synchronisation, ms per micro-batch), round-robin among themselves: ours FP8 quantises its weights
once for the four (its weight cache), torchao casts them at every call (what it does), the bf16
contenders have no cast. As in every row, the gradients are fresh each call: accumulation's own
adds are in no row.

    python3 -m benchmarks.gpu.bench_fp8_ffn --out fp8_ffn.json [--tokens 8192 ...] [--sections quantization,ffn,profile]

The profile section lists every kernel of our FP8 FFN's fwd+bwd with its GPU time, against the
eager and the CUDA-graph-replayed wall time (where the time outside the GEMMs goes).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from paddle_fastffn.torch import ops
from paddle_fastffn.torch.fp8 import ffn as fp8_ffn
from paddle_fastffn.torch.fp8 import c_api as fp8_c_api
from benchmarks.gpu.bench_gpu import (DT, GEMM_KERNEL_MARKS, ceilings, environment, fwd_bwd, graphed,
                                      kernel_times, leaf, peak_bytes, round_robin, saved_activation_bytes,
                                      timeit)

# hidden, intermediate: LLaMA-2 7B / 13B / 70B and Llama-3-8B.
WIDTHS = {"llama2_7b": (4096, 11008), "llama2_13b": (5120, 13824), "llama2_70b": (8192, 28672),
          "llama3_8b": (4096, 14336)}


class TorchFFN(torch.nn.Module):
    """LLaMA's MLP with PaddleNLP's fused gate_up weight, as torch Linear layers (what torchao
    converts)."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        super().__init__()
        inter, hidden = w_down.shape[1], w_down.shape[0]
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False, device=w_down.device, dtype=DT)
        self.down = torch.nn.Linear(inter, hidden, bias=False, device=w_down.device, dtype=DT)
        with torch.no_grad():
            self.gate_up.weight.copy_(w_gate_up)
            self.down.weight.copy_(w_down)

    def forward(self, x):  # eager_ffn's math through the Linear modules torchao replaces
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


def eager_ffn(x, w_gate_up, w_down):
    gate, up = (x @ w_gate_up.t()).chunk(2, -1)
    return (F.silu(gate) * up) @ w_down.t()


def torchao_ffn(w_gate_up, w_down, recipe: str):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    module = TorchFFN(w_gate_up, w_down)
    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))
    return torch.compile(module)


def module_step(module, x, dy):
    def run():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        module(x).backward(dy)
    return run


def six_fp8_gemms(x, w_gate_up, w_down, dy):
    """The GEMMs of fp8_ffn's composition (its docstring's table) on operands quantised once,
    outside the timing: what an FP8 FFN cannot go below."""
    k = fp8_c_api.kernels()
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    inter = w_down.shape[1]
    with torch.no_grad():
        gate_up = x @ w_gate_up.t()
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        q = {name: k.quantize(t, fmt, transpose=True)
             for name, t, fmt in (("x", x, e4m3), ("w_gu", w_gate_up, e4m3), ("w_d", w_down, e4m3),
                                  ("h", h, e4m3), ("dy", dy, e5m2), ("d_gu", gate_up, e5m2))}

    def run():
        k.gemm_q(q["x"], q["w_gu"], fast_accum=True)           # gate_up  [T, 2I]
        k.gemm_q(q["h"], q["w_d"], fast_accum=True)            # y        [T, H]
        k.gemm_q(q["dy"], q["w_d"], b_t=True)                  # d_h      [T, I]
        k.gemm_q(q["dy"], q["h"], a_t=True, b_t=True)          # d_W_d    [H, I]
        k.gemm_q(q["d_gu"], q["w_gu"], b_t=True)               # d_x      [T, H]
        k.gemm_q(q["d_gu"], q["x"], a_t=True, b_t=True)        # d_W_gu   [2I, H]
    return run


# Micro-batches per optimizer step of configs/llama2_7b_sft_*.json (4 x 2048 tokens each: this
# benchmark's 8192): the FP8 weight copies are quantised on the first of them and reused by the rest.
SFT_7B_ACCUMULATION = 4


def ours_fp8(x, w_gate_up, w_down, dy, kind, saved_gate_up="fp8"):
    state = fp8_ffn.Fp8FFNState(fp8_ffn.Fp8Recipe(scaling=kind, saved_gate_up=saved_gate_up), device=x.device)

    def forward(x, w_gu, w_d):
        state.cache.invalidate()  # one optimizer step per iteration
        return fp8_ffn.fp8_ffn(x, w_gu, w_d, state)
    return forward


def ours_fp8_accumulating(x, w_gate_up, w_down, dy, kind, micro_batches=SFT_7B_ACCUMULATION):
    """One micro-batch's fwd+bwd per call, the FP8 weight copies invalidated at every
    `micro_batches`-th call (an optimizer step), for round_robin's loop of `micro_batches` calls
    per sample (its warm-up runs whole loops too, so the first call of each sample quantises)."""
    state = fp8_ffn.Fp8FFNState(fp8_ffn.Fp8Recipe(scaling=kind), device=x.device)
    calls = [0]

    def run():
        if calls[0] % micro_batches == 0:
            state.cache.invalidate()
        calls[0] += 1
        for t in (x, w_gate_up, w_down):
            t.grad = None
        fp8_ffn.fp8_ffn(x, w_gate_up, w_down, state).backward(dy)
    return run


def ffn_contenders(hidden, inter, tokens, device="cuda"):
    """The FFN table's contenders at one shape: ({impl: (fn(x, w_gate_up, w_down), inputs)}, {impl:
    build() -> module}, {impl: make_run() -> run()} of the accumulating loop and the GEMM floor,
    x, w_gate_up, w_down, dy)."""
    torch.manual_seed(0)
    w_gate_up = (torch.randn(2 * inter, hidden, device=device) * 0.02).to(DT).requires_grad_()
    w_down = (torch.randn(hidden, inter, device=device) * 0.02).to(DT).requires_grad_()
    x = leaf((tokens, hidden), device=device)
    dy = torch.randn(tokens, hidden, device=device, dtype=DT)
    functional = {
        "eager_bf16": (eager_ffn, [x, w_gate_up, w_down]),
        "ours_bf16": (lambda x, a, b: ops.fused_ffn(x, a, b, True), [x, w_gate_up, w_down]),
        "ours_fp8_current": (ours_fp8(x, w_gate_up, w_down, dy, "current"), [x, w_gate_up, w_down]),
        "ours_fp8_delayed": (ours_fp8(x, w_gate_up, w_down, dy, "delayed"), [x, w_gate_up, w_down]),
        "ours_fp8_current_gate_up_activation": (ours_fp8(x, w_gate_up, w_down, dy, "current", "activation"),
                                                [x, w_gate_up, w_down]),
        "ours_fp8_delayed_gate_up_activation": (ours_fp8(x, w_gate_up, w_down, dy, "delayed", "activation"),
                                                [x, w_gate_up, w_down]),
    }
    modules = {"torch_compile_bf16": lambda: torch.compile(TorchFFN(w_gate_up.detach(), w_down.detach())),
               "torchao_tensorwise": lambda: torchao_ffn(w_gate_up.detach(), w_down.detach(), "tensorwise"),
               "torchao_rowwise": lambda: torchao_ffn(w_gate_up.detach(), w_down.detach(), "rowwise")}
    others = {"six_fp8_gemms_alone": lambda: six_fp8_gemms(x.detach(), w_gate_up.detach(), w_down.detach(), dy),
              **{f"ours_fp8_{kind}_accumulate{SFT_7B_ACCUMULATION}":
                 (lambda kind=kind: ours_fp8_accumulating(x, w_gate_up, w_down, dy, kind))
                 for kind in ("current", "delayed")}}
    return functional, modules, others, x, w_gate_up, w_down, dy


def ffn_rows(model, hidden, inter, tokens):
    # A fresh dynamo cache per shape: the compiled contenders share TorchFFN.forward's code object,
    # and after config.recompile_limit (8) recompiles dynamo silently runs it eager (seen in a run
    # that went through four widths: torchao at Llama-3-8B width timed as eager).
    torch._dynamo.reset()
    functional, modules, others, x, w_gate_up, w_down, dy = ffn_contenders(hidden, inter, tokens)
    rows, runs = [], {}
    for name, (fn, inputs) in functional.items():
        try:
            run = fwd_bwd(fn, inputs, [dy])
            runs[name] = (run, peak_bytes(run), saved_activation_bytes(fn, inputs))
        except Exception as error:  # noqa: BLE001
            rows.append({"model": model, "tokens": tokens, "impl": name, "error": repr(error)})
    for name, build in modules.items():
        try:
            module = build()
            run = module_step(module, x, dy)
            run()  # compile outside the timing
            runs[name] = (run, peak_bytes(run), saved_activation_bytes(module, [x]))
        except Exception as error:  # noqa: BLE001
            rows.append({"model": model, "tokens": tokens, "impl": name, "error": repr(error)})
    try:
        runs["six_fp8_gemms_alone"] = (others["six_fp8_gemms_alone"](), None, None)
    except Exception as error:  # noqa: BLE001
        rows.append({"model": model, "tokens": tokens, "impl": "six_fp8_gemms_alone", "error": repr(error)})
    reps = 12 if tokens >= 16384 else 20
    timings = round_robin({name: r[0] for name, r in runs.items()}, reps=reps)
    flops = 3 * 2 * tokens * hidden * 3 * inter  # bf16-equivalent: 3 GEMMs forward, 6 in all, x3 of fwd
    for name, (_, peak, saved) in runs.items():
        rows.append({"model": model, "tokens": tokens, "impl": name, **timings[name], "peak_bytes": peak,
                     "saved_activation_bytes": saved, "tflops": flops / (timings[name]["p50_ms"] * 1e-3) / 1e12})
    # Gradient accumulation: the same 4-call loop for every contender that has a per-call weight cast
    # or none (ours FP8 with its cache; torchao and the bf16 contenders call for call).
    accumulating = {f"{name}_accumulate{SFT_7B_ACCUMULATION}": runs[name][0] for name in
                    ("eager_bf16", "ours_bf16", "torch_compile_bf16", "torchao_tensorwise", "torchao_rowwise")
                    if name in runs}
    for kind in ("current", "delayed"):
        name = f"ours_fp8_{kind}_accumulate{SFT_7B_ACCUMULATION}"
        accumulating[name] = others[name]()
    timings = round_robin(accumulating, reps=max(3, reps // 2), calls=SFT_7B_ACCUMULATION)
    for name, timing in timings.items():
        rows.append({"model": model, "tokens": tokens, "impl": name, **timing,
                     "micro_batches_per_sample": SFT_7B_ACCUMULATION,
                     "tflops": flops / (timing["p50_ms"] * 1e-3) / 1e12})
    return rows


def replay_timeline(replay, reps=5):
    """The kernels of `reps` back-to-back graph replays as profile_step's timeline (busy, idle,
    largest gaps): what of the replayed wall time is not kernel time."""
    from benchmarks.gpu.profile_step import kernel_timeline

    replay()
    timeline = kernel_timeline(replay, reps, top=12)
    timeline.pop("kernel_ms_by_category", None)
    return timeline


def profile_rows(models, tokens=8192):
    """Where the FP8 FFN's time goes, per recipe: the GPU time of every kernel (profiler), their sum,
    the eager wall time (CUDA events, as the FFN table times it) and the same fwd+bwd replayed from
    a CUDA graph (no host launch cost). eager - kernel sum = time the GPU waited for the host;
    kernels that are not GEMMs = the quantisation and scaling work the FFN adds to its GEMMs;
    graph_timeline = the replays' kernel timeline (idle inside the graph, largest gaps)."""
    rows = []
    for model in models:
        hidden, inter = WIDTHS[model]
        torch.manual_seed(0)
        w_gate_up = (torch.randn(2 * inter, hidden, device="cuda") * 0.02).to(DT).requires_grad_()
        w_down = (torch.randn(hidden, inter, device="cuda") * 0.02).to(DT).requires_grad_()
        x = leaf((tokens, hidden))
        dy = torch.randn(tokens, hidden, device="cuda", dtype=DT)
        for kind in ("current", "delayed"):
            run = fwd_bwd(ours_fp8(x, w_gate_up, w_down, dy, kind), [x, w_gate_up, w_down], [dy])
            row = {"model": model, "tokens": tokens, "impl": f"ours_fp8_{kind}"}
            try:
                kernels = kernel_times(run, reps=5)
                gemm_ms = sum(t for name, t in kernels.items() if any(s in name.lower() for s in GEMM_KERNEL_MARKS))
                row.update(kernels_ms=kernels, kernel_sum_ms=sum(kernels.values()), gemm_ms=gemm_ms,
                           eager=timeit(run))
                try:
                    replay = graphed(run)
                    row["graph_replay"] = timeit(replay)
                    row["graph_timeline"] = replay_timeline(replay)
                except Exception as error:  # noqa: BLE001
                    row["graph_replay"] = {"error": repr(error)}
            except Exception as error:  # noqa: BLE001
                row["error"] = repr(error)
            rows.append(row)
            print(f"profile {model} {kind}: " + (row.get("error") or
                  f"eager {row['eager']['p50_ms']:.3f} ms, kernels {row['kernel_sum_ms']:.3f} ms "
                  f"(GEMMs {row['gemm_ms']:.3f}), graph {row['graph_replay'].get('p50_ms', float('nan')):.3f} ms"),
                  flush=True)
        del w_gate_up, w_down, x, dy
        torch.cuda.empty_cache()
    return rows


# (the row's name, its amax-only pass, its quantising pass, the scales its amax pass gives): current
# scaling's cost per tensor, the amax pass and scale update added to the quantising pass.
CURRENT_SCALING_ROWS = (
    ("quantize_cast_transpose", "quantize_amax_only", "quantize_cast_transpose", 1),
    ("swiglu_fwd_fp8", "swiglu_fwd_fp8_amax_only", "swiglu_fwd_fp8", 1),
    ("swiglu_bwd_fp8", "swiglu_bwd_fp8_amax_only", "swiglu_bwd_fp8", 1),
    ("swiglu_fwd_fp8_with_gate_up", "swiglu_fwd_fp8_with_gate_up_amax_only", "swiglu_fwd_fp8_with_gate_up", 2))


def quantization_kernels(hidden: int, inter: int, tokens: int, device="cuda"):
    """The FP8 FFN's quantisation kernels at one width, each as (a call, the bytes it moves: each
    input read once, each output written once; an amax-only pass reads its input), scale_update()
    (current scaling's scale from the amax) and the amax they accumulate into, on `device`'s
    kernels."""
    k = fp8_c_api.kernels()
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    one = fp8_c_api.scalar(1.0, device)
    amax, scale, scale_inv = (fp8_c_api.scalar(0.0, device), fp8_c_api.scalar(1.0, device),
                              fp8_c_api.scalar(1.0, device))
    x = torch.randn(tokens, hidden, device=device, dtype=DT)
    gate_up = torch.randn(tokens, 2 * inter, device=device, dtype=DT)
    d_h = torch.randn(tokens, inter, device=device, dtype=DT)
    x_bytes, gu_bytes, h_bytes = x.numel() * 2, gate_up.numel() * 2, d_h.numel() * 2
    q_gate_up = k.quantize(gate_up, e4m3, one, transpose=False).data
    # a frozen FFN weight's FP8 copy [I, H]: its dgrad copy is made per backward (frozen_weights "fp8")
    q_weight = k.quantize(torch.randn(inter, hidden, device=device, dtype=DT), e4m3, one, transpose=False).data
    amax2 = fp8_c_api.scalar(0.0, device)

    def scale_update():
        k.compute_scale(amax, scale, scale_inv, 448.0)

    kernels = {
        # x [T, H] -> q(x) and q(x)^T (the FFN input; dy [T, H] is the same kernel in e5m2)
        "quantize_cast_transpose": (lambda: k.quantize(x, e4m3, one, amax=amax), x_bytes + x_bytes // 2 * 2),
        "quantize_amax_only": (lambda: k.quantize(x, e4m3, None, rowwise=False, transpose=False, amax=amax),
                               x_bytes),
        # gate_up [T, 2I] -> q(h) [T, I]
        "swiglu_fwd_fp8": (lambda: k.swiglu_fwd_fp8(gate_up, e4m3, one, amax=amax), gu_bytes + h_bytes // 2),
        "swiglu_fwd_fp8_amax_only": (lambda: k.swiglu_fwd_fp8(gate_up, e4m3, rowwise=False, amax=amax), gu_bytes),
        # gate_up, d_h -> q(d_gu) [T, 2I] and q(d_gu)^T, and the recomputed q(h)^T [I, T]
        "swiglu_bwd_fp8": (lambda: k.swiglu_bwd_fp8(gate_up, d_h, e5m2, one, amax=amax, h=e4m3, h_scale=one),
                           gu_bytes + h_bytes + gu_bytes // 2 * 2 + h_bytes // 2),
        "swiglu_bwd_fp8_amax_only": (lambda: k.swiglu_bwd_fp8(gate_up, d_h, e5m2, rowwise=False, transpose=False,
                                                              amax=amax), gu_bytes + h_bytes),
        # saved_gate_up "fp8": the forward also writes q(gate_up) [T, 2I] (its amax pass gives both
        # amaxes), and the backward reads that copy instead of the 16-bit gate_up
        "swiglu_fwd_fp8_with_gate_up": (
            lambda: k.swiglu_fwd_fp8_with_gate_up(gate_up, e4m3, one, amax=amax, gate_up_scale=one,
                                                  gate_up_rowwise=True, gate_up_amax=amax2),
            gu_bytes + h_bytes // 2 + gu_bytes // 2),
        "swiglu_fwd_fp8_with_gate_up_amax_only": (
            lambda: k.swiglu_fwd_fp8_with_gate_up(gate_up, e4m3, rowwise=False, amax=amax, gate_up_amax=amax2),
            gu_bytes),
        "swiglu_bwd_fp8_from_fp8_gate_up": (
            lambda: k.swiglu_bwd_fp8(q_gate_up, d_h, e5m2, one, amax=amax, h=e4m3, h_scale=one,
                                     gate_up_scale_inv=one),
            gu_bytes // 2 + h_bytes + gu_bytes // 2 * 2 + h_bytes // 2),
        "fp8_transpose_weight": (lambda: k.transpose(q_weight), q_weight.numel() * 2),
        "torch_fp8_transpose_weight": (lambda: q_weight.t().contiguous(), q_weight.numel() * 2),
    }
    return kernels, scale_update, amax


def current_scaling(kernels: dict, scale_update, amax, row: tuple):
    """One tensor's quantisation under current scaling (`row` of CURRENT_SCALING_ROWS): the amax
    zeroed, the amax pass, as many scale updates as the pass gives scales, the quantising pass."""
    _, amax_pass, quant, scales = row
    first, second = kernels[amax_pass][0], kernels[quant][0]

    def composite():
        amax.zero_()
        first()
        for _ in range(scales):
            scale_update()
        second()
    return composite


def quantization_kernel_rows(copy_bw, tokens=8192):
    """Each quantisation kernel of the FP8 FFN alone (quantization_kernels), CUDA-graph timing, as a
    fraction of the copy bandwidth measured in the same run. The "current" rows add current
    scaling's amax pass and scale update to the quantising pass: what that recipe pays per tensor."""
    rows = []
    for model, (hidden, inter) in WIDTHS.items():
        kernels, scale_update, amax = quantization_kernels(hidden, inter, tokens)
        for name, (fn, nbytes) in kernels.items():
            t = timeit(graphed(fn))
            rows.append({"model": model, "tokens": tokens, "kernel": name, "bytes": nbytes, **t,
                         "fraction_of_copy": nbytes / (t["p50_ms"] * 1e-3) / copy_bw})
        for row in CURRENT_SCALING_ROWS:
            t = timeit(graphed(current_scaling(kernels, scale_update, amax, row)))
            nbytes = kernels[row[2]][1]
            rows.append({"model": model, "tokens": tokens, "kernel": f"{row[0]}_current_scaling", "bytes": nbytes,
                         **t, "fraction_of_copy": nbytes / (t["p50_ms"] * 1e-3) / copy_bw})
        del kernels
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--models", nargs="+", default=list(WIDTHS))
    parser.add_argument("--sections", default="quantization,ffn")
    parser.add_argument("--profile-models", nargs="+", default=["llama2_7b", "llama3_8b"])
    args = parser.parse_args()
    sections = args.sections.split(",")
    started = time.time()
    report = {"environment": environment(), "command": "python3 -m benchmarks.gpu.bench_fp8_ffn " +
              " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()),
              "note": "fwd+bwd of LLaMA's SwiGLU FFN, bf16 activations; FP8 = e4m3 forward, e5m2 gradients, "
                      "per-tensor scales, weights re-quantised every step",
              "ceilings": ceilings(), "ffn": []}
    try:  # this benchmark runs torchao's rows: where it cannot import, the record says why
        import torchao
        report["environment"]["torchao"] = torchao.__version__
    except Exception as error:  # noqa: BLE001
        report["environment"]["torchao"] = f"unavailable: {error!r}"
    if "quantization" in sections:
        report["quantization_kernels"] = quantization_kernel_rows(report["ceilings"]["copy_bytes_per_s"])
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        for row in report["quantization_kernels"]:
            print(f"{row['model']:11s} {row['kernel']:40s} {row['p50_ms'] * 1e3:8.1f} us "
                  f"{row['fraction_of_copy']:.1%} of copy", flush=True)
    if "profile" in sections:
        report["profile"] = profile_rows(args.profile_models, args.tokens[0])
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    for model in (args.models if "ffn" in sections else []):
        hidden, inter = WIDTHS[model]
        for tokens in args.tokens:
            report["ffn"] += ffn_rows(model, hidden, inter, tokens)
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
            print(f"{model} T={tokens} done at {time.time() - started:.0f}s", flush=True)
    for row in report["ffn"]:
        if "p50_ms" in row:
            print(f"{row['model']:11s} {row['tokens']:6d} {row['impl']:22s} {row['p50_ms']:8.3f} ms "
                  f"{row['tflops']:7.1f} TFLOP/s  saved {(row.get('saved_activation_bytes') or 0) / 2**30:.3f} GiB")  # accumulate rows have none
        else:
            print(f"{row['model']:11s} {row['tokens']:6d} {row['impl']:22s} ERROR {row['error'][:200]}")


if __name__ == "__main__":
    main()
