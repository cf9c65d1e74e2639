"""CPU benchmark: each fused op forward+backward against the best Paddle CPU equivalent, in the
same run, at LLaMA-2 7B sizes (8192 tokens; hidden 4096, intermediate 11008, 32 heads x 128).

    python -m benchmarks.cpu.bench_ops [--tokens 8192] [--repeats 5]

Writes benchmarks/results/cpu_ops.json. Paddle CPU has no bf16/fp16 silu, matmul or add, so the
comparison is in float32 (the dtype both sides can run).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import paddle

from benchmarks.common import cpu_model, percentiles, write_results
from paddle_fastffn import ops


def _leaf(shape, scale=1.0):
    t = paddle.to_tensor(np.random.randn(*shape).astype("float32") * scale)
    t.stop_gradient = False
    return t


def _fwd_bwd(fn, inputs, upstream):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    paddle.autograd.backward(list(outs), upstream)
    for t in inputs:
        if isinstance(t, paddle.Tensor) and not t.stop_gradient:
            t.clear_gradient(set_to_zero=False)


def time_case(fn, inputs, upstream, repeats):
    _fwd_bwd(fn, inputs, upstream)  # warm-up (and, for ours, the one-time library load)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        _fwd_bwd(fn, inputs, upstream)
        samples.append((time.perf_counter() - start) * 1e3)
    return percentiles(samples)


def stock_rms_norm(hidden, weight, eps=1e-6):
    """PaddleNLP LlamaRMSNorm.forward (fp32 path)."""
    variance = hidden.astype("float32").pow(2).mean(-1, keepdim=True)
    return paddle.rsqrt(variance + eps) * hidden * weight


def cases(tokens: int):
    from paddlenlp.transformers.llama.modeling import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hidden, inter, heads, head_dim = 4096, 11008, 32, 128
    batch, seq = max(1, tokens // 2048), min(tokens, 2048)
    gate_up = lambda: [_leaf((tokens, 2 * inter), 2.0)]  # noqa: E731
    yield ("swiglu", f"{tokens}x{inter} (packed gate|up)", gate_up, gate_up,
           lambda x: paddle.incubate.nn.functional.swiglu(x), ops.swiglu, "paddle.incubate.nn.functional.swiglu",
           [(tokens, inter)])
    norm_in = lambda: [_leaf((tokens, hidden)), _leaf((hidden,))]  # noqa: E731
    yield ("rms_norm", f"{tokens}x{hidden}", norm_in, norm_in, stock_rms_norm,
           lambda x, w: ops.rms_norm(x, w, 1e-6), "PaddleNLP LlamaRMSNorm math", [(tokens, hidden)])
    add_in = lambda: [_leaf((tokens, hidden)), _leaf((tokens, hidden)), _leaf((hidden,))]  # noqa: E731
    yield ("fused_add_rms_norm", f"{tokens}x{hidden}", add_in, add_in,
           lambda x, r, w: (stock_rms_norm(x + r, w), x + r),
           lambda x, r, w: ops.fused_add_rms_norm(x, r, w, 1e-6),
           "residual add + PaddleNLP LlamaRMSNorm math", [(tokens, hidden), (tokens, hidden)])
    rope = LlamaRotaryEmbedding(head_dim, seq)
    cos, sin = rope(paddle.zeros([1]), seq_len=seq)
    positions = paddle.arange(seq, dtype="int64").unsqueeze(0).expand([batch, seq])
    qk = lambda: [_leaf((batch, seq, heads, head_dim)), _leaf((batch, seq, heads, head_dim))]  # noqa: E731
    yield ("rotary_embedding", f"q,k {batch}x{seq}x{heads}x{head_dim}", qk, qk,
           lambda q, k: apply_rotary_pos_emb(q, k, cos, sin, positions),
           lambda q, k: ops.rotary_embedding(q, k, cos, sin, positions),
           "PaddleNLP apply_rotary_pos_emb", [(batch, seq, heads, head_dim)] * 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    paddle.set_device("cpu")
    np.random.seed(0)
    ops.ensure_loaded()
    rows = []
    for name, shape, make_base, make_ours, base_fn, our_fn, base_name, out_shapes in cases(args.tokens):
        upstream = [paddle.to_tensor(np.random.randn(*s).astype("float32")) for s in out_shapes]
        base = time_case(base_fn, make_base(), upstream, args.repeats)
        ours = time_case(our_fn, make_ours(), upstream, args.repeats)
        speedup = base["p50_ms"] / ours["p50_ms"]
        rows.append({"op": name, "shape": shape, "dtype": "float32", "pass": "forward+backward",
                     "baseline": base_name, "baseline_ms": base, "fastffn_ms": ours,
                     "speedup_p50": round(speedup, 3)})
        print(f"{name:20s} {shape:28s} baseline {base['p50_ms']:9.1f} ms  ours {ours['p50_ms']:9.1f} ms"
              f"  speedup {speedup:5.2f}x", flush=True)
    import paddlenlp

    path = write_results("cpu_ops", {
        "device": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "versions": {"paddle": paddle.__version__, "paddlenlp": paddlenlp.__version__,
                     "numpy": np.__version__},
        "tokens": args.tokens, "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
