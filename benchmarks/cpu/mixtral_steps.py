"""Demo-size Mixtral training steps on CPU, stock PaddleNLP against the fast path in one process:
tokens/s of forward + backward (fp32; the stock side under Paddle 2.x's paddle.where, which stock
PaddleNLP 2.8.1's MoE block needs on Paddle 3.x). `python -m benchmarks.cpu.mixtral_steps --out F`."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np
import paddle

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "integration"))
import mixtral_parity as mp  # noqa: E402

SIZE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=2)


def tokens_per_second(model, batch, steps: int) -> float:
    model.train()
    for i in range(steps + 1):
        if i == 1:
            start = time.perf_counter()
        out = model(**batch, return_dict=True)
        out.loss.backward()
        model.clear_gradients()
    return steps * batch["input_ids"].size / (time.perf_counter() - start)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    options = parser.parse_args(argv)
    import paddlenlp
    from paddlenlp.transformers import MixtralForCausalLM

    import paddle_fastffn
    from paddle_fastffn.integration import FastFFNOptions, enable, mixtral

    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, SIZE["vocab_size"], (options.batch, options.seq)))
    batch = {"input_ids": ids, "labels": ids}
    results = {}
    for side in ("stock", "fast"):
        paddle_fastffn.revert_fast_ffn()
        if side == "fast":
            enable(FastFFNOptions())
        paddle.seed(0)
        model = MixtralForCausalLM(mixtral.example_config(**SIZE))
        with (mp.contextlib.nullcontext() if side == "fast" else mp.paddle_2x_where()):
            results[side] = tokens_per_second(model, batch, options.steps)
    paddle_fastffn.revert_fast_ffn()
    row = {"model": dict(SIZE, output_router_logits=True), "batch": options.batch, "seq": options.seq,
           "steps": options.steps, "tokens_per_s_stock": results["stock"], "tokens_per_s_fast": results["fast"],
           "speedup": results["fast"] / results["stock"]}
    print(json.dumps(row))
    with open(options.out, "w") as f:
        json.dump({"command": "python -m benchmarks.cpu.mixtral_steps " + " ".join(sys.argv[1:]),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)",
                   "versions": {"paddle": paddle.__version__, "paddlenlp": paddlenlp.__version__,
                                "python": platform.python_version()},
                   "rows": [row]}, f, indent=1)


if __name__ == "__main__":
    main()
