"""GPU benchmark through the standalone harness, every baseline in the same run:

    python3 -m benchmarks.gpu.bench_gpu --out results.json [--quick]

1. ceilings: device copy bandwidth and bf16 GEMM rate, measured now;
2. kernels (bf16, 8192 tokens, LLaMA-2 7B/13B/70B widths): ours vs PyTorch eager, the same under
   torch.compile and Liger-Kernel, each in its users' layout, GB/s and fraction of the copy bandwidth (bytes = each input read once
   + each output written once);
3. FFN forward+backward (7B/13B/70B x 2048/8192/16384 tokens): the six GEMMs of our composition
   alone, eager unfused, eager fused gate_up, Liger SwiGLU, ours (recompute on/off), and
   torch.compile at 8192 tokens; time and peak memory;
4. decoder layer forward+backward at 7B (4 x 2048) and Llama-3-8B (2 x 4096): ours vs Hugging Face
   LlamaDecoderLayer eager, under torch.compile and patched by Liger; time, model TFLOP/s, peak
   memory, kernel-time breakdown.

Every table is timed round-robin (round_robin: each repeat runs every contender once, the order
rotated per repeat, at least 3 repeats; median and spread, compared by benchmarks/common.py's
TIE_RULE).

Our kernels are the csrc/kernels CUDA sources that the Paddle bindings call; torch's cuBLAS and
SDPA stand in for Paddle's GEMMs and flash attention.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import itertools
import json
import subprocess
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.common import MIN_REPEATS, percentiles, rotated, summarize_rounds
from paddle_fastffn.torch import c_api, ops
from paddle_fastffn.torch.llama import FastDecoderLayer

DT = torch.bfloat16
MODELS = {"7B": (4096, 11008, 32, 32), "13B": (5120, 13824, 40, 40), "70B": (8192, 28672, 64, 8)}
_L2_FLUSH: torch.Tensor | None = None


def _flush_l2():
    global _L2_FLUSH
    if _L2_FLUSH is None:
        _L2_FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    _L2_FLUSH.zero_()


def _time_once(fn, flush=True, calls=1) -> float:
    """`calls` back-to-back calls timed with CUDA events (ms for all of them), after evicting L2 so
    inputs come from HBM: one flush and one synchronisation per sample, whatever `calls` is."""
    if flush:
        _flush_l2()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def timeit(fn, reps=20, warmup=3, flush=True):
    """One contender alone (ceilings, sweeps of one kernel's builds). Tables that compare
    contenders use round_robin."""
    for _ in range(warmup):
        fn()
    return percentiles([_time_once(fn, flush) for _ in range(reps)])


def round_robin(fns: dict, reps=20, warmup=2, calls=1, flush=True, contexts=None):
    """Every table's timing loop: each repeat times every contender once, in an order rotated by one
    per repeat (common.rotated), at least common.MIN_REPEATS repeats; a sample is `calls`
    back-to-back calls after one L2 flush with one synchronisation, the same loop for everyone, and
    counts ms per call. contexts: {name: context manager factory} entered around that contender's
    warm-up and each of its samples, outside the CUDA events (e.g. Liger's module-level patch,
    which must not leak into the Hugging Face eager contender). Returns {name: percentiles + spread}."""
    reps = max(reps, MIN_REPEATS)
    contexts = contexts or {}
    names = list(fns)

    def entered(name):
        return contexts.get(name, contextlib.nullcontext)()

    for name in names:
        with entered(name):
            for _ in range(warmup * calls):
                fns[name]()
    samples = {name: [] for name in names}
    for repeat in range(reps):
        for name in rotated(names, repeat):
            with entered(name):
                samples[name].append(_time_once(fns[name], flush, calls) / calls)
    return {name: {**percentiles(values), "timing": "round_robin", "calls_per_sample": calls}
            for name, values in samples.items()}


def timeit_interleaved(fns: dict, reps=20, warmup=2):
    """round_robin with one call per sample (the name earlier results were written under)."""
    return round_robin(fns, reps=reps, warmup=warmup)


def round_robin_rebuilt(builders: dict, rounds=MIN_REPEATS, on_round=lambda name, index, row: None):
    """For contenders too large to be held side by side (whole models with optimizer state): each
    round builds, measures and frees every contender once, in an order rotated by one per round.
    builders: {name: () -> {"<metric>_ms": ms, ...; other keys kept from the first round}}; a builder
    that raises gives that contender an error row. Returns {name: {"<metric>": percentiles over the
    rounds (median, spread), ..., "rounds": every round's row, ...the first round's other fields}}."""
    rounds = max(rounds, MIN_REPEATS)
    names = list(builders)
    per_round = {name: [] for name in names}
    errors = {}
    for index in range(rounds):
        for name in rotated(names, index):
            if name in errors:
                continue
            try:
                row = builders[name]()
            except Exception as error:  # noqa: BLE001
                errors[name] = {"error": repr(error), "trace": traceback.format_exc()[-2500:], "round": index}
                row = None
            gc.collect()
            torch.cuda.empty_cache()
            if row is not None:
                per_round[name].append(row)
            on_round(name, index, row if row is not None else errors[name])
    results = {}
    for name in names:
        if name in errors and not per_round[name]:
            results[name] = errors[name]
            continue
        timings = [{k[:-3]: v for k, v in r.items() if k.endswith("_ms")} for r in per_round[name]]
        first = {k: v for k, v in per_round[name][0].items() if not k.endswith("_ms")}
        results[name] = {**first, **summarize_rounds(timings), "rounds": per_round[name],
                         **({"error_in_later_round": errors[name]} if name in errors else {})}
    return results


def saved_activation_bytes(fn, inputs):
    """Memory held between forward and backward: what the FFN keeps for its backward."""
    for t in inputs:
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(*inputs)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del out
    return held


def graphed(fn):
    """Captures fn (a forward or forward+backward) in a CUDA graph and returns its replay, so the
    timing is the GPU's and not Python's launch overhead (applied to every implementation)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def peak_bytes(fn):
    fn()  # gradients exist afterwards: measure the steady state of a training step
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def environment():
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as error:  # noqa: BLE001
            return f"unavailable: {error}"

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
        "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "nvcc": run(["nvcc", "--version"]).splitlines()[-1] if run(["nvcc", "--version"]) else "",
        "liger_kernel": _liger_version(),
        "transformers": _version("transformers"),
        # the installed wheel's version: importing torchao takes seconds and registers its ops in
        # every benchmark, most of which never run it
        "torchao": _distribution_version("torchao"),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _version(name):
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001
        return None


def _distribution_version(distribution: str):
    try:
        from importlib.metadata import version
        return version(distribution)
    except Exception:  # noqa: BLE001
        return None


def _liger_version():
    return _distribution_version("liger-kernel")


def ceilings():
    n = 1 << 30  # 1 GiB each way
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    copy = timeit(lambda: dst.copy_(src), reps=20, flush=False)
    copy_bw = 2 * n / (copy["p50_ms"] * 1e-3)
    a, b = torch.randn(8192, 8192, device="cuda", dtype=DT), torch.randn(8192, 8192, device="cuda", dtype=DT)
    gemm = timeit(lambda: a @ b, reps=20, flush=False)
    return {"copy_bytes_per_s": copy_bw, "copy_ms": copy,
            "bf16_gemm_tflops": 2 * 8192**3 / (gemm["p50_ms"] * 1e-3) / 1e12}


def leaf(shape, scale=1.0, device="cuda"):
    return (torch.randn(shape, device=device) * scale).to(DT).requires_grad_()


def fwd_bwd(fn, inputs, upstream):
    def run():
        for t in inputs:
            t.grad = None
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, upstream)
    return run


def fwd_only(fn, inputs):
    def run():
        with torch.no_grad():
            fn(*inputs)
    return run


def record_kernel_rows(rows, copy_bw, op, model, pass_name, nbytes, impls):
    """The kernel tables' measurement: every impl captured in a CUDA graph, then eager launches and
    graph replays each timed round-robin across the impls (graph replay is the kernel's time,
    eager adds launches); a row per impl appended to rows (an error row where it fails)."""
    replays = {}
    for name, fn in impls.items():
        try:
            fn()  # first-call work (torch.compile, Triton JIT) on the default stream, before capture
            replays[name] = graphed(fn)
        except Exception as error:  # noqa: BLE001
            rows.append({"op": op, "model": model, "pass": pass_name, "impl": name, "bytes": nbytes,
                         "error": repr(error)})
    eager = round_robin({name: impls[name] for name in replays})
    graph = round_robin(replays)
    for name, t in graph.items():
        gbps = nbytes / (t["p50_ms"] * 1e-3)
        rows.append({"op": op, "model": model, "pass": pass_name, "impl": name, "bytes": nbytes,
                     "eager_launch": eager[name], **t, "timing": "cuda_graph_round_robin",
                     "GB_per_s": gbps / 1e9, "fraction_of_copy": gbps / copy_bw})


def add_compiled(impls_fwd, impls_fb, eager_fn, inputs, upstream):
    """torch.compile of the eager function (default mode, static shapes) as one more peer: the
    tables name it where it is the fastest."""
    compiled = torch.compile(eager_fn, dynamic=False)
    impls_fwd["torch_compile"] = fwd_only(compiled, inputs)
    impls_fb["torch_compile"] = fwd_bwd(compiled, inputs, upstream)


def rotary_contenders(tokens, hidden, heads, kv_heads, liger, eager=True, seq=2048, device="cuda"):
    """Rotary on q and k (grouped-query for 70B), each impl in its users' layout: ours reads the
    [b, s, h, d] projection output; Hugging Face's rope (eager, and Liger's, which replaces it)
    gets what HF hands it, q/k of [b, h, s, d] shape as transposed views of [b, s, h, d]
    (LlamaAttention's view(...).transpose(1, 2)), and upstream gradients in that layout (SDPA's
    backward returns them so). Liger 0.8.5 (ops/rope.py) transposes back to [b, s, h, d], which is
    then contiguous, and rotates in place (no copy; the leaves here change each call, rotated,
    which the timing does not notice); fed contiguous [b, h, s, d] (runs up to 14) it copied q
    and k, and the gradients in backward, before rotating. eager: also HF's eager rope and its
    torch.compile. Returns ({impl: fwd}, {impl: fwd+bwd}, fwd bytes, fwd+bwd bytes): q and k read
    and written once per pass."""
    e = 2  # bf16 bytes
    batch, d = tokens // seq, hidden // heads
    q_bshd, k_bshd = leaf((batch, seq, heads, d), device=device), leaf((batch, seq, kv_heads, d), device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    emb = torch.cat([torch.outer(torch.arange(seq, device=device).float(), inv)] * 2, -1)
    cos32, sin32 = emb.cos().contiguous(), emb.sin().contiguous()
    cos_hf, sin_hf = cos32.to(DT)[None], sin32.to(DT)[None]
    du_q, du_k = torch.randn_like(q_bshd), torch.randn_like(k_bshd)

    def hf_layout(fn):
        """fn(q, k) on HF's [b, h, s, d] views of the [b, s, h, d] leaves."""
        return lambda q, k: fn(q.transpose(1, 2), k.transpose(1, 2))

    def eager_rope(q, k):
        c, s = cos_hf.unsqueeze(1), sin_hf.unsqueeze(1)
        rot = lambda x: torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)  # noqa: E731
        return q * c + rot(q) * s, k * c + rot(k) * s

    hf_upstream = [du_q.transpose(1, 2), du_k.transpose(1, 2)]
    ours_rope = lambda q, k: ops.Rotary.apply(q, k, cos32, sin32, None)  # noqa: E731
    impls_fwd, impls_fb = {}, {}
    if eager:
        impls_fwd["eager"] = fwd_only(hf_layout(eager_rope), [q_bshd, k_bshd])
        impls_fb["eager"] = fwd_bwd(hf_layout(eager_rope), [q_bshd, k_bshd], hf_upstream)
    impls_fwd["ours"] = fwd_only(ours_rope, [q_bshd, k_bshd])
    impls_fb["ours"] = fwd_bwd(ours_rope, [q_bshd, k_bshd], [du_q, du_k])
    if eager:
        add_compiled(impls_fwd, impls_fb, hf_layout(eager_rope), [q_bshd, k_bshd], hf_upstream)
    if liger:
        from liger_kernel.ops.rope import LigerRopeFunction
        lig_rope = hf_layout(lambda q, k: LigerRopeFunction.apply(q, k, cos_hf, sin_hf))
        impls_fwd["liger"] = fwd_only(lig_rope, [q_bshd, k_bshd])
        impls_fb["liger"] = fwd_bwd(lig_rope, [q_bshd, k_bshd], hf_upstream)
    qk_bytes = (q_bshd.numel() + k_bshd.numel()) * e
    return impls_fwd, impls_fb, 2 * qk_bytes, 4 * qk_bytes


def kernel_contenders(tokens, hidden, inter, heads, kv_heads, liger, seq=2048, device="cuda"):
    """The kernels section's tables for one model, one at a time: yields (op, pass, bytes, {impl:
    run()}); each op's tensors are released when the next is asked for."""
    e = 2  # bf16 bytes
    # SwiGLU, separate gate and up (HF / Liger layout) and packed (Paddle's gate_up_fused_proj).
    gate, up = leaf((tokens, inter), 2.0, device), leaf((tokens, inter), device=device)
    packed = leaf((tokens, 2 * inter), 2.0, device)
    d_h = torch.randn(tokens, inter, device=device, dtype=DT)
    eager = lambda g, u: F.silu(g) * u  # noqa: E731
    impls_fwd = {"eager": fwd_only(eager, [gate, up]), "ours": fwd_only(harness_pair, [gate, up]),
                 "ours_packed": fwd_only(ops.SwiGLU.apply, [packed])}
    impls_fb = {"eager": fwd_bwd(eager, [gate, up], [d_h]), "ours": fwd_bwd(harness_pair, [gate, up], [d_h]),
                "ours_packed": fwd_bwd(ops.SwiGLU.apply, [packed], [d_h])}
    add_compiled(impls_fwd, impls_fb, eager, [gate, up], [d_h])
    if liger:
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction, LigerSiLUMulFunction
        impls_fwd["liger"] = fwd_only(LigerSiLUMulFunction.apply, [gate, up])
        impls_fb["liger"] = fwd_bwd(LigerSiLUMulFunction.apply, [gate, up], [d_h])
        impls_fwd["liger_packed"] = fwd_only(LigerFusedGateUpSiLUMulFunction.apply, [packed])
        impls_fb["liger_packed"] = fwd_bwd(LigerFusedGateUpSiLUMulFunction.apply, [packed], [d_h])
    yield "swiglu", "fwd", 3 * tokens * inter * e, impls_fwd
    yield "swiglu", "fwd+bwd", 8 * tokens * inter * e, impls_fb
    del gate, up, packed, d_h, impls_fwd, impls_fb

    # RMSNorm and residual-add + RMSNorm.
    x, r, w = leaf((tokens, hidden), device=device), leaf((tokens, hidden), device=device), leaf((hidden,), device=device)
    dy, ds = torch.randn_like(x), torch.randn_like(x)
    eps = 1e-6

    def eager_norm(x, w):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return w * (x.float() * torch.rsqrt(v + eps)).to(x.dtype)

    ours_norm = lambda x, w: ops.RMSNorm.apply(x, w, eps)  # noqa: E731
    impls_fwd = {"eager": fwd_only(eager_norm, [x, w]), "ours": fwd_only(ours_norm, [x, w])}
    impls_fb = {"eager": fwd_bwd(eager_norm, [x, w], [dy]), "ours": fwd_bwd(ours_norm, [x, w], [dy])}
    add_compiled(impls_fwd, impls_fb, eager_norm, [x, w], [dy])
    if liger:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        lig = lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)  # noqa: E731
        impls_fwd["liger"] = fwd_only(lig, [x, w])
        impls_fb["liger"] = fwd_bwd(lig, [x, w], [dy])
    yield "rms_norm", "fwd", 2 * tokens * hidden * e, impls_fwd
    yield "rms_norm", "fwd+bwd", 5 * tokens * hidden * e, impls_fb

    def eager_add(x, r, w):
        s = x + r
        return eager_norm(s, w), s

    ours_add = lambda x, r, w: ops.AddRMSNorm.apply(x, r, w, eps)  # noqa: E731
    impls_fwd = {"eager": fwd_only(eager_add, [x, r, w]), "ours": fwd_only(ours_add, [x, r, w])}
    impls_fb = {"eager": fwd_bwd(eager_add, [x, r, w], [dy, ds]),
                "ours": fwd_bwd(ours_add, [x, r, w], [dy, ds])}
    add_compiled(impls_fwd, impls_fb, eager_add, [x, r, w], [dy, ds])
    if liger:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        lig_add = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)  # noqa: E731
        impls_fwd["liger"] = fwd_only(lig_add, [x, r, w])
        impls_fb["liger"] = fwd_bwd(lig_add, [x, r, w], [dy, ds])
    # fwd: read x, r; write out, sum. bwd: read sum, d_out, d_sum; write d_x.
    yield "fused_add_rms_norm", "fwd", 4 * tokens * hidden * e, impls_fwd
    yield "fused_add_rms_norm", "fwd+bwd", 8 * tokens * hidden * e, impls_fb
    del x, r, w, dy, ds, impls_fwd, impls_fb

    impls_fwd, impls_fb, fwd_bytes, fwd_bwd_bytes = rotary_contenders(tokens, hidden, heads, kv_heads, liger,
                                                                      seq=seq, device=device)
    yield "rotary", "fwd", fwd_bytes, impls_fwd
    yield "rotary", "fwd+bwd", fwd_bwd_bytes, impls_fb


def kernel_section(copy_bw, tokens, liger):
    rows = []
    for model, (hidden, inter, heads, kv_heads) in MODELS.items():
        for op, pass_name, nbytes, impls in kernel_contenders(tokens, hidden, inter, heads, kv_heads, liger):
            record_kernel_rows(rows, copy_bw, op, model, pass_name, nbytes, impls)
            del impls
        torch.cuda.empty_cache()
    return rows


def harness_pair(g, u):
    """The product's two-input SwiGLU (core.swiglu.SwiGLU through the harness; the inputs kept, as
    for a caller that still holds them)."""
    return ops.SwiGLUPair.apply(g, u, False)


def rms_sweep_contenders(tokens, hidden, impl, device="cuda"):
    """The rms_sweep's forward runs of one model for impl "ours" (whichever build c_api._KERNELS
    holds) or "liger": ((op, run(), bytes), ...)."""
    x, r, w = leaf((tokens, hidden), device=device), leaf((tokens, hidden), device=device), leaf((hidden,), device=device)
    if impl == "ours":
        return (("rms_norm", fwd_only(lambda x, w: ops.RMSNorm.apply(x, w, 1e-6), [x, w]), 2 * tokens * hidden * 2),
                ("fused_add_rms_norm", fwd_only(lambda x, r, w: ops.AddRMSNorm.apply(x, r, w, 1e-6), [x, r, w]),
                 4 * tokens * hidden * 2))
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return (("rms_norm", fwd_only(lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False), [x, w]),
             2 * tokens * hidden * 2),
            ("fused_add_rms_norm", fwd_only(lambda x, r, w: LigerFusedAddRMSNormFunction.apply(
                x, r, w, 1e-6, 0.0, "llama", False), [x, r, w]), 4 * tokens * hidden * 2))


def rms_sweep_section(copy_bw, tokens=8192):
    """RMSNorm forward (and fused add) at each vectors-per-thread setting of the cached kernel, with
    Liger's measured in the same run for reference."""
    rows = []
    default = c_api._KERNELS
    for per_thread in (1, 2, 4, 8):
        c_api._KERNELS = c_api.Kernels(c_api.build(defines=(f"FASTFFN_RMS_NORM_VECS_PER_THREAD={per_thread}",)))
        for model, (hidden, *_rest) in MODELS.items():
            for op, fn, nbytes in rms_sweep_contenders(tokens, hidden, "ours"):
                t = timeit(graphed(fn))
                rows.append({"op": op, "model": model, "vecs_per_thread": per_thread, **t,
                             "fraction_of_copy": nbytes / (t["p50_ms"] * 1e-3) / copy_bw})
    c_api._KERNELS = default
    if _liger_version() is not None:
        for model, (hidden, *_rest) in MODELS.items():
            for op, fn, nbytes in rms_sweep_contenders(tokens, hidden, "liger"):
                t = timeit(graphed(fn))
                rows.append({"op": op, "model": model, "impl": "liger", **t,
                             "fraction_of_copy": nbytes / (t["p50_ms"] * 1e-3) / copy_bw})
    return rows


def rope_sweep_section(copy_bw, liger, tokens=8192):
    """Our rotary at each FASTFFN_ROTARY_HEADS_PER_THREAD value (build_definition's
    ROTARY_HEADS_PER_THREAD; `ours` is the default build, 1 head per thread) against Liger's, forward
    and forward+backward at the kernels section's widths, layouts and byte counts
    (rotary_contenders), timed as that section times them (record_kernel_rows): the builds' libraries
    are loaded side by side and each contender switches the harness to its own before it runs, so its
    CUDA graph holds that build's kernel and every build shares one round-robin table with Liger."""
    default = c_api.kernels()
    builds = {("ours" if h == 1 else f"ours_heads_per_thread_{h}"): (h, kernels)
              for h, kernels in c_api.rotary_heads_per_thread_kernels().items()}

    def on_build(kernels, fn):
        def run():
            c_api._KERNELS = kernels
            fn()
        return run

    rows = []
    try:
        for model, (hidden, _, heads, kv_heads) in MODELS.items():
            impls_fwd, impls_fb, fwd_bytes, fwd_bwd_bytes = rotary_contenders(tokens, hidden, heads, kv_heads, liger,
                                                                              eager=False)
            for pass_name, impls, nbytes in (("fwd", impls_fwd, fwd_bytes), ("fwd+bwd", impls_fb, fwd_bwd_bytes)):
                ours = impls.pop("ours")
                impls = {**{name: on_build(kernels, ours) for name, (_, kernels) in builds.items()}, **impls}
                record_kernel_rows(rows, copy_bw, "rotary", model, pass_name, nbytes, impls)
            del impls_fwd, impls_fb
            torch.cuda.empty_cache()
            print(f"rope_sweep {model}: " + ", ".join(
                f"{r['pass']} {r['impl']} {r['fraction_of_copy'] * 100:.0f}%" for r in rows
                if r["model"] == model and "fraction_of_copy" in r), flush=True)
    finally:
        c_api._KERNELS = default
    for row in rows:
        if row["impl"] in builds:
            row["heads_per_thread"] = builds[row["impl"]][0]
    return rows


def ffn_section(token_list, liger, compile_tokens):
    rows = []
    for model, (hidden, inter, _, _) in MODELS.items():
        w_gu = (torch.randn(2 * inter, hidden, device="cuda") * 0.02).to(DT).requires_grad_()
        w_g, w_u = [t.detach().clone().requires_grad_() for t in w_gu.chunk(2, 0)]
        w_d = (torch.randn(hidden, inter, device="cuda") * 0.02).to(DT).requires_grad_()
        for tokens in token_list:
            x = leaf((tokens, hidden))
            dy = torch.randn(tokens, hidden, device="cuda", dtype=DT)

            def unfused(x, w_g, w_u, w_d):
                return (F.silu(x @ w_g.t()) * (x @ w_u.t())) @ w_d.t()

            def fused_gate_up(x, w_gu, w_d):
                g, u = (x @ w_gu.t()).chunk(2, -1)
                return (F.silu(g) * u) @ w_d.t()

            variants = {
                "eager_unfused": (unfused, [x, w_g, w_u, w_d]),
                "eager_fused_gate_up": (fused_gate_up, [x, w_gu, w_d]),
                "ours_recompute": (lambda x, a, b: ops.fused_ffn(x, a, b, True), [x, w_gu, w_d]),
                "ours_no_recompute": (lambda x, a, b: ops.fused_ffn(x, a, b, False), [x, w_gu, w_d]),
                "ours_fused_gemm_recompute": (lambda x, a, b: ops.fused_ffn(x, a, b, True, False), [x, w_gu, w_d]),
                "ours_split_gemm_recompute": (lambda x, a, b: ops.fused_ffn(x, a, b, True, True), [x, w_gu, w_d]),
            }
            if liger:
                from liger_kernel.ops.swiglu import LigerSiLUMulFunction
                variants["liger_swiglu"] = (
                    lambda x, w_g, w_u, w_d: LigerSiLUMulFunction.apply(x @ w_g.t(), x @ w_u.t()) @ w_d.t(),
                    [x, w_g, w_u, w_d])
            if tokens == compile_tokens:
                try:
                    variants["torch_compile_unfused"] = (torch.compile(unfused), [x, w_g, w_u, w_d])
                except Exception as error:  # noqa: BLE001
                    rows.append({"model": model, "tokens": tokens, "impl": "torch_compile_unfused", "error": repr(error)})
            runs = {}
            for name, (fn, inputs) in variants.items():
                try:
                    run = fwd_bwd(fn, inputs, [dy])
                    runs[name] = (run, peak_bytes(run), saved_activation_bytes(fn, inputs))
                except Exception as error:  # noqa: BLE001
                    rows.append({"model": model, "tokens": tokens, "impl": name, "error": repr(error)})
            # Round-robin: every repeat times each variant once, so clock or neighbour drift
            # during the run hits all variants alike (sequential timing drifted by up to 7%).
            timings = timeit_interleaved({n: r[0] for n, r in runs.items()}, reps=12 if tokens >= 16384 else 20)
            for name, (_, peak, saved) in runs.items():
                rows.append({"model": model, "tokens": tokens, "impl": name, **timings[name],
                             "peak_bytes": peak, "saved_activation_bytes": saved})
            # The floor of this design: our composition's GEMMs alone, same shapes and layouts,
            # for the fused [T, 2I] layout and the split layout; "gemms_alone" is the fused one,
            # fused_ffn's default.
            with torch.no_grad():
                gu = x @ w_gu.t()
                h = gu[:, :inter].contiguous()
                g2, u2 = h.clone(), h.clone()
                d_wgu = torch.empty_like(w_gu)

                def gemms_fused():
                    torch.mm(x, w_gu.t(), out=gu)
                    out = h @ w_d.t()
                    d_h = dy @ w_d
                    dwd = dy.t() @ h
                    d_x = gu @ w_gu
                    dwgu = gu.t() @ x
                    return out, d_h, dwd, d_x, dwgu

                def gemms_split():
                    torch.mm(x, w_gu[:inter].t(), out=g2)
                    torch.mm(x, w_gu[inter:].t(), out=u2)
                    out = h @ w_d.t()
                    d_h = dy @ w_d
                    dwd = dy.t() @ h
                    d_x = g2 @ w_gu[:inter]
                    d_x.addmm_(u2, w_gu[inter:])
                    torch.mm(g2.t(), x, out=d_wgu[:inter])
                    torch.mm(u2.t(), x, out=d_wgu[inter:])
                    return out, d_h, dwd, d_x

                both = timeit_interleaved({"fused": gemms_fused, "split": gemms_split},
                                          reps=12 if tokens >= 16384 else 20)
                t_fused, t_split = both["fused"], both["split"]
                rows.append({"model": model, "tokens": tokens, "impl": "gemms_alone_fused_layout", **t_fused})
                rows.append({"model": model, "tokens": tokens, "impl": "gemms_alone_split_layout", **t_split})
                rows.append({"model": model, "tokens": tokens, "impl": "gemms_alone", **t_fused})  # fused_ffn's default
            flops = 3 * 2 * tokens * hidden * 3 * inter
            for row in rows:
                if row.get("model") == model and row.get("tokens") == tokens and "p50_ms" in row:
                    row["tflops"] = flops / (row["p50_ms"] * 1e-3) / 1e12
            torch.cuda.empty_cache()
    return rows


# --- projection GEMMs: fused vs split weights, torch's cuBLAS vs our provider ------------------

PROJECTIONS = {"llama2_7b": {"qkv": (4096, 4096, 4096), "gate_up": (11008, 11008)},
               "llama3_8b": {"qkv": (4096, 1024, 1024), "gate_up": (14336, 14336)}}


def projection_contenders(tokens, hidden, parts, fp8k, device="cuda"):
    """One projection's contenders (projection_section says what each is): ({impl: run()}, x, w, y)."""
    n = sum(parts)
    x = leaf((tokens, hidden), device=device).detach()
    w = leaf((n, hidden), scale=hidden ** -0.5, device=device).detach()
    dy = leaf((tokens, n), device=device).detach()
    y, d_x, d_w = torch.empty_like(dy), torch.empty_like(x), torch.empty_like(w)
    bounds = [0, *itertools.accumulate(parts)]
    blocks = list(zip(bounds[:-1], bounds[1:]))  # each part's rows of the fused weight
    ys = [torch.empty(tokens, b - a, dtype=DT, device=device) for a, b in blocks]
    dys = [dy[:, a:b].contiguous() for a, b in blocks]

    def fused():
        torch.mm(x, w.t(), out=y)
        torch.mm(dy, w, out=d_x)
        torch.mm(dy.t(), x, out=d_w)

    def split():
        for (a, b), out in zip(blocks, ys):
            torch.mm(x, w[a:b].t(), out=out)
        torch.mm(dys[0], w[blocks[0][0]:blocks[0][1]], out=d_x)
        for (a, b), g in zip(blocks[1:], dys[1:]):
            d_x.addmm_(g, w[a:b])
        for (a, b), g in zip(blocks, dys):
            torch.mm(g.t(), x, out=d_w[a:b])

    def provider():
        fp8k.gemm(x, w, out=y)
        fp8k.gemm(dy, w, transpose_b=True, out=d_x)
        fp8k.gemm(dy, x, transpose_a=True, transpose_b=True, out=d_w)

    return {"fused_torch": fused, "split_torch": split, "fused_provider": provider}, x, w, y


def projection_section(tokens=8192, hidden=4096, reps=20):
    """The three GEMMs (forward, input gradient, weight gradient) of each fused projection of the
    decoder layer, timed interleaved in the same run: one GEMM on the fused [sum(N), H] weight (the
    composition's layout), one GEMM per part (Hugging Face's separate Linears: the input gradient
    summed in place, the weight gradients written into the fused gradient's row blocks), and the
    fused layout through our cuBLASLt provider (fastffn_gemm_cuda, the FP8 path's GEMM, with
    bf16 operands). It locates the decoder layer's GEMM time against Hugging Face's."""
    from paddle_fastffn.torch.fp8 import c_api as fp8_c_api

    fp8k = fp8_c_api.kernels()
    fp8k.gemm_init()
    rows = []
    for model, projections in PROJECTIONS.items():
        for name, parts in projections.items():
            n = sum(parts)
            fns, x, w, y = projection_contenders(tokens, hidden, parts, fp8k)
            provider = fns["fused_provider"]
            torch.mm(x, w.t(), out=y)
            reference = y.float()
            provider()
            error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
            timings = timeit_interleaved(fns, reps=reps)
            flops = 3 * 2 * tokens * hidden * n
            for impl, t in timings.items():
                rows.append({"model": model, "projection": name, "parts": list(parts), "tokens": tokens,
                             "impl": impl, **t, "tflops": flops / (t["p50_ms"] * 1e-3) / 1e12})
            rows.append({"model": model, "projection": name, "impl": "provider_vs_torch_forward",
                         "max_rel_diff": error})
            print(f"projections {model} {name}: " + ", ".join(
                f"{k} {v['p50_ms']:.3f} ms" for k, v in timings.items()), flush=True)
            torch.cuda.empty_cache()
    return rows


# --- decoder layer ------------------------------------------------------------------------------

# Our csrc/kernels CUDA kernels, by the names the profiler shows.
FASTFFN_KERNELS = ("swiglu_", "rms_norm_", "rotary_kernel", "reduce_partials", "quantize_kernel", "amax_kernel",
                   "compute_scale_kernel", "update_history_kernel", "cross_entropy_kernel")


def kernel_times(run, reps=3) -> dict:
    """{kernel name: GPU ms per run} from torch.profiler over `reps` runs, largest first."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) is not None and "cuda" not in str(evt.device_type).lower():
            continue
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if t:
            times[evt.key[:100]] = times.get(evt.key[:100], 0.0) + t / reps / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


GEMM_KERNEL_MARKS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")


def kernel_breakdown(run, reps=3):
    """GPU kernel time per category from torch.profiler over `reps` runs (ms per run)."""
    cats = {"gemm": 0.0, "attention": 0.0, "fastffn": 0.0, "other": 0.0}
    top_other = {}
    for key, t in kernel_times(run, reps).items():
        name = key.lower()
        if any(s in name for s in GEMM_KERNEL_MARKS):
            cats["gemm"] += t
        elif any(s in name for s in ("flash", "fmha", "attention", "cudnn", "sdpa")):
            cats["attention"] += t
        elif any(s in name for s in FASTFFN_KERNELS):
            cats["fastffn"] += t
        else:
            cats["other"] += t
            top_other[key[:80]] = top_other.get(key[:80], 0.0) + t
    per_run = dict(cats)
    per_run["top_other_ms"] = dict(sorted(top_other.items(), key=lambda kv: -kv[1])[:6])
    return per_run


# Decoder-layer shapes: LLaMA-2 7B at 4 x 2048 tokens, Llama-3-8B (GQA 32/8) at 2 x 4096.
DECODER_CONFIGS = {"llama2_7b": dict(batch=4, seq=2048, hidden=4096, inter=11008, heads=32, kv_heads=32),
                   "llama3_8b": dict(batch=2, seq=4096, hidden=4096, inter=14336, heads=32, kv_heads=8)}


class liger_patched:
    """apply_liger_kernel_to_llama for the models built inside the block, and Hugging Face's own
    functions and classes back afterwards: Liger replaces them at module level
    (modeling_llama.apply_rotary_pos_emb, LlamaRMSNorm, LlamaMLP, LlamaForCausalLM.forward), so an
    "eager" model built or run after an unrestored patch would silently run Liger's kernels."""

    NAMES = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")

    def __init__(self, fused_linear_cross_entropy=False):
        self.flce = fused_linear_cross_entropy

    def __enter__(self):
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.models.llama import modeling_llama

        self.saved = {name: getattr(modeling_llama, name) for name in self.NAMES}
        self.saved_forward = modeling_llama.LlamaForCausalLM.forward
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=self.flce)
        return self

    def __exit__(self, *exc):
        from transformers.models.llama import modeling_llama

        for name, value in self.saved.items():
            setattr(modeling_llama, name, value)
        modeling_llama.LlamaForCausalLM.forward = self.saved_forward
        return False


def decoder_flops(batch, seq, hidden, inter, heads, kv_heads, **_):
    """Model FLOPs of one decoder layer's fwd+bwd: 3x the forward, causal attention at half."""
    kv = kv_heads * hidden // heads
    tokens = batch * seq
    return 3 * (2 * tokens * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)
                + 2 * 2 * batch * seq * seq * hidden * 0.5)


def decoder_contenders(shape, liger, device="cuda"):
    """One decoder configuration's contenders: ({name: build() -> (run(x) -> out, params)}, {name:
    context manager factory to build and run it in}, x, dy)."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    from paddle_fastffn.torch.fp8.ffn import Fp8Recipe

    batch, seq, hidden, inter = shape["batch"], shape["seq"], shape["hidden"], shape["inter"]
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, rms_norm_eps=1e-5, max_position_embeddings=max(4096, seq))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to(device, DT)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    rope = modeling_llama.LlamaRotaryEmbedding(config=config).to(device)
    x = leaf((batch, seq, hidden), device=device)
    position_ids = torch.arange(seq, device=device).expand(batch, seq)
    cos_hf, sin_hf = rope(x, position_ids)
    cos32 = cos_hf[0].float().contiguous()
    sin32 = sin_hf[0].float().contiguous()
    dy = torch.randn_like(x)

    def hf_call(layer):
        def run(x):
            out = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=(cos_hf, sin_hf))
            return out[0] if isinstance(out, tuple) else out
        return run, list(layer.parameters())

    def ours(fp8_kind=None):
        recipe = None if fp8_kind is None else Fp8Recipe(scaling=fp8_kind)
        fast = FastDecoderLayer(hf, heads, kv_heads, config.rms_norm_eps, fp8_recipe=recipe).to(device)

        def run(x):
            fast.invalidate_fp8_weights()  # one optimizer step per iteration
            return fast(x, cos32, sin32)
        return run, list(fast.parameters())

    def compiled():
        layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to(device, DT)
        layer.load_state_dict(hf.state_dict())
        return hf_call(torch.compile(layer))

    def liger_layer():  # built and measured inside liger_patched (decoder_section)
        lig = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to(device, DT)
        lig.load_state_dict(hf.state_dict())
        return hf_call(lig)

    builders = {"hf_eager": lambda: hf_call(hf), "hf_torch_compile": compiled, "ours": ours,
                "ours_fp8_current": lambda: ours("current"), "ours_fp8_delayed": lambda: ours("delayed")}
    if liger:
        builders["hf_liger"] = liger_layer
    # hf_liger runs under Liger's module-level patch (rope is looked up at call time), entered
    # around its own calls only; every other contender runs Hugging Face's functions.
    contexts = {"hf_liger": liger_patched} if liger else {}
    return builders, contexts, x, dy


def decoder_section(liger, configs=tuple(DECODER_CONFIGS)):
    """Per configuration: Hugging Face's LlamaDecoderLayer eager, under torch.compile and patched
    by Liger; ours (the composition list) in bf16 and with FP8 linears (current and delayed
    scaling, the weights re-quantised every iteration as after an optimizer step)."""
    report = {}
    for config_name in configs:
        shape = DECODER_CONFIGS[config_name]
        builders, contexts, x, dy = decoder_contenders(shape, liger)
        flops = decoder_flops(**shape)
        results, runs = {}, {}
        for name, build in builders.items():
            try:
                with contexts.get(name, contextlib.nullcontext)():
                    fn, params = build()

                    def run(fn=fn, params=params):
                        for t in [x] + params:
                            t.grad = None
                        out = fn(x)
                        torch.autograd.backward((out,), (dy,))

                    run()  # compile / first-call work outside the timing
                runs[name] = run
            except Exception as error:  # noqa: BLE001
                results[name] = {"error": repr(error), "trace": traceback.format_exc()[-2000:]}
        timings = round_robin(runs, reps=15, contexts=contexts)
        for name, run in runs.items():
            try:
                with contexts.get(name, contextlib.nullcontext)():
                    results[name] = {**timings[name], "peak_bytes": peak_bytes(run),
                                     "model_tflops": flops / (timings[name]["p50_ms"] * 1e-3) / 1e12,
                                     "kernel_ms": kernel_breakdown(run)}
            except Exception as error:  # noqa: BLE001
                results[name] = {**timings[name], "error": repr(error), "trace": traceback.format_exc()[-2000:]}
            print(f"decoder {config_name} {name}: {results[name].get('p50_ms')} ms "
                  f"(spread {results[name].get('spread_ms', 0):.3f})", flush=True)
        del runs
        torch.cuda.empty_cache()
        results["shape"] = {**shape, "flops_convention": "3x forward; causal attention at half; "
                            "FP8 rows count the same (bf16-equivalent) FLOPs"}
        report[config_name] = results
        torch.cuda.empty_cache()
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    parser.add_argument("--sections", default="kernels,ffn,decoder")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    liger = _liger_version() is not None
    report = {"environment": environment(), "command": "python3 -m benchmarks.gpu.bench_gpu " + " ".join(
        f"--{k} {v}" if not isinstance(v, bool) else (f"--{k}" if v else "") for k, v in vars(args).items()).strip(),
        "note": "Our kernels are the framework-neutral csrc/kernels CUDA sources (the ones the Paddle "
                "bindings call), driven through ctypes; torch's cuBLAS and SDPA stand in for Paddle's."}
    started = time.time()

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    report["ceilings"] = ceilings()
    save()
    print("ceilings", json.dumps(report["ceilings"]), flush=True)
    sections = args.sections.split(",")
    if "kernels" in sections:
        report["kernels"] = kernel_section(report["ceilings"]["copy_bytes_per_s"], 8192, liger)
        save()
        print(f"kernels done at {time.time() - started:.0f}s", flush=True)
    if "rms_sweep" in sections:
        report["rms_norm_sweep"] = rms_sweep_section(report["ceilings"]["copy_bytes_per_s"])
        save()
    if "rope_sweep" in sections:
        report["rope_sweep"] = rope_sweep_section(report["ceilings"]["copy_bytes_per_s"], liger)
        save()
        print(f"rope_sweep done at {time.time() - started:.0f}s", flush=True)
    if "ffn" in sections:
        tokens = [8192] if args.quick else [2048, 8192, 16384]
        report["ffn"] = ffn_section(tokens, liger, compile_tokens=8192)
        save()
        print(f"ffn done at {time.time() - started:.0f}s", flush=True)
    if "projections" in sections:
        report["projection_gemms"] = projection_section()
        save()
        print(f"projections done at {time.time() - started:.0f}s", flush=True)
    if "decoder" in sections:
        report["decoder_layer"] = decoder_section(liger)
        save()
        print(f"decoder done at {time.time() - started:.0f}s", flush=True)
    save()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
