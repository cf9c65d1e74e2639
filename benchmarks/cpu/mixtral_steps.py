"""Demo-size Mixtral training steps on CPU, stock PaddleNLP against the fast path in one process:
tokens/s of forward + backward (fp32; the stock side under Paddle 2.x's paddle.where, which stock
PaddleNLP 2.8.1's MoE block needs on Paddle 3.x). `python -m benchmarks.cpu.mixtral_steps` writes benchmarks/results/cpu_mixtral_steps.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import paddle

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "integration"))
import mixtral_parity as mp  # noqa: E402

from benchmarks.common import MIN_REPEATS, RESULTS_DIR, compare, cpu_model, percentiles, rotated, write_results  # noqa: E402

SIZE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=2)


def step_ms(model, batch, steps: int) -> list[float]:
    """Per-step wall time (ms) of `steps` forward + backward steps after one warm-up step."""
    model.train()
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        out = model(**batch, return_dict=True)
        out.loss.backward()
        model.clear_gradients()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=MIN_REPEATS, help="round-robin rounds (at least 3)")
    options = parser.parse_args(argv)
    import paddlenlp
    from paddlenlp.transformers import MixtralForCausalLM

    import paddle_fastffn
    from paddle_fastffn.integration import FastFFNOptions, enable, mixtral

    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, SIZE["vocab_size"], (options.batch, options.seq)))
    batch = {"input_ids": ids, "labels": ids}
    rounds = {"stock": [], "fast": []}
    # Round-robin: each round builds and times both sides, in an order rotated by one per round (the
    # patch is class-level, so a side's model is built and timed with only its own path installed).
    for index in range(max(options.rounds, MIN_REPEATS)):
        for side in rotated(["stock", "fast"], index):
            paddle_fastffn.revert_fast_ffn()
            if side == "fast":
                enable(FastFFNOptions())
            paddle.seed(0)
            model = MixtralForCausalLM(mixtral.example_config(**SIZE))
            with (mp.contextlib.nullcontext() if side == "fast" else mp.paddle_2x_where()):
                rounds[side].append(percentiles(step_ms(model, batch, options.steps))["p50_ms"])
    paddle_fastffn.revert_fast_ffn()
    tokens = options.batch * options.seq
    sides = {side: {**percentiles(ms), "tokens_per_s": tokens / (percentiles(ms)["p50_ms"] * 1e-3)}
             for side, ms in rounds.items()}
    row = {"model": dict(SIZE, output_router_logits=True), "batch": options.batch, "seq": options.seq,
           "steps_per_round": options.steps, "stock": sides["stock"], "fast": sides["fast"],
           "comparison": compare(sides["fast"], sides["stock"])}
    print(json.dumps(row))
    path = write_results("cpu_mixtral_steps", {
        "device": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": paddle.get_num_threads()
                   if hasattr(paddle, "get_num_threads") else None},
        "versions": {"paddle": paddle.__version__, "paddlenlp": paddlenlp.__version__},
        "timing": "round-robin over rebuilt models, median of each round's median step, spread over rounds; "
                  "the stock side under Paddle 2.x's paddle.where (PaddleNLP 2.8.1's MoE block needs it on Paddle 3)",
        "rows": [row]}, Path(options.results_dir))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
